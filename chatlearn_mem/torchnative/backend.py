"""Plain PyTorch as a :class:`~chatlearn_mem.backend.TrainerBackend`: an ``nn.Module`` (a Hugging Face
model included), alone, in torch's ``DistributedDataParallel`` or sharded by FSDP2's
``fully_shard``, with a torch optimizer or ``ZeroRedundancyOptimizer``.

Parts:
    weights: every parameter's memory (a DTensor's local shard; ZeroRedundancyOptimizer's flat
        buckets, which its bucket views live in) and the module buffers. Copied to the host.
    grads: DDP's gradient buckets, when ``gradient_as_bucket_view=True`` makes them the gradients
        (found from the ``.grad`` s of the first step's backward). Dropped, rebuilt zeroed. Freeing
        them also drops every ``param.grad`` (as ``optimizer.zero_grad(set_to_none=True)`` does),
        which is all a trainer without DDP's bucket views holds for gradients.
    optimizer_states: the state tensors of the optimizer (ZeRO: of this rank's local optimizer),
        but not ``step`` of an eager optimizer, which torch keeps on the host. Copied.

There are no fp32 main weights: torch's optimizers update the parameters themselves (FSDP2's
mixed precision keeps fp32 sharded parameters, the weights here, and casts for compute).

Who owns which storage under FSDP2: the manager releases and restores the sharded parameters'
padded local shards (``_sharded_param_data``, which each ``DTensor``'s local tensor narrows);
FSDP2 allocates and frees the unsharded parameters itself (``all_gather_outputs``, by
``resize_``), and the manager never touches them: before releasing the weights it asks FSDP2 to
free any it still holds (``reshard()``), so that nothing else of the model stays on the device.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Hashable, Iterable, Optional

import torch
import torch.utils._pytree

from chatlearn_mem.audit import AuditReport
from chatlearn_mem.backend import ExternalHints, GuardPlan, first_of
from chatlearn_mem.device_memory import storage_id
from chatlearn_mem.errors import UnsupportedLayoutError
from chatlearn_mem.parts import Part
from chatlearn_mem.torchnative import checks, layout

__all__ = ["TORCH_HINTS", "TorchTrainer"]

TORCH_HINTS = ExternalHints(
    regrown="something regrew them (another offload mechanism's reload). The manager's host copy is the "
    "current one: release them again the same way and call onload(), and use one offload mechanism per trainer",
    short="something resized their storages to 0 behind the manager (FSDP2 frees only its unsharded "
    "parameters, never these: another offload mechanism did). Bring them back the same way before using "
    "the manager, and use one offload mechanism per trainer",
    moved="(model.cpu(), model.to(device) or param.data = t.to(device) moved them: that replaces every "
    "parameter's .data, which breaks ZeroRedundancyOptimizer's bucket views and leaves DDP's gradient hooks "
    "on dropped accumulators). Move them back, or close() this manager and create a new one for the "
    "trainer as it is now (and rebuild DDP and the optimizer if their views are broken)",
    rebound="(param.data = ..., model.to(dtype), model.half(), or optimizer.load_state_dict() replaced "
    "their memory since the manager's last call), so an offload would free the manager's stale copies and "
    "leave them on the device; close() this manager and create a new one for the trainer as it is now "
    "(and rebuild DDP and ZeroRedundancyOptimizer if their views are broken), or load state with "
    "param.copy_() instead",
)
"""How the torch backend explains memory changed behind the manager's back (see :mod:`chatlearn_mem.external`)."""

_BOTH = (Part.WEIGHTS, Part.GRADS)


class _PendingBackward:
    """Lives as long as the autograd graph of a forward whose backward has not started."""

    __slots__ = ("started", "__weakref__")

    def __init__(self):
        self.started = False


def _mark_started(token: _PendingBackward, backend: "weakref.ref[TorchTrainer]", grad: torch.Tensor) -> None:
    token.started = True
    trainer = backend()
    if trainer is not None and trainer.ddp is not None and layout.ddp_uses_bucket_views(trainer.ddp):
        # once the backward is done the .grads view DDP's buckets: see them before zero_grad drops
        # them (overlapped ZeRO steps inside the backward: no step pre-hook runs)
        torch.autograd.Variable._execution_engine.queue_callback(trainer._record_grad_buckets)


class TorchTrainer:
    """A plain PyTorch trainer, as the trainer manager sees it (see :mod:`chatlearn_mem.torchnative.backend`).

    Args:
        model: The ``nn.Module`` trained: plain, torch's ``DistributedDataParallel``, or a module
            (or one holding modules) sharded by ``fully_shard``.
        optimizer: A ``torch.optim.Optimizer`` over the model's parameters, or a
            ``ZeroRedundancyOptimizer``.

    Raises:
        TypeError: ``optimizer`` is not a torch optimizer.
        ValueError: Parameters on two devices, or an optimizer holding parameters the model does
            not (one created before ``fully_shard``).
        UnsupportedLayoutError: DDP around FSDP2, FSDP2's CPU offload policy, parameters on the
            meta device.
    """

    name = "torch"
    hints = TORCH_HINTS
    # nothing but the manager resizes these (FSDP2 resizes only its unsharded parameters)
    contiguous = frozenset({Part.WEIGHTS, Part.OPTIMIZER_STATES})

    def __init__(self, model: torch.nn.Module, optimizer: Any):
        self._check_optimizer_type(model, optimizer)
        self.model = model
        self.ddp = layout.find_ddp(model)
        self.module = self.ddp.module if self.ddp is not None else model
        self.fsdp = layout.fsdp_modules(self.module)
        if self.ddp is not None and self.fsdp:
            raise UnsupportedLayoutError(
                "DistributedDataParallel around an FSDP2 model is not supported: shard with "
                "fully_shard(model, mesh=...) alone (a 2-D mesh gives hybrid sharding)"
            )
        self.optimizer = optimizer
        self.zero = optimizer if layout.is_zero(optimizer) else None
        self._fsdp_params = layout.fsdp_params(self.module) if self.fsdp else []
        self.params = self._collect_params()
        if not self.params:
            raise ValueError("the model has no parameters; nothing to manage")
        self._buffer_slots = [
            (m, name, f"{prefix}.{name}" if prefix else name)
            for prefix, m in self.module.named_modules()
            for name, _ in m.named_buffers(recurse=False)
        ]
        self.device = self._one_device()
        self._check_optimizer_params()
        # the state dict's names, read once (state_dict() runs hooks and would need the weights)
        self._state_slots = [self._slot(name) for name in self.module.state_dict(keep_vars=True)]
        self.parts = {Part.WEIGHTS: True, Part.GRADS: False, Part.OPTIMIZER_STATES: True}
        kind = "DistributedDataParallel model" if self.ddp is not None else "FSDP2 model" if self.fsdp else "model"
        self.what = f"this {kind}"
        # DDP's gradient buckets, found from the .grad views a backward leaves (weak: DDP's
        # rebuild frees the first ones)
        self._grad_buckets: dict[int, weakref.ref] = {}
        # the grad-accumulator node DDP's reducer hooked, per trainable parameter
        self._hooked = (
            {p: layout.grad_accumulator(p) for p in self.params if p.requires_grad} if self.ddp is not None else {}
        )
        self._pending: Optional[weakref.ref] = None  # a forward whose backward has not started
        if self.ddp is not None and not layout.ddp_uses_bucket_views(self.ddp):
            import warnings

            nbytes = sum(p.numel() * p.element_size() for p in self.params if p.requires_grad)
            warnings.warn(
                f"DistributedDataParallel(gradient_as_bucket_view=False) keeps its gradient buckets "
                f"({nbytes / 2**20:.2f} MiB, a second copy of the gradients) inside its C++ reducer, where "
                "no Python code can release them: they stay on the device while the trainer sleeps. Wrap "
                "the model with gradient_as_bucket_view=True (the buckets are then the gradients, which "
                "the manager releases)",
                UserWarning,
                stacklevel=4,
            )

    # -- construction checks ------------------------------------------------------------------
    @staticmethod
    def _check_optimizer_type(model: torch.nn.Module, optimizer: Any) -> None:
        if layout.megatron_optimizer(optimizer):
            raise TypeError(
                f"optimizer is a {type(optimizer).__name__} (megatron-core's) but the model is a "
                f"{type(model).__name__}, not megatron.core.distributed.DistributedDataParallel: a "
                "megatron optimizer goes with megatron's DDP model (DistributedDataParallel(config, "
                "ddp_config, module)); a torch model takes a torch.optim.Optimizer or ZeroRedundancyOptimizer"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer; a torch model "
                "takes a torch optimizer (torch.optim.AdamW(model.parameters(), ...)) or "
                "torch.distributed.optim.ZeroRedundancyOptimizer"
            )

    def _collect_params(self) -> dict[torch.Tensor, str]:
        """``parameter -> name`` (as in the inner module's ``state_dict()``), each once; under FSDP2
        the sharded parameters even while FSDP2 has the unsharded ones registered."""
        sharded = {}
        for fp in self._fsdp_params:
            for m, attr in layout.fsdp_slots(fp):
                sharded[(id(m), attr)] = layout.fsdp_param_of(fp)
        self._sharded = sharded
        return self._current_params()

    def _current_params(self) -> dict[torch.Tensor, str]:
        """The parameters registered in the module now (FSDP2's sharded ones where it shards), by name."""
        out: dict[torch.Tensor, str] = {}
        for prefix, m in self.module.named_modules():
            for attr, p in m.named_parameters(recurse=False):
                p = self._sharded.get((id(m), attr), p)
                if p not in out:
                    out[p] = f"{prefix}.{attr}" if prefix else attr
        return out

    def _slot(self, name: str) -> tuple[str, torch.nn.Module, str]:
        """``(state-dict name, module, attribute)`` of one state-dict entry."""
        prefix, _, attr = name.rpartition(".")
        return name, self.module.get_submodule(prefix), attr

    def _read_slot(self, module: torch.nn.Module, attr: str) -> Optional[torch.Tensor]:
        """The tensor a state-dict entry names now: FSDP2's sharded parameter even while FSDP2 has
        the unsharded one registered."""
        t = self._sharded.get((id(module), attr))
        return t if t is not None else getattr(module, attr, None)

    def state_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every entry of the module's ``state_dict()`` (DTensors under FSDP2)."""
        for name, m, attr in self._state_slots:
            t = self._read_slot(m, attr)
            if isinstance(t, torch.Tensor):
                yield name, t

    def _one_device(self) -> torch.device:
        where: dict[torch.device, list[str]] = {}
        for p, name in self.params.items():
            where.setdefault(layout.local_tensor(p).device, []).append(f"param {name}")
        for m, attr, name in self._buffer_slots:
            t = getattr(m, attr, None)
            if isinstance(t, torch.Tensor):
                where.setdefault(t.device, []).append(f"buffer {name}")
        if len(where) > 1:
            listed = "; ".join(first_of(names, f"{d}:") for d, names in where.items())
            offload = (
                " (FSDP2's CPUOffloadPolicy keeps the parameters on the host for good: drop it to let the "
                "manager put the trainer to sleep between phases)"
                if self.fsdp
                else ""
            )
            raise ValueError(
                f"the model's parameters and buffers live on {len(where)} devices ({listed}); the manager moves "
                f"the memory of one device{offload}. Put the whole model on one device (model.to(device)) "
                "before creating the manager"
            )
        if any(d.type == "meta" for d in where):
            raise UnsupportedLayoutError(
                f"{first_of(where[torch.device('meta')], 'the model has tensors on the meta device:')}; "
                "materialise the model (model.to_empty(device=...) and load its weights) before creating the manager"
            )
        return next(iter(where))

    def _check_optimizer_params(self) -> None:
        tracked = {id(p) for p in self.params}
        held = layout.optimizer_params(self.optimizer)
        foreign = [p for p in held if id(p) not in tracked]
        if not foreign:
            return
        shapes = [tuple(p.shape) for p in foreign]
        if self.fsdp and not any(layout.is_dtensor(p) for p in foreign):
            raise ValueError(
                f"the optimizer was created before fully_shard: it holds {len(foreign)} parameter(s) that "
                f"fully_shard replaced by sharded DTensor parameters ({first_of(shapes, 'unsharded shapes')}), "
                "so its steps would update tensors the model no longer uses. Create the optimizer after "
                "fully_shard(model): torch.optim.AdamW(model.parameters(), ...)"
            )
        raise ValueError(
            f"the optimizer holds {len(foreign)} of its {len(held)} parameter(s) that are not parameters of the "
            f"model ({first_of(shapes, 'shapes')}): its steps would update tensors the manager neither moves nor "
            "restores. Build the optimizer from this model's parameters (optimizer(model.parameters(), ...)), "
            "or pass the model that holds them"
        )

    # -- which tensors make up each part --------------------------------------------------------
    def _state_opt(self) -> Any:
        return layout.state_optimizer(self.optimizer)

    def _grad_bucket_handles(self) -> list[torch.Tensor]:
        """One tensor over each of DDP's gradient bucket storages known now (bucket views only)."""
        if self.ddp is None or not layout.ddp_uses_bucket_views(self.ddp):
            return []
        self._record_grad_buckets()
        out = []
        for key, ref in list(self._grad_buckets.items()):
            s = ref()
            if s is None:
                del self._grad_buckets[key]  # freed by DDP's bucket rebuild
                continue
            out.append(torch.empty(0, dtype=torch.uint8, device=s.device).set_(s))
        return out

    def _record_grad_buckets(self, *args: Any) -> None:
        if self.ddp is None or not layout.ddp_uses_bucket_views(self.ddp):
            return
        for s in layout.bucket_storages_seen(self.params):
            self._grad_buckets.setdefault(storage_id(s), layout.storage_ref(s))

    def part_tensors(self, part: Part) -> Iterable[torch.Tensor]:
        if part is Part.WEIGHTS:
            for p in self.params:
                yield layout.local_tensor(p)
            if self.zero is not None:
                yield from (t for _, t in layout.zero_bucket_tensors(self.zero))
            for m, attr, _ in self._buffer_slots:
                t = getattr(m, attr, None)
                if isinstance(t, torch.Tensor):
                    yield t
        elif part is Part.GRADS:
            yield from self._grad_bucket_handles()
        elif part is Part.OPTIMIZER_STATES:
            opt = self._state_opt()
            for _, k, v in layout.state_entries(opt):
                if v.numel() and not layout.host_scalar_state(opt, k):
                    yield layout.local_tensor(v)
        elif part is not Part.MAIN_WEIGHTS:
            raise AssertionError(f"not a trainer part: {part!r}")

    def part_slots(self, part: Part) -> Optional[Iterable[tuple[Hashable, torch.Tensor]]]:
        if part is Part.WEIGHTS:
            # what the module holds now: a Parameter replaced behind the manager shows as new memory
            out = [(f"param {name}", layout.local_tensor(p)) for p, name in self._current_params().items()]
            if self.zero is not None:
                out += layout.zero_bucket_tensors(self.zero)
            for m, attr, name in self._buffer_slots:
                t = getattr(m, attr, None)
                if isinstance(t, torch.Tensor):
                    out.append((f"buffer {name}", t))
            return out
        if part is Part.GRADS:  # a handle per bucket storage: named by the storage, not the handle
            return [
                (f"DistributedDataParallel gradient bucket {storage_id(h.untyped_storage())}", h)
                for h in self._grad_bucket_handles()
            ]
        if part is Part.OPTIMIZER_STATES:
            opt = self._state_opt()
            return [
                (f"optimizer state {k!r} of param {self.params.get(p, '?')}", layout.local_tensor(v))
                for p, k, v in layout.state_entries(opt)
                if v.numel() and not layout.host_scalar_state(opt, k)
            ]
        return None

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((f"param {name}", layout.local_tensor(p)) for p, name in self.params.items())

    def state_dict_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The state dict's tensors' memory: a DTensor's local shard (the whole tensor on one rank)."""
        return ((name, layout.local_tensor(t)) for name, t in self.state_tensors())

    def transient_tensors(self) -> Iterable[torch.Tensor]:
        """Every ``param.grad`` (a DTensor's local shard), recreated by the next backward."""
        for p in self.params:
            if p.grad is not None:
                yield layout.local_tensor(p.grad)

    def drop_transient(self) -> None:
        self._record_grad_buckets()  # the last chance to see DDP's buckets through the views
        for p in self.params:
            p.grad = None

    # -- what the manager guards -------------------------------------------------------------------
    def guard_plan(self) -> GuardPlan:
        overlap = self.zero is not None and layout.zero_overlaps_ddp(self.zero)
        plan = GuardPlan(
            modules=[(self.model, self.module)],
            backward_parts=(*_BOTH, Part.OPTIMIZER_STATES) if overlap else _BOTH,
            step_in_backward=overlap,
            optimizers=[self.optimizer],
        )
        # per-module fences, unless something reads all the weights before the modules run: DDP's
        # buffer broadcast, FSDP2's all-gather of a whole parameter group in its pre-hook
        waits_for_all = self.fsdp or (self.ddp is not None and layout.ddp_broadcasts_buffers(self.ddp))
        plan.weight_users = None if waits_for_all else list(self.module.modules())
        table = layout.ZERO_METHOD_PARTS if self.zero is not None else layout.OPTIMIZER_METHOD_PARTS
        plan.methods.append((self.optimizer, {k: tuple(Part(p) for p in v) for k, v in table.items()}))
        for m in self.fsdp:
            plan.methods.append((m, {k: tuple(Part(p) for p in v) for k, v in layout.FSDP_METHOD_PARTS.items()}))
        return plan

    def step_parts(self) -> tuple[Part, ...]:
        return (*_BOTH, Part.OPTIMIZER_STATES)

    def install(self) -> list:
        handles = []
        if self.ddp is not None or self.fsdp:
            handles.append(self.model.register_forward_hook(self._after_forward))
        if self.ddp is not None and layout.ddp_uses_bucket_views(self.ddp):
            # the gradients are views of DDP's buckets right before the step (zero_grad drops them)
            handles.append(self.optimizer.register_step_pre_hook(self._record_grad_buckets))
        return handles

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        if self.ddp is not None and not layout.ddp_syncs_in_backward(self.ddp):
            return  # inside no_sync(): DDP expects no reduction from this backward
        for t in torch.utils._pytree.tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                # the token lives as long as the graph holds the hook, and says whether it ran
                token = _PendingBackward()
                t.register_hook(functools.partial(_mark_started, token, weakref.ref(self)))
                self._pending = weakref.ref(token)
                return

    def _backward_pending(self) -> bool:
        token = self._pending() if self._pending is not None else None
        return token is not None and not token.started

    def layout_epoch(self) -> Hashable:
        zero = layout.zero_layout_epoch(self.zero) if self.zero is not None else None
        fsdp = tuple(storage_id(layout.fsdp_sharded_data(fp).untyped_storage()) for fp in self._fsdp_params)
        return (zero, fsdp)

    def before_release(self, part: Part) -> None:
        if part is Part.WEIGHTS and self.fsdp:
            # FSDP2's unsharded parameters are its memory: it frees them (resize_(0)) itself
            layout.reshard(layout.unsharded(self.module))

    def check_layout(self) -> None:
        pass

    def pending_work(self) -> list[str]:
        out = []
        if self._backward_pending():
            who = "DistributedDataParallel's reducer" if self.ddp is not None else "FSDP2's post-backward hooks"
            out.append(
                f"a forward pass ran with gradients enabled and its backward has not run yet ({who} wait for "
                "the backward's gradient hooks, and the graph holds the weights)"
            )
        n = layout.zero_pending_broadcasts(self.zero) if self.zero is not None else 0
        if n:
            out.append(f"ZeroRedundancyOptimizer still has {n} parameter broadcast(s) in flight")
        return out

    def pending_message(self, what: str, pending: list[str]) -> str:
        return (
            f"cannot {what}: {'; '.join(pending)}. Run the backward first (loss.backward()), and run forward "
            "passes whose backward will not run under torch.no_grad(); nothing was offloaded"
        )

    def unconsumed_grads(self) -> list[str]:
        return [
            f"param {name}"
            for p, name in self.params.items()
            if p.grad is not None and bool(layout.local_tensor(p.grad).any())
        ]

    def unconsumed_message(self, labels: list[str]) -> str:
        return (
            f"refusing to drop the gradients of {first_of(labels, '')}: a backward wrote them and no "
            "optimizer step has consumed them. Run optimizer.step() first (or optimizer.zero_grad() to "
            "discard them), or call offload(force=True) to drop them"
        )

    # -- the audit and the debug guard -------------------------------------------------------------
    def guard_names(self) -> Iterable[tuple[str, torch.Tensor]]:
        yield from self.named_weights()
        for p, name in self.params.items():
            if p.grad is not None:
                yield f"param {name} .grad", layout.local_tensor(p.grad)
        for p, k, v in layout.state_entries(self._state_opt()):
            yield f"optimizer state {k!r} of param {self.params.get(p, '?')}", layout.local_tensor(v)

    def audit(self, report: AuditReport) -> None:
        checks.check_parameters(report, self.module, self.params, self._current_params())
        checks.check_devices(report, self.params, self.device)
        checks.check_optimizer(report, self.optimizer, self.params)
        if self.ddp is not None:
            checks.check_ddp(report, self.ddp, self._hooked, self.params, self._grad_buckets)
        if self.zero is not None:
            checks.check_zero(report, self.zero, self.params)
        if self._fsdp_params:
            checks.check_fsdp(report, self._fsdp_params, self.params, self.device)

    # -- checkpoints --------------------------------------------------------------------------------
    def checkpoint_io(self) -> Any:
        from chatlearn_mem.torchnative.checkpointing import TorchCheckpointIO

        return TorchCheckpointIO(self)
