"""Tensors megatron-core keeps on the device between steps that belong to no part.

The pipeline schedule's last received activation, megatron's global memory buffer, the MoE token
dispatchers' routing tensors and Transformer Engine's workspaces and FP8 state. The trainer manager
drops the pipeline activations when it frees the grads; :func:`chatlearn_mem.device_report` names
the others, so that a user sees what stays on the device while a model sleeps. Like
:mod:`~chatlearn_mem.mcore.layout`, this module is one of the places that spell megatron's (and
Transformer Engine's) private names.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import torch

__all__ = [
    "clear_pipeline_input_tensors",
    "global_memory_buffer_tensors",
    "is_moe_token_dispatcher",
    "is_transformer_engine_module",
    "pipeline_input_modules",
    "pipeline_input_tensors",
    "transformer_engine_global_tensors",
]


def pipeline_input_modules(chunk: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of a chunk that can hold an activation from the pipeline schedule: megatron's
    ``TransformerBlock.set_input_tensor`` (called before every forward) stores the previous
    stage's output in ``input_tensor``. Walk the tree once and keep the list (megatron builds no
    modules after DDP wraps the model): a walk costs ~1 ms on a 12-layer model."""
    return [m for m in chunk.modules() if hasattr(m, "set_input_tensor")]


def pipeline_input_tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Activations megatron's pipeline schedule left on a chunk: the last micro batch's input
    from the previous stage (``TransformerBlock.input_tensor``) and its ``.grad``.

    Args:
        modules: What :func:`pipeline_input_modules` returned for the chunk.
    """
    out = []
    for m in modules:
        t = vars(m).get("input_tensor")
        if isinstance(t, torch.Tensor):
            out.append(t)
            if t.grad is not None:
                out.append(t.grad)
    return out


def clear_pipeline_input_tensors(modules: Iterable[torch.nn.Module]) -> None:
    """Drop them (the schedule sets a fresh one before every forward)."""
    for m in modules:
        if "input_tensor" in vars(m):
            m.input_tensor = None


def global_memory_buffer_tensors() -> list[tuple[str, torch.Tensor]]:
    """``(label, tensor)`` of megatron's global memory buffer (``parallel_state``'s
    ``GlobalMemoryBuffer``: scratch space kept between steps, e.g. for sequence-parallel
    all-gathers); empty when megatron is not imported or the buffer was never created."""
    ps = sys.modules.get("megatron.core.parallel_state")
    gmb = getattr(ps, "_GLOBAL_MEMORY_BUFFER", None) if ps is not None else None
    entries = getattr(gmb, "buffer", None) or {}
    return [(f"global_memory_buffer[{k!r}]", t) for k, t in entries.items() if isinstance(t, torch.Tensor)]


def is_moe_token_dispatcher(obj: Any) -> bool:
    """Whether ``obj`` is one of megatron's MoE token dispatchers (they keep the last batch's
    routing tensors between forward passes)."""
    mod = sys.modules.get("megatron.core.transformer.moe.token_dispatcher")
    base = getattr(mod, "MoETokenDispatcher", None) if mod is not None else None
    return base is not None and isinstance(obj, base)


_TE_MODULES = (
    "transformer_engine.pytorch.module.base",
    "transformer_engine.pytorch.fp8",
    "transformer_engine.pytorch.quantization",
)


def is_transformer_engine_module(obj: Any) -> bool:
    """Whether ``obj`` is a Transformer Engine module (its non-parameter tensors are TE's: FP8
    scales and amax histories, workspaces). False when TE was never imported."""
    mod = sys.modules.get("transformer_engine.pytorch.module.base")
    base = getattr(mod, "TransformerEngineBaseModule", None) if mod is not None else None
    return base is not None and isinstance(obj, base)


def transformer_engine_global_tensors() -> list[tuple[str, Any]]:
    """``(label, object)`` of what Transformer Engine keeps in module globals and class attributes
    (the cuBLAS workspaces, FP8 global state); walk them to find their tensors. Empty when TE was
    never imported (it is not imported here: a model that uses TE has imported it already)."""
    out = []
    for name in _TE_MODULES:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        for key, value in vars(mod).items():
            if key.startswith("__"):
                continue
            if isinstance(value, type) and value.__module__ == name:  # e.g. FP8GlobalStateManager
                out += [(f"{name}.{key}.{k}", v) for k, v in vars(value).items() if not k.startswith("__")]
            else:
                out.append((f"{name}.{key}", value))
    return out
