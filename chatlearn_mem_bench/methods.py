"""The ways of moving a trainer part off the device and back that the benchmark times.

Every method moves exactly the tensors the manager moves (``TrainerMemoryManager._part_tensors``,
the same storages and bytes) and leaves the trainer exactly as it found it, so all methods run in
one process on one trainer, interleaved repeat by repeat.

* ``manager``: :class:`chatlearn_mem.TrainerMemoryManager` (host store reused, storages released
  and regrown in place).
* ``ceiling``: not a way to offload anything; one copy of the same number of bytes between a
  device buffer and a host buffer, both allocated once per run (the host one sized for the
  largest copy, pinned on GPU the way the manager pins its store) and sliced per part. No
  allocation, no release: the fastest a copy of these bytes can be on this machine.
* ``release_bound``: not a way to offload either; the same copy (into the ceiling's host
  buffer), but the device buffer is really released after the offload copy and regrown before
  the onload copy (with the manager's huge page advice on CPU). What any method that frees the
  memory must at least pay. On CPU the kernel zeroes every page it hands back, an extra pass the
  preallocated ceiling never makes. On CUDA ``resize_(0)`` alone would only return the block to
  torch's caching allocator (no release at all), so the bound calls ``torch.cuda.empty_cache()``
  after it: the block goes back to the driver (``cudaFree``) and the regrow is a ``cudaMalloc``.
* ``per_tensor_new_host`` (alternative): every tensor copied one by one into a newly allocated,
  unpinned host tensor (``t.to("cpu")`` on a GPU; an explicit copy on CPU, where ``.to("cpu")``
  copies nothing), as several RLHF systems move optimizer state; copied back tensor by tensor.
  Device memory is released and regrown in place like the manager, so the difference is the
  per-tensor copies and the fresh host allocations.
* ``fresh_host_alloc`` (alternative): one host buffer per storage, allocated anew (pinned on GPU)
  on every offload and freed after onload, instead of a reused store. Copies whole storages
  like the manager, so the difference is the allocation (and, on GPU, pinning) every cycle. On
  GPU each buffer is fresh anonymous memory page-locked with ``cudaHostRegister`` at its exact
  size and unregistered and unmapped after the onload (a one-storage
  :class:`chatlearn_mem.host_store.HostStore`, the manager's own pinning). torch's pinned
  allocator (``pin_memory=True``) is not used: it hands back blocks cached from the previous
  cycle, so the alternative would tie with the manager without ever allocating, and it rounds
  every block up to a power of two, which makes the host peak depend on the storage sizes.
* ``replace_rebuild`` (alternative): ``t.data = <host copy>`` for every tensor (``param.data``
  replacement), the device storage dropped; onload allocates a new device buffer per storage,
  copies every tensor back into it and rebuilds every view megatron keeps (params, buffer and
  bucket views, cached bucket-group shards, distributed-optimizer shards) by reassigning
  ``.data``. After timing, the benchmark (untimed) moves everything back onto the original
  storages so the next method finds the trainer unchanged.
* ``megatron_builtin`` (alternative, megatron-core 0.16+): megatron-core's own calls. Weights:
  ``_ParamAndGradBuffer.offload_to_cpu(move_params=True)`` (one flat copy of each param buffer
  into a pinned host copy allocated on the first call and kept), ``reload_from_cpu``; grads:
  ``DistributedDataParallel.offload_grad_buffers`` / ``restore_grad_buffers`` (dropped, rebuilt
  zeroed); the full trainer adds ``MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu``
  (main weights and optimizer states together, per tensor, into new pageable host tensors,
  moved back as new device tensors). That last call acts on CUDA tensors only, so on CPU the
  method covers weights and grads alone. Parameters outside the DDP buffers (frozen ones) and
  module buffers stay on the device.

Like with like on CUDA: every method that releases device memory returns it to the driver with
``torch.cuda.empty_cache()`` when the manager does (``MemoryConfig.empty_cache``, on by default):
the manager after each offload, ``release_bound`` always, the alternatives after their release,
megatron-core's optimizer offload by itself. Only the ceiling never releases and never pays it.
:attr:`Method.pays_empty_cache` says which (recorded in the results). Host memory: see
:mod:`chatlearn_mem_bench.plan`; pageable copies are freed, and the C heap trimmed
(:func:`chatlearn_mem.device_memory.trim_host_heap`), before the next method runs.
"""

from __future__ import annotations

from typing import Optional

import torch

from chatlearn_mem import Part
from chatlearn_mem.device_memory import advise_huge_pages, own_memory, storage_key
from chatlearn_mem.host_store import HostStore
from chatlearn_mem.mcore import layout
from chatlearn_mem_bench.config import FULL
from chatlearn_mem_bench.plan import method_parts

__all__ = [
    "Method",
    "ManagerMethod",
    "CeilingMethod",
    "ReleaseBound",
    "LABELS",
    "sync",
    "part_storages",
    "logical_tensors",
]

LABELS = {
    "manager": "chatlearn-mem manager (reused host store, in-place release)",
    "ceiling": "ceiling: one copy between preallocated buffers",
    "release_bound": "bound: one copy plus a real release/regrow of one device buffer",
    "per_tensor_new_host": "alternative: per-tensor copy into new host tensors",
    "fresh_host_alloc": "alternative: host buffers allocated (pinned on GPU) and freed every cycle",
    "replace_rebuild": "alternative: replace .data, then rebuild views",
    "megatron_builtin": "alternative: megatron-core's own offload calls",
    "torch_memory_saver": "alternative: torch_memory_saver as slime uses it (CPU backup; its own process)",
}


def sync(device: torch.device) -> None:
    """Wait for the device (CUDA) so wall time covers the copies."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def storage_view(storage: torch.UntypedStorage, dtype, offset, size, stride) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=storage.device).set_(storage, offset, size, stride)


def part_storages(mm, part: str) -> list[torch.UntypedStorage]:
    """The device storages the manager moves for ``part`` (the same bytes for every method)."""
    return mm.state.storages(Part(part))


def all_storages(mm) -> list[torch.UntypedStorage]:
    """The device storages of every part."""
    return [s for p in mm.parts for s in mm.state.storages(p)]


def logical_tensors(mm, trainer, part: str) -> list[torch.Tensor]:
    """The tensors a per-tensor system would move: params and module buffers for weights, else
    the manager's own list (main weights, optimizer state tensors)."""
    keys = {storage_key(s) for s in part_storages(mm, part)}
    if part == Part.WEIGHTS:
        cands = [t for c in layout.ddp_chunks(trainer.model) for t in list(c.parameters()) + layout.module_buffers(c)]
    else:
        cands = list(mm.state.hooks.part_tensors(Part(part)))
    seen, out = set(), []
    for t in cands:
        if t is not None and id(t) not in seen and storage_key(t) in keys and t.numel():
            seen.add(id(t))
            out.append(t)
    return out


def other_views(mm, trainer, part: str, logical: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every other tensor megatron keeps into the part's storages (rebuilt by replace_rebuild)."""
    keys = {storage_key(s) for s in part_storages(mm, part)}
    cands: list[torch.Tensor] = []
    chunks = layout.ddp_chunks(trainer.model)
    for i, c in enumerate(chunks):
        for b in layout.ddp_buffers(c, i):
            cands += [b.param_data, b.grad_data] + [v for _, v, _, _ in layout.bucket_views(b)]
    for g in layout.bucket_groups(chunks, trainer.optimizer):
        cands += [shard for _, shard, _ in layout.cached_shard_views(g)]
    for leaf in layout.leaf_optimizers(trainer.optimizer):
        cands += [sv.shard for sv in layout.shard_views(leaf)]
    skip = {id(t) for t in logical}
    out, seen = [], set()
    for t in cands:
        if t is None or id(t) in skip or id(t) in seen:
            continue
        if storage_key(t) in keys:
            seen.add(id(t))
            out.append(t)
    return out


class Method:
    """One way of offloading and onloading a part. ``offload``/``onload`` return bytes copied."""

    name = "method"

    def __init__(self, mm, trainer, pin: bool):
        self.mm, self.trainer, self.pin = mm, trainer, pin
        self.device = mm.device
        self.detached_grad_hooks: dict[str, int] = {}
        """Per part: DDP gradient hooks the method left on dropped grad-accumulator nodes (each
        restore hooks them again; none for a method that keeps the trainer intact)."""

    def parts(self) -> tuple[str, ...]:
        """The parts this method is timed on (an alternative: the parts whose bytes are copied)."""
        return method_parts(self.name, self.device.type == "cuda")

    @property
    def pays_empty_cache(self) -> bool:
        """Whether the method returns released device memory to the CUDA driver (``empty_cache``)."""
        return self.device.type == "cuda" and self.mm.config.empty_cache

    def _released(self) -> None:
        """After releasing device storages: to the driver, when the manager would do so too."""
        if self.pays_empty_cache:
            torch.cuda.empty_cache()

    def offload(self, part: str) -> int:
        raise NotImplementedError

    def onload(self, part: str) -> int:
        raise NotImplementedError

    resizes_storages = True
    """Whether the method releases the part's storages itself (``resize_``)."""

    def before(self, part: str) -> None:
        """Untimed, before each round of the method: a method that resizes the part's storages
        gets them resizable. On a CPU device the manager lays a part of many storages out in one
        slab (``MemoryConfig.cpu_contiguous``), where ``resize_`` raises; each such storage gets
        memory of its own again, with its bytes (the manager's next onload lays it out again)."""
        if not self.resizes_storages:
            return
        for s in part_storages(self.mm, part) if part != FULL else all_storages(self.mm):
            own_memory(s)

    def restore(self, part: str) -> None:
        """Untimed: put the trainer back exactly as the manager expects it."""

    def device_bytes(self, part: str) -> int:
        """Device bytes the part holds now (the part's storages plus any new device buffers)."""
        return sum(s.nbytes() for s in part_storages(self.mm, part))

    def host_bytes(self) -> tuple[int, int]:
        """``(host bytes this method holds now, of which pinned)``."""
        return 0, 0


class ManagerMethod(Method):
    name = "manager"
    resizes_storages = False

    last_stats: list = []
    """The :class:`~chatlearn_mem.TransferStats` of the last offload or onload (its host time)."""

    def offload(self, part: str) -> int:
        self.last_stats = self.mm.offload(None if part == FULL else part, force=True)
        return sum(s.copied_bytes for s in self.last_stats)

    def onload(self, part: str) -> int:
        self.last_stats = self.mm.onload(None if part == FULL else part)
        return sum(s.copied_bytes for s in self.last_stats)

    def device_bytes(self, part: str) -> int:
        r = self.mm.residency()
        return r.device_bytes if part == FULL else r.by_category[part]

    def host_bytes(self) -> tuple[int, int]:
        n = self.mm.residency().host_bytes
        return n, n if self.mm.config.resolved_pin_memory() else 0


class CeilingMethod(Method):
    """A copy of a part's bytes between buffers allocated once per run (:meth:`prepare`) and
    sliced per part (:meth:`use`); for grads, a zero-fill (what rebuilding zeroed grads must at
    least do) and no offload copy at all."""

    name = "ceiling"
    resizes_storages = False

    def __init__(self, mm, trainer, pin: bool):
        super().__init__(mm, trainer, pin)
        self._dev: Optional[torch.Tensor] = None
        self._store: Optional[HostStore] = None
        self.nbytes = 0

    @property
    def pays_empty_cache(self) -> bool:
        return False  # never releases

    def prepare(self, device_bytes: int, host_bytes: int) -> None:
        """Allocate and touch both buffers (untimed): ``device_bytes`` for the largest part (grads
        included, which only zero-fill), ``host_bytes`` for the largest copy. The host buffer is
        pinned on GPU exactly as the manager's store is (registered at its exact size)."""
        self.release()
        self._dev = torch.ones(device_bytes, dtype=torch.uint8, device=self.device)
        self._store = HostStore([host_bytes], max(host_bytes, 1), self.pin) if host_bytes else None
        if self._store is not None:
            self._store.buckets[0].fill_(1)
        sync(self.device)

    def use(self, nbytes: int) -> None:
        """Copy ``nbytes`` (a part's) from now on."""
        self.nbytes = nbytes

    @property
    def host(self) -> torch.Tensor:
        return self._store.buckets[0][: self.nbytes]

    @property
    def dev(self) -> torch.Tensor:
        return self._dev[: self.nbytes]

    def release(self) -> None:
        """Free both buffers (the pinned one unregistered), back to the driver on CUDA."""
        self._dev = None
        if self._store is not None:
            self._store.close()
            self._store = None
        _empty_cache(self.device)

    def offload(self, part: str) -> int:
        if part == Part.GRADS:
            return 0
        self.host.copy_(self.dev, non_blocking=self.pin)
        sync(self.device)
        return self.nbytes

    def onload(self, part: str) -> int:
        if part == Part.GRADS:
            self.dev.zero_()
            sync(self.device)
            return 0
        self.dev.copy_(self.host, non_blocking=self.pin)
        sync(self.device)
        return self.nbytes

    def device_bytes(self, part: str) -> int:
        return self._dev.numel() if self._dev is not None else 0

    def host_bytes(self) -> tuple[int, int]:
        n = self._store.nbytes if self._store is not None else 0
        return n, n if self.pin else 0


class ReleaseBound(Method):
    """The ceiling's copy into the ceiling's host buffer, from a device buffer of the part's size
    (:meth:`prepare`, per part) that is released for real after the offload copy and regrown
    before the onload copy."""

    name = "release_bound"
    resizes_storages = False

    def __init__(self, mm, trainer, pin: bool, ceiling: CeilingMethod):
        super().__init__(mm, trainer, pin)
        self.ceiling = ceiling
        self._dev: Optional[torch.Tensor] = None
        self.nbytes = 0

    @property
    def pays_empty_cache(self) -> bool:
        return self.device.type == "cuda"  # the definition of a real release on CUDA

    def prepare(self, nbytes: int) -> None:
        """A device buffer of ``nbytes`` (untimed), replacing the previous part's."""
        self.release()
        self.nbytes = nbytes
        self._dev = torch.ones(nbytes, dtype=torch.uint8, device=self.device)
        sync(self.device)

    def release(self) -> None:
        self._dev = None
        _empty_cache(self.device)

    def offload(self, part: str) -> int:
        n = 0
        if part != Part.GRADS:
            self.ceiling.host.copy_(self._dev, non_blocking=self.pin)
            sync(self.device)
            n = self.nbytes
        self._dev.untyped_storage().resize_(0)
        _empty_cache(self.device)  # resize_(0) alone leaves the block in torch's CUDA cache
        return n

    def onload(self, part: str) -> int:
        s = self._dev.untyped_storage()
        s.resize_(self.nbytes)
        if self.mm.config.cpu_huge_pages:
            advise_huge_pages(s)
        if part == Part.GRADS:
            self._dev.zero_()
            sync(self.device)
            return 0
        self._dev.copy_(self.ceiling.host, non_blocking=self.pin)
        sync(self.device)
        return self.nbytes

    def device_bytes(self, part: str) -> int:
        return self._dev.untyped_storage().nbytes() if self._dev is not None else 0
