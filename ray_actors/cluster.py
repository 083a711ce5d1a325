"""Ray plumbing of a colocated run: start or join a cluster, place every actor on the same
resources, and wait for actor calls phase by phase with errors that name the actor and phase.

Placement: one placement-group bundle per trainer rank (``ray.cpus_per_rank`` CPUs, plus one GPU
when GPUs are used). Bundle ``i`` holds rank ``i`` of the policy and of the critic; bundle 0 also
holds the rollout and the reference model. Each actor asks for a quarter of its bundle, so the
four models of bundle 0 share one GPU (or its CPUs) and only the memory manager keeps them from
needing four times the memory.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Mapping, Optional

from chatlearn_mem_ray.config import RunConfig
from chatlearn_mem_ray.errors import ActorFailedError, PhaseTimeoutError, ResourceError

__all__ = ["Colocation", "check_resources"]

logger = logging.getLogger("chatlearn_mem_ray")

ACTOR_SHARE = 0.25  # of a bundle: up to four colocated models per bundle


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("Ray is required for the PPO run; install it with: pip install 'chatlearn-mem[ray]'") from e
    return ray


def _wants_gpu(cfg: RunConfig, available_gpus: float) -> bool:
    if cfg.ray.use_gpu == "auto":
        return available_gpus >= 1
    return bool(cfg.ray.use_gpu)


def check_resources(cfg: RunConfig, cpus: float, gpus: float, where: str) -> bool:
    """Check that the run's bundles fit; return whether GPUs are used.

    Raises:
        ResourceError: Saying what is asked, what exists and which setting to change.
    """
    ranks = cfg.parallel.world_size
    need_cpus = ranks * cfg.ray.cpus_per_rank
    problems = []
    if need_cpus > cpus:
        problems.append(f"{ranks} rank(s) x ray.cpus_per_rank={cfg.ray.cpus_per_rank:g} need {need_cpus:g} "
                        f"CPUs but {where} has {cpus:g}: lower parallel.world_size or ray.cpus_per_rank")
    use_gpu = _wants_gpu(cfg, gpus)
    if use_gpu and ranks > gpus:
        problems.append(f"{ranks} rank(s) need {ranks} GPUs but {where} has {gpus:g}: lower "
                        "parallel.world_size or set ray.use_gpu=false")
    if problems:
        raise ResourceError("not enough resources for this run:\n  " + "\n  ".join(problems))
    return use_gpu


class Colocation:
    """Every actor of a PPO run on one set of placement-group bundles.

    Use as a context manager: entering starts (or joins) Ray, checks resources, creates the
    placement group and the actors and sets them up; leaving kills the actors and, when this
    object started Ray, stops it.

    Attributes:
        policy, critic: The trainer actors, one per rank.
        rollout, reference: The inference actors.
        names: Actor handle -> name (for error messages).
        ranks: Per trainer actor name, its ``setup()`` result (dp_rank, tp_rank, ...).
    """

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self._started_ray = False
        self._pg = None
        self.names: dict[Any, str] = {}
        self.ranks: dict[str, dict] = {}
        self.policy: list = []
        self.critic: list = []
        self.rollout = self.reference = None
        self.use_gpu = False

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> "Colocation":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        ray = _ray()
        cfg = self.cfg
        if cfg.ray.address is None:  # check before starting anything
            import torch

            cpus = cfg.ray.num_cpus or os.cpu_count() or 1
            check_resources(cfg, cpus, torch.cuda.device_count(), "this machine")
        if not ray.is_initialized():
            if cfg.ray.address is None:
                ray.init(num_cpus=cfg.ray.num_cpus, include_dashboard=False, logging_level="WARNING",
                         log_to_driver=True)
            else:
                ray.init(address=cfg.ray.address, logging_level="WARNING")
            self._started_ray = True
        total = ray.cluster_resources()
        where = f"the Ray cluster at {cfg.ray.address}" if cfg.ray.address else "the local Ray cluster"
        self.use_gpu = check_resources(cfg, total.get("CPU", 0), total.get("GPU", 0), where)
        self._place()

    def _place(self) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from chatlearn_mem_ray.actors import InferenceActor, TrainerActor

        cfg = self.cfg
        bundle = {"CPU": cfg.ray.cpus_per_rank} | ({"GPU": 1} if self.use_gpu else {})
        self._pg = placement_group([dict(bundle) for _ in range(cfg.parallel.world_size)], strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=cfg.ray.phase_timeout_s)
        if not ready:
            raise ResourceError(f"the placement group ({cfg.parallel.world_size} x {bundle}) could not be "
                                f"scheduled within {cfg.ray.phase_timeout_s:g} s; the cluster has "
                                f"{ray.available_resources()} available")

        def options(index: int) -> dict:
            share = {"num_cpus": cfg.ray.cpus_per_rank * ACTOR_SHARE}
            if self.use_gpu:
                share["num_gpus"] = ACTOR_SHARE
            return dict(share, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._pg, placement_group_bundle_index=index))

        memory = cfg.memory.manager.model_dump()
        Trainer, Inference = ray.remote(TrainerActor), ray.remote(InferenceActor)
        for role, group, model in (("policy", self.policy, cfg.policy), ("critic", self.critic, cfg.critic)):
            for rank in range(cfg.parallel.world_size):
                name = f"{role}_{rank}"
                handle = Trainer.options(**options(rank)).remote(name, role, model.model_dump(), memory)
                group.append(handle)
                self.names[handle] = name
        self.rollout = Inference.options(**options(0)).remote("rollout", cfg.policy.model_dump(), memory)
        self.reference = Inference.options(**options(0)).remote("reference", cfg.policy.model_dump(), memory)
        self.names[self.rollout], self.names[self.reference] = "rollout", "reference"

        p = cfg.parallel
        for group in (self.policy, self.critic):
            init = self.call("setup", {group[0]: group[0].master_address.remote()})[group[0]]
            results = self.call("setup", {a: a.setup.remote(r, p.world_size, p.tensor_model_parallel_size, init)
                                          for r, a in enumerate(group)})
            self.ranks.update({self.names[a]: v for a, v in results.items()})
        for a in (self.rollout, self.reference):
            init = self.call("setup", {a: a.master_address.remote()})[a]
            self.call("setup", {a: a.setup.remote(init)})

    def close(self) -> None:
        """Kill the actors and the placement group; stop Ray if this object started it."""
        ray = _ray()
        if not ray.is_initialized():
            return
        for handle in list(self.names):
            try:
                ray.kill(handle)
            except Exception:  # already dead
                pass
        self.names.clear()
        if self._pg is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    # -- calls ----------------------------------------------------------------------------
    @property
    def all_actors(self) -> list:
        return [*self.policy, *self.critic, self.rollout, self.reference]

    def call(self, phase: str, refs: Mapping[Any, Any], timeout_s: Optional[float] = None) -> dict:
        """Wait for one call per actor; return ``{actor: result}``.

        Fails fast: the first actor that dies or raises stops the wait, even while others are
        still running (a peer blocked in a collective on a dead rank would otherwise hang).

        Raises:
            ActorFailedError: Naming the actor, the phase and the cause.
            PhaseTimeoutError: After ``timeout_s`` (default ``ray.phase_timeout_s``).
        """
        ray = _ray()
        from ray.exceptions import RayActorError, RayTaskError

        timeout_s = self.cfg.ray.phase_timeout_s if timeout_s is None else timeout_s
        pending = {ref: actor for actor, ref in refs.items()}
        results: dict = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                waiting = sorted(self.names.get(a, "?") for a in pending.values())
                raise PhaseTimeoutError(f"phase {phase!r} did not finish within {timeout_s:g} s; still "
                                        f"waiting for {', '.join(waiting)} (raise ray.phase_timeout_s "
                                        "if the phase is just slow)")
            for ref in ready:
                actor = pending.pop(ref)
                name = self.names.get(actor, "?")
                try:
                    results[actor] = ray.get(ref)
                except RayActorError as e:
                    raise ActorFailedError(name, phase, f"the actor process died ({type(e).__name__})") from None
                except RayTaskError as e:
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    raise ActorFailedError(name, phase, f"{type(cause).__name__}: {cause}") from e
        return results
