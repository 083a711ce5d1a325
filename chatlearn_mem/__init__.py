"""chatlearn-mem: put megatron-core trainers and inference models to sleep and wake them exactly.

Public API::

    from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager
    mm = TrainerMemoryManager(model, optimizer, MemoryConfig(bucket_size_mb=256))
    mm.offload()                    # weights, grads, main weights, optimizer states
    mm.onload([Part.WEIGHTS])       # a forward-only phase needs the weights alone
    mm.onload()
    assert mm.audit().ok
    print(device_report(model, optimizer, managers=[mm]))   # what stays on the device, who holds it
    save_checkpoint(mm, "ckpt", step=10, async_=True)   # even asleep: read from the host store
    load_checkpoint(mm, latest_checkpoint("ckpt"))
    plan = plan_residency(sizes, phases, budget_bytes, written=written)   # which parts stay resident

Beside the managers: :mod:`chatlearn_mem.mcore` (the one place that knows megatron-core's private
names), :mod:`chatlearn_mem.models` (GPT trainers) and :mod:`chatlearn_mem.cpu_backend`.
"""

from chatlearn_mem.audit import AuditReport
from chatlearn_mem.checkpoint import (CheckpointDamagedError, CheckpointError, SaveHandle, estimate_checkpoint_nbytes,
                                      latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint,
                                      verify_checkpoint)
from chatlearn_mem.config import MemoryConfig, load_config
from chatlearn_mem.device_report import DeviceReport, device_report
from chatlearn_mem.errors import (ChatlearnMemError, ConfigError, ExternalChangeError, HostMemoryError,
                                  OffloadedError, TransferError, UnsupportedLayoutError)
from chatlearn_mem.inference import InferenceMemoryManager
from chatlearn_mem.manager import manager_of
from chatlearn_mem.parts import Part
from chatlearn_mem.planner import BoundaryMoves, ResidencyPlan, plan_residency, residency_bytes_moved
from chatlearn_mem.residency import Residency
from chatlearn_mem.storage import TransferStats
from chatlearn_mem.trainer import TrainerMemoryManager
from chatlearn_mem.transitions import Transfer, swap

__all__ = [
    "BoundaryMoves", "ResidencyPlan", "plan_residency", "residency_bytes_moved",  # the residency planner
    "AuditReport", "ChatlearnMemError", "CheckpointDamagedError", "CheckpointError", "ConfigError", "DeviceReport", "ExternalChangeError",
    "HostMemoryError", "InferenceMemoryManager", "MemoryConfig", "OffloadedError", "Part", "Residency", "SaveHandle",
    "TrainerMemoryManager", "Transfer", "TransferError", "TransferStats", "UnsupportedLayoutError", "device_report", "estimate_checkpoint_nbytes",
    "latest_checkpoint",
    "list_checkpoints", "load_checkpoint", "load_config", "manager_of", "save_checkpoint", "swap", "verify_checkpoint",
]
__version__ = "0.1.0"
