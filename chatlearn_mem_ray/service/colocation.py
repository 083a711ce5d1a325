"""Every actor of a colocated run on the same resources, and phase-aware waits for their calls.

:class:`Colocation` connects the driver to Ray (:func:`chatlearn_mem_ray.actors.connect.start_or_join`),
waits for the cluster to have room, places the actors of the models a loop declared
(:class:`~chatlearn_mem_ray.service.declare.Model`), sets them up, and waits for their calls phase by
phase with errors that name the actor and the phase.

Placement: one placement-group bundle per trainer rank (``ray.cpus_per_rank`` CPUs, plus one GPU
when GPUs are used), one placement group per tensor-parallel group on one node, the groups packed
or spread over the nodes (``ray.placement``; see :mod:`chatlearn_mem_ray.actors.nodes`). Bundle ``i``
holds rank ``i`` of every trainer; a one-actor model (an inference model, an engine) sits on its
``bundle`` (0 by default). Each actor asks for an equal share of its bundle (a quarter when four
models share bundle 0, as in PPO), so the models of a bundle share one GPU (or its CPUs) and only
the memory manager keeps them from needing that many times the memory. Every actor reports its
node and the versions it runs; a version that differs from the driver's stops the run before any
work.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from chatlearn_mem_ray.actors import connect
from chatlearn_mem_ray.actors.nodes import (
    group_targets,
    node_label,
    remove_check_files,
    shared_dir_check,
    software_versions,
    unseen_nodes,
    version_skew,
)
from chatlearn_mem_ray.actors.wire import register_tensor_serializer
from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.errors import (
    ActorFailedError,
    CheckpointDirError,
    PhaseTimeoutError,
    ResourceError,
    VersionSkewError,
)
from chatlearn_mem_ray.service.declare import Model

__all__ = ["Colocation", "actor_roster", "engine_log"]

logger = logging.getLogger("chatlearn_mem_ray")


def actor_roster(models: Sequence[Model], world_size: int) -> str:
    """The actors a run starts, in words: ``"6 actors (policy x2, critic x2, rollout, reference)"``."""
    counts = [(m.name, len(m.actor_names(world_size))) for m in models]
    roles = [f"{name} x{n}" if n > 1 else name for name, n in counts]
    return f"{sum(n for _, n in counts)} actors ({', '.join(roles)})"


def engine_log(output_dir: str, name: str) -> Path:
    """Where the vLLM engine of actor ``name`` writes its own log (not the run's console)."""
    return Path(output_dir) / f"{name}_vllm.log"


class Colocation:
    """Every actor of a loop's models on one set of placement-group bundles.

    Use as a context manager: entering starts (or joins, see
    :func:`~chatlearn_mem_ray.actors.connect.start_or_join`) Ray, checks resources, creates the placement
    groups and the actors and sets them up, saying what starts before each wait; leaving kills the
    actors and, when this object started or joined Ray, shuts this driver's Ray down.

    Args:
        cfg: The run config.
        models: The loop's models, in the order their actors start.
        progress: Receives a line before each step of the start and the line saying which cluster
            was joined (default: the logger).
        wait_s: Wait up to this long for the cluster to have room for every rank (a restart after a
            lost node: a replacement may be joining) before :class:`ResourceError`.

    Attributes:
        actors_of: Model name -> its actors (a trainer's in rank order).
        bundle_of: Actor name -> the bundle (device) it lives on.
        names: Actor handle -> name (for error messages).
        ranks: Per trainer actor name, its ``setup()`` result (dp_rank, tp_rank, ...).
        nodes: Per actor name, its node's label (``ip/node-id prefix``).
    """

    def __init__(
        self,
        cfg: LoopConfig,
        models: Sequence[Model],
        progress: Optional[Callable[[str], None]] = None,
        wait_s: float = 0.0,
    ):
        self.cfg = cfg
        self.models = list(models)
        self.wait_s = wait_s  # how long to wait for the cluster to have room (after a lost node)
        self._deadline = 0.0
        self.progress = progress or logger.info
        self._started_ray = False
        self._pgs: list = []
        self.names: dict[Any, str] = {}
        self.ranks: dict[str, dict] = {}
        self.nodes: dict[str, str] = {}
        self._node_ids: dict[str, str] = {}  # actor name -> Ray node id
        self.actors_of: dict[str, list] = {m.name: [] for m in self.models}
        ws = cfg.parallel.world_size
        self.bundle_of: dict[str, int] = {a: b for m in self.models for a, b in zip(m.actor_names(ws), m.bundles(ws))}
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
        ray = connect.import_ray()
        where, self._started_ray = connect.start_or_join(self.cfg, self.progress)
        register_tensor_serializer()  # what the driver sends crosses as bytes too
        self.use_gpu = self._wait_for_room(ray, where)
        self._place()

    def _wait_for_room(self, ray, where: str) -> bool:
        """:func:`~chatlearn_mem_ray.actors.connect.check_resources` on the live nodes, retried for up to
        :attr:`wait_s` (the placement groups then wait for what is left of it: Ray may count a lost
        node's resources until its health checks declare it dead)."""
        self._deadline = time.monotonic() + self.wait_s
        deadline, said = self._deadline, False
        while True:
            total = ray.cluster_resources()  # the nodes alive now
            try:
                return connect.check_resources(self.cfg, total.get("CPU", 0), total.get("GPU", 0), where)
            except ResourceError as e:
                if time.monotonic() >= deadline:
                    raise
                if not said:
                    self.progress(
                        f"waiting up to {self.wait_s:g} s (ray.node_wait_s) for the cluster to have room "
                        f"for every rank again: {str(e).splitlines()[-1].strip()}"
                    )
                    said = True
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _place(self) -> None:
        """Create the placement groups and the actors, then set the actors up, saying what it waits
        for before each wait (the actors' processes start, then they build their models)."""
        self.progress(f"starting {actor_roster(self.models, self.cfg.parallel.world_size)} ...")
        self._make_placement_groups()
        self._start_actors()
        self.progress("building the models ...")
        self._setup_actors()

    def _make_placement_groups(self) -> None:
        ray = connect.import_ray()
        from ray.util.placement_group import placement_group

        cfg = self.cfg
        tp = cfg.parallel.tensor_model_parallel_size
        groups = cfg.parallel.world_size // tp
        bundle = {"CPU": cfg.ray.cpus_per_rank} | ({"GPU": 1} if self.use_gpu else {})
        targets = group_targets(
            groups, cfg.ray.cpus_per_rank * tp, tp if self.use_gpu else 0, ray.nodes(), cfg.ray.placement
        )
        self._pgs = [
            placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK", _soft_target_node_id=target)
            for target in targets
        ]
        timeout, why = cfg.ray.phase_timeout_s, "ray.phase_timeout_s"
        if self.wait_s:  # a restart: what is left of ray.node_wait_s
            timeout, why = max(1.0, self._deadline - time.monotonic()), "ray.node_wait_s"
        ready, _ = ray.wait([pg.ready() for pg in self._pgs], num_returns=len(self._pgs), timeout=timeout)
        if len(ready) < len(self._pgs):
            raise ResourceError(
                f"the placement groups ({groups} tensor-parallel group(s) of {tp} x {bundle}, each "
                f"on one node) could not be scheduled within {timeout:.0f} s ({why}); the "
                f"cluster has {ray.available_resources()} available"
            )

    def _start_actors(self) -> None:
        """Create every actor in its bundle and wait for each to report its node."""
        ray = connect.import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from chatlearn_mem_ray.actors import InferenceActor, TorchInferenceActor, TorchTrainerActor, TrainerActor

        cfg = self.cfg
        tp = cfg.parallel.tensor_model_parallel_size

        per_bundle: dict[int, int] = {}
        for b in self.bundle_of.values():
            per_bundle[b] = per_bundle.get(b, 0) + 1
        share = 1.0 / max(4, max(per_bundle.values()))  # a quarter of a bundle at least, as before

        def options(bundle: int) -> dict:
            ask = {"num_cpus": cfg.ray.cpus_per_rank * share}
            if self.use_gpu:
                ask["num_gpus"] = share
            return dict(
                ask,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._pgs[bundle // tp], placement_group_bundle_index=bundle % tp
                ),
            )

        memory = cfg.memory.manager.model_dump()
        for m in self.models:
            config = m.config.model_dump()
            torch_native = getattr(m.config, "backend", "megatron") == "torch"  # never imports megatron
            Trainer = ray.remote(TorchTrainerActor if torch_native else TrainerActor)
            Inference = ray.remote(TorchInferenceActor if torch_native else InferenceActor)
            for name, bundle in zip(m.actor_names(cfg.parallel.world_size), m.bundles(cfg.parallel.world_size)):
                if m.kind == "trainer":
                    handle = Trainer.options(**options(bundle)).remote(name, m.head, config, memory)
                elif m.kind == "engine" and m.backend == "vllm":
                    from chatlearn_mem_ray.actors.vllm import VLLMRolloutActor

                    log_file = str(engine_log(cfg.output_dir, name).absolute())
                    handle = (
                        ray.remote(VLLMRolloutActor)
                        .options(**options(bundle))
                        .remote(name, config, memory, m.engine_config.model_dump(), log_file, cfg.memory.verify_sync)
                    )
                else:  # a frozen model, or the megatron rollout
                    handle = Inference.options(**options(bundle)).remote(name, config, memory)
                self.actors_of[m.name].append(handle)
                self.names[handle] = name
        self._check_nodes()

    def _setup_actors(self) -> None:
        """Every actor builds its model; a trainer's ranks join their process group. On GPUs a vLLM
        engine starts once every model built before it is asleep, so that its free-memory check
        sees the room it will have beside them."""
        p = self.cfg.parallel
        built: list = []
        for m in self.models:
            group = self.actors_of[m.name]
            if m.kind == "engine" and m.backend == "vllm" and self.use_gpu and self.cfg.memory.enabled and built:
                self.call("setup", {a: a.offload.remote() for a in built})
            built += group
            init = self.call("setup", {group[0]: group[0].master_address.remote()})[group[0]]
            if m.kind == "trainer":
                results = self.call(
                    "setup",
                    {
                        a: a.setup.remote(r, p.world_size, p.tensor_model_parallel_size, init)
                        for r, a in enumerate(group)
                    },
                )
                self.ranks.update({self.names[a]: v for a, v in results.items()})
            else:
                self.call("setup", {group[0]: group[0].setup.remote(init)})

    def _check_nodes(self) -> None:
        """Learn every actor's node; stop before any work when one runs other versions than the driver."""
        info = {
            self.names[a]: r for a, r in self.call("setup", {a: a.node_info.remote() for a in self.all_actors}).items()
        }
        self._node_ids = {name: r["node_id"] for name, r in info.items()}
        self.nodes = {name: node_label(r["node_id"], r["ip"]) for name, r in info.items()}
        skew = version_skew(
            software_versions(), {n: {"versions": r["versions"], "node": self.nodes[n]} for n, r in info.items()}
        )
        if skew:
            raise VersionSkewError(
                "the actors must run the driver's versions: "
                + "; ".join(skew)
                + ". Install the same versions on every node (one image or one environment)"
            )
        by_node: dict[str, list[str]] = {}
        for name in (self.names[a] for a in self.all_actors):
            by_node.setdefault(self.nodes[name], []).append(name)
        self.progress(
            f"actors on {len(by_node)} node(s): "
            + "; ".join(f"{node}: {', '.join(names)}" for node, names in by_node.items())
        )

    def check_shared_dir(self, directory: Path) -> None:
        """With actors on several nodes (or the driver on a node without actors): check that every
        node reads and writes ``directory``.

        Raises:
            CheckpointDirError: Naming the nodes that cannot see it.
        """
        ray = connect.import_ray()
        nodes = sorted(set(self._node_ids.values()))
        if len(nodes) < 2 and ray.get_runtime_context().get_node_id() in nodes:
            return
        one = {}
        for a in self.all_actors:
            one.setdefault(self._node_ids[self.names[a]], a)
        token_path, token = shared_dir_check(Path(directory))
        try:
            seen = self.call("setup", {a: a.check_shared.remote(str(token_path), token) for a in one.values()})
            missing = unseen_nodes(token_path, {n: seen[a] for n, a in one.items()})
        finally:
            remove_check_files(token_path)
        if missing:
            labels = {self._node_ids[n]: self.nodes[n] for n in self.nodes}
            raise CheckpointDirError(
                f"checkpoint.directory {directory} is not shared by every node of the run: node(s) "
                f"{', '.join(labels.get(n, n) for n in missing)} cannot read or write what the driver wrote there. "
                "Put it on a filesystem every node mounts at the same path (NFS, a parallel filesystem)"
            )

    def close(self) -> None:
        """Kill the actors and the placement groups; stop Ray if this object started it."""
        ray = connect.import_ray()
        if not ray.is_initialized():
            return
        for handle in list(self.names):
            try:
                ray.kill(handle)
            except Exception:  # already dead
                pass
        self.names.clear()
        for pg in self._pgs:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
            except Exception:
                pass
        self._pgs = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    # -- calls ----------------------------------------------------------------------------
    @property
    def all_actors(self) -> list:
        """Every actor, model by model in declared order (a trainer's in rank order)."""
        return [a for m in self.models for a in self.actors_of[m.name]]

    def call(self, phase: str, refs: Mapping[Any, Any], timeout_s: Optional[float] = None) -> dict:
        """Wait for one call per actor; return ``{actor: result}``.

        Fails fast: the first actor that dies or raises stops the wait, even while others are
        still running (a peer blocked in a collective on a dead rank would otherwise hang).

        Raises:
            ActorFailedError: Naming the actor, the phase and the cause.
            PhaseTimeoutError: After ``timeout_s`` (default ``ray.phase_timeout_s``).
        """
        ray = connect.import_ray()
        from ray.exceptions import RayActorError, RayTaskError

        timeout_s = self.cfg.ray.phase_timeout_s if timeout_s is None else timeout_s
        pending = {ref: actor for actor, ref in refs.items()}
        results: dict = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                waiting = sorted(self.names.get(a, "?") for a in pending.values())
                raise PhaseTimeoutError(
                    f"phase {phase!r} did not finish within {timeout_s:g} s; still "
                    f"waiting for {', '.join(waiting)} (raise ray.phase_timeout_s "
                    "if the phase is just slow)"
                )
            for ref in ready:
                actor = pending.pop(ref)
                name = self.names.get(actor, "?")
                try:
                    results[actor] = ray.get(ref)
                except RayActorError as e:
                    raise ActorFailedError(
                        name, phase, f"the actor process died ({type(e).__name__})", died=True
                    ) from None
                except RayTaskError as e:
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    dead = self._dead_peer(actor)
                    if dead is not None:  # a collective broke because a peer's process (or node) is gone
                        raise ActorFailedError(
                            dead,
                            phase,
                            f"the actor process died; {name} then failed in a collective ({type(cause).__name__})",
                            died=True,
                        ) from e
                    raise ActorFailedError(name, phase, f"{type(cause).__name__}: {cause}") from e
        return results

    def _dead_peer(self, failed: Any) -> Optional[str]:
        """After ``failed`` raised: the name of another actor whose process is gone, if any. A rank
        whose peer died (a killed process, a lost node) fails in its next collective with an error
        of its own (gloo: "Connection closed by peer"); what the run must see is the death, which
        a restart can mend. Waits up to a minute for Ray to notice a lost node (its health checks),
        less when every other actor answers."""
        ray = connect.import_ray()
        from ray.exceptions import RayActorError

        refs = {a.ping.remote(): a for a in self.all_actors if a is not failed and a is not None}
        pending = list(refs)
        deadline = time.monotonic() + min(60.0, self.cfg.ray.phase_timeout_s)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            try:
                ray.get(ready[0])
            except RayActorError:
                return self.names.get(refs[ready[0]], "?")
            except Exception:  # noqa: BLE001 - an answer that is no death
                pass
        return None
