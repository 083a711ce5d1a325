"""chatlearn-mem: put megatron-core trainers and inference models to sleep and wake them exactly.

Public API::

    from chatlearn_mem import TrainerMemoryManager, MemoryConfig
    mm = TrainerMemoryManager(model, optimizer, MemoryConfig(bucket_size_mb=256))
    mm.offload()            # weights, grads, main weights, optimizer states
    mm.onload()
    assert mm.audit().ok
"""

from chatlearn_mem.audit import AuditReport
from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.errors import ChatlearnMemError, OffloadedError, UnsupportedLayoutError
from chatlearn_mem.inference import InferenceMemoryManager
from chatlearn_mem.residency import Residency
from chatlearn_mem.storage import TransferStats
from chatlearn_mem.trainer import TrainerMemoryManager

__all__ = [
    "AuditReport", "ChatlearnMemError", "InferenceMemoryManager", "MemoryConfig", "OffloadedError",
    "Residency", "TrainerMemoryManager", "TransferStats", "UnsupportedLayoutError",
]
__version__ = "0.1.0"
