"""The ``torch_memory_saver`` method: the same trainer asleep the way slime puts it to sleep.

slime, vime and SGLang put a megatron-core trainer to sleep with torch_memory_saver (TMS): every
CUDA allocation of the training process goes through TMS (``LD_PRELOAD`` of its ``preload``
library, ``TMS_INIT_ENABLE=1``, ``TMS_INIT_ENABLE_CPU_BACKUP=1``), and ``torch_memory_saver.pause()``
copies each allocation to a host backup and unmaps its physical memory, ``resume()`` maps new
memory at the same virtual addresses and copies the backup back (one synchronous copy per
allocation). Nothing in the model is touched, so nothing needs rebuilding.

**Why another process.** TMS's preload library replaces ``cudaMalloc``/``cudaFree`` for the whole
process, and must be loaded before CUDA starts (``LD_PRELOAD``): with it every allocation of the
benchmark process (the manager's trainer, the ceiling's buffers) would become a TMS allocation,
and torch's allocator counters, which the other methods' rows and targets read, would count
memory that TMS has unmapped. TMS also ends the process (``exit(1)``) on any state or CUDA error
in a pause or a resume. So the method runs in a worker process of its own
(:mod:`chatlearn_mem_bench.tms_worker`), started with the environment slime gives its training
actors, which builds the same trainer (same config and seed, one training step) and answers one
round at a time: the benchmark asks it for its round of a part right after the other methods'
round of that part, so its rounds are interleaved with theirs as theirs are with each other, and
the GPU is idle in the benchmark process while the worker copies. Its times are measured in the
worker, with the same synchronisation as :func:`chatlearn_mem_bench.measure.timed`.

**Parts.** TMS can tell apart only what was allocated under different tags
(``torch_memory_saver.region(tag=...)``). The worker builds the model and DDP under tag ``model``
(megatron's DDP allocates the param and grad buffers in one constructor, so the weights come with
the grads), the optimizer under ``main_weights`` (the fp32 main weights) and runs the first
optimizer step under ``optimizer_states`` (Adam's states are created then); the rest of the
process (activations, workspaces) is TMS's ``default`` tag. It is timed on ``weights`` (pausing
``model``: weights and grads, what TMS must move to free the weights), ``main_weights``,
``optimizer_states`` and ``full`` (``pause()`` of everything, as slime's ``sleep()``). Each pause is
preceded by ``torch.cuda.empty_cache()`` (as slime's ``sleep()`` and the manager's offload do), and
each row records the device bytes the pause gave back (``tms_released_bytes``): a tag's allocator
segments are backed up whole, free blocks included.

Exactness: in the first round of every part the worker compares an integer checksum of the
part's tensors before the pause with the one after the resume; a difference counts as a changed
part of the method (the integrity target), as for the other methods.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

from chatlearn_mem_bench.config import FULL
from chatlearn_mem_bench.methods import Method
from chatlearn_mem_bench.plan import TMS_IN_GBPS, TMS_OUT_GBPS

__all__ = [
    "NAME",
    "TAGS",
    "TMS_IN_GBPS",
    "TMS_OUT_GBPS",
    "TorchMemorySaverMethod",
    "TmsWorkerError",
    "skip_reason",
    "worker_env",
]

NAME = "torch_memory_saver"
TAGS = {"weights": "model", "main_weights": "main_weights", "optimizer_states": "optimizer_states", FULL: None}
"""The TMS tag each part is paused by (None: ``pause()`` of every tag)."""
READY_TIMEOUT_S = 600.0
"""How long :meth:`_Pending.ready` waits for the worker by default."""
READY_MIN_S = 60.0
READY_FACTOR = 2.0
"""The benchmark waits for the worker, which builds the same trainer from the same moment, at most
``max(READY_MIN_S, READY_FACTOR x its own setup time)`` past its own setup: a worker that hangs
costs the run that much, not its time budget."""
ROUND_TIMEOUT_S = 300.0
"""How long one round (a pause and a resume) may take before the worker counts as stuck."""


class TmsWorkerError(RuntimeError):
    """The TMS worker could not start, or stopped answering; the message says why."""


def _tms_package():
    """The installed ``torch_memory_saver`` package's directory, or None."""
    import importlib.util

    spec = importlib.util.find_spec("torch_memory_saver")
    return Path(spec.origin).parent if spec is not None and spec.origin else None


def preload_library() -> Path:
    """The TMS ``preload`` library matching this torch's CUDA major (``..._preload_cu13.abi3.so``).

    Raises:
        RuntimeError: Not exactly one such library next to the package (TMS's own rule).
    """
    from torch_memory_saver.utils import get_binary_path_from_package

    return Path(get_binary_path_from_package("torch_memory_saver_hook_mode_preload"))


def cuda_runtime_dir(major: Optional[int] = None) -> Optional[Path]:
    """The directory of the ``libcudart.so.<major>`` this process uses (from ``/proc/self/maps``),
    else one in an ``nvidia/*/lib`` folder of ``sys.path``: the preload library needs it found by
    the loader before Python starts, where torch's own RPATHs do not apply."""
    major = major or int((torch.version.cuda or "0").split(".")[0])
    name = f"libcudart.so.{major}"
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            path = line.split()[-1] if line.split() else ""
            if Path(path).name.startswith(name):
                return Path(path).parent
    except OSError:
        pass
    for entry in sys.path:
        for hit in sorted(Path(entry).glob(f"nvidia/*/lib/{name}*")) if entry and Path(entry).is_dir() else []:
            return hit.parent
    return None


def skip_reason(cuda: bool) -> Optional[str]:
    """Why the method cannot run here, or None: no CUDA, TMS not installed, expandable segments
    (TMS refuses them), no preload library for this CUDA."""
    if not cuda:
        return "no CUDA: torch_memory_saver pauses CUDA allocations (GPU only)"
    if _tms_package() is None:
        return (
            "torch_memory_saver is not installed (pip install torch_memory_saver; scripts/gpu_wheelhouse.sh carries it)"
        )
    if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, which torch_memory_saver refuses"
    try:
        preload_library()
    except Exception as e:  # noqa: BLE001 - TMS's own RuntimeError, or an import error: the reason
        return f"torch_memory_saver cannot be loaded in this process: {e}"
    return None


def worker_env(retain_cpu_backup: bool, base: Optional[dict] = None) -> dict:
    """The worker's environment: slime's (``LD_PRELOAD`` of the preload library,
    ``TMS_INIT_ENABLE=1``, ``TMS_INIT_ENABLE_CPU_BACKUP=1``), the CUDA runtime's directory on
    ``LD_LIBRARY_PATH``, and ``TMS_RETAIN_CPU_BACKUP`` as configured.

    The preload library needs ``libcudart.so.<major>`` and ``libcuda.so.1`` and has no RPATH: the
    loader finds the runtime on ``LD_LIBRARY_PATH`` or in its cache. Torch's pip build brings its
    own (``nvidia/cu13/lib``); a machine with a system CUDA as well would load both (checked on a
    CPU machine with CUDA 13 in ``/usr/local``: two ``libcudart.so.13`` in one process). Torch's
    folder first makes the preload library use torch's, which torch then finds loaded."""
    env = dict(os.environ if base is None else base)
    lib = str(preload_library())
    others = [p for p in env.get("LD_PRELOAD", "").split(":") if p and "torch_memory_saver" not in p]
    env["LD_PRELOAD"] = ":".join([lib, *others])
    runtime = cuda_runtime_dir()
    if runtime is not None:
        env["LD_LIBRARY_PATH"] = ":".join([str(runtime), *[p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]])
    env.update(
        TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1", TMS_RETAIN_CPU_BACKUP="1" if retain_cpu_backup else "0"
    )
    env["PYTHONUNBUFFERED"] = "1"
    return env


class TorchMemorySaverMethod(Method):
    """The benchmark's side of the TMS worker: starts it, asks it for rounds, keeps its answers.

    Unlike the other methods it is not timed in this process: :meth:`round` returns the worker's
    own times, bytes and memory snapshots (``remote`` is True).
    """

    name = NAME
    remote = True
    resizes_storages = False

    def __init__(self, mm, trainer, pin: bool, proc: subprocess.Popen):
        # mm and trainer are the benchmark's (for the rows); None where the worker is used alone
        self.mm, self.trainer, self.pin = mm, trainer, pin
        self.device = mm.device if mm is not None else torch.device("cuda")
        self.detached_grad_hooks: dict[str, int] = {}
        self._proc = proc
        self.info: dict = {}
        """The worker's answer once ready (TMS version, environment, its trainer's bytes and first loss)."""
        self.failed: Optional[str] = None
        """Why the worker stopped, once it did (its later rounds are skipped)."""
        self.released: dict[str, list[int]] = {}
        """Per part, the device bytes each timed pause gave back."""
        self.last_memory: dict = {}

    # -- starting -------------------------------------------------------------------------------
    @classmethod
    def spawn(cls, cfg, fake: bool = False) -> "_Pending":
        """Start the worker for ``cfg`` (it builds its trainer while the caller builds its own).

        Args:
            fake: Run the worker without TMS (a host copy stands in for the pause, no LD_PRELOAD):
                its protocol and checksums on any machine, for tests; never timed against anything.
        """
        env = dict(os.environ, PYTHONUNBUFFERED="1") if fake else worker_env(cfg.tms_retain_cpu_backup)
        cmd = [sys.executable, "-m", "chatlearn_mem_bench.tms_worker"] + (["--fake"] if fake else [])
        # the protocol on the worker's stdin and stdout (the worker moves its own prints to stderr)
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        _send(proc, {"cmd": "start", "config": cfg.model_dump(mode="json")})
        return _Pending(cls, proc)

    # -- rounds ---------------------------------------------------------------------------------
    def parts(self) -> tuple[str, ...]:
        return tuple(TAGS) if self.device.type == "cuda" or self.info.get("fake") else ()

    @property
    def pays_empty_cache(self) -> bool:
        return True  # every pause starts with torch.cuda.empty_cache(), as slime's sleep()

    def offload(self, part: str) -> int:  # pragma: no cover - timed in the worker (round)
        raise NotImplementedError("the torch_memory_saver method is timed in its worker: use round()")

    onload = offload

    def round(self, part: str, check: bool, snap: bool) -> dict:
        """One pause and resume of ``part`` in the worker: ``offload_s``, ``onload_s``,
        ``released_bytes`` (device bytes the pause gave back), ``bytes_equal`` (with ``check``:
        the part's checksum after the resume equals the one before), ``memory`` (with ``snap``:
        the worker's snapshot per stage).

        Raises:
            TmsWorkerError: The worker failed or stopped answering (it is then stopped).
        """
        if self.failed:
            raise TmsWorkerError(self.failed)
        try:
            _send(self._proc, {"cmd": "round", "part": part, "check": check, "snap": snap})
            out = _receive(self._proc, ROUND_TIMEOUT_S)
        except TmsWorkerError as e:
            self.failed = f"{part}: {e}"
            self.close()
            raise
        if "error" in out:
            self.failed = f"{part}: {out['error']}"
            self.close()
            raise TmsWorkerError(self.failed)
        self.released.setdefault(part, []).append(out["released_bytes"])
        self.last_memory = out.get("memory") or {}
        return out

    def device_bytes(self, part: str) -> int:  # the worker's figures (round's memory)
        return 0

    def host_bytes(self) -> tuple[int, int]:
        return 0, 0

    def row_extra(self, part: str) -> dict:
        """Fields the benchmark adds to this method's timing rows of ``part``."""
        released = sorted(self.released.get(part, []))
        return {
            "tms_tag": TAGS[part] or "(every tag)",
            "tms_released_bytes": released[len(released) // 2] if released else None,
        }

    def close(self) -> dict:
        """Stop the worker (asking it first); its last words (its final check), or ``{}``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return {}
        bye: dict = {}
        try:
            if proc.poll() is None:
                _send(proc, {"cmd": "exit"})
                bye = _receive(proc, 60.0).get("bye", {})
        except TmsWorkerError:
            pass
        finally:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return bye


class _Pending:
    """A worker that is building its trainer; :meth:`ready` waits for it."""

    def __init__(self, cls, proc: subprocess.Popen):
        self._cls, self._proc = cls, proc

    def ready(self, mm, trainer, pin: bool, timeout_s: float = READY_TIMEOUT_S) -> TorchMemorySaverMethod:
        """The method, once the worker has built its trainer.

        Raises:
            TmsWorkerError: The worker could not load TMS, build the trainer, or did not answer in
                ``timeout_s`` (it is then stopped); the message is the skip reason.
        """
        try:
            out = _receive(self._proc, timeout_s)
        except TmsWorkerError:
            self.abort()
            raise
        if "error" in out:
            self.abort()
            raise TmsWorkerError(out["error"])
        method = self._cls(mm, trainer, pin, self._proc)
        method.info = out["ready"]
        return method

    def abort(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()


def _send(proc: subprocess.Popen, msg: dict) -> None:
    try:
        proc.stdin.write(json.dumps(msg) + "\n")
        proc.stdin.flush()
    except (BrokenPipeError, OSError, ValueError) as e:
        raise TmsWorkerError(f"the worker is gone (exit status {proc.poll()}): {e}") from None


def _receive(proc: subprocess.Popen, timeout_s: float) -> dict:
    """The worker's next protocol line (JSON), within ``timeout_s``."""
    box: list = []

    def read() -> None:
        box.append(proc.stdout.readline())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s)
    if reader.is_alive():
        proc.kill()
        raise TmsWorkerError(f"no answer from the worker in {timeout_s:.0f} s (it was stopped)")
    line = box[0] if box else ""
    if not line:
        code = proc.wait()
        why = {
            127: "the loader could not start it: a library the preload library needs (libcuda.so.1, "
            "libcudart) was not found",
            1: "torch_memory_saver ends its process on a failed pause or resume",
        }.get(code, "")
        raise TmsWorkerError(
            f"the worker ended (exit status {code}) without an answer{'; ' + why if why else ''} (its "
            "messages are in the benchmark's stderr)"
        )
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        raise TmsWorkerError(f"the worker answered something that is not JSON: {line[:200]!r}") from None
