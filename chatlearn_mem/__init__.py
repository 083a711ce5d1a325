"""chatlearn-mem: put trainers and inference models to sleep and wake them exactly.

A :class:`TrainerMemoryManager` wraps a megatron-core model (DDP chunks) and its optimizer, or a
plain PyTorch one (an ``nn.Module``, torch DDP, ZeroRedundancyOptimizer, FSDP2; see
``docs/torch-native.md``). It
offloads the weights into flat host buckets, releases the grad buffers, the fp32 main weights and
the optimizer states, and brings all of it back, in place, so that training continues
bit-identically; :meth:`~TrainerMemoryManager.audit` proves it. An
:class:`InferenceMemoryManager` does the same for any ``nn.Module``.

Example (runs as written; a test runs it)::

    import tempfile
    from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager
    from chatlearn_mem.models import gpt

    # cpu_backend=True: megatron-core runs on the CPU when there is no GPU (it says so)
    gpt.init_distributed(init_method=f"file://{tempfile.mkdtemp()}/init", cpu_backend=True)
    config = gpt.GPTTrainerConfig()            # a small GPT with the distributed optimizer
    trainer = gpt.build_gpt_trainer(config)    # megatron's DDP model and MegatronOptimizer
    trainer.train_step(gpt.synthetic_batch(config, 0))

    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(bucket_size_mb=64))
    awake = mm.residency().device_bytes
    mm.offload()                               # weights, grads, main weights, optimizer states
    assert mm.residency().device_bytes == 0 < awake
    mm.onload(Part.WEIGHTS)                    # a forward-only phase needs the weights alone
    mm.onload()                                # everything, in place
    assert mm.audit().ok
    trainer.train_step(gpt.synthetic_batch(config, 1))
    gpt.shutdown_distributed()                 # before the process exits (torch asks for it)

The rest of the API: checkpoints of a sleeping trainer (:func:`save_checkpoint`,
:func:`load_checkpoint`), what stays on the device and who holds it (:func:`device_report`),
which parts to keep resident under a memory budget (:func:`plan_residency`), and non-blocking
transitions (``blocking=False`` returns a :class:`Transfer`; :func:`swap` overlaps one model's
offload with another's onload). Beside it: :mod:`chatlearn_mem.cpu_backend` (megatron-core on a
machine without a GPU), :mod:`chatlearn_mem.models` (GPT trainers built from megatron-core's
public API), :mod:`chatlearn_mem.mcore` (the one place that knows megatron-core's private
names) and :mod:`chatlearn_mem.torchnative` (the same for plain PyTorch's).
"""

from typing import Any, Optional, Union

from chatlearn_mem import owners
from chatlearn_mem.audit import AuditReport
from chatlearn_mem.checkpoint import (
    CheckpointDamagedError,
    CheckpointError,
    SaveHandle,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.device_report import DeviceReport, device_report
from chatlearn_mem.errors import (
    ChatlearnMemError,
    ConfigError,
    ExternalChangeError,
    HostMemoryError,
    OffloadedError,
    TransferError,
    UnsupportedLayoutError,
)
from chatlearn_mem.group_transfer import TransferStats
from chatlearn_mem.inference import InferenceMemoryManager
from chatlearn_mem.parts import Part
from chatlearn_mem.planner import ResidencyPlan, plan_residency
from chatlearn_mem.residency import Residency
from chatlearn_mem.trainer import TrainerMemoryManager
from chatlearn_mem.transitions import Transfer, swap

__all__ = [
    # the managers
    "TrainerMemoryManager",
    "InferenceMemoryManager",
    "MemoryConfig",
    "Part",
    "manager_of",
    # what they report
    "AuditReport",
    "Residency",
    "TransferStats",
    "DeviceReport",
    "device_report",
    # non-blocking transitions
    "Transfer",
    "swap",
    # checkpoints
    "save_checkpoint",
    "load_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "verify_checkpoint",
    "SaveHandle",
    # the residency planner
    "plan_residency",
    "ResidencyPlan",
    # errors (all derive from ChatlearnMemError)
    "ChatlearnMemError",
    "OffloadedError",
    "ConfigError",
    "HostMemoryError",
    "TransferError",
    "UnsupportedLayoutError",
    "ExternalChangeError",
    "CheckpointError",
    "CheckpointDamagedError",
]
__version__ = "0.1.0"


def manager_of(model: Any) -> Optional[Union[TrainerMemoryManager, InferenceMemoryManager]]:
    """The live (not closed) memory manager of ``model``, or None.

    A manager stays alive as long as its model (the hooks it registers hold it), so a sleeping
    model can always be woken up: ``manager_of(model).onload()``.

    Args:
        model: What the manager was created with (a megatron DDP chunk or a list of them, an
            ``nn.Module``), any module inside it, or one of its parameters.

    Raises:
        TypeError: ``model`` is none of those.
    """
    # The registry sits below the managers and knows them through a small Protocol; every
    # manager it holds is one of these two (each claims its model's storages when created).
    return owners.manager_of(model)  # type: ignore[return-value]
