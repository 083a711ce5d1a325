"""The benchmark's torch_memory_saver worker: the trainer built under TMS tags, paused and resumed on request.

Started by :class:`chatlearn_mem_bench.tms.TorchMemorySaverMethod` with slime's environment
(``LD_PRELOAD`` of TMS's preload library, ``TMS_INIT_ENABLE=1``, ``TMS_INIT_ENABLE_CPU_BACKUP=1``);
see :mod:`chatlearn_mem_bench.tms` for why it is a process of its own and what it times. The
protocol is one JSON object per line: the benchmark writes to the worker's stdin, the worker
answers on its stdout, which carries nothing else (everything the libraries print goes to stderr).

1. ``{"cmd": "start", "config": <BenchConfig>}``: the worker checks that TMS is loaded, builds the
   trainer (tags ``model``, ``main_weights``, ``optimizer_states``) and trains one step; answers
   ``{"ready": {...}}`` or ``{"error": "<why it cannot run>"}`` (and ends).
2. ``{"cmd": "round", "part": p, "check": bool, "snap": bool}``: one timed pause and resume of the
   part's tag; answers the times, the device bytes the pause gave back, whether the part's bytes
   are the same after the resume (``check``) and memory snapshots (``snap``).
3. ``{"cmd": "exit"}``: answers ``{"bye": {...}}`` (a forward-only loss, to compare with the
   benchmark's own trainer), then ends.

``--fake`` runs the same protocol without TMS (a host copy of the part's tensors stands in for the
pause, the tensors are zeroed while "paused"): for tests on any machine, never timed against
anything.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

CHECKED = {
    "weights": ("weights", "grads"),
    "main_weights": ("main_weights",),
    "optimizer_states": ("optimizer_states",),
    "full": ("weights", "grads", "main_weights", "optimizer_states"),
}
"""The parts whose bytes each timed part's pause and resume must keep (the ``model`` tag holds
the weights and the grads)."""


FAKE_EXIT_ON = "CHATLEARN_MEM_BENCH_FAKE_TMS_EXIT_ON"
"""With ``--fake``: the tag (``all`` for every tag) whose pause ends the worker, as TMS ends its
process on a failed pause (tests)."""
FAKE_CORRUPT = "CHATLEARN_MEM_BENCH_FAKE_TMS_CORRUPT"
"""With ``--fake``: the tag whose resume brings back other bytes (tests)."""


class FakeSaver:
    """A stand-in for TMS's API (``region``, ``pause``, ``resume``) that copies the tagged tensors to
    the host and zeroes them while paused. Knows a tag's tensors from the worker, not from the
    allocations; only for tests of the protocol."""

    def __init__(self):
        self.tensors = {}  # tag -> callable returning the tensors of the tag
        self._saved: dict = {}

    @contextlib.contextmanager
    def region(self, tag: str, enable_cpu_backup: bool = False):
        yield

    def _tags(self, tag: Optional[str]) -> list[str]:
        return list(self.tensors) if tag is None else [tag]

    def pause(self, tag: Optional[str] = None) -> int:
        # test hooks: end the process as TMS does on a failed pause, or bring back other bytes
        if os.environ.get(FAKE_EXIT_ON) == (tag or "all"):
            os._exit(1)
        n = 0
        for t in self._tags(tag):
            assert t not in self._saved, f"tag {t} paused twice"
            tensors = self.tensors[t]()
            self._saved[t] = [(x, x.detach().clone()) for x in tensors]
            for x in tensors:
                x.detach().zero_()
                n += x.numel() * x.element_size()
        return n

    def resume(self, tag: Optional[str] = None) -> int:
        n = 0
        for t in self._tags(tag):
            for x, saved in self._saved.pop(t):
                x.detach().copy_(saved)
                n += saved.numel() * saved.element_size()
            if os.environ.get(FAKE_CORRUPT) == t and x.numel():
                x.detach().view(-1)[:1].add_(1)
        return n


class Worker:
    """The trainer built under TMS tags and the rounds on it."""

    def __init__(self, cfg, fake: bool):
        self.cfg, self.fake = cfg, fake
        self.cuda = torch.cuda.is_available() and not fake
        self.saver = FakeSaver() if fake else _real_saver()
        self._fake_released = 0

    def build(self) -> dict:
        from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager
        from chatlearn_mem.models import gpt
        from chatlearn_mem_bench.plan import measured_part_sizes, part_bytes
        from chatlearn_mem_bench.trainer import init_distributed

        t0 = time.perf_counter()
        cfg, saver = self.cfg, self.saver
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            init_distributed(tmp)
            with saver.region(tag="model", enable_cpu_backup=True):
                with _optimizer_tagged(saver):
                    trainer = gpt.build_gpt_trainer(cfg.trainer)
                _empty_cache(self.cuda)  # where torch empties the active pool: its free blocks
            # GPTTrainer.train_step, with the optimizer step (which creates Adam's states) tagged
            batch = gpt.synthetic_batch(cfg.trainer, 0, batch_size=cfg.batch_size)
            trainer.model.zero_grad_buffer()
            trainer.optimizer.zero_grad()
            loss = trainer.loss(batch)
            loss.backward()
            trainer.model.finish_grad_sync()
            with saver.region(tag="optimizer_states", enable_cpu_backup=True):
                trainer.optimizer.step()
                _empty_cache(self.cuda)
            first_loss = loss.item()
        del loss, batch
        gc.collect()
        _empty_cache(self.cuda)
        self.trainer = trainer
        # never offloads: it names the parts' tensors, for the checksums, as in the benchmark
        self.mm = TrainerMemoryManager(
            trainer.model, trainer.optimizer, MemoryConfig(pin_memory=False, check_host_memory=False)
        )
        sizes = measured_part_sizes({p: self.mm.state.storages(p) for p in Part})
        if self.fake:
            from chatlearn_mem_bench.methods import logical_tensors

            parts = {"model": ("weights", "grads"), "main_weights": ("main_weights",)}
            parts["optimizer_states"] = ("optimizer_states",)
            for tag, names in parts.items():
                self.saver.tensors[tag] = lambda names=names: [
                    t for n in names for t in logical_tensors(self.mm, trainer, n)
                ]
        return {
            "fake": self.fake,
            "version": _version(),
            # one CUDA runtime: the preload library's libcudart must be torch's (worker_env puts its
            # folder first on LD_LIBRARY_PATH); a second copy would take TMS's calls apart from torch's
            "libcudart": _loaded("libcudart.so"),
            "environment": {
                k: os.environ.get(k)
                for k in ("LD_PRELOAD", "TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP", "TMS_RETAIN_CPU_BACKUP")
            },
            "settings": self._settings(),
            "bytes_per_part": part_bytes(sizes),
            "first_loss": first_loss,
            "build_s": time.perf_counter() - t0,
            "memory_after_build": self._snap(),
        }

    def _settings(self) -> dict:
        """What TMS runs with, as it reports it (its hook mode, whether it keeps its host backups,
        their kind); ``{}`` for the stand-in."""
        if self.fake:
            return {}
        out = {"hook_mode": "preload"}
        try:
            out["retain_cpu_backup"] = bool(self.saver.retain_cpu_backup)
            cdll = self.saver._impl._binary_wrapper.cdll  # TMS's own getter; no public one
            out["cpu_backup_backend"] = cdll.tms_get_cpu_backup_backend().decode()
            out["enable_cpu_backup"] = bool(cdll.tms_get_enable_cpu_backup())
        except Exception as e:  # noqa: BLE001 - another TMS release: say what could not be read
            out["unreadable"] = f"{type(e).__name__}: {e}"
        return out

    def _snap(self) -> dict:
        import psutil

        out = {"rss_bytes": psutil.Process().memory_info().rss}
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            out.update(
                device_used_bytes=total - free,
                cuda_allocated_bytes=torch.cuda.memory_allocated(),
                cuda_reserved_bytes=torch.cuda.memory_reserved(),
            )
        return out

    def _free(self) -> int:
        if self.cuda:
            return torch.cuda.mem_get_info()[0]
        return self._fake_released

    def round(self, part: str, check: bool, snap: bool) -> dict:
        from chatlearn_mem_bench.tms import TAGS
        from chatlearn_mem_bench.trainer import checksum

        tag = TAGS[part]
        checked = CHECKED[part]
        ref = checksum(self.mm, self.trainer, checked) if check else None
        memory = {"before": self._snap()} if snap else {}
        _sync(self.cuda)
        free0 = self._free()
        t0 = time.perf_counter()
        _empty_cache(self.cuda)
        paused = self.saver.pause(tag)
        _sync(self.cuda)
        offload_s = time.perf_counter() - t0
        if self.fake:
            self._fake_released += paused or 0
        free1 = self._free()
        if snap:
            memory["after_offload"] = self._snap()
        t0 = time.perf_counter()
        self.saver.resume(tag)
        _sync(self.cuda)
        onload_s = time.perf_counter() - t0
        if self.fake:
            self._fake_released -= paused or 0
        free2 = self._free()
        if snap:
            memory["after_onload"] = self._snap()
        equal = None if ref is None else checksum(self.mm, self.trainer, checked) == ref
        return {
            "offload_s": offload_s,
            "onload_s": onload_s,
            "released_bytes": int(free1 - free0),
            "restored_bytes": int(free1 - free2),
            "bytes_equal": equal,
            "memory": memory,
        }

    def finish(self) -> dict:
        from chatlearn_mem.models import gpt

        batch = gpt.synthetic_batch(self.cfg.trainer, 1, batch_size=self.cfg.batch_size)
        with torch.no_grad():
            loss = self.trainer.loss(batch).item()
        return {"forward_loss_batch1": loss, "audit_ok": self.mm.audit().ok}


def forward_loss(trainer, cfg) -> float:
    """The no-grad loss the worker reports at the end, computed the same way (for the comparison)."""
    from chatlearn_mem.models import gpt

    batch = gpt.synthetic_batch(cfg.trainer, 1, batch_size=cfg.batch_size)
    with torch.no_grad():
        return trainer.loss(batch).item()


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _empty_cache(cuda: bool) -> None:
    if cuda:
        torch.cuda.empty_cache()


@contextlib.contextmanager
def _optimizer_tagged(saver):
    """megatron's ``get_megatron_optimizer`` (which allocates the fp32 main weights) under the
    ``main_weights`` tag: :func:`chatlearn_mem.models.gpt.build_gpt_trainer` imports it from
    ``megatron.core.optimizer`` when it runs, so the module attribute is wrapped for the build."""
    import megatron.core.optimizer as mopt

    original = mopt.get_megatron_optimizer

    def tagged(*args, **kwargs):
        with saver.region(tag="main_weights", enable_cpu_backup=True):
            out = original(*args, **kwargs)
            _empty_cache(torch.cuda.is_available())
        return out

    mopt.get_megatron_optimizer = tagged
    try:
        yield
    finally:
        mopt.get_megatron_optimizer = original


def _loaded(name: str) -> list[str]:
    """The files of this process whose name starts with ``name`` (from ``/proc/self/maps``)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps if Path(line.split()[-1]).name.startswith(name)})


def _preloaded() -> Optional[str]:
    """Why TMS's preload library is not in this process (None when it is)."""
    wanted = [p for p in os.environ.get("LD_PRELOAD", "").split(":") if "torch_memory_saver" in p]
    if len(wanted) != 1:
        return f"LD_PRELOAD names {len(wanted)} torch_memory_saver libraries ({os.environ.get('LD_PRELOAD')!r})"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None  # cannot tell: TMS's own checks decide
    if os.path.realpath(wanted[0]) not in maps and wanted[0] not in maps:
        return (
            f"the loader did not preload {wanted[0]} (its reason is in this worker's stderr, e.g. "
            "libcudart.so not found): allocations would not go through torch_memory_saver"
        )
    return None


def _real_saver():
    problem = _preloaded()
    if problem:
        raise RuntimeError(problem)
    from torch_memory_saver import torch_memory_saver

    return torch_memory_saver


def _version() -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version("torch_memory_saver")
    except metadata.PackageNotFoundError:
        return None


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    fake = "--fake" in argv
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # from here on, whatever anything prints goes to stderr: stdout is the protocol

    def send(msg: dict) -> None:
        proto.write(json.dumps(msg) + "\n")
        proto.flush()

    start = json.loads(sys.stdin.readline() or "{}")
    from chatlearn_mem.models import gpt
    from chatlearn_mem_bench.config import BenchConfig

    code = 0
    with contextlib.ExitStack() as stack:
        try:
            if start.get("cmd") != "start":
                raise RuntimeError(f"expected a start command, got {start!r}")
            if not fake and not torch.cuda.is_available():
                raise RuntimeError("no CUDA in the worker")
            worker = Worker(BenchConfig(**start["config"]), fake)
            stack.enter_context(gpt.owned_process_group())
            ready = worker.build()
        except Exception as e:  # noqa: BLE001 - the benchmark records it as the skip reason
            send({"error": f"torch_memory_saver cannot run in the worker: {type(e).__name__}: {e}"})
            worker = None
        if worker is not None:
            send({"ready": ready})
            for line in sys.stdin:
                msg = json.loads(line)
                if msg["cmd"] == "exit":
                    send({"bye": worker.finish()})
                    break
                try:
                    send(worker.round(msg["part"], msg["check"], msg["snap"]))
                except Exception as e:  # noqa: BLE001 - sent, and the worker stops
                    send({"error": f"{type(e).__name__}: {e}"})
                    code = 1
                    break
    gpt.exit_process(code)


if __name__ == "__main__":
    main()
