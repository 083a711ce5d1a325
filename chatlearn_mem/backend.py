"""What a trainer manager asks about the trainer it manages: the backend protocol, and the dispatch.

:class:`~chatlearn_mem.TrainerMemoryManager` owns the parts' state (storage groups, transitions,
guards, host store) and knows no framework. Everything it must know about one framework's
trainer, which tensors make each part, which aliases the audit checks, which calls it guards, how
a checkpoint is written, it asks a :class:`TrainerBackend`. Each backend is the one place that
spells its framework's private names:

- :mod:`chatlearn_mem.mcore` (megatron-core's ``DistributedDataParallel`` chunks and
  ``MegatronOptimizer``);
- :mod:`chatlearn_mem.torchnative` (a plain ``nn.Module``, torch's ``DistributedDataParallel``,
  ``ZeroRedundancyOptimizer``, FSDP2's ``fully_shard``, with a torch optimizer).

A third framework (DeepSpeed's ZeRO engine, say) is one more such module and one more line in
the trainer manager's dispatch (:func:`chatlearn_mem.trainer.trainer_backend`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, Optional, Protocol, Sequence

import torch

from chatlearn_mem.audit import AuditReport
from chatlearn_mem.errors import UnsupportedLayoutError
from chatlearn_mem.external import ExternalHints
from chatlearn_mem.parts import Part

__all__ = [
    "ExternalHints",
    "GuardPlan",
    "SUPPORTED_TRAINERS",
    "TrainerBackend",
    "first_of",
    "is_megatron_chunk",
    "unsupported_wrapper",
]

SUPPORTED_TRAINERS = (
    "megatron-core's DistributedDataParallel (a chunk or a list of chunks) with get_megatron_optimizer's "
    "optimizer; or a torch nn.Module (a Hugging Face model included), plain, in "
    "torch.nn.parallel.DistributedDataParallel, or sharded by FSDP2's torch.distributed.fsdp.fully_shard, "
    "with a torch.optim.Optimizer or torch.distributed.optim.ZeroRedundancyOptimizer"
)
"""What :class:`~chatlearn_mem.TrainerMemoryManager` accepts, for messages."""


@dataclass
class GuardPlan:
    """What the manager guards, as a backend describes it.

    Attributes:
        modules: ``(outer, inner)`` module pairs: forward pre-hooks on both (``outer`` first),
            a forward hook on ``outer`` (the backward guard), state-dict hooks on ``inner``.
        methods: ``(object, {method name: parts it touches})``: methods wrapped per instance.
        optimizers: Torch optimizers whose step pre- and post-hooks the manager registers.
        weight_users: Modules that read their own weights in order (per-module fences of a
            non-blocking onload), or None: every forward waits for all the weights.
        backward_parts: The parts a backward pass through the model reads or writes.
        step_in_backward: The optimizer steps inside the backward pass (ZeRO overlapped with
            DDP): a backward counts as a step.
    """

    modules: list[tuple[torch.nn.Module, torch.nn.Module]] = field(default_factory=list)
    methods: list[tuple[Any, dict[str, tuple[Part, ...]]]] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    weight_users: Optional[list[torch.nn.Module]] = None
    backward_parts: tuple[Part, ...] = (Part.WEIGHTS, Part.GRADS)
    step_in_backward: bool = False


class TrainerBackend(Protocol):
    """What :class:`~chatlearn_mem.TrainerMemoryManager` asks about a trainer.

    Tensors handed to the manager are plain tensors whose storages the manager may resize (a
    DTensor's local shard, never the DTensor itself).

    Attributes:
        name: The framework, for messages ("megatron-core", "torch").
        what: What the manager claims, for messages ("this model").
        device: The device the trainer computes on.
        parts: ``part -> keep contents`` of the parts this trainer has.
        params: ``parameter -> name`` of every parameter, each once.
        hints: How changes made behind the manager's back are explained.
        contiguous: Parts nothing but the manager resizes (may be laid out in a slab).
    """

    name: str
    what: str
    device: torch.device
    parts: dict[Part, bool]
    params: dict[torch.Tensor, str]
    hints: Optional[ExternalHints]
    contiguous: frozenset

    def part_tensors(self, part: Part) -> Iterable[torch.Tensor]:
        """The tensors whose storages make up ``part``."""

    def part_slots(self, part: Part) -> Optional[Iterable[tuple[Hashable, torch.Tensor]]]:
        """``(slot, tensor)`` naming where each tensor of ``part`` is held; None: by the tensor."""

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the weights whose storage the audit follows."""

    def state_dict_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of what ``weights_state_dict()`` exports, in state-dict naming."""

    def transient_tensors(self) -> Iterable[torch.Tensor]:
        """Device tensors that belong to no part and are dropped with the grads (residency ``other``)."""

    def drop_transient(self) -> None:
        """Drop them (as ``optimizer.zero_grad(set_to_none=True)`` does)."""

    def guard_plan(self) -> GuardPlan:
        """What the manager guards (read once, when the manager is created)."""

    def install(self) -> list:
        """Register the backend's own hooks (each with ``.remove()``); called once."""

    def check_layout(self) -> None:
        """Raise :class:`UnsupportedLayoutError` for a layout the manager cannot handle."""

    def pending_work(self) -> list[str]:
        """What is in flight and makes an offload unsafe now (one phrase each; empty: none)."""

    def pending_message(self, what: str, pending: list[str]) -> str:
        """The error refusing ``what`` (an offload) while ``pending`` is in flight."""

    def unconsumed_grads(self) -> list[str]:
        """Labels of gradients a backward wrote that no optimizer step consumed (asked only when a
        training forward ran since the last step)."""

    def unconsumed_message(self, labels: list[str]) -> str:
        """The error refusing to free those gradients (``offload(force=True)`` drops them)."""

    def step_parts(self) -> tuple[Part, ...]:
        """The parts an optimizer step touches (what its pre-hook requires)."""

    def before_release(self, part: Part) -> None:
        """Called just before ``part``'s release is submitted (after its own checks)."""

    def layout_epoch(self) -> Hashable:
        """Changes when the framework itself rebuilt what the parts are made of (the manager then
        takes the tensors as they are now)."""

    def guard_names(self) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the tensors the debug guard can name."""

    def audit(self, report: AuditReport) -> None:
        """Add one sentence per broken alias the framework built."""

    def checkpoint_io(self) -> Any:
        """The checkpoint format's calls (see :mod:`chatlearn_mem.checkpoint`)."""


def is_megatron_chunk(obj: Any) -> bool:
    """Whether ``obj`` is megatron-core's ``DistributedDataParallel``, recognised without importing
    megatron (its ``buffers`` is a list of buffers, where an ``nn.Module``'s is a method)."""
    return (
        hasattr(obj, "grad_accs")
        and hasattr(obj, "module")
        and hasattr(obj, "buffers")
        and not callable(getattr(obj, "buffers", None))
    )


def _type_names(obj: Any) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in type(obj).__mro__}


_UNSUPPORTED = {
    "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel": (
        "FSDP1 (torch.distributed.fsdp.FullyShardedDataParallel) flattens parameters into FlatParameters "
        "that it swaps in and out itself; use FSDP2 (torch.distributed.fsdp.fully_shard) instead"
    ),
    "deepspeed.runtime.engine.DeepSpeedEngine": (
        "a DeepSpeed engine keeps its parameters, gradients and optimizer partitions in its own "
        "flat buffers (ZeRO); its own offload (offload_optimizer / offload_param) is the way to sleep it"
    ),
}


def first_of(items: Sequence[Any], what: str, describe: Callable[[Any], str] = repr, n: int = 3) -> str:
    """``what``: up to ``n`` of ``items`` described, and how many more (for messages)."""
    shown = ", ".join(describe(i) if not isinstance(i, str) else i for i in list(items)[:n])
    more = f" and {len(items) - n} more" if len(items) > n else ""
    return f"{what} {shown}{more}" if what else f"{shown}{more}"


def unsupported_wrapper(model: Any) -> None:
    """Raise :class:`UnsupportedLayoutError` naming what is supported when ``model`` is a wrapper
    the trainer manager does not support (FSDP1, a DeepSpeed engine), recognised by class name."""
    first = model[0] if isinstance(model, (list, tuple)) and model else model
    names = _type_names(first)
    for name, why in _UNSUPPORTED.items():
        if name in names:
            raise UnsupportedLayoutError(
                f"the model is a {type(first).__name__}, which the trainer manager does not support: {why}. "
                f"Supported: {SUPPORTED_TRAINERS}"
            )
