"""The colocation service: any Ray loop declares its models and phases, and runs each phase through it.

A loop is a :class:`~chatlearn_mem_ray.service.loop.Loop` subclass: it declares its models (:class:`~chatlearn_mem_ray.service.declare.Model`)
and its phases (:class:`~chatlearn_mem_ray.service.declare.Phase`: what each needs resident), and writes
one iteration, :meth:`~chatlearn_mem_ray.service.loop.Loop.step`, as a few ``with svc.phase(name) as p:`` blocks. For each block
the :class:`Service` wakes what the phase needs (everything it names, or as the residency plan of
``memory.device_budget_mb`` says, with prefetch), audits it, runs the block, records every actor's
device bytes in the memory timeline and puts the models back to sleep. Inside a block, ``p.call``,
``p.forward``, ``p.train`` and ``p.sync`` reach the models the phase declared; any other model is
refused with an error naming the phase. :func:`chatlearn_mem_ray.job.run.run_loop` runs a loop
as a job: Ray, the iterations, ``log.json``, checkpoints, ``--resume``, restarts and SIGTERM.

::

    class BestOfN(Loop):
        def models(self):
            return [Model.trainer("policy", self.cfg.policy),
                    Model.engine("rollout", self.cfg.policy, follows="policy", rollout=self.cfg.rollout)]

        def phases(self):
            return [Phase("generate", needs={"rollout": WEIGHTS}), Phase("train", needs={"policy": EVERYTHING})]

        def step(self, svc, index):
            with svc.phase("generate") as p:
                p.sync("policy", "rollout")
                tokens, _ = p.call("rollout", "generate", prompts, length, 1.0, seed)[0]
            with svc.phase("train") as p:
                metrics = p.train("policy", {"tokens": tokens}, loss_fn, epochs=1, minibatch_size=8, seed=index)
            return {"reward": ..., **metrics}

Ordering the service keeps for a loop (trap by trap, see docs/service.md):

- A phase that writes a saved model first completes the open asynchronous checkpoint save (derived
  from the phase's writes; the wait is the iteration's ``checkpoint_seconds``).
- Every boundary is computed from what is resident now, so a loop that skips, repeats or reorders
  phases stays correct; a prefetch that guessed wrong moves out first when its room is needed.
- A weight sync, an audit or a save that reads a host store waits for that store's pending
  offloads (the managers' rule R5).
- An exception inside a phase calls no actor on the way out (one may be dead) and propagates
  unchanged, so the supervisor's restarts still see it; the next phase first puts every model to
  sleep, from whatever state the failure left.
- After a restore every model is asleep and every engine stale: the loop syncs before generating.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from chatlearn_mem import Part
from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.errors import LoopUsageError
from chatlearn_mem_ray.service import weight_sync
from chatlearn_mem_ray.service.budget import pinned_items
from chatlearn_mem_ray.service.colocation import Colocation
from chatlearn_mem_ray.service.declare import Model, Phase, check_declarations, parts_of, phase_demands, phase_writes
from chatlearn_mem_ray.service.phases import OpenPhase, PhaseRunner
from chatlearn_mem_ray.service.schedule import ResidencySchedule
from chatlearn_mem_ray.service.timeline import MemoryTimeline

__all__ = ["PhaseContext", "Service"]


@dataclass
class _Iteration:
    index: int
    t_start: float
    checkpoint_seconds: float = 0.0
    weight_sync: Optional[dict] = None


class Service:
    """The colocation service of one run: the actors of the declared models on shared devices, and
    every phase's memory moves, audits and record.

    Use as a context manager: entering checks the declarations, starts (or joins) Ray and places
    and builds every model's actors; leaving kills them. :func:`~chatlearn_mem_ray.job.run.run_loop`
    does this for a :class:`Loop`, and restarts it after a lost actor.

    Args:
        cfg: The run config (``parallel``, ``memory``, ``ray``, ``rollout``).
        models: The loop's models.
        phases: The loop's phases, in their usual order.
        progress: Receives the start's lines and the warnings of a residency plan.
        on_phase: Called as each phase starts with the service, the iteration's index and the
            phase (tests use it to disturb the actors).
        wait_s: After a restart: how long to wait for the cluster to have room again.

    Raises:
        DeclarationError: On construction, when the declarations are inconsistent.
    """

    def __init__(
        self,
        cfg: LoopConfig,
        models: Sequence[Model],
        phases: Sequence[Phase],
        progress: Callable[[str], None] = print,
        on_phase: Optional[Callable[["Service", int, str], None]] = None,
        wait_s: float = 0.0,
    ):
        check_declarations(models, phases, cfg.parallel.world_size)
        self.cfg, self.progress, self.on_phase = cfg, progress, on_phase
        self.models = {m.name: m for m in models}
        self.phases = {p.name: p for p in phases}
        self.phase_order = [p.name for p in phases]
        self.colo = Colocation(cfg, models, progress, wait_s=wait_s)
        self.runner = PhaseRunner(
            cfg, self.colo, phase_demands(models, phases, cfg.parallel.world_size), pinned_items(cfg, models), progress
        )
        self.iterations: list[dict] = []
        self.sync_checks: list[dict] = []
        self.manager_on = cfg.memory.enabled
        self.checkpointer = None  # a RunCheckpointer when the run saves checkpoints
        self.where: tuple[Optional[int], str] = (None, "setup")  # (iteration index, phase) now running
        self._comparison_from: Optional[int] = None  # index of the first manager-off comparison iteration
        self._versions = {m.name: 0 for m in models if m.kind == "trainer"}  # bumped when a phase trains one
        self._synced: dict[str, Optional[int]] = {m.name: None for m in models if m.kind == "engine"}
        self._iteration: Optional[_Iteration] = None
        self._open: Optional[str] = None
        self._disturbed = False

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> "Service":
        self.colo.__enter__()
        self.runner.pinned = pinned_items(self.cfg, self.models.values(), self.colo.use_gpu)
        return self

    def __exit__(self, *exc) -> None:
        self.colo.__exit__(*exc)

    # -- what is where --------------------------------------------------------------------
    @property
    def timeline(self) -> MemoryTimeline:
        """Every phase's residency and transitions so far."""
        return self.runner.timeline

    @property
    def audits(self) -> dict:
        """``{"runs", "checks_clean"}``: the audits after each phase's onload."""
        return self.runner.audits

    @property
    def schedule(self) -> Optional[ResidencySchedule]:
        """With ``memory.device_budget_mb``: the residency plan (see :meth:`plan`)."""
        return self.runner.schedule

    @property
    def over_budget(self) -> list[dict]:
        """Phases measured above their device's budget."""
        return self.runner.over_budget

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of every trainer."""
        return self.cfg.parallel.data_parallel_size

    def actors(self, model: str) -> list:
        """The actor handles of ``model`` (a trainer's in rank order)."""
        self._model(model)
        return list(self.colo.actors_of[model])

    def by_dp_rank(self, model: str) -> list[list]:
        """A trainer's actors grouped by data-parallel rank (each group in tensor-parallel order)."""
        out: list[list] = [[] for _ in range(self.dp_size)]
        for a in self.actors(model):
            out[self.colo.ranks[self.colo.names[a]]["dp_rank"]].append(a)
        return out

    def stale(self, model: str) -> bool:
        """Whether engine ``model`` serves older weights than its trainer's (or none synced yet)."""
        m = self._model(model)
        if m.kind != "engine":
            raise LoopUsageError(f"stale({model!r}): {model!r} is a {m.kind}, not an engine following a trainer")
        return self._synced[model] != self._versions[m.follows]

    def explain(self, phase: str) -> str:
        """The moves into ``phase`` from what is resident now, in words (nothing is moved)."""
        declared = self._phase(phase)
        s = self.schedule
        if s is None or not self.manager_on:
            needs = ", ".join(f"{m}: {'+'.join(p.value for p in parts_of(spec))}" for m, spec in declared.needs.items())
            if not self.manager_on:
                return f"{phase}: nothing moves (the memory manager is off; every model is resident)"
            return f"{phase}: onload {needs or 'nothing'}, then offload them when it ends"
        moves = s.boundary(s.index(phase))

        def words(m: dict) -> str:
            return "; ".join(f"{a} {'+'.join(p.value for p in parts)}" for a, parts in m.items()) or "nothing"

        return f"{phase}: offload {words(moves.out)}; onload {words(moves.into)}"

    def _model(self, model: str) -> Model:
        if model not in self.models:
            raise LoopUsageError(f"{model!r} is not a model of this loop (declared: {', '.join(self.models)})")
        return self.models[model]

    def _phase(self, phase: str) -> Phase:
        if phase not in self.phases:
            raise LoopUsageError(f"phase {phase!r} was not declared (declared: {', '.join(self.phase_order)})")
        return self.phases[phase]

    @property
    def open_phase(self) -> Optional[str]:
        """The name of the phase running now, or None between phases."""
        return self._open

    # -- iterations -----------------------------------------------------------------------
    @property
    def next_iteration(self) -> int:
        """The index of the iteration to run next (the iterations done so far)."""
        return len(self.iterations)

    def number(self, index: int) -> tuple[int, bool]:
        """``(number, comparison)`` of the iteration at ``index``: its number counts from 1, and
        from 1 again for the comparison iterations after :meth:`wake_all` (the manager off). A
        checkpoint named ``iter_<K>`` holds iterations 1 to K."""
        first = self._comparison_from
        if first is not None and index >= first:
            return index - first + 1, True
        return index + 1, False

    def begin_iteration(self, index: int) -> None:
        """Start timing iteration ``index`` (the runner calls it before :meth:`~chatlearn_mem_ray.service.loop.Loop.step`)."""
        self._iteration = _Iteration(index, time.perf_counter())

    def end_iteration(self, metrics: dict) -> dict:
        """The iteration's log entry: its number, the loop's ``metrics``, and the service's figures
        (seconds, each phase's seconds and device bytes, bytes moved, each actor's RSS, the peak
        per device, the weight sync's record, the budget); kept in :attr:`iterations`."""
        it, self._iteration = self._iteration, None
        number, _ = self.number(it.index)
        phases = [r for r in self.timeline.records if r.iteration == number and r.manager_on == self.manager_on]
        out = {
            "iteration": number,
            "manager_on": self.manager_on,
            **metrics,
            "seconds": time.perf_counter() - it.t_start,
            "checkpoint_seconds": it.checkpoint_seconds,
            "phase_seconds": {r.phase: r.seconds for r in phases},
            "phase_colocated_bytes": {r.phase: r.colocated_bytes for r in phases},
            "moved_in_bytes": sum(r.moved_in_bytes for r in phases),
            "moved_out_bytes": sum(r.moved_out_bytes for r in phases),
            "transition_seconds": sum(r.transition_seconds for r in phases),
            "rss_bytes": dict(phases[-1].rss_bytes) if phases else {},  # each actor's, at the last phase
            "peak_device_bytes": {
                b: max(r.bundle_bytes.get(b, 0) for r in phases) for b in (phases[0].bundle_bytes if phases else {})
            },
        }
        if it.weight_sync is not None:
            out["weight_sync"] = dict(it.weight_sync, share_of_iteration=it.weight_sync["seconds"] / out["seconds"])
        if self.schedule is not None and self.manager_on:
            out["budget_bytes"] = {str(b): v for b, v in self.schedule.budget.items()}
        self.iterations.append(out)
        return out

    # -- phases ---------------------------------------------------------------------------
    def phase(self, name: str) -> "PhaseContext":
        """``with svc.phase(name) as p:``: wake what phase ``name`` needs, audit it, run the block,
        record the residency, put the models back to sleep (see :class:`PhaseContext`)."""
        self._phase(name)
        return PhaseContext(self, name)

    def _enter(self, p: "PhaseContext") -> OpenPhase:
        if self._iteration is None:
            raise LoopUsageError(f"phase {p.name!r} ran outside an iteration: phases run inside Loop.step")
        if self._open is not None:
            raise LoopUsageError(f"phase {p.name!r} started inside phase {self._open!r}: phases do not nest")
        index = self._iteration.index
        declared = self.phases[p.name]
        writes = phase_writes(declared, self.models)
        if self.checkpointer is not None and any(self.models[m].is_saved for m in writes):
            self.where = (index, "checkpoint")  # the saved models are about to change: commit the open save
            self._iteration.checkpoint_seconds += self.checkpointer.complete()
        self.where = (index, p.name)
        if self.on_phase is not None:
            self.on_phase(self, index, p.name)
        if self._disturbed and self.manager_on:
            self.sleep_all()
        self._disturbed = False
        needs = {a: parts_of(spec) for m, spec in declared.needs.items() for a in self.colo.actors_of[m]}
        self._open = p.name
        try:
            return self.runner.enter(self.number(index)[0], p.name, needs, self.manager_on)
        except BaseException:
            self._open, self._disturbed = None, True
            raise

    def _exit(self, p: "PhaseContext", failed: bool) -> None:
        self._open = None
        if failed:  # no actor is called: one may be dead; the next phase starts from a clean sleep
            self._disturbed = True
            return
        try:
            self.runner.exit(p.open)
        except BaseException:
            self._disturbed = True
            raise
        for model, parts in phase_writes(self.phases[p.name], self.models).items():
            if model in self._versions and Part.WEIGHTS in parts:
                self._versions[model] += 1

    # -- memory ---------------------------------------------------------------------------
    def sleep_all(self) -> None:
        """Offload every model (after setup, and after a phase that failed)."""
        c = self.colo
        self.runner.settle()
        c.call("sleep", {a: a.offload.remote() for a in c.all_actors})
        if self.schedule is not None:
            self.schedule.clear()

    def plan(self) -> Optional[ResidencySchedule]:
        """With ``memory.device_budget_mb`` and the manager on: measure every model's parts and plan
        what each device keeps resident in each declared phase (call with every model asleep).

        Raises:
            BudgetError: A phase alone needs more than the budget.
        """
        return self.runner.plan() if self.manager_on else None

    def wake_all(self) -> None:
        """Onload every model and keep it resident: the run continues with the manager off, its
        iterations numbered as comparison iterations (:meth:`number`)."""
        c = self.colo
        c.call("wake", {a: a.onload.remote() for a in c.all_actors})
        self.manager_on = False
        self._comparison_from = self.next_iteration

    # -- checkpoints ----------------------------------------------------------------------
    @property
    def saved_models(self) -> list[str]:
        """The models run checkpoints save (the trainers, by default)."""
        return [m.name for m in self.models.values() if m.is_saved]

    def state(self) -> dict:
        """What a run checkpoint keeps of the service: the config, the log and the memory timeline
        so far, and which models it saved."""
        state = {
            "config": json.loads(self.cfg.model_dump_json()),
            "models": self.saved_models,
            "iterations": self.iterations,
            "memory_timeline": self.timeline.to_json(),
            "sync_checks": self.sync_checks,
            "audits": self.audits,
        }
        return json.loads(json.dumps(state))  # a copy: the run goes on while a save is open

    def restore(self, path: Path, state: dict) -> None:
        """Continue the run a checkpoint saved: every saved model's ranks load their state from
        ``path`` and the service takes the log, timeline and checks over. Every engine is stale
        afterwards (the loop syncs it before its first generate). The driver verified the files
        against their manifests when it chose ``path``: the ranks do not read them twice."""
        self.where = (None, "resume")
        step = f"step_{state['iterations_done']:08d}"
        saved = [m for m in state.get("models", self.saved_models) if m in self.models]
        self.colo.call(
            "resume",
            {
                a: a.load_checkpoint.remote(str(Path(path) / model / step), verify=False)
                for model in saved
                for a in self.colo.actors_of[model]
            },
        )
        self.iterations = [dict(m) for m in state["iterations"]]
        self.runner.timeline = MemoryTimeline.from_json(state["memory_timeline"])
        self.sync_checks = list(state["sync_checks"])
        self.runner.audits = dict(state["audits"])
        self._synced = {m: None for m in self._synced}

    def export_hf(self, model: str, path, tokenizer=None, max_shard_bytes: int = 4 * 2**30) -> dict:
        """Write trainer ``model`` to ``path`` as a Hugging Face directory (a Llama or Qwen2; a
        tensor-parallel model's shards merged), from its host store while it sleeps, atomically;
        returns what was written. See :func:`chatlearn_mem_ray.service.export.export_hf`."""
        from chatlearn_mem_ray.service.export import export_hf

        return export_hf(self, model, path, tokenizer, max_shard_bytes)

    def final_weights(self) -> dict[str, str]:
        """SHA-256 of every trainer rank's weights (read from the host store when asleep)."""
        c = self.colo
        trainers = [a for m in self.models.values() if m.kind == "trainer" for a in c.actors_of[m.name]]
        return {c.names[a]: d for a, d in c.call("final", {a: a.weights_digest.remote() for a in trainers}).items()}


class PhaseContext:
    """One running phase: what ``with svc.phase(name) as p:`` gives the block.

    Every call reaches only the models the phase declared in its ``needs`` (a weight sync may
    also read its source trainer, asleep, from its host store); another model is a
    :class:`~chatlearn_mem_ray.errors.LoopUsageError` naming the phase. The calls wait with the
    phase's name in every error (a dead actor: :class:`~chatlearn_mem_ray.errors.ActorFailedError`).
    """

    def __init__(self, svc: Service, name: str):
        self.svc, self.name = svc, name
        self.open: Optional[OpenPhase] = None

    def __enter__(self) -> "PhaseContext":
        self.open = self.svc._enter(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.svc._exit(self, failed=exc_type is not None)
        return False

    # -- calls ----------------------------------------------------------------------------
    def _needed(self, model: str) -> Model:
        m = self.svc._model(model)
        if model not in self.svc.phases[self.name].needs:
            raise LoopUsageError(
                f"phase {self.name!r} calls {model!r}, which it does not need; declare it: "
                f"Phase({self.name!r}, needs={{..., {model!r}: WEIGHTS}})"
            )
        return m

    def call(self, model: str, method: str, *args, **kwargs) -> list:
        """``method(*args, **kwargs)`` on every actor of ``model`` at once; their results in rank order."""
        self._needed(model)
        actors = self.svc.colo.actors_of[model]
        results = self.svc.colo.call(self.name, {a: getattr(a, method).remote(*args, **kwargs) for a in actors})
        return [results[a] for a in actors]

    def _shard(self, batch: dict, dp_rank: int) -> dict:
        n = next(iter(batch.values())).shape[0] // self.svc.dp_size
        return {k: v[dp_rank * n : (dp_rank + 1) * n] for k, v in batch.items()}

    def call_sharded(self, model: str, method: str, batch: dict, *args, **kwargs) -> dict:
        """``method(shard, *args, **kwargs)`` on every rank of trainer ``model``, each data-parallel
        rank on its share of ``batch`` (tensors, batch first); ``{actor: result}``."""
        self._needed(model)
        c = self.svc.colo
        return c.call(
            self.name,
            {
                a: getattr(a, method).remote(self._shard(batch, c.ranks[c.names[a]]["dp_rank"]), *args, **kwargs)
                for a in c.actors_of[model]
            },
        )

    def forward(self, model: str, tokens: torch.Tensor, *args) -> torch.Tensor:
        """``forward(tokens, *args)`` on every rank of trainer ``model``, each data-parallel rank on
        its share of ``tokens``: the outputs of tensor-parallel rank 0, concatenated (log-probs of
        an lm head, values of a value head)."""
        self._needed(model)
        c = self.svc.colo
        results = c.call(
            self.name,
            {
                a: a.forward.remote(self._shard({"t": tokens}, c.ranks[c.names[a]]["dp_rank"])["t"], *args)
                for a in c.actors_of[model]
            },
        )
        return torch.cat([results[ranks[0]] for ranks in self.svc.by_dp_rank(model)], dim=0)

    def train(
        self,
        model: str,
        batch: dict,
        loss_fn: Callable,
        *,
        epochs: int,
        minibatch_size: int,
        seed: int,
        temperature: float = 1.0,
        entropy: bool = False,
    ) -> dict[str, float]:
        """Optimizer steps of trainer ``model`` on ``batch``, each data-parallel rank on its share
        (see :meth:`chatlearn_mem_ray.actors.trainer.TrainerActor.train`); each metric averaged over the
        data-parallel ranks."""
        results = self.call_sharded(model, "train", batch, loss_fn, epochs, minibatch_size, seed, temperature, entropy)
        firsts = [ranks[0] for ranks in self.svc.by_dp_rank(model)]
        return {k: sum(results[a][k] for a in firsts) / len(firsts) for k in results[firsts[0]]}

    def sync(self, source: str, target: str) -> None:
        """Load trainer ``source``'s weights (read from its host store when it sleeps) into engine
        ``target``, verified (see :mod:`chatlearn_mem_ray.service.weight_sync`); ``target`` is then fresh
        (:meth:`Service.stale`)."""
        svc = self.svc
        engine = self._needed(target)
        if engine.kind != "engine" or engine.follows != source:
            raise LoopUsageError(f"sync({source!r}, {target!r}): {target!r} is not an engine following {source!r}")
        senders = svc.by_dp_rank(source)[0]  # tensor-parallel ranks of data-parallel rank 0
        handle = svc.colo.actors_of[target][0]
        if engine.backend == "vllm":
            svc._iteration.weight_sync = weight_sync.sync_engine(svc, self.name, handle, senders)
        else:
            weight_sync.sync_rollout_model(svc, self.name, handle, senders)
        svc._synced[target] = svc._versions[source]
