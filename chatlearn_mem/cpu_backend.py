"""Run megatron-core's CUDA-only code paths on a CPU-only PyTorch build.

megatron-core allocates with ``device=torch.cuda.current_device()``, moves tensors with
``.cuda()``, checks ``tensor.type() == 'torch.cuda.BFloat16Tensor'``, creates CUDA streams and
events, pins memory and seeds the CUDA generator. On a machine without a GPU none of that works.
:func:`install` makes it work by

* pushing a :class:`torch.overrides.TorchFunctionMode` that rewrites every CUDA device argument
  (``"cuda"``, ``"cuda:0"``, ``torch.device("cuda")``, a bare device index) to ``"cpu"``, turns
  ``Tensor.cuda()`` into a no-op move, drops ``pin_memory=True`` and makes ``Tensor.type()`` report
  the CUDA type names megatron's optimizers test for; backward passes (``Tensor.backward``,
  ``torch.autograd.backward`` / ``grad``) run with the mode pushed again (torch's autograd engine
  entry point is wrapped), because a mode is off while its own handler runs and megatron's
  autograd functions allocate on the CUDA device in their backward;
* replacing the ``torch.cuda`` entry points megatron calls (``current_device``, ``synchronize``,
  ``Stream``, ``Event``, RNG state, memory queries) with CPU stand-ins;
* two megatron-core patches, kept with megatron's other private names in
  :func:`chatlearn_mem.mcore.cpu.patch_for_cpu`: megatron's CUDA RNG tracker
  (``_get_cuda_rng_state`` / ``_set_cuda_rng_state``) points at the CPU default generator, so
  ``tracker.fork()`` really switches the stream CPU kernels draw from and no closures pile up in
  torch's lazy CUDA call queue (a CPU build queues every ``torch.cuda.manual_seed`` forever); and
  ``moe_utils.te_general_gemm`` is defined as ``None`` when Transformer Engine is missing, so the
  MoE router uses ``torch.mm``.

gloo (torch >= 2.6) has every collective the distributed optimizer uses (all-reduce,
reduce-scatter, all-gather into a tensor, bf16 included), so no collective is patched. One thing
is: torch gives every gloo process group a transport device of its own, and each device a thread
that wakes every 10 ms whether or not anything is sent. megatron-core makes about twenty groups
(one rank or many), so a CPU process had twenty-one such threads waking 2000 times a second and
taking 5% of a core while idle; on a machine of few cores every wakeup preempts the compute or a
copy lane. After :func:`install`, the gloo groups created in the process share one device, as
torch's own options allow (:func:`_share_one_gloo_device`; ``CHATLEARN_MEM_GLOO_SHARED_DEVICE=0``,
or ``install(share_gloo_device=False)``, keeps torch's default).

The mode is active on the thread that called :func:`install` and on every thread started after
it; threads already running at that moment do not see it.

Limits: there are no streams (a stream is a no-op and every "async" op completes at once), no
MoE all-to-all or flex token dispatcher (MoE works with the all-gather dispatcher and the local
``SequentialMLP`` experts; grouped GEMM needs TE or CUDA kernels), no sequence parallel with the local layer spec, no fused kernels
(apex, Transformer Engine, flash attention) and no CUDA graphs. Call :func:`install` once per
process before building the model; it does nothing when CUDA is available. Nothing in
chatlearn-mem installs it unasked: :func:`install` prints one line when it does (``quiet=True`` to
keep it silent), and :func:`chatlearn_mem.models.gpt.init_distributed` installs it only with
``cpu_backend=True``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import threading
from typing import Any, Optional

import torch
from torch.overrides import TorchFunctionMode

from chatlearn_mem.mcore import cpu as mcore_cpu

__all__ = ["install", "is_installed"]

_lock = threading.Lock()
_installed = False
SHARED_GLOO_DEVICE_ENV = "CHATLEARN_MEM_GLOO_SHARED_DEVICE"
_mode: "_CudaToCpuMode | None" = None

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.int8: "torch.cuda.CharTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return False


def _map_device(device: Any) -> Any:
    """Map a CUDA device spec (or a bare index, which torch reads as a CUDA index) to CPU."""
    if _is_cuda_device(device) or (isinstance(device, int) and not isinstance(device, bool)):
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to CPU."""

    # a memory manager's public calls pop it while they run (guards.serialized): they name their
    # devices themselves, and their work per tensor is 18x slower through the mode
    skip_in_manager_calls = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _map_device(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0].clone()
        if func is torch.Tensor.is_pinned:
            return False
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = _CUDA_TYPE_NAMES.get(args[0].dtype)
            if name is not None:
                return name
        if func is torch.Tensor.to:  # t.to(0) means cuda:0 (a dtype is never an int)
            args = args[:1] + tuple(_map_device(a) for a in args[1:])
        elif func in (
            torch.Tensor.new_empty,
            torch.Tensor.new_zeros,
            torch.Tensor.new_full,
            torch.Tensor.new_ones,
            torch.Tensor.new_tensor,
        ):
            args = tuple(torch.device("cpu") if _is_cuda_device(a) else a for a in args)
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for ``torch.cuda.Stream``: every operation completes when issued."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _NullEvent:
    """Stand-in for ``torch.cuda.Event``."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _get_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, *args, **kwargs) -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    # Not torch.manual_seed: that calls torch.cuda.manual_seed_all, i.e. this function again.
    torch.default_generator.manual_seed(int(seed))


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = lambda device: None
    cuda.synchronize = lambda device=None: None
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = lambda device=None: _NullStream()
    cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.get_rng_state = _get_rng_state
    cuda.set_rng_state = _set_rng_state
    cuda.manual_seed = _manual_seed
    cuda.manual_seed_all = _manual_seed
    cuda.empty_cache = lambda: None
    cuda.memory_allocated = lambda device=None: 0
    cuda.max_memory_allocated = lambda device=None: 0
    cuda.memory_reserved = lambda device=None: 0
    cuda.reset_peak_memory_stats = lambda device=None: None
    cuda.random.get_rng_state = _get_rng_state
    cuda.random.set_rng_state = _set_rng_state
    cuda.random.manual_seed = _manual_seed
    if not hasattr(cuda, "nvtx") or not hasattr(cuda.nvtx, "range_push"):
        return
    cuda.nvtx.range_push = lambda msg: 0
    cuda.nvtx.range_pop = lambda: 0


def _mode_is_active() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, _CudaToCpuMode) for m in _get_current_function_mode_stack())


def _run_backward_under_the_mode() -> None:
    # ``loss.backward()`` reaches the autograd engine through the mode's own handler, and a mode
    # is switched off while its handler runs: every Python backward (megatron's gather/scatter
    # mappings allocate with device=torch.cuda.current_device() there) would run without it.
    # The engine entry point both torch.autograd.backward and .grad call pushes it again.
    from torch.autograd import graph

    original = getattr(graph, "_engine_run_backward", None)
    if original is None:  # torch releases without this entry point: nothing to wrap
        return

    def run_backward(*args, **kwargs):
        if _mode_is_active():
            return original(*args, **kwargs)
        with _CudaToCpuMode():
            return original(*args, **kwargs)

    graph._engine_run_backward = run_backward
    torch.autograd._engine_run_backward = run_backward


def _enter_mode_in_new_threads() -> None:
    # Torch function modes are per thread; a manager may be called from a thread pool (a Ray
    # actor with concurrency > 1), so every thread started from now on runs under the mode too.
    original_run = threading.Thread.run

    def run(self):
        with _CudaToCpuMode():
            original_run(self)

    threading.Thread.run = run


def _share_one_gloo_device() -> bool:
    """Make the gloo process groups created from now on in this process share one transport device
    (torch's ``ProcessGroupGloo`` options take the devices a group uses; by default every group
    creates its own, with a thread polling every 10 ms). The devices are made as torch makes them:
    one per interface in ``GLOO_SOCKET_IFNAME``, else the default one; a group made with explicit
    options keeps them. Returns whether the groups share a device from now on.

    Nothing changes when a process group already exists: torch's ``ProcessGroupGloo`` is replaced by
    a subclass, and a group made before would fail torch's ``isinstance`` checks against it."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return False
    if not dist.is_available() or not dist.is_gloo_available():
        return False
    base = getattr(c10d, "ProcessGroupGloo", None)
    if base is None:
        return False
    if getattr(base, "_chatlearn_shared_device", False):
        return True
    if dist.is_initialized() or not all(
        hasattr(base, n) for n in ("_Options", "create_default_device", "create_device")
    ):
        return False
    devices: list = []
    made = threading.Lock()

    def shared_devices() -> list:
        with made:
            if not devices:
                ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
                if len(ifname) > 1:  # as torch reads it
                    devices.extend(base.create_device(interface=i) for i in ifname.split(","))
                else:
                    devices.append(base.create_default_device())
            return list(devices)

    class SharedDeviceGloo(base):
        """torch's gloo process group on this process's one (set of) transport device(s)."""

        _chatlearn_shared_device = True

        def __init__(self, store, rank, size, options=None, timeout=None):
            if isinstance(options, base._Options):
                super().__init__(store, rank, size, options)
                return
            if isinstance(options, datetime.timedelta) and timeout is None:
                timeout = options  # passed by position, as torch's own overload takes it
            opts = base._Options()
            opts._devices = shared_devices()
            opts._threads = 2 * len(opts._devices)  # torch's default for its own devices
            if timeout is not None:
                opts._timeout = timeout
            super().__init__(store, rank, size, opts)

    SharedDeviceGloo.__name__ = SharedDeviceGloo.__qualname__ = base.__name__
    SharedDeviceGloo.__module__ = base.__module__
    c10d.ProcessGroupGloo = SharedDeviceGloo
    return True


def _sharing_gloo_device_by_env() -> bool:
    """Whether ``CHATLEARN_MEM_GLOO_SHARED_DEVICE`` leaves the shared gloo device on: unless it is
    0/false/no/off (any case), as the project's other switches read."""
    return os.environ.get(SHARED_GLOO_DEVICE_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def install(quiet: bool = False, share_gloo_device: Optional[bool] = None) -> bool:
    """Make megatron-core's CUDA code paths run on CPU in this process.

    Idempotent and thread-safe. Does nothing when CUDA is available.

    Args:
        quiet: Do not print the one line (on standard error) that says the backend is now on.
        share_gloo_device: The gloo process groups created after this call share one transport
            device (one polling thread for all of them, instead of one per group). None: yes,
            unless the environment sets ``CHATLEARN_MEM_GLOO_SHARED_DEVICE=0``. Nothing changes
            for groups that exist already, nor when a default process group exists.

    Returns:
        ``True`` when the CPU backend is active after the call, ``False`` when CUDA is available
        and nothing was changed.
    """
    global _installed, _mode
    if torch.cuda.is_available():
        return False
    with _lock:
        if _installed:
            return True
        _patch_torch_cuda()
        mcore_cpu.patch_for_cpu(_get_rng_state, _set_rng_state)
        _mode = _CudaToCpuMode()
        _mode.__enter__()  # stays pushed for the life of the process, on this thread
        _enter_mode_in_new_threads()
        _run_backward_under_the_mode()
        if share_gloo_device if share_gloo_device is not None else _sharing_gloo_device_by_env():
            _share_one_gloo_device()
        _installed = True
    if not quiet:
        sys.stderr.write(
            "chatlearn-mem: no CUDA device; the CPU backend is on in this process (torch.cuda is "
            "patched so that megatron-core runs on the CPU)\n"
        )
    return True


def is_installed() -> bool:
    """Whether :func:`install` has activated the CPU backend in this process."""
    return _installed
