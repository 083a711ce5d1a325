"""What every actor holding a model shares (:class:`ManagedActor`: process-group setup, transitions,
residency, audit) and how an actor measures its own process (:class:`PeakRSS`, :func:`process_memory`).

Every method returns plain Python or CPU tensors, so results cross process boundaries cheaply.
"""

from __future__ import annotations

import logging
import os
import platform
import warnings
from typing import Any, Callable, Mapping, Optional

import torch

from chatlearn_mem import MemoryConfig, Part
from chatlearn_mem.parts import PartsArg, parse_parts
from chatlearn_mem_ray.actors.wire import register_tensor_serializer

__all__ = ["ManagedActor", "PeakRSS", "process_memory", "to_device"]


def _stats(stats) -> list[dict]:
    return [
        {
            "part": s.group,
            "direction": s.direction,
            "bytes": s.nbytes,
            "copied_bytes": s.copied_bytes,
            "seconds": s.seconds,
            "steps": s.steps,
            "actions": s.actions,
            "host_seconds": s.host_seconds,
        }
        for s in stats
        if s is not None
    ]


def _rss_bytes() -> Optional[int]:
    """This process's resident set in bytes (Linux ``/proc``); None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _private_and_shared_bytes() -> Optional[tuple[int, int]]:
    """This process's resident private (anonymous) memory and shared memory (``RssAnon``,
    ``RssShmem`` of ``/proc/self/status``); None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssShmem")))
        return int(fields["RssAnon"].split()[0]) * 1024, int(fields["RssShmem"].split()[0]) * 1024
    except (OSError, ValueError, KeyError):
        return None


class PeakRSS:
    """The peak growth of this process's resident memory over a ``with`` block, sampled every
    ``interval_s`` on a thread: ``.bytes`` of private memory (what the process itself allocated:
    copies, merged tensors) and ``.shared_bytes`` of shared memory (Ray's object store, which maps
    the same pages into every process that reads them); 0 where ``/proc`` cannot be read."""

    def __init__(self, interval_s: float = 0.002):
        import threading

        self.interval_s, self.bytes, self.shared_bytes = interval_s, 0, 0
        self._start: Optional[tuple[int, int]] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="chatlearn-peak-rss", daemon=True)

    def _take(self) -> None:
        now = _private_and_shared_bytes()
        if now is not None and self._start is not None:
            self.bytes = max(self.bytes, now[0] - self._start[0])
            self.shared_bytes = max(self.shared_bytes, now[1] - self._start[1])

    def _sample(self) -> None:
        while True:
            self._take()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "PeakRSS":
        self._start = _private_and_shared_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()


def process_memory() -> dict:
    """What this process holds beside a model's parts: on CUDA torch's allocated and reserved
    bytes, and the process's resident set (``rss_bytes``)."""
    out = {}
    if torch.cuda.is_available():
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        out["cuda_reserved_bytes"] = torch.cuda.memory_reserved()
    out["rss_bytes"] = _rss_bytes()
    return out


class ManagedActor:
    """What both actor kinds share: process-group setup, residency, audit, weight digests."""

    manager: Any
    name: str

    def __init__(self, name: str, memory: Mapping[str, Any]):
        # The run's console is the run's: megatron's notices (its deprecations, "GPTModel IS DEPRECATED"
        # on 0.19) and torch's warning when megatron's zero_grad reads .grad of an fp32 shard view
        # say nothing a user of the run can act on; the actors' own problems come back as errors.
        logging.getLogger("megatron").setLevel(logging.ERROR)
        # torch's CUDA build on a host without a CUDA runtime, when megatron imports cpp_extension
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module="megatron")
        warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
        warnings.filterwarnings("ignore", message=".*is deprecated. Please use.*")  # torch.distributed renames
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        register_tensor_serializer()  # the driver reads what this actor returns without megatron-core
        self.name = name
        self.memory = MemoryConfig(**memory)
        self.manager = None
        self._in_flight: list = []  # Transfer handles of non-blocking offloads and onloads (see settle)

    def master_address(self) -> str:
        """A ``tcp://ip:port`` init method on this actor's node (call on rank 0, which then joins
        with :meth:`setup`). The rendezvous server starts here, listening on a port the OS picks:
        a port chosen free and bound later could be taken in between (seen as a DistNetworkError
        when many processes start at once)."""
        import datetime

        import torch.distributed as dist

        try:
            import ray

            ip = ray.util.get_node_ip_address()
        except Exception:  # not inside Ray
            ip = "127.0.0.1"
        self._master_store = dist.TCPStore(
            ip, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(minutes=30)
        )
        return f"tcp://{ip}:{self._master_store.port}"

    def _init_distributed(self, rank: int, world_size: int, tp: int, init_method: str, seed: int) -> None:
        from chatlearn_mem import cpu_backend
        from chatlearn_mem.models import gpt

        cpu_backend.install(quiet=True)  # without CUDA; the driver's device line says which it is
        store = getattr(self, "_master_store", None) if rank == 0 else None
        gpt.init_distributed(rank, world_size, tp, init_method=init_method, seed=seed, store=store)

    def offload(self, parts: PartsArg = None, blocking: bool = True) -> list[dict]:
        """Offload the chosen parts (None: every part of the manager; offloaded ones are skipped).

        ``blocking=False``: return at once; the copies run behind this actor's next calls (each
        waits for what it needs) and :meth:`settle` reports them."""
        return self._transition(self.manager.offload, parts, blocking)

    def onload(self, parts: PartsArg = None, blocking: bool = True) -> list[dict]:
        """Onload the chosen parts (None: every part of the manager; resident ones are skipped);
        ``blocking`` as in :meth:`offload` (a forward pass then waits per module)."""
        return self._transition(self.manager.onload, parts, blocking)

    def _transition(self, call: Callable, parts: PartsArg, blocking: bool) -> list[dict]:
        if parts is not None:  # the service's "every part" names parts a torch-native trainer has not
            parts = [p for p in parse_parts(parts, Part) if p in self.manager.parts]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = call(parts, blocking=blocking)
        if blocking:
            return _stats(out)
        self._in_flight.append(out)
        return []

    def settle(self) -> dict:
        """Wait for the non-blocking transitions this actor started.

        Returns:
            ``{"seconds": how long this call waited, "stats": one dict per part moved}``.
        """
        import time

        t0 = time.perf_counter()
        stats = []
        while self._in_flight:
            stats += _stats(self._in_flight.pop(0).wait())
        return {"seconds": time.perf_counter() - t0, "stats": stats}

    def part_sizes(self) -> dict[str, int]:
        """Device bytes of each part when resident, whether resident now or not (for a residency plan)."""
        return {p: int(b) for p, b in self.manager.residency().resident_by_category.items() if p in set(Part)}

    def device_free_bytes(self) -> Optional[int]:
        """Free bytes on this actor's GPU (``torch.cuda.mem_get_info``); None without CUDA."""
        if not torch.cuda.is_available():
            return None
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info()[0])

    def residency(self) -> dict:
        """Device and host bytes of the model, per part; on CUDA also what the allocator holds."""
        r = self.manager.residency()
        out = {
            "device_bytes": r.device_bytes,
            "host_bytes": r.host_bytes,
            "by_part": dict(r.by_category),
            "host_by_part": dict(r.host_by_category),
            "resident_by_part": self.part_sizes(),
        }
        return {**out, **process_memory()}

    def audit(self) -> list[str]:
        """The manager's audit problems (empty when clean)."""
        return list(self.manager.audit().problems)

    def ping(self) -> str:
        return self.name

    def pid(self) -> int:
        """This actor's process id (tests kill it to simulate a lost process)."""
        return os.getpid()

    def node_info(self) -> dict:
        """Where this actor runs and what: ``{"node_id", "ip", "hostname", "versions"}`` (see
        :func:`chatlearn_mem_ray.actors.nodes.software_versions`)."""
        import ray

        from chatlearn_mem_ray.actors.nodes import software_versions

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": platform.node(),
            "versions": software_versions(),
        }

    def check_shared(self, token_path: str, token: str) -> bool:
        """Whether this actor's node reads the driver's token file (and leaves a marker beside it)."""
        import ray

        from chatlearn_mem_ray.actors.nodes import check_shared_from_node

        return check_shared_from_node(token_path, token, ray.get_runtime_context().get_node_id())


def to_device(t: torch.Tensor) -> torch.Tensor:
    """``t`` on this actor's GPU when it has one, else as it is."""
    return t.cuda() if torch.cuda.is_available() else t
