"""The ways other systems put a trainer to sleep, as benchmark methods beside the manager's: per
tensor into new host tensors (verl's optimizer offload), a fresh host allocation each cycle,
replacing ``param.data`` and rebuilding the views (ChatLearn), and megatron-core's own offload calls.
See :mod:`chatlearn_mem_bench.methods` for the interface and the manager's own method."""

from __future__ import annotations

from typing import Optional

import torch

from chatlearn_mem import Part
from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.host_store import HostStore
from chatlearn_mem.mcore import layout
from chatlearn_mem_bench.config import FULL
from chatlearn_mem_bench.methods import (
    Method,
    byte_view,
    logical_tensors,
    other_views,
    part_storages,
    storage_view,
    sync,
)
from chatlearn_mem_bench.plan import method_parts

__all__ = ["ALTERNATIVES", "FreshHostAlloc", "MegatronBuiltin", "PerTensorNewHost", "ReplaceRebuild"]


class PerTensorNewHost(Method):
    name = "per_tensor_new_host"

    def __init__(self, mm, trainer, pin: bool):
        super().__init__(mm, trainer, pin)
        self._state: Optional[tuple] = None

    def offload(self, part: str) -> int:
        storages = part_storages(self.mm, part)
        tensors = logical_tensors(self.mm, self.trainer, part)
        hosts = []
        for t in tensors:
            src = t.detach()
            if self.device.type == "cuda":
                hosts.append(src.to("cpu"))  # what .to("cpu") does: new pageable tensor, sync copy
            else:
                h = torch.empty(src.shape, dtype=src.dtype, device="cpu")
                h.copy_(src)
                hosts.append(h)
        sync(self.device)
        released = [(s, s.nbytes()) for s in storages]
        for s, _ in released:
            s.resize_(0)
        self._released()
        self._state = (tensors, hosts, released)
        return sum(h.numel() * h.element_size() for h in hosts)

    def onload(self, part: str) -> int:
        tensors, hosts, released = self._state
        for s, n in released:
            s.resize_(n)
        copied = 0
        for t, h in zip(tensors, hosts):
            t.detach().copy_(h)
            copied += h.numel() * h.element_size()
        sync(self.device)
        self._state = None
        return copied

    def host_bytes(self) -> tuple[int, int]:
        if self._state is None:
            return 0, 0
        return sum(h.numel() * h.element_size() for h in self._state[1]), 0


class FreshHostAlloc(Method):
    name = "fresh_host_alloc"

    def __init__(self, mm, trainer, pin: bool):
        super().__init__(mm, trainer, pin)
        self._state: Optional[list] = None

    def offload(self, part: str) -> int:
        out = []
        for s in part_storages(self.mm, part):
            n = s.nbytes()
            store = HostStore([n], max(n, 1), self.pin)  # new memory, pinned on GPU at its exact size
            if n:
                store.buckets[0].copy_(byte_view(s), non_blocking=self.pin)
            out.append((s, n, store))
        sync(self.device)
        for s, _, _ in out:
            s.resize_(0)
        self._released()
        self._state = out
        return sum(n for _, n, _ in out)

    def onload(self, part: str) -> int:
        for s, n, _ in self._state:
            s.resize_(n)
        for s, n, store in self._state:
            if n:
                byte_view(s).copy_(store.buckets[0], non_blocking=self.pin)
        sync(self.device)
        copied = sum(n for _, n, _ in self._state)
        for _, _, store in self._state:
            store.close()  # unpinned and freed: the next offload allocates and pins again
        self._state = None
        return copied

    def host_bytes(self) -> tuple[int, int]:
        n = sum(store.nbytes for _, _, store in self._state or [])
        return n, n if self.pin else 0


class ReplaceRebuild(Method):
    name = "replace_rebuild"

    def __init__(self, mm, trainer, pin: bool):
        super().__init__(mm, trainer, pin)
        self._state: Optional[dict] = None
        # On CUDA ``t.data = host tensor`` makes torch drop each weight's grad-accumulator node, and
        # DDP's gradient hooks with it: restore() hooks them again and counts them (a finding).
        self._hook_slots = [(c, layout.grad_hook_slots(c)) for c in layout.ddp_chunks(trainer.model)]

    @staticmethod
    def _geometry(t: torch.Tensor) -> tuple:
        return (t, t.untyped_storage(), t.dtype, t.storage_offset(), tuple(t.size()), tuple(t.stride()))

    def offload(self, part: str) -> int:
        storages = part_storages(self.mm, part)
        logical = logical_tensors(self.mm, self.trainer, part)
        others = other_views(self.mm, self.trainer, part, logical)
        geo_logical = [self._geometry(t) for t in logical]
        geo_others = [self._geometry(t) for t in others]
        hosts = []
        for t in logical:
            src = t.detach()
            if self.device.type == "cuda":
                h = src.to("cpu")
            else:
                h = torch.empty(src.shape, dtype=src.dtype, device="cpu")
                h.copy_(src)
            hosts.append(h)
            t.data = h  # param.data replacement: the tensor now lives on the host
        sync(self.device)
        released = [(s, s.nbytes()) for s in storages]
        for s, _ in released:  # the old device storage is dropped (its last users are rebuilt on onload)
            s.resize_(0)
        self._released()
        self._state = dict(geo_logical=geo_logical, geo_others=geo_others, hosts=hosts, released=released, new={})
        return sum(h.numel() * h.element_size() for h in hosts)

    def onload(self, part: str) -> int:
        st = self._state
        new = {
            storage_key(s): torch.empty(n, dtype=torch.uint8, device=self.device).untyped_storage()
            for s, n in st["released"]
        }
        copied = 0
        for (t, s, dtype, off, size, stride), h in zip(st["geo_logical"], st["hosts"]):
            v = storage_view(new[storage_key(s)], dtype, off, size, stride)
            v.copy_(h)
            t.data = v
            copied += h.numel() * h.element_size()
        for t, s, dtype, off, size, stride in st["geo_others"]:  # rebuild every other view
            t.data = storage_view(new[storage_key(s)], dtype, off, size, stride)
        sync(self.device)
        st["new"], st["hosts"] = new, []
        return copied

    def restore(self, part: str) -> None:
        st = self._state
        for s, n in st["released"]:
            s.resize_(n)
            byte_view(s).copy_(byte_view(st["new"][storage_key(s)]))
        for t, s, dtype, off, size, stride in st["geo_logical"] + st["geo_others"]:
            t.data = storage_view(s, dtype, off, size, stride)
        sync(self.device)
        self._state = None
        detached = sum(layout.rehook_grad_accumulators(c, slots) for c, slots in self._hook_slots)
        if detached:
            self.detached_grad_hooks[part] = detached

    def device_bytes(self, part: str) -> int:
        if self._state is None:
            return super().device_bytes(part)
        return sum(s.nbytes() for s, _ in self._state["released"]) + sum(
            s.nbytes() for s in self._state["new"].values()
        )

    def host_bytes(self) -> tuple[int, int]:
        if self._state is None:
            return 0, 0
        return sum(h.numel() * h.element_size() for h in self._state["hosts"]), 0


class MegatronBuiltin(Method):
    name = "megatron_builtin"

    def __init__(self, mm, trainer, pin: bool):
        super().__init__(mm, trainer, pin)
        self.chunks = layout.ddp_chunks(trainer.model)
        self.buffers = [b.buffer for i, c in enumerate(self.chunks) for b in layout.ddp_buffers(c, i)]
        self.available = all(hasattr(c, "offload_grad_buffers") for c in self.chunks)

    def parts(self) -> tuple[str, ...]:
        # the optimizer's offload moves main weights and states together, and only CUDA tensors
        return method_parts(self.name, self._cuda(), self.available)

    @property
    def pays_empty_cache(self) -> bool:
        return self._cuda()  # its optimizer offload empties the cache itself; the rest when the manager does

    def _cuda(self) -> bool:
        return self.device.type == "cuda"

    def offload(self, part: str) -> int:
        copied = 0
        if part in (Part.WEIGHTS, FULL):
            for b in self.buffers:
                if b.param_data is not None:
                    copied += b.param_data.numel() * b.param_data.element_size()
                    b.offload_to_cpu(move_params=True, move_grads=False)
        if part in (Part.GRADS, FULL):
            for c in self.chunks:
                c.offload_grad_buffers(synchronize=self._cuda(), empty_cache=False)
        if part == FULL:
            copied += _optimizer_bytes(self.trainer.optimizer, self.device)
            # Every slot, also the host-resident ones (AdamW's step counters): its restore moves
            # every tensor not on CUDA to CUDA, also those its offload never moved.
            self._originals = [
                (ref, t, t.untyped_storage().nbytes()) for ref, t in _optimizer_tensors(self.trainer.optimizer)
            ]
            self.trainer.optimizer.offload_to_cpu()  # empties the CUDA cache itself
            # The tensors it moved (on CUDA, all) now live on the host and megatron dropped the
            # device ones; the manager still references their storages, so release them as
            # dropping them would have.
            moved = [t for ref, t, _ in self._originals if _moved(ref, t)]
            for t in moved:
                t.untyped_storage().resize_(0)
            if moved and self._cuda():
                torch.cuda.empty_cache()
        elif self._cuda() and self.mm.config.empty_cache:
            torch.cuda.empty_cache()  # as the manager does after an offload
        sync(self.device)
        return copied

    def onload(self, part: str) -> int:
        copied = 0
        if part == FULL:
            self.trainer.optimizer.restore_from_cpu()
            copied += _optimizer_bytes(self.trainer.optimizer, self.device)
        if part in (Part.WEIGHTS, FULL):
            for b in self.buffers:
                if b.param_data is not None:
                    b.reload_from_cpu(move_params=True, move_grads=False)
                    copied += b.param_data.numel() * b.param_data.element_size()
        if part in (Part.GRADS, FULL):
            for c in self.chunks:
                c.restore_grad_buffers(synchronize=False)
        sync(self.device)
        return copied

    def restore(self, part: str) -> None:
        """``restore_from_cpu()`` brought main weights and states back as new device tensors (on a
        GPU; on CPU it does nothing), and moved the host-resident ones (AdamW's ``step`` counters,
        which its offload never moved) to the device too: copy every slot's tensor into its
        original storage and rebind, so that the manager and the next method find the trainer as
        it was. Left as megatron leaves it, the manager would refuse to offload
        (ExternalChangeError), and before it learned to notice, it offloaded its stale storages
        while the live ones, 7.3 GB here, stayed on the GPU."""
        originals, self._originals = getattr(self, "_originals", None), None
        if part != FULL or not originals:
            return
        with torch.no_grad():
            for (holder, key), t, nbytes in originals:
                now = holder.data if key is None else holder[key]
                if storage_key(now) == storage_key(t):
                    continue
                if t.untyped_storage().nbytes() != nbytes:
                    t.untyped_storage().resize_(nbytes)
                t.copy_(now)
                if key is None:
                    holder.data = t
                else:
                    holder[key] = t
        sync(self.device)

    def device_bytes(self, part: str) -> int:
        if part != FULL:
            return super().device_bytes(part)
        return sum(super(MegatronBuiltin, self).device_bytes(p) for p in Part)

    def host_bytes(self) -> tuple[int, int]:
        kept = sum(
            b.param_data_cpu.numel() * b.param_data_cpu.element_size()
            for b in self.buffers
            if getattr(b, "param_data_cpu", None) is not None
        )
        return kept, kept if self._cuda() else 0


def _optimizer_tensors(optimizer) -> list:
    """``((holder, key), tensor)`` for every tensor ``MegatronOptimizer.offload_to_cpu`` and
    ``restore_from_cpu`` may replace: a param-group tensor (``holder.data``, key None) or a state
    entry (``holder[key]``), wherever it lives."""
    out = []
    for leaf in layout.leaf_optimizers(optimizer):
        opt = layout.torch_optimizer(leaf)
        out += [((p, None), p.data) for g in opt.param_groups for p in g["params"]]
        out += [((st, k), v) for st in opt.state.values() for k, v in st.items() if isinstance(v, torch.Tensor)]
    return out


def _moved(ref: tuple, t: torch.Tensor) -> bool:
    """Whether the slot ``ref`` of :func:`_optimizer_tensors` no longer uses ``t``'s storage."""
    holder, key = ref
    now = holder.data if key is None else holder[key]
    return storage_key(now) != storage_key(t)


def _optimizer_bytes(optimizer, device: torch.device) -> int:
    """Bytes ``MegatronOptimizer.offload_to_cpu`` moves: param-group and state tensors on the device."""
    n = 0
    for leaf in layout.leaf_optimizers(optimizer):
        opt = layout.torch_optimizer(leaf)
        tensors = [p for g in opt.param_groups for p in g["params"]]
        tensors += [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
        n += sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cuda")
    return n


ALTERNATIVES = {m.name: m for m in (PerTensorNewHost, FreshHostAlloc, ReplaceRebuild, MegatronBuiltin)}
