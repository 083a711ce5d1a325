"""Offload and onload of a megatron-core trainer: weights, grads, fp32 main weights, optimizer state."""

from __future__ import annotations

import warnings
from typing import Any, Hashable, Iterable, Optional

import torch

from chatlearn_mem.audit import AuditReport, check_view, count_post_hooks
from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.errors import ChatlearnMemError, OffloadedError, UnsupportedLayoutError
from chatlearn_mem.manager import MemoryManagerBase, serialized
from chatlearn_mem.mcore import layout
from chatlearn_mem.residency import Residency, measure
from chatlearn_mem.storage import TransferStats, storage_key

__all__ = ["TrainerMemoryManager"]

PARTS = ("weights", "grads", "main_weights", "optimizer_states")


class TrainerMemoryManager(MemoryManagerBase):
    """Puts a megatron-core trainer to sleep and wakes it up, bit-exactly.

    The manager never replaces a tensor. It frees a part by resizing the part's storages to 0
    bytes (after copying them into a bucketed host store when their contents must survive) and
    restores it by growing the same storages back and copying the bytes in. Every alias megatron
    built (``param.data`` and ``main_grad`` views into the DDP buffers, bucket views, cached
    shards, the distributed optimizer's shard groups, ``param_groups`` and ``state`` keys, the
    grad-accumulator hooks) therefore survives untouched; :meth:`audit` proves it.

    Parts:
        weights: every DDP param buffer, parameters outside the buffers (frozen ones) and module
            buffers on the device. Copied to the host.
        grads: the DDP grad buffers (and a param buffer sharing their storage). Dropped, never
            copied; rebuilt zeroed. Dropping them also drops the ``.grad`` tensors derived from
            them and the activation the pipeline schedule left on each chunk (its last micro
            batch's input from the previous stage, reset before every forward).
        main_weights: the optimizers' fp32 main weights. Copied to the host.
        optimizer_states: the torch optimizers' state tensors (Adam ``exp_avg`` ...). Copied.

    Unchanged parts are not copied again: a part's host copy stays current until an optimizer
    step runs or one of its tensors is written in place (PyTorch's per-tensor version counter),
    so offloading again after a forward-only phase only releases memory. Writes through
    ``param.data`` are invisible to the version counter: call :meth:`mark_weights_dirty`.

    Args:
        model: A megatron ``DistributedDataParallel`` chunk or a list of them (virtual pipeline).
        optimizer: What ``megatron.core.optimizer.get_megatron_optimizer`` returned.
        config: Host store settings; defaults to ``MemoryConfig()``.

    Raises:
        UnsupportedLayoutError: megatron-core outside the supported range, or a layout whose
            model weights share storage with gradients.
        TypeError: ``model`` or ``optimizer`` are not megatron-core objects.
    """

    def __init__(self, model: Any, optimizer: Any, config: Optional[MemoryConfig] = None):
        layout.check_supported_version()
        self._chunks = layout.ddp_chunks(model)
        self._optimizer = optimizer
        self._leaves = layout.leaf_optimizers(optimizer)
        first = next((p for c in self._chunks for p in c.parameters()), None)
        if first is None:
            raise ValueError("the model has no parameters; nothing to manage")
        super().__init__({"weights": True, "grads": False, "main_weights": True,
                          "optimizer_states": True}, first.device, config)
        self._chunk_buffers = [layout.ddp_buffers(c, i) for i, c in enumerate(self._chunks)]
        self._buffers = [b for bufs in self._chunk_buffers for b in bufs]
        self._names = {p: f"chunk{i}.{n}" for i, c in enumerate(self._chunks) for n, p in c.named_parameters()}
        self._steps = 0
        self._forward_since_step = False
        self._check_layout()
        self._remember_weight_storages()
        for c in self._chunks:
            for m in (c, c.module):
                self._hook_handles.append(m.register_forward_pre_hook(self._before_forward))
        for leaf in self._leaves:
            opt = layout.torch_optimizer(leaf)
            self._hook_handles.append(opt.register_step_pre_hook(self._before_step))
            self._hook_handles.append(opt.register_step_post_hook(self._after_step))

    # -- which tensors make up each part ----------------------------------------------------
    def _grad_storage_keys(self) -> set[int]:
        return {storage_key(b.grad_data) for b in self._buffers}

    def _part_tensors(self, part: str) -> Iterable[torch.Tensor]:
        if part == "weights":
            grads = self._grad_storage_keys()
            for b in self._buffers:
                if b.param_data is not None and storage_key(b.param_data) not in grads:
                    yield b.param_data
            for c in self._chunks:
                yield from c.parameters()
                yield from layout.module_buffers(c)
        elif part == "grads":
            grads = self._grad_storage_keys()
            for b in self._buffers:
                yield b.grad_data
                if b.param_data is not None and storage_key(b.param_data) in grads:
                    yield b.param_data
        elif part == "main_weights":
            for leaf in self._leaves:
                yield from layout.main_weights(leaf)
        elif part == "optimizer_states":
            for leaf in self._leaves:
                for state in layout.torch_optimizer(leaf).state.values():
                    yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.numel())
        else:
            raise ValueError(f"unknown part {part!r}; parts are {list(PARTS)}")

    def _named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((f"param {name}", p) for p, name in self._names.items())

    def _state_dict_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        many = len(self._chunks) > 1
        for i, c in enumerate(self._chunks):
            for name, t in c.module.state_dict(keep_vars=True).items():
                if isinstance(t, torch.Tensor):
                    yield (f"chunk{i}.{name}" if many else name), t

    def _stale_grads(self) -> Iterable[torch.Tensor]:
        """``.grad`` tensors the optimizers derived from ``main_grad`` (recreated every step) and
        the activations the pipeline schedule left on the chunks (reset before every forward)."""
        for leaf in self._leaves:
            yield from layout.derived_grads(leaf)
        for c in self._chunks:
            for p in c.parameters():
                if p.grad is not None:
                    yield p.grad
            yield from layout.pipeline_input_tensors(c)

    def _part_token(self, part: str) -> Optional[Hashable]:
        if part == "grads":
            return None
        versions = tuple(t._version for t in self._part_tensors(part))
        return (self._steps, self._dirty_epoch, versions)

    def _check_layout(self) -> None:
        grads = self._grad_storage_keys()
        for p, name in self._names.items():
            if storage_key(p) in grads:
                raise UnsupportedLayoutError(
                    f"parameter {name} lives in a gradient buffer's storage (megatron's "
                    "reuse_grad_buf_for_mxfp8_param_ag layout); freeing grads would destroy the "
                    "weights. Disable that option to use the memory manager.")
        for part in PARTS:
            for s in self._storages(part):
                if not s.resizable():
                    raise UnsupportedLayoutError(f"a {part} storage of {s.nbytes()} bytes cannot be resized "
                                                 "(created from external memory), so it cannot be released")

    # -- guards --------------------------------------------------------------------------------
    def _before_forward(self, module, args) -> None:
        self._check_no_concurrent_call("forward pass")
        self._check_weights_resident("forward pass")
        if torch.is_grad_enabled():
            if self._groups["grads"].offloaded:
                raise OffloadedError(
                    "training forward pass while the grad buffers are released: call "
                    "build_grad_buffers() (or onload()) first, or run forward-only passes under "
                    "torch.no_grad()")
            self._forward_since_step = True

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._check_no_concurrent_call("optimizer step")
        missing = [p for p in ("main_weights", "optimizer_states", "weights", "grads")
                   if self._groups[p].offloaded]
        if missing:
            calls = ", ".join(f"onload_{p}()" if p != "grads" else "build_grad_buffers()" for p in missing)
            raise OffloadedError(f"optimizer step while {', '.join(missing)} are offloaded: call "
                                 f"{calls} (or onload()) first")

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._steps += 1
        self._forward_since_step = False

    def _before_offload(self, part: str) -> None:
        if part == "weights":
            self._check_no_pending_communication("offload weights")

    def _check_no_pending_communication(self, what: str) -> None:
        for g in layout.bucket_groups(self._chunks, self._optimizer):
            pending = layout.pending_communication(g)
            if pending:
                raise ChatlearnMemError(
                    f"cannot {what}: a bucket group still has {', '.join(pending)} in flight; call "
                    "model.finish_grad_sync() (and let the param all-gather finish) first")

    # -- public API ----------------------------------------------------------------------------
    @serialized
    def free_grad_buffers(self, force: bool = False) -> Optional[TransferStats]:
        """Release the grad buffers without copying them.

        Args:
            force: Drop gradients even when they were never consumed by an optimizer step.

        Raises:
            ChatlearnMemError: The buffers hold non-zero gradients accumulated since the last
                optimizer step (and ``force`` is False), or a grad reduction is in flight.
        """
        if self._groups["grads"].offloaded:
            warnings.warn("grads are already released; nothing to do", stacklevel=3)
            return None
        self._check_no_pending_communication("free grad buffers")
        if not force:
            self._check_grads_consumed()
        self._drop_stale_grads()
        stats = self._groups["grads"].offload(self._storages("grads"))
        self._empty_cache()
        return stats

    @serialized
    def build_grad_buffers(self) -> Optional[TransferStats]:
        """Reallocate the grad buffers, zeroed; every ``main_grad`` view is valid again."""
        return self._onload_part("grads")

    @serialized
    def offload_main_weights(self) -> Optional[TransferStats]:
        """Copy the optimizers' fp32 main weights to the host store and free them."""
        return self._offload_one("main_weights")

    @serialized
    def onload_main_weights(self) -> Optional[TransferStats]:
        """Bring the fp32 main weights back."""
        return self._onload_part("main_weights")

    @serialized
    def offload_optimizer_states(self) -> Optional[TransferStats]:
        """Copy the optimizer state tensors into flat host buckets and free them."""
        return self._offload_one("optimizer_states")

    @serialized
    def onload_optimizer_states(self) -> Optional[TransferStats]:
        """Bring the optimizer state tensors back."""
        return self._onload_part("optimizer_states")

    @serialized
    def offload(self, weights: bool = True, grads: bool = True, main_weights: bool = True,
                optimizer_states: bool = True, force: bool = False) -> list[TransferStats]:
        """Offload the chosen parts (all by default) in a safe order.

        Everything that can refuse or fail (unconsumed grads, in-flight communication, host
        allocation) is checked before any memory is released, so a failing call changes nothing.

        Args:
            weights, grads, main_weights, optimizer_states: Which parts to offload.
            force: Passed to :meth:`free_grad_buffers`.

        Returns:
            One :class:`TransferStats` per part that was offloaded (parts already offloaded are
            skipped silently).
        """
        chosen = {"weights": weights, "grads": grads, "main_weights": main_weights,
                  "optimizer_states": optimizer_states}
        todo = [p for p in ("grads", "optimizer_states", "main_weights", "weights")
                if chosen[p] and not self._groups[p].offloaded]
        if not todo:
            if any(chosen.values()):
                warnings.warn("the chosen parts are already offloaded; nothing to do", stacklevel=3)
            return []
        self._check_no_pending_communication("offload")
        if "grads" in todo and not force:
            self._check_grads_consumed()
        storages = {p: self._storages(p) for p in todo}
        for p in todo:  # allocate every host store first: a host OOM leaves everything resident
            self._groups[p].prepare(storages[p])
        out = []
        for p in todo:
            if p == "grads":
                self._drop_stale_grads()
            out.append(self._offload_part(p, storages[p]))
        self._empty_cache()
        return out

    @serialized
    def onload(self, weights: bool = True, grads: bool = True, main_weights: bool = True,
               optimizer_states: bool = True) -> list[TransferStats]:
        """Onload the chosen parts (all by default): weights, main weights, states, then grads.

        For a forward-only phase, ``onload(grads=False, main_weights=False,
        optimizer_states=False)`` brings back the weights alone. If a device allocation fails
        the parts restored so far stay restored and the others stay offloaded; call again once
        memory is available.
        """
        chosen = {"weights": weights, "grads": grads, "main_weights": main_weights,
                  "optimizer_states": optimizer_states}
        todo = [p for p in ("weights", "main_weights", "optimizer_states", "grads")
                if chosen[p] and self._groups[p].offloaded]
        if not todo and any(chosen.values()):
            warnings.warn("the chosen parts are already on the device; nothing to do", stacklevel=3)
        return [self._onload_part(p) for p in todo]

    @serialized
    def residency(self) -> Residency:
        """Device bytes held per part (each storage once) and host store bytes."""
        return measure({p: self._part_tensors(p) for p in PARTS} | {"other": self._stale_grads()},
                       self.device, self._host_bytes())

    @serialized
    def audit(self) -> AuditReport:
        """Check every alias and residency invariant; see :class:`AuditReport`.

        Checks: each param ``.data`` and ``main_grad`` is a view of its DDP buffer at the offset
        in megatron's ``param_index_map``; bucket views and cached bucket-group shards view their
        buffers; the distributed optimizer's shard groups view the params; each torch
        ``param_group`` holds exactly the live shard / main tensors and ``state`` is keyed by
        them; each trainable parameter has exactly one grad-accumulator hook and one entry in
        DDP's ``grad_accs``; offloaded parts hold no device memory and resident parts all of it.
        """
        report = AuditReport()
        self._audit_buffers(report)
        self._audit_optimizers(report)
        self._audit_hooks(report)
        for part in PARTS:
            self._check_storage_state(report, part)
        return report

    # -- internals -----------------------------------------------------------------------------
    def _check_grads_consumed(self) -> None:
        if not self._forward_since_step:
            return
        dirty = [b.label for b in self._buffers if b.grad_data.numel() and bool(b.grad_data.any())]
        if dirty:
            raise ChatlearnMemError(
                f"refusing to free grad buffers {', '.join(dirty)}: they hold gradients that no "
                "optimizer step has consumed. Run optimizer.step() or model.zero_grad_buffer() "
                "first, or call free_grad_buffers(force=True) / offload(force=True) to drop them")

    def _drop_stale_grads(self) -> None:
        # The same as megatron's optimizer.zero_grad(set_to_none=True): these are derived from
        # main_grad (or alias it) and are recreated by the next step's prepare_grads(). The
        # pipeline schedule's last received activation (and its grad) is set afresh before
        # every forward, so holding it only pins device memory.
        for leaf in self._leaves:
            layout.clear_derived_grads(leaf)
        for c in self._chunks:
            for p in c.parameters():
                p.grad = None
            layout.clear_pipeline_input_tensors(c)

    def _audit_buffers(self, report: AuditReport) -> None:
        self._check_rebinds(report)
        for b in self._buffers:
            for p, (start, end) in b.param_offsets.items():
                name = self._names.get(p, "<a parameter not in the model>")
                if b.param_data is not None:
                    check_view(report, f"param {name} .data", p, b.param_data, start, end - start,
                               f"{b.label}.param_data")
                check_view(report, f"param {name} .main_grad", getattr(p, "main_grad", None),
                           b.grad_data, start, end - start, f"{b.label}.grad_data")
            for label, view, base, offset in layout.bucket_views(b):
                check_view(report, label, view, base, offset, view.numel(), b.label)
        for g in layout.bucket_groups(self._chunks, self._optimizer):
            for label, shard, bucket_tensor in layout.cached_shard_views(g):
                report.checked += 1
                lo = bucket_tensor.storage_offset()
                if storage_key(shard) != storage_key(bucket_tensor):
                    report.add(f"bucket group cache {label} does not view its bucket's storage "
                               "(a stale shard left pointing at other memory)")
                elif not lo <= shard.storage_offset() <= lo + bucket_tensor.numel() - shard.numel():
                    report.add(f"bucket group cache {label} lies outside its bucket")

    def _audit_optimizers(self, report: AuditReport) -> None:
        model_params = {id(p) for p in self._names}
        for li, leaf in enumerate(self._leaves):
            prefix = f"optimizer[{li}]({type(leaf).__name__})"
            for sv in layout.shard_views(leaf):
                pname = self._names.get(sv.param, "?")
                check_view(report, f"{prefix}.{sv.label} (param {pname})", sv.shard, sv.param,
                           sv.start, sv.numel, f"param {pname}")
            opt = layout.torch_optimizer(leaf)
            expected = layout.expected_param_groups(leaf)
            live: set[int] = set()
            for gi, group in enumerate(opt.param_groups):
                ids = [id(t) for t in group["params"]]
                live.update(ids)
                report.checked += 1
                if expected is None:
                    bad = [i for i, x in enumerate(ids) if x not in model_params]
                    if bad:
                        report.add(f"{prefix}.param_groups[{gi}] entries {bad} are not parameters of the model")
                elif gi >= len(expected) or sorted(ids) != sorted(id(t) for t in expected[gi]):
                    report.add(f"{prefix}.param_groups[{gi}]['params'] is not the optimizer's live shard "
                               "tensors (a rebuilt shard was not put back into param_groups)")
            for key in opt.state:
                report.checked += 1
                if id(key) not in live:
                    report.add(f"{prefix}.state is keyed by a tensor of shape {tuple(key.shape)} that is "
                               "not in param_groups (stale key; that state will never be used)")

    def _audit_hooks(self, report: AuditReport) -> None:
        for ci, (c, bufs) in enumerate(zip(self._chunks, self._chunk_buffers)):
            accs = layout.grad_accumulators(c)
            trainable = [p for b in bufs for p in b.param_offsets if p.requires_grad]
            owned = set()
            for p in trainable:
                name = self._names.get(p, "?")
                node = layout.grad_accumulator(p)
                owned.add(id(node))
                report.checked += 1
                n_entries = sum(a is node for a in accs)
                n_hooks = count_post_hooks(node)
                if n_entries != 1 or n_hooks != 1:
                    report.add(f"param {name} has {n_hooks} grad-accumulator hook(s) and {n_entries} "
                               "entries in DDP's grad_accs; expected exactly 1 of each "
                               "(0: its gradient is never reduced; 2: it is reduced twice)")
            stale = sum(id(a) not in owned for a in accs)
            if stale:
                report.add(f"chunk{ci}: {stale} grad_accs entries hook accumulators no parameter uses "
                           "any more (hooks registered on replaced tensors)")
