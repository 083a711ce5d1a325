"""Offload and onload of a megatron-core trainer: weights, grads, fp32 main weights, optimizer state."""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Optional

import torch

from chatlearn_mem import guards
from chatlearn_mem.audit import AuditReport
from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.device_memory import parks_cpu_memory, storage_key
from chatlearn_mem.errors import ChatlearnMemError, OffloadedError, UnsupportedLayoutError
from chatlearn_mem.guards import serialized
from chatlearn_mem.manager import MemoryManagerBase
from chatlearn_mem.mcore import checks, layout, transient
from chatlearn_mem.parts import OTHER, Part, PartsArg
from chatlearn_mem.residency import Residency, measure

__all__ = ["TrainerMemoryManager"]


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
        grads: the DDP grad buffers (and a param buffer sharing their storage, and the separate
            fp32 ``main_grad`` s of fp32 local accumulation, megatron-core 0.17+). Dropped, never
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

    # grads first: dropped for free, and a training step zeroes them before its forward; the
    # weights then come in the order the forward reads them, the optimizer's parts behind them
    _OFFLOAD_ORDER = (Part.GRADS, Part.OPTIMIZER_STATES, Part.MAIN_WEIGHTS, Part.WEIGHTS)
    _ONLOAD_ORDER = (Part.GRADS, Part.WEIGHTS, Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES)
    # not the weights: megatron-core's own offload calls resize its param buffers' storages
    _CONTIGUOUS = frozenset({Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES})

    def __init__(self, model: Any, optimizer: Any, config: Optional[MemoryConfig] = None):
        layout.check_supported_version()
        self._chunks = layout.ddp_chunks(model)
        self._optimizer = optimizer
        self._leaves = layout.leaf_optimizers(optimizer)
        first = next((p for c in self._chunks for p in c.parameters()), None)
        if first is None:
            raise ValueError("the model has no parameters; nothing to manage")
        super().__init__(
            {Part.WEIGHTS: True, Part.GRADS: False, Part.MAIN_WEIGHTS: True, Part.OPTIMIZER_STATES: True},
            first.device,
            config,
        )
        self._chunk_buffers = [layout.ddp_buffers(c, i) for i, c in enumerate(self._chunks)]
        self._buffers = [b for bufs in self._chunk_buffers for b in bufs]
        self._names = {p: f"chunk{i}.{n}" for i, c in enumerate(self._chunks) for n, p in c.named_parameters()}
        # the module tree is walked once: walking it again on every call cost ~1 ms per walk and
        # several walks per offload on a 12-layer model (parameters are fixed objects once DDP
        # wraps the model, see _check_rebinds; buffers are read through their module each time)
        self._buffer_slots = [slot for c in self._chunks for slot in layout.module_buffer_slots(c)]
        self._input_modules = [transient.pipeline_input_modules(c) for c in self._chunks]
        self._steps = 0
        self._forward_since_step = False
        self._check_layout()
        self._remember_weight_storages()
        self._claim("this model" if len(self._chunks) == 1 else "this list of model chunks")
        if not any(layout.overlaps_param_gather(c) for c in self._chunks):
            # megatron's overlapped param all-gather reads whole buckets from a module's pre-hook:
            # with it, a forward waits for all the weights instead (the outer pre-hook's guard)
            self._hook_handles += self.state.register_weight_users(m for c in self._chunks for m in c.module.modules())
        for c in self._chunks:
            self._guard_module(c, c.module)
            self._hook_handles += guards.guard_methods(c, layout.DDP_METHOD_PARTS, self._require)
            self._hook_handles += guards.guard_methods(
                c.module, {"sharded_state_dict": layout.DDP_METHOD_PARTS["sharded_state_dict"]}, self._require
            )
        for opt in dict.fromkeys([optimizer] + self._leaves):  # the outer optimizer first
            self._hook_handles += guards.guard_methods(opt, layout.OPTIMIZER_METHOD_PARTS, self._require)
        for leaf in self._leaves:
            opt = layout.torch_optimizer(leaf)
            self._hook_handles.append(opt.register_step_pre_hook(self._before_step))
            self._hook_handles.append(opt.register_step_post_hook(self._after_step))
        self.state.record_placement()

    @property
    def checkpoint_parts(self) -> tuple[list, Any, list]:
        """``(model chunks, optimizer, leaf optimizers)``: what a checkpoint of this model reads
        (see :mod:`chatlearn_mem.checkpoint`)."""
        return self._chunks, self._optimizer, self._leaves

    # -- which tensors make up each part ----------------------------------------------------
    def _grad_storage_keys(self) -> set[int]:
        return {storage_key(b.grad_data) for b in self._buffers}

    def _part_tensors(self, part: Part) -> Iterable[torch.Tensor]:
        if part is Part.WEIGHTS:
            grads = self._grad_storage_keys()
            for b in self._buffers:
                if b.param_data is not None and storage_key(b.param_data) not in grads:
                    yield b.param_data
            yield from self._names  # every parameter of every chunk, each once
            for module, name in self._buffer_slots:
                t = getattr(module, name, None)
                if isinstance(t, torch.Tensor):
                    yield t
        elif part is Part.GRADS:
            grads = self._grad_storage_keys()
            for b in self._buffers:
                yield b.grad_data
                yield from b.extra_main_grads
                if b.param_data is not None and storage_key(b.param_data) in grads:
                    yield b.param_data
        elif part is Part.MAIN_WEIGHTS:
            for leaf in self._leaves:
                yield from layout.main_weights(leaf)
        elif part is Part.OPTIMIZER_STATES:
            for leaf in self._leaves:
                for state in layout.torch_optimizer(leaf).state.values():
                    yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.numel())
        else:
            raise AssertionError(f"not a trainer part: {part!r}")

    def _named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((f"param {name}", p) for p, name in self._names.items())

    def _part_slots(self, part: Part) -> Iterable[tuple[Hashable, torch.Tensor]]:
        if part is not Part.OPTIMIZER_STATES:
            return super()._part_slots(part)
        # a state entry is replaced (state[k] = v.cpu()), not rebound: name it by where it is held
        return (
            ((li, id(key), k), v)
            for li, leaf in enumerate(self._leaves)
            for key, state in layout.torch_optimizer(leaf).state.items()
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.numel()
        )

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
        for p in self._names:
            if p.grad is not None:
                yield p.grad
        for modules in self._input_modules:
            yield from transient.pipeline_input_tensors(modules)

    def _part_token(self, part: Part) -> Optional[Hashable]:
        if part is Part.GRADS:
            return None
        versions = tuple(t._version for t in self._part_tensors(part))
        return (self._steps, self.state.dirty_epoch, versions)

    def _check_layout(self) -> None:
        grads = self._grad_storage_keys()
        for p, name in self._names.items():
            if storage_key(p) in grads:
                raise UnsupportedLayoutError(
                    f"parameter {name} lives in a gradient buffer's storage (megatron's "
                    "reuse_grad_buf_for_mxfp8_param_ag layout); freeing grads would destroy the "
                    "weights. Disable that option to use the memory manager."
                )
        for part in Part:
            for s in self.state.storages(part):
                # a CPU storage's memory is moved out and back (device_memory), never resized:
                # one in a slab of an earlier manager (MemoryConfig.cpu_contiguous) is fine
                if not s.resizable() and not (s.device.type == "cpu" and parks_cpu_memory()):
                    raise UnsupportedLayoutError(
                        f"a {part} storage of {s.nbytes()} bytes cannot be resized "
                        "(created from external memory), so it cannot be released"
                    )

    # -- guards --------------------------------------------------------------------------------
    def _before_forward(self, module, args) -> None:
        self._check_no_concurrent_call("forward pass")
        self._check_weights_resident("forward pass")
        if torch.is_grad_enabled():
            if self.state.offloaded(Part.GRADS):
                raise OffloadedError(
                    f"training forward pass while the grad buffers are released: call "
                    f"{guards.onload_call([Part.GRADS])} (or onload()) first, or run forward-only passes under "
                    "torch.no_grad()"
                )
            self._forward_since_step = True

    def _before_step(self, optimizer, args, kwargs) -> None:
        # The torch step inside megatron's; megatron's own step() is guarded before it starts
        # (layout.OPTIMIZER_METHOD_PARTS). This one catches a torch step called directly.
        self._require("optimizer step", layout.OPTIMIZER_METHOD_PARTS["step"])

    def _backward_parts(self) -> tuple[Part, ...]:
        return (Part.WEIGHTS, Part.GRADS)  # weights saved for backward; DDP's hooks add into main_grad

    def _guard_names(self) -> Iterable[tuple[str, torch.Tensor]]:
        yield from self._named_weights()
        yield from (
            (f"main_grad of param {name}", layout.main_grad(p))
            for p, name in self._names.items()
            if layout.main_grad(p) is not None
        )
        for i, leaf in enumerate(self._leaves):
            yield from ((f"main weight {j} of optimizer {i}", t) for j, t in enumerate(layout.main_weights(leaf)))
            for j, state in enumerate(layout.torch_optimizer(leaf).state.values()):
                yield from (
                    (f"optimizer state {k!r} #{j} of optimizer {i}", v)
                    for k, v in state.items()
                    if isinstance(v, torch.Tensor)
                )

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._steps += 1
        self._forward_since_step = False
        self.state.record_placement([Part.OPTIMIZER_STATES])  # the first step creates the states

    def _before_offload_checks(self, todo: list[Part], force: bool) -> None:
        self._check_no_pending_communication("offload" if len(todo) > 1 else f"offload {todo[0]}")
        if Part.GRADS in todo and not force:
            self._check_grads_consumed()

    def _before_release(self, part: Part) -> None:
        if part is Part.GRADS:
            self._drop_stale_grads()

    def _check_no_pending_communication(self, what: str) -> None:
        for g in layout.bucket_groups(self._chunks, self._optimizer):
            pending = layout.pending_communication(g)
            if pending:
                raise ChatlearnMemError(
                    f"cannot {what}: a bucket group still has {', '.join(pending)} in flight; call "
                    "model.finish_grad_sync() (and let the param all-gather finish) first"
                )

    # -- public API ----------------------------------------------------------------------------
    @serialized
    def offload(
        self,
        parts: PartsArg = None,
        *,
        force: bool = False,
        blocking: bool = True,
        release_idle_memory: Optional[bool] = None,
    ):
        """Offload the chosen parts (all by default) in a safe order: grads, states, main weights, weights.

        Everything that can refuse or fail (unconsumed grads, in-flight communication, host
        allocation) is checked before any memory is released, so a refusal changes nothing. The
        copies run on the device's copy engine: each storage is released as soon as its own bytes
        are on the host, and the call waits once, at the end.

        Args:
            parts: A :class:`~chatlearn_mem.Part`, a part name, or a list of them; None: all.
            force: Drop gradients that no optimizer step consumed (else such gradients make the
                offload refuse, changing nothing).
            blocking: True (default): wait, return the stats. False: return a
                :class:`~chatlearn_mem.Transfer` at once; the parts count as offloaded from now on.
            release_idle_memory: On CUDA, once the offload has settled, also give back what the
                process keeps for compute (:func:`chatlearn_mem.process_memory.release_idle_memory`:
                the cuBLAS/cuBLASLt workspaces, then, with ``MemoryConfig.empty_cache``, the
                allocator's free blocks). None (default): when the offload leaves every part
                offloaded, the trainer asleep; True: after any offload; False: never. The
                workspaces are stateless scratch the next matmul
                allocates again (one allocation per stream), and they are the process's, not the
                model's: pass False when another model of this process computes while this one
                sleeps and should keep them. Ignored off CUDA.

        Returns:
            One :class:`TransferStats` per part that was offloaded (parts already offloaded are
            skipped; when every chosen part is, a warning says so), or the ``Transfer``.

        Raises:
            ValueError: An unknown part name.
            Whatever a copy raises, once the parts are rolled back (with ``blocking=False``: from
            ``Transfer.wait()``).
        """
        started = self.state.begin_offload(parts, force=force)
        return self._run("offload", started, blocking, self._idle_release(release_idle_memory))

    def _idle_release(self, wanted: Optional[bool]) -> list:
        """The callable that releases the process's idle memory once an offload settles (see
        :meth:`offload`), in a list; empty when there is nothing to do."""
        if wanted is False or self.device.type != "cuda":
            return []

        def release() -> None:
            if wanted or all(self.state.offloaded(p) for p in self.parts):
                from chatlearn_mem.process_memory import release_idle_memory

                release_idle_memory(self.device, measure=False, empty_cache=self.config.empty_cache)

        return [release]

    @serialized
    def onload(self, parts: PartsArg = None, *, blocking: bool = True):
        """Onload the chosen parts (all by default): grads, weights, main weights, then states.

        For a forward-only phase, ``onload(Part.WEIGHTS)`` brings back the weights alone. The
        weights come in the order the forward reads them: with ``blocking=False`` a forward pass
        can start at once and each module waits only for its own weights. If a device
        allocation fails, the parts restored so far stay restored and the others stay offloaded;
        call again once memory is available.

        Args:
            parts: A :class:`~chatlearn_mem.Part`, a part name, or a list of them; None: all.
            blocking: True (default): wait, return the stats. False: return a
                :class:`~chatlearn_mem.Transfer` at once; every guarded call waits for what it needs.

        Raises:
            ValueError: An unknown part name.
            Whatever a device allocation or copy raises, once the failed part is rolled back (with
            ``blocking=False``: from ``Transfer.wait()``).
        """
        return self._run("onload", self.state.begin_onload(parts, use_order=not blocking), blocking)

    @serialized
    def residency(self) -> Residency:
        """Device bytes held per part (each storage once) and host store bytes, once the transitions
        in flight have finished."""
        self.state.settle()
        return measure(
            {p.value: self._part_tensors(p) for p in Part} | {OTHER: self._stale_grads()},
            self.device,
            self.state.host_bytes(),
            self.state.released_bytes(),
        )

    @serialized
    def audit(self) -> AuditReport:
        """Check every alias and residency invariant; see :class:`AuditReport`.

        Checks: each param ``.data`` and ``main_grad`` is a view of its DDP buffer at the offset
        in megatron's ``param_index_map``; bucket views and cached bucket-group shards view their
        buffers; the distributed optimizer's shard groups view the params; each torch
        ``param_group`` holds exactly the live shard / main tensors and ``state`` is keyed by
        them; each trainable parameter has exactly one grad-accumulator hook and one entry in
        DDP's ``grad_accs``; offloaded parts hold no device memory and resident parts all of it;
        nothing else (megatron-core's own offload calls, say) released, regrew or moved the
        manager's memory since its last call (see :mod:`chatlearn_mem.external`).
        """
        self.state.settle()
        report = AuditReport()
        self._check_rebinds(report)
        checks.check_buffers(report, self._buffers, self._names, self._chunks, self._optimizer)
        checks.check_optimizers(report, self._leaves, self._names)
        checks.check_hooks(report, self._chunks, self._chunk_buffers, self._names)
        for part in Part:
            self.state.check_storage_state(report, part)
        report.checked += 1
        for sentence in self.state.external_changes():
            report.add(sentence)
        return report

    # -- internals -----------------------------------------------------------------------------
    def _check_grads_consumed(self) -> None:
        if not self._forward_since_step:
            return
        dirty = [
            b.label
            for b in self._buffers
            if any(g.numel() and bool(g.any()) for g in (b.grad_data, *b.extra_main_grads))
        ]
        if dirty:
            raise ChatlearnMemError(
                f"refusing to free grad buffers {', '.join(dirty)}: they hold gradients that no "
                "optimizer step has consumed. Run optimizer.step() or model.zero_grad_buffer() "
                "first, or call offload(force=True) to drop them"
            )

    def _drop_stale_grads(self) -> None:
        # The same as megatron's optimizer.zero_grad(set_to_none=True): these are derived from
        # main_grad (or alias it) and are recreated by the next step's prepare_grads(). The
        # pipeline schedule's last received activation (and its grad) is set afresh before
        # every forward, so holding it only pins device memory.
        for leaf in self._leaves:
            layout.clear_derived_grads(leaf)
        for p in self._names:  # every parameter of every chunk
            if p.grad is not None:
                p.grad = None
        for modules in self._input_modules:
            transient.clear_pipeline_input_tensors(modules)
