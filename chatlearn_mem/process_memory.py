"""A process's device memory as the driver sees it, and what an idle process can give back.

PyTorch's allocator counters (``memory_allocated``, ``memory_reserved``) see only the memory the
caching allocator handed out. The driver sees more: the CUDA context (kernels, driver state, the
modules loaded so far), NCCL's communicator buffers, and what libraries allocate themselves.
:func:`process_memory` reads both views of this process: NVML's bytes for this process (when
``pynvml`` / ``nvidia-ml-py`` is installed and NVML lists this process), ``cudaMemGetInfo``
(device-wide: every process on the GPU) and the allocator's counters.

:func:`release_idle_memory` gives back what a sleeping process keeps for compute it is not doing:
the cuBLAS/cuBLASLt workspaces torch keeps per handle and stream (``torch._C._cuda_clearCublasWorkspaces``;
the next matmul allocates them again) and then the caching allocator's free blocks
(``torch.cuda.empty_cache()``). :meth:`TrainerMemoryManager.offload` calls it after a full offload
on CUDA (``release_idle_memory``). What it does not release, and why, is in
:data:`chatlearn_mem.device_report.WHY_IT_STAYS`.

Everything here needs CUDA; on any other device the functions return None (the reports then say
"not measured here: no CUDA").
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

__all__ = [
    "NOT_MEASURED",
    "IdleRelease",
    "ProcessMemory",
    "nvml_process_bytes",
    "process_memory",
    "release_idle_memory",
]

NOT_MEASURED = "not measured here: no CUDA"
"""What a report says of the driver's view where there is no CUDA device."""


@dataclass(frozen=True)
class ProcessMemory:
    """One device's memory as this process's driver and allocator see it, bytes.

    Attributes:
        device: The CUDA device (``cuda:0``).
        pid: This process.
        allocated: The caching allocator's bytes in live tensors (``memory_allocated``).
        reserved: The allocator's bytes taken from the driver (``memory_reserved``).
        device_used: ``cudaMemGetInfo`` total minus free: every process on this GPU.
        device_total: The GPU's memory.
        nvml_process_used: NVML's bytes for this process (context, allocator segments, NCCL,
            libraries' own allocations); None when it cannot be read, ``nvml_note`` says why.
        nvml_note: How ``nvml_process_used`` was read, or why it was not.
    """

    device: str
    pid: int
    allocated: int
    reserved: int
    device_used: int
    device_total: int
    nvml_process_used: Optional[int]
    nvml_note: str

    @property
    def cached(self) -> int:
        """Free blocks the caching allocator keeps (reserved minus allocated)."""
        return self.reserved - self.allocated

    @property
    def per_process(self) -> bool:
        """Whether :attr:`used` is this process's own (NVML) rather than the whole device's."""
        return self.nvml_process_used is not None

    @property
    def used(self) -> int:
        """This process's bytes on the device (NVML), else the whole device's (``device_used``)."""
        return self.nvml_process_used if self.nvml_process_used is not None else self.device_used

    @property
    def outside_allocator(self) -> int:
        """:attr:`used` minus ``reserved``: the CUDA context, NCCL, libraries' own allocations (and,
        without NVML, other processes on the GPU)."""
        return max(0, self.used - self.reserved)

    def to_dict(self) -> dict:
        """Every field and derived figure, JSON-ready."""
        return {
            **asdict(self),
            "cached": self.cached,
            "used": self.used,
            "per_process": self.per_process,
            "outside_allocator": self.outside_allocator,
        }


def _cuda_device(device) -> Optional[torch.device]:
    """``device`` as an indexed CUDA device, or None when it is not CUDA or CUDA is not available."""
    if not torch.cuda.is_available():
        return None
    d = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if d.type != "cuda":
        return None
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


_nvml_ready: Optional[bool] = None


def _nvml():
    """``pynvml`` initialised, or a string saying why not."""
    global _nvml_ready
    try:
        import pynvml
    except ImportError:
        return "NVML not read: pynvml is not installed (pip install nvidia-ml-py)"
    if not _nvml_ready:
        try:
            pynvml.nvmlInit()
        except Exception as e:  # noqa: BLE001 - NVMLError of any kind: say it, measure without it
            return f"NVML not read: nvmlInit failed ({e})"
        _nvml_ready = True
    return pynvml


def _nvml_handle(pynvml, index: int):
    """NVML's handle of torch's CUDA device ``index``: by UUID (CUDA_VISIBLE_DEVICES renumbers
    torch's devices, NVML's never are), else by index when nothing renumbers them."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        for candidate in dict.fromkeys((text if text.startswith("GPU-") else f"GPU-{text}", text)):
            try:
                return pynvml.nvmlDeviceGetHandleByUUID(candidate)
            except Exception:  # noqa: BLE001 - try the next spelling
                continue
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return pynvml.nvmlDeviceGetHandleByIndex(index)
    raise LookupError(f"no NVML device matches torch's cuda:{index} (UUID {uuid})")


def nvml_process_bytes(index: int, pid: Optional[int] = None) -> tuple[Optional[int], str]:
    """NVML's bytes of process ``pid`` (default: this one) on torch's CUDA device ``index``.

    Returns:
        ``(bytes, note)``; bytes None when NVML is not installed, cannot start, does not list the
        process (a container's PID namespace hides the host's PIDs) or does not report its memory.
    """
    pid = os.getpid() if pid is None else pid
    pynvml = _nvml()
    if isinstance(pynvml, str):
        return None, pynvml
    try:
        handle = _nvml_handle(pynvml, index)
        procs = list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except Exception as e:  # noqa: BLE001 - NVMLError, LookupError: say it, measure without it
        return None, f"NVML not read: {type(e).__name__}: {e}"
    mine = [p for p in procs if p.pid == pid]
    if not mine:
        return None, (
            f"NVML does not list this process (pid {pid}) among the {len(procs)} on the GPU (pids "
            f"{sorted(p.pid for p in procs)}; a PID namespace?): device-wide figures only"
        )
    used = [p.usedGpuMemory for p in mine]
    if any(u is None for u in used):
        return None, "NVML lists this process but not its memory (usedGpuMemory not available)"
    return int(sum(used)), f"NVML, pid {pid}"


def process_memory(device=None) -> Optional[ProcessMemory]:
    """Read both views of ``device`` (default: the current CUDA device) now; None without CUDA.

    Allocator counters are read after a device synchronisation, so that work in flight is counted
    where it ends up. Read-only: nothing is freed.
    """
    d = _cuda_device(device)
    if d is None:
        return None
    torch.cuda.synchronize(d)
    free, total = torch.cuda.mem_get_info(d)
    nvml, note = nvml_process_bytes(d.index)
    return ProcessMemory(
        device=str(d),
        pid=os.getpid(),
        allocated=int(torch.cuda.memory_allocated(d)),
        reserved=int(torch.cuda.memory_reserved(d)),
        device_used=int(total - free),
        device_total=int(total),
        nvml_process_used=nvml,
        nvml_note=note,
    )


@dataclass(frozen=True)
class IdleRelease:
    """What :func:`release_idle_memory` gave back, bytes.

    Attributes:
        cublas_workspaces_bytes: Allocated bytes the cleared cuBLAS/cuBLASLt workspaces held (0
            when this torch has no ``_cuda_clearCublasWorkspaces``: ``cleared_workspaces`` False).
        allocator_cache_bytes: Reserved bytes ``empty_cache()`` returned to the driver (the
            workspaces' blocks among them).
        process_bytes: The fall of the process's bytes on the device (NVML), or of the device's
            (``per_process`` False); None when not measured (``measure=False``).
        per_process: Whether ``process_bytes`` is NVML's figure for this process.
        seconds: Wall time of the release.
        cleared_workspaces: Whether torch had the call that clears the workspaces.
    """

    cublas_workspaces_bytes: int
    allocator_cache_bytes: int
    process_bytes: Optional[int]
    per_process: bool
    seconds: float
    cleared_workspaces: bool

    def to_dict(self) -> dict:
        return asdict(self)


def release_idle_memory(device=None, measure: bool = True, empty_cache: bool = True) -> Optional[IdleRelease]:
    """Give back what an idle process keeps for compute: cuBLAS/cuBLASLt workspaces, then the
    caching allocator's free blocks. None without CUDA.

    Args:
        measure: Also read the driver's view before and after (NVML, ``cudaMemGetInfo``: a device
            synchronisation and an NVML query each) for ``process_bytes``; False reads the
            allocator's counters only (what the manager does after a full offload).
        empty_cache: Return the allocator's free blocks to the driver; False (a manager with
            ``MemoryConfig.empty_cache=False``) leaves the workspaces' blocks in its cache, for
            this process's next allocations.

    The workspaces are scratch space with no state: torch keeps one per (cuBLAS handle, stream)
    (32 MiB each on Hopper by default, ``CUBLAS_WORKSPACE_CONFIG``) and allocates it again at the
    next matmul on that stream, so the price is one allocation per stream at the first matmul
    after the release. They belong to the process, not to a model: every model of this process
    gets new ones at its next matmul. A CUDA graph keeps the workspace it captured in its own
    pool, so replaying it stays correct.
    """
    d = _cuda_device(device)
    if d is None:
        return None
    t0 = time.perf_counter()
    before = process_memory(d) if measure else None
    allocated, reserved = int(torch.cuda.memory_allocated(d)), int(torch.cuda.memory_reserved(d))
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    cleared = int(torch.cuda.memory_allocated(d))
    if empty_cache:
        torch.cuda.empty_cache()
    emptied = int(torch.cuda.memory_reserved(d))
    after = process_memory(d) if measure else None
    per_process = bool(before and after and before.per_process and after.per_process)
    if not measure:
        process_bytes = None
    elif per_process:
        process_bytes = before.nvml_process_used - after.nvml_process_used
    else:
        process_bytes = before.device_used - after.device_used
    return IdleRelease(
        cublas_workspaces_bytes=max(0, allocated - cleared),
        allocator_cache_bytes=max(0, reserved - emptied),
        process_bytes=process_bytes,
        per_process=per_process,
        seconds=time.perf_counter() - t0,
        cleared_workspaces=clear is not None,
    )
