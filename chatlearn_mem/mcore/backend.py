"""megatron-core as a :class:`~chatlearn_mem.backend.TrainerBackend`: what the trainer manager asks
about a megatron DDP model (one chunk or a list of them) and its ``MegatronOptimizer``.

It answers from :mod:`~chatlearn_mem.mcore.layout` (the buffers, optimizers and guarded methods),
:mod:`~chatlearn_mem.mcore.transient` (the pipeline's activations) and
:mod:`~chatlearn_mem.mcore.checks` (the audit); the checkpoint's calls are
:mod:`~chatlearn_mem.mcore.checkpointing`'s.
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Optional

import torch

from chatlearn_mem.audit import AuditReport
from chatlearn_mem.backend import GuardPlan
from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.errors import UnsupportedLayoutError
from chatlearn_mem.mcore import checks, layout, transient
from chatlearn_mem.parts import Part

__all__ = ["MegatronTrainer"]


class MegatronTrainer:
    """A megatron-core trainer, as the trainer manager sees it (see :class:`~chatlearn_mem.backend.TrainerBackend`).

    Parts: weights (the DDP param buffers, parameters outside them, module buffers), grads (the DDP
    grad buffers; dropped), main weights (the optimizers' fp32 copies), optimizer states.

    Raises:
        UnsupportedLayoutError: megatron-core outside the supported range.
        TypeError: ``model`` or ``optimizer`` are not megatron-core objects.
        ValueError: The model has no parameters.
    """

    name = "megatron-core"
    hints = None  # external.py's own words are megatron's
    # not the weights: megatron-core's own offload calls resize its param buffers' storages
    contiguous = frozenset({Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES})

    def __init__(self, model: Any, optimizer: Any):
        layout.check_supported_version()
        self.chunks = layout.ddp_chunks(model)
        self.optimizer = optimizer
        self.leaves = layout.leaf_optimizers(optimizer)
        first = next((p for c in self.chunks for p in c.parameters()), None)
        if first is None:
            raise ValueError("the model has no parameters; nothing to manage")
        self.device = first.device
        self.parts = {Part.WEIGHTS: True, Part.GRADS: False, Part.MAIN_WEIGHTS: True, Part.OPTIMIZER_STATES: True}
        self.what = "this model" if len(self.chunks) == 1 else "this list of model chunks"
        self.chunk_buffers = [layout.ddp_buffers(c, i) for i, c in enumerate(self.chunks)]
        self.buffers = [b for bufs in self.chunk_buffers for b in bufs]
        self.params = {p: f"chunk{i}.{n}" for i, c in enumerate(self.chunks) for n, p in c.named_parameters()}
        # the module tree is walked once: walking it again on every call cost ~1 ms per walk and
        # several walks per offload on a 12-layer model (parameters are fixed objects once DDP
        # wraps the model; buffers are read through their module each time)
        self._buffer_slots = [slot for c in self.chunks for slot in layout.module_buffer_slots(c)]
        self._input_modules = [transient.pipeline_input_modules(c) for c in self.chunks]

    # -- which tensors make up each part ----------------------------------------------------
    def _grad_storage_keys(self) -> set[int]:
        return {storage_key(b.grad_data) for b in self.buffers}

    def part_tensors(self, part: Part) -> Iterable[torch.Tensor]:
        if part is Part.WEIGHTS:
            grads = self._grad_storage_keys()
            for b in self.buffers:
                if b.param_data is not None and storage_key(b.param_data) not in grads:
                    yield b.param_data
            yield from self.params  # every parameter of every chunk, each once
            for module, name in self._buffer_slots:
                t = getattr(module, name, None)
                if isinstance(t, torch.Tensor):
                    yield t
        elif part is Part.GRADS:
            grads = self._grad_storage_keys()
            for b in self.buffers:
                yield b.grad_data
                yield from b.extra_main_grads
                if b.param_data is not None and storage_key(b.param_data) in grads:
                    yield b.param_data
        elif part is Part.MAIN_WEIGHTS:
            for leaf in self.leaves:
                yield from layout.main_weights(leaf)
        elif part is Part.OPTIMIZER_STATES:
            for leaf in self.leaves:
                for state in layout.torch_optimizer(leaf).state.values():
                    yield from (v for v in state.values() if isinstance(v, torch.Tensor) and v.numel())
        else:
            raise AssertionError(f"not a trainer part: {part!r}")

    def part_slots(self, part: Part) -> Optional[Iterable[tuple[Hashable, torch.Tensor]]]:
        if part is not Part.OPTIMIZER_STATES:
            return None
        # a state entry is replaced (state[k] = v.cpu()), not rebound: name it by where it is held
        return (
            ((li, id(key), k), v)
            for li, leaf in enumerate(self.leaves)
            for key, state in layout.torch_optimizer(leaf).state.items()
            for k, v in state.items()
            if isinstance(v, torch.Tensor) and v.numel()
        )

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((f"param {name}", p) for p, name in self.params.items())

    def state_dict_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        many = len(self.chunks) > 1
        for i, c in enumerate(self.chunks):
            for name, t in c.module.state_dict(keep_vars=True).items():
                if isinstance(t, torch.Tensor):
                    yield (f"chunk{i}.{name}" if many else name), t

    def transient_tensors(self) -> Iterable[torch.Tensor]:
        """``.grad`` tensors the optimizers derived from ``main_grad`` (recreated every step) and
        the activations the pipeline schedule left on the chunks (reset before every forward)."""
        for leaf in self.leaves:
            yield from layout.derived_grads(leaf)
        for p in self.params:
            if p.grad is not None:
                yield p.grad
        for modules in self._input_modules:
            yield from transient.pipeline_input_tensors(modules)

    def drop_transient(self) -> None:
        # The same as megatron's optimizer.zero_grad(set_to_none=True): these are derived from
        # main_grad (or alias it) and are recreated by the next step's prepare_grads(). The
        # pipeline schedule's last received activation (and its grad) is set afresh before
        # every forward, so holding it only pins device memory.
        for leaf in self.leaves:
            layout.clear_derived_grads(leaf)
        for p in self.params:  # every parameter of every chunk
            if p.grad is not None:
                p.grad = None
        for modules in self._input_modules:
            transient.clear_pipeline_input_tensors(modules)

    # -- what the manager guards ------------------------------------------------------------
    def guard_plan(self) -> GuardPlan:
        plan = GuardPlan(backward_parts=(Part.WEIGHTS, Part.GRADS))  # weights saved; DDP's hooks add into main_grad
        if not any(layout.overlaps_param_gather(c) for c in self.chunks):
            # megatron's overlapped param all-gather reads whole buckets from a module's pre-hook:
            # with it, a forward waits for all the weights instead (the outer pre-hook's guard)
            plan.weight_users = [m for c in self.chunks for m in c.module.modules()]
        for c in self.chunks:
            plan.modules.append((c, c.module))
            plan.methods.append((c, layout.DDP_METHOD_PARTS))
            plan.methods.append((c.module, {"sharded_state_dict": layout.DDP_METHOD_PARTS["sharded_state_dict"]}))
        for opt in dict.fromkeys([self.optimizer] + self.leaves):  # the outer optimizer first
            plan.methods.append((opt, layout.OPTIMIZER_METHOD_PARTS))
        # The torch step inside megatron's; megatron's own step() is guarded before it starts
        # (layout.OPTIMIZER_METHOD_PARTS). The pre-hook catches a torch step called directly.
        plan.optimizers = [layout.torch_optimizer(leaf) for leaf in self.leaves]
        return plan

    def step_parts(self) -> tuple[Part, ...]:
        """The parts an optimizer step touches."""
        return layout.OPTIMIZER_METHOD_PARTS["step"]

    def install(self) -> list:
        return []

    def layout_epoch(self) -> Hashable:
        return None

    def before_release(self, part: Part) -> None:
        pass

    def check_layout(self) -> None:
        grads = self._grad_storage_keys()
        for p, name in self.params.items():
            if storage_key(p) in grads:
                raise UnsupportedLayoutError(
                    f"parameter {name} lives in a gradient buffer's storage (megatron's "
                    "reuse_grad_buf_for_mxfp8_param_ag layout); freeing grads would destroy the "
                    "weights. Disable that option to use the memory manager."
                )

    def pending_work(self) -> list[str]:
        out = []
        for g in layout.bucket_groups(self.chunks, self.optimizer):
            pending = layout.pending_communication(g)
            if pending:
                out.append(f"a bucket group still has {', '.join(pending)} in flight")
        return out

    def pending_message(self, what: str, pending: list[str]) -> str:
        return f"cannot {what}: {'; '.join(pending)}; call model.finish_grad_sync() (and let the param all-gather finish) first"

    def unconsumed_grads(self) -> list[str]:
        return [
            b.label
            for b in self.buffers
            if any(g.numel() and bool(g.any()) for g in (b.grad_data, *b.extra_main_grads))
        ]

    def unconsumed_message(self, labels: list[str]) -> str:
        return (
            f"refusing to free grad buffers {', '.join(labels)}: they hold gradients that no "
            "optimizer step has consumed. Run optimizer.step() or model.zero_grad_buffer() "
            "first, or call offload(force=True) to drop them"
        )

    # -- the audit and the debug guard --------------------------------------------------------
    def guard_names(self) -> Iterable[tuple[str, torch.Tensor]]:
        yield from self.named_weights()
        yield from (
            (f"main_grad of param {name}", layout.main_grad(p))
            for p, name in self.params.items()
            if layout.main_grad(p) is not None
        )
        for i, leaf in enumerate(self.leaves):
            yield from ((f"main weight {j} of optimizer {i}", t) for j, t in enumerate(layout.main_weights(leaf)))
            for j, state in enumerate(layout.torch_optimizer(leaf).state.values()):
                yield from (
                    (f"optimizer state {k!r} #{j} of optimizer {i}", v)
                    for k, v in state.items()
                    if isinstance(v, torch.Tensor)
                )

    def audit(self, report: AuditReport) -> None:
        checks.check_buffers(report, self.buffers, self.params, self.chunks, self.optimizer)
        checks.check_optimizers(report, self.leaves, self.params)
        checks.check_hooks(report, self.chunks, self.chunk_buffers, self.params)

    # -- checkpoints ---------------------------------------------------------------------------
    @property
    def checkpoint_parts(self) -> tuple[list, Any, list]:
        """``(model chunks, optimizer, leaf optimizers)``: what a checkpoint of this model reads."""
        return self.chunks, self.optimizer, self.leaves

    def checkpoint_io(self) -> Any:
        from chatlearn_mem.mcore.checkpointing import MegatronCheckpointIO

        return MegatronCheckpointIO(self.chunks, self.optimizer, self.leaves)
