"""A run's device budget before anything starts: the sizes of its models estimated from the configs,
the items that cannot leave the device, and the check that the largest declared phase fits."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from chatlearn_mem import Part
from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.errors import BudgetConfigError
from chatlearn_mem_ray.service.declare import Model, Phase, phase_demands
from chatlearn_mem_ray.service.schedule import ResidencySchedule

__all__ = ["check_budget", "estimate_sizes", "pinned_items", "runs_on_gpus"]


def runs_on_gpus(cfg: LoopConfig, use_gpu: Optional[bool] = None) -> bool:
    """``use_gpu`` when known (the colocation's), else ``ray.use_gpu``, where ``auto`` means
    whether this process sees a GPU (before Ray starts, on the driver's machine)."""
    if use_gpu is not None:
        return bool(use_gpu)
    if cfg.ray.use_gpu == "auto":
        return torch.cuda.is_available()
    return bool(cfg.ray.use_gpu)


def pinned_items(cfg: LoopConfig, models, use_gpu: Optional[bool] = None) -> set[tuple[str, Part]]:
    """Items that cannot leave the device, so the plan counts them in every phase: a vLLM
    engine's weights and KV cache without GPUs (vLLM's CPU build cannot sleep). ``use_gpu``: as
    :func:`runs_on_gpus`."""
    if runs_on_gpus(cfg, use_gpu):
        return set()
    return {(m.name, Part.WEIGHTS) for m in models if m.kind == "engine" and m.backend == "vllm"}


def estimate_sizes(cfg: LoopConfig, models: Sequence[Model]) -> dict[str, dict[Part, int]]:
    """Per actor and part, the device bytes a run of ``cfg`` with ``models`` will hold, from the
    configs alone: for a budget check before Ray starts."""
    from chatlearn_mem.models import gpt

    p = cfg.parallel
    tp, dp = p.tensor_model_parallel_size, p.data_parallel_size
    out: dict[str, dict[Part, int]] = {}
    for m in models:
        for name in m.actor_names(p.world_size):
            if m.kind == "trainer":
                est = gpt.estimate_part_bytes(m.config, m.head == "value", tp, dp)
                out[name] = {Part(k): v for k, v in est.items()}
            elif m.kind == "engine" and m.backend == "vllm" and not runs_on_gpus(cfg):
                from chatlearn_mem_ray.actors.vllm import engine_bytes  # what the engine's actor reports

                out[name] = {Part.WEIGHTS: engine_bytes(m.config, m.engine_config, cuda=False)}
            else:
                out[name] = {Part.WEIGHTS: gpt.estimate_part_bytes(m.config, trainer=False)["weights"]}
    return out


def check_budget(cfg: LoopConfig, models: Sequence[Model], phases: Sequence[Phase]) -> None:
    """Before Ray starts: a ``memory.device_budget_mb`` below what the largest declared phase
    needs, estimated from the configs (:func:`estimate_sizes`), stops the run here. The plan made
    once the models are measured checks again, exactly.

    Raises:
        BudgetConfigError: Naming the phase, its bytes and the budget (exit code 2).
    """
    budget = cfg.memory.device_budget_mb
    if budget is None or budget == "auto" or not cfg.memory.enabled:
        return
    ws = cfg.parallel.world_size
    bundles = {a: b for m in models for a, b in zip(m.actor_names(ws), m.bundles(ws))}
    try:
        ResidencySchedule(
            estimate_sizes(cfg, models),
            int(budget * 2**20),
            phase_demands(models, phases, ws),
            bundles,
            pinned=pinned_items(cfg, models),
        )
    except ValueError as e:
        raise BudgetConfigError(f"{e} (estimated from the config, before starting)") from None
