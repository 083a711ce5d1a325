"""Module paths of the app from before it was arranged by role, each to the module that holds its
contents now: importing an old path gives the new module with a ``DeprecationWarning`` naming it.
A reward function named by an old path in a YAML file (``chatlearn_mem_ray.text_task:...``) keeps
working the same way."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

__all__ = ["MOVED", "install"]

MOVED = {
    "chatlearn_mem_ray.supervisor": "chatlearn_mem_ray",  # run_loop, run_ppo, run_grpo
    "chatlearn_mem_ray.ppo": "chatlearn_mem_ray.loops.ppo",
    "chatlearn_mem_ray.grpo": "chatlearn_mem_ray.loops.grpo",
    "chatlearn_mem_ray.data": "chatlearn_mem_ray.inputs.data",
    "chatlearn_mem_ray.rewards": "chatlearn_mem_ray.inputs.rewards",
    "chatlearn_mem_ray.tasks": "chatlearn_mem_ray.inputs.tasks",
    "chatlearn_mem_ray.text_task": "chatlearn_mem_ray.inputs.text_task",
    "chatlearn_mem_ray.vllm_actor": "chatlearn_mem_ray.actors.vllm",
    "chatlearn_mem_ray.modeling": "chatlearn_mem_ray.actors.modeling",
    "chatlearn_mem_ray.wire": "chatlearn_mem_ray.actors.wire",
    "chatlearn_mem_ray.nodes": "chatlearn_mem_ray.actors.nodes",
    "chatlearn_mem_ray.connect": "chatlearn_mem_ray.actors.connect",
    "chatlearn_mem_ray.declare": "chatlearn_mem_ray.service.declare",
    "chatlearn_mem_ray.schedule": "chatlearn_mem_ray.service.schedule",
    "chatlearn_mem_ray.phases": "chatlearn_mem_ray.service.phases",
    "chatlearn_mem_ray.colocation": "chatlearn_mem_ray.service.colocation",
    "chatlearn_mem_ray.timeline": "chatlearn_mem_ray.service.timeline",
    "chatlearn_mem_ray.weight_sync": "chatlearn_mem_ray.service.weight_sync",
    "chatlearn_mem_ray.checkpoints": "chatlearn_mem_ray.job.checkpoints",
}
"""Old module path -> where its contents live now."""


class _Redirect(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers only for the old paths of :data:`MOVED`; every other import goes on as usual."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        warnings.warn(
            f"{spec.name} moved: import from {new} (see the layout in chatlearn_mem_ray's docstring)",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        """The module is the new one, already executed."""


def install() -> None:
    """Put the redirect first on ``sys.meta_path`` (once per process)."""
    if not any(isinstance(f, _Redirect) for f in sys.meta_path):
        sys.meta_path.insert(0, _Redirect())
