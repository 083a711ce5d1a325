"""A colocated PPO recipe: read it top to bottom, copy it, edit it.

One iteration runs five phases. Each phase onloads only what it needs and offloads it when done,
so the device holds one phase's models at a time:

===============  ==========================  ==========================================
phase            actors (parts onloaded)     work
===============  ==========================  ==========================================
generate         rollout (weights)           sync policy -> rollout, sample, log-probs
reference        reference (weights)         reference log-probs (KL penalty)
values           critic (weights)            values of every prefix
train_critic     critic (everything)         value-loss steps
train_policy     policy (everything)         clipped policy-loss steps
===============  ==========================  ==========================================

The weight sync reads the policy's weights from its host store (the policy is asleep since its
last train phase) and sends them to the rollout actor, which is awake for generation anyway.

Math (per response token ``t``; ``P`` prompt tokens, ``R`` response tokens):
``reward_t = -kl_coef * (logp_old_t - logp_ref_t) + [t == last] * task_score``; advantages by
GAE(gamma, lam) over the critic's values, whitened; policy loss
``-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)``; value loss: clipped squared error to the
returns.
"""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from chatlearn_mem import Part
from chatlearn_mem_ray.checkpoints import (RunCheckpointer, check_checkpoint_dir, check_room, config_differences,
                                           latest_run_checkpoint, list_run_checkpoints, newest_intact_run_checkpoint,
                                           remove_temporaries, write_json_atomic)
from chatlearn_mem_ray.connect import Colocation, _wants_gpu
from chatlearn_mem_ray.nodes import software_versions
from chatlearn_mem_ray.config import RunConfig, TaskConfig
from chatlearn_mem_ray.errors import (ActorFailedError, AuditFailedError, BudgetError, CheckpointDirError,
                                      NonFiniteLossError, OutputDirError, PhaseTimeoutError, ResourceError, ResumeError,
                                      RunInterrupted,
                                      RunTerminated,
                                      WeightSyncError)
from chatlearn_mem_ray.residency import PHASES, BoundaryPlan, ResidencySchedule, bundle_of, estimate_sizes
from chatlearn_mem_ray.timeline import MemoryTimeline, plot_timeline

__all__ = ["PPORun", "TASKS", "check_finite", "gae", "policy_loss", "prepare_output_dir", "run_ppo",
           "token_range_reward", "value_loss", "weight_sync_mismatch", "write_json_atomic"]


# -- the task ------------------------------------------------------------------------------
def token_range_reward(responses: torch.Tensor, task: TaskConfig) -> torch.Tensor:
    """Fraction of response tokens (B, R) with ids in ``[target_low, target_high)``: (B,) in [0, 1]."""
    hit = (responses >= task.target_low) & (responses < task.target_high)
    return hit.float().mean(dim=1)


TASKS: dict[str, Callable[[torch.Tensor, TaskConfig], torch.Tensor]] = {"token_range": token_range_reward}


# -- the math ------------------------------------------------------------------------------
def gae(rewards: torch.Tensor, values: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns for (B, R) rewards and values (episode ends at R)."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_value = values[:, t + 1] if t + 1 < rewards.shape[1] else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def policy_loss(logprobs: torch.Tensor, mb: dict, *, prompt_length: int, clip_ratio: float):
    """Clipped PPO objective on the response tokens. ``logprobs`` (b, T-1) from the policy."""
    new = logprobs[:, prompt_length - 1:]  # (b, R): log p of each response token
    ratio = torch.exp(new - mb["old_logprobs"])
    adv = mb["advantages"]
    loss = -torch.min(ratio * adv, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * adv).mean()
    with torch.no_grad():
        metrics = {"clip_fraction": ((ratio - 1).abs() > clip_ratio).float().mean().item(),
                   "approx_kl": (mb["old_logprobs"] - new).mean().item()}
    return loss, metrics


def value_loss(values: torch.Tensor, mb: dict, *, prompt_length: int, value_clip: float):
    """Clipped value regression on the response tokens. ``values`` (b, T) from the critic."""
    v = values[:, prompt_length - 1:-1]  # (b, R): value before each response token
    old = mb["old_values"]
    clipped = old + (v - old).clamp(-value_clip, value_clip)
    loss = 0.5 * torch.max((v - mb["returns"]) ** 2, (clipped - mb["returns"]) ** 2).mean()
    return loss, {"value_mean": v.mean().item()}


def weight_sync_mismatch(policy_digests: list[str], rollout_digests: list[str]) -> Optional[str]:
    """None when the rollout's weights equal the policy's shard for shard, else what differs."""
    bad = [i for i, (a, b) in enumerate(zip(policy_digests, rollout_digests)) if a != b]
    if len(policy_digests) != len(rollout_digests) or bad:
        return f"tensor-parallel shard(s) {bad or 'count'} differ after the weight sync"
    return None


def check_finite(iteration: int, phase: str, metrics: dict) -> None:
    """Stop the run when a phase's loss (or any other metric) is NaN or infinite.

    Raises:
        NonFiniteLossError: Naming the iteration, the phase and the values.
    """
    bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
    if bad:
        raise NonFiniteLossError(iteration, phase, bad)


# -- the loop ------------------------------------------------------------------------------
class PPORun:
    """A PPO run on a :class:`Colocation`; :meth:`iteration` runs the five phases once.

    Args:
        cfg: The run config.
        colo: The actors, set up.
        progress: Called with one line per iteration.
    """

    def __init__(self, cfg: RunConfig, colo: Colocation, progress: Callable[[str], None] = print,
                 on_phase: Optional[Callable[["PPORun", int, str], None]] = None):
        self.cfg, self.colo, self.progress, self.on_phase = cfg, colo, progress, on_phase
        self.checkpointer = None  # a RunCheckpointer when the run saves checkpoints
        self.where: tuple[Optional[int], str] = (None, "setup")  # (iteration, phase) now running
        self.timeline = MemoryTimeline()
        self.iterations: list[dict] = []
        self.sync_checks: list[dict] = []
        self.audits = {"runs": 0, "checks_clean": 0}
        self.manager_on = cfg.memory.enabled
        self.schedule: Optional[ResidencySchedule] = None  # with memory.device_budget_mb: see plan_memory()
        self.over_budget: list[dict] = []  # phases measured above their device's budget
        self.prefetch = cfg.memory.prefetch  # with a residency plan: non-blocking transitions, prefetch
        self._unsettled: set = set()  # actors with non-blocking transitions not yet waited for
        p = cfg.parallel
        self.tp = p.tensor_model_parallel_size
        self.dp = p.data_parallel_size
        ppo = cfg.ppo
        self._policy_loss = functools.partial(policy_loss, prompt_length=ppo.prompt_length,
                                              clip_ratio=ppo.clip_ratio)
        self._value_loss = functools.partial(value_loss, prompt_length=ppo.prompt_length,
                                             value_clip=ppo.value_clip)

    # -- checkpoints ----------------------------------------------------------------------
    def state(self) -> dict:
        """What a run checkpoint keeps of the driver: the config, the log and the memory timeline so far."""
        state = {"config": json.loads(self.cfg.model_dump_json()), "iterations": self.iterations,
                 "memory_timeline": self.timeline.to_json(), "sync_checks": self.sync_checks, "audits": self.audits}
        return json.loads(json.dumps(state))  # a copy: the run goes on while a save is open

    def restore(self, path: Path, state: dict) -> None:
        """Continue the run a checkpoint saved: load every trainer rank's state from ``path`` and
        take the driver's state (``run.json``) over; then :meth:`next_iteration` is where it left off.
        The driver verified the files against their manifests when it chose ``path``
        (:func:`~chatlearn_mem_ray.checkpoints.newest_intact_run_checkpoint`): the ranks do not read
        them twice."""
        c = self.colo
        self.where = (None, "resume")
        step = f"step_{state['iterations_done']:08d}"
        c.call("resume", {a: a.load_checkpoint.remote(str(Path(path) / role / step), verify=False)
                          for role in ("policy", "critic") for a in getattr(c, role)})
        self.iterations = [dict(m) for m in state["iterations"]]
        self.timeline = MemoryTimeline.from_json(state["memory_timeline"])
        self.sync_checks = list(state["sync_checks"])
        self.audits = dict(state["audits"])

    @property
    def next_iteration(self) -> int:
        return len(self.iterations)

    def final_weights(self) -> dict[str, str]:
        """SHA-256 of every trainer rank's weights (read from the host store when asleep)."""
        c = self.colo
        return {c.names[a]: d for a, d in c.call("final", {a: a.weights_digest.remote()
                                                           for a in [*c.policy, *c.critic]}).items()}

    # -- memory ---------------------------------------------------------------------------
    def sleep_all(self) -> None:
        """Offload every model (after setup, before the first phase)."""
        c = self.colo
        c.call("sleep", {a: a.offload.remote() for a in c.all_actors})
        if self.schedule is not None:
            self.schedule.clear()

    def plan_memory(self) -> Optional[ResidencySchedule]:
        """With ``memory.device_budget_mb``: measure every model's parts and plan what each device
        keeps resident in each phase (call with every model asleep: ``auto`` reads the free memory).

        Raises:
            BudgetError: A phase alone needs more than the budget (or ``auto`` without a GPU).
        """
        mem, c = self.cfg.memory, self.colo
        if mem.device_budget_mb is None or not self.manager_on:
            return None
        sizes = {c.names[a]: s for a, s in c.call("plan", {a: a.part_sizes.remote() for a in c.all_actors}).items()}
        sizes = {n: {Part(p): b for p, b in s.items()} for n, s in sizes.items()}
        if mem.device_budget_mb == "auto":
            if not c.use_gpu:
                raise BudgetError("memory.device_budget_mb=auto reads the free memory of each GPU, and this run "
                                  "has none; give the budget in MiB, or null (all or nothing)")
            one = {bundle_of(c.names[a]): a for a in reversed(c.policy)}  # one actor per device
            free = c.call("plan", {a: a.device_free_bytes.remote() for a in one.values()})
            margin = int(mem.device_budget_margin_mb * 2**20)
            budget = {b: max(0, free[a] - margin) for b, a in one.items()}
        else:
            budget = int(mem.device_budget_mb * 2**20)
        try:
            self.schedule = ResidencySchedule(sizes, budget)
        except ValueError as e:
            raise BudgetError(str(e)) from None
        return self.schedule

    def wake_all(self) -> None:
        """Onload every model and keep it resident: the run continues with the manager off."""
        c = self.colo
        c.call("wake", {a: a.onload.remote() for a in c.all_actors})
        self.manager_on = False

    def _audit(self, name: str, actors) -> None:
        c = self.colo
        for a, problems in c.call(name, {a: a.audit.remote() for a in actors}).items():
            self.audits["runs"] += 1
            if problems:
                raise AuditFailedError(f"audit of {c.names[a]} after onload in phase {name!r} "
                                       f"found {len(problems)} problem(s): {problems[:5]}")
            self.audits["checks_clean"] += 1

    def _phase(self, iteration: int, name: str, needs: dict[Any, tuple[str, ...]], work: Callable[[], Any]):
        """Onload what ``needs`` names, do ``work``, record everyone's residency, offload."""
        c = self.colo
        self.where = (iteration, name)
        if self.on_phase is not None:
            self.on_phase(self, iteration, name)
        if self.schedule is not None and self.manager_on:
            return self._planned_phase(iteration, name, needs, work)
        t0 = time.perf_counter()
        moved = []
        if self.manager_on:
            moved += [s for stats in c.call(name, {a: a.onload.remote(parts) for a, parts in needs.items()}).values()
                      for s in stats]
        t_in = time.perf_counter() - t0
        if self.manager_on and self.cfg.memory.audit:
            self._audit(name, needs)
        result = work()
        residency = c.call(name, {a: a.residency.remote() for a in c.all_actors})
        t1 = time.perf_counter()
        if self.manager_on:
            moved += [s for stats in c.call(name, {a: a.offload.remote(parts) for a, parts in needs.items()}).values()
                      for s in stats]
        seconds = time.perf_counter() - t0
        self.timeline.add(iteration, name, self.manager_on, seconds,
                          {c.names[a]: parts for a, parts in needs.items()},
                          {c.names[a]: r for a, r in residency.items()},
                          moved=moved, transition_seconds=t_in + time.perf_counter() - t1)
        return result

    def _moves(self, name: str, moves: dict[str, tuple[Part, ...]], direction: str, blocking: bool) -> list[dict]:
        """Offload or onload ``moves`` (actor name -> parts) on every actor at once; the stats of
        blocking calls (non-blocking ones report through ``settle``)."""
        if not moves:
            return []
        c = self.colo
        by_name = {c.names[a]: a for a in c.all_actors}
        refs = {by_name[n]: getattr(by_name[n], direction).remote(list(parts), blocking)
                for n, parts in moves.items()}
        if not blocking:
            self._unsettled.update(refs)
        return [s for stats in c.call(name, refs).values() for s in stats]

    def _planned_phase(self, iteration: int, name: str, needs: dict[Any, tuple[str, ...]], work: Callable[[], Any]):
        """A phase under the residency plan (``memory.device_budget_mb``): at the boundary the
        plan's out-moves (first, and waited for, only when the device needs their room), then its
        in-moves; the next phase's in-moves start now when they fit beside this phase's models
        (prefetch); the work; then every transition still running is waited for and the residency
        recorded. With ``memory.prefetch`` the transitions are non-blocking: a forward pass waits
        per module for its weights, a training step for the parts it touches."""
        c, s = self.colo, self.schedule
        phase = PHASES.index(name)
        nb = self.prefetch
        t0 = time.perf_counter()
        moves = s.boundary(phase)
        moved = []
        if moves.out and not s.fits(s.resident | s.target(phase)):  # their room is needed first
            moved += self._moves(name, moves.out, "offload", blocking=True)
            s.moved(BoundaryPlan(moves.out, {}))
            moves = BoundaryPlan({}, moves.into)
        moved += self._moves(name, moves.into, "onload", blocking=not nb)
        moved += self._moves(name, moves.out, "offload", blocking=not nb)  # behind this phase
        s.moved(moves)
        if nb:  # the next phase's in-moves, when they fit beside what is resident now
            ahead = s.boundary((phase + 1) % len(PHASES)).into
            items = {(a, p) for a, parts in ahead.items() for p in parts}
            if ahead and s.fits(s.resident | items):
                self._moves(name, ahead, "onload", blocking=False)
                s.moved(BoundaryPlan({}, ahead))
        t_before = time.perf_counter() - t0
        result = work()
        t1 = time.perf_counter()
        waits = c.call(name, {a: a.settle.remote() for a in self._unsettled})
        self._unsettled.clear()
        moved += [x for w in waits.values() for x in w["stats"]]
        t_settle = time.perf_counter() - t1
        if self.cfg.memory.audit:
            self._audit(name, needs)
        residency = c.call(name, {a: a.residency.remote() for a in c.all_actors})
        self.timeline.add(iteration, name, True, time.perf_counter() - t0,
                          {c.names[a]: parts for a, parts in needs.items()},
                          {c.names[a]: r for a, r in residency.items()},
                          moved=moved, transition_seconds=t_before + t_settle,
                          budget_bytes=s.budget, kept=s.kept(phase))
        over = {b: n for b, n in self.timeline.records[-1].bundle_bytes.items() if n > s.budget[int(b)]}
        if over:  # never silently: a measured phase above its device's budget is said and logged
            self.over_budget.append({"iteration": iteration, "phase": name, "device_bytes": over})
            self.progress(f"warning: {name} of iteration {iteration} held " + ", ".join(
                f"{n / 2**20:.2f} MiB on device {b}" for b, n in over.items()) + " (the budget is "
                f"{max(s.budget.values()) / 2**20:.2f} MiB); a model grew past what was measured")
        sizes = {c.names[a]: {Part(p): b for p, b in r["resident_by_part"].items()} for a, r in residency.items()}
        if s.update_sizes(sizes):
            self.progress(f"re-planned the device memory after {name} of iteration {iteration}: a model's "
                          "parts changed size")
        return result

    def _by_dp_rank(self, group: list) -> list[list]:
        """Actors of a trainer grouped by data-parallel rank."""
        out: list[list] = [[] for _ in range(self.dp)]
        for a in group:
            out[self.colo.ranks[self.colo.names[a]]["dp_rank"]].append(a)
        return out

    def _shard(self, batch: dict, dp_rank: int) -> dict:
        n = next(iter(batch.values())).shape[0] // self.dp
        return {k: v[dp_rank * n:(dp_rank + 1) * n] for k, v in batch.items()}

    def _first_tp_outputs(self, group: list, results: dict) -> torch.Tensor:
        """Concatenate the outputs of tensor-parallel rank 0 of every data-parallel rank."""
        return torch.cat([results[ranks[0]] for ranks in self._by_dp_rank(group)], dim=0)

    # -- phases ---------------------------------------------------------------------------
    def _sync_and_generate(self, iteration: int, prompts: torch.Tensor):
        c, ppo = self.colo, self.cfg.ppo
        senders = self._by_dp_rank(c.policy)[0]  # tensor-parallel ranks of data-parallel rank 0
        verify = self.cfg.memory.verify_sync
        triples = [a.weights_for_sync.options(num_returns=3).remote(verify) for a in senders]
        # Waiting on the small refs finds a dead sender by name; the states go actor to actor.
        dims = c.call("generate", {senders[0]: triples[0][1]})[senders[0]]
        digests = c.call("generate", {a: digest_ref for a, (_, _, digest_ref) in zip(senders, triples)})
        rollout_digests = c.call("generate", {c.rollout: c.rollout.load_weights.remote(
            dims, *[state_ref for state_ref, _, _ in triples])})[c.rollout]
        if verify:
            policy_digests = [digests[a] for a in senders]  # tensor-parallel rank order, as the shards
            mismatch = weight_sync_mismatch(policy_digests, rollout_digests)
            self.sync_checks.append({"iteration": iteration, "equal": mismatch is None,
                                     "policy": policy_digests, "rollout": rollout_digests})
            if mismatch:
                raise WeightSyncError(f"iteration {iteration}: {mismatch}")
        seed = ppo.seed * 1_000_003 + iteration
        return c.call("generate", {c.rollout: c.rollout.generate.remote(
            prompts, ppo.response_length, ppo.temperature, seed)})[c.rollout]

    def _critic_values(self, tokens: torch.Tensor) -> torch.Tensor:
        c = self.colo
        results = c.call("values", {a: a.forward.remote(self._shard({"t": tokens}, c.ranks[c.names[a]]["dp_rank"])["t"])
                                    for a in c.critic})
        return self._first_tp_outputs(c.critic, results)

    def _train(self, phase: str, group: list, batch: dict, loss_fn: Callable, iteration: int) -> dict:
        c, ppo = self.colo, self.cfg.ppo
        results = c.call(phase, {a: a.train.remote(self._shard(batch, c.ranks[c.names[a]]["dp_rank"]), loss_fn,
                                                   ppo.ppo_epochs, ppo.minibatch_size, ppo.seed + iteration,
                                                   ppo.temperature)
                                 for a in group})
        firsts = [ranks[0] for ranks in self._by_dp_rank(group)]
        return {k: sum(results[a][k] for a in firsts) / len(firsts) for k in results[firsts[0]]}

    def iteration(self, iteration: int) -> dict:
        """Run one PPO iteration; return (and keep) its metrics."""
        c, cfg, ppo = self.colo, self.cfg, self.cfg.ppo
        P = ppo.prompt_length
        t_start = time.perf_counter()
        g = torch.Generator().manual_seed(ppo.seed * 7919 + iteration)
        prompts = torch.randint(0, cfg.policy.vocab_size, (ppo.prompts_per_iteration, P), generator=g)

        tokens, old_logprobs = self._phase(iteration, "generate", {c.rollout: (Part.WEIGHTS,)},
                                           lambda: self._sync_and_generate(iteration, prompts))
        ref_logprobs = self._phase(iteration, "reference", {c.reference: (Part.WEIGHTS,)},
                                   lambda: c.call("reference", {c.reference: c.reference.logprobs.remote(
                                       tokens, ppo.temperature)})[c.reference])
        values = self._phase(iteration, "values", {a: (Part.WEIGHTS,) for a in c.critic},
                             lambda: self._critic_values(tokens))

        old = old_logprobs[:, P - 1:]  # (B, R)
        kl = old - ref_logprobs[:, P - 1:]  # (B, R) per-token KL estimate
        score = TASKS[cfg.task.name](tokens[:, P:], cfg.task)  # (B,)
        rewards = -ppo.kl_coef * kl
        rewards[:, -1] += score
        old_values = values[:, P - 1:-1]  # (B, R)
        advantages, returns = gae(rewards, old_values, ppo.gamma, ppo.lam)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

        checkpoint_wait = 0.0
        if self.checkpointer is not None:  # the trainers are about to change: commit the open save
            self.where = (iteration, "checkpoint")
            checkpoint_wait = self.checkpointer.complete()
        critic = self._phase(iteration, "train_critic", {a: tuple(Part) for a in c.critic},
                             lambda: self._train("train_critic", c.critic, {
                                 "tokens": tokens, "old_values": old_values, "returns": returns},
                                 self._value_loss, iteration))
        check_finite(iteration, "train_critic", critic)
        policy = self._phase(iteration, "train_policy", {a: tuple(Part) for a in c.policy},
                             lambda: self._train("train_policy", c.policy, {
                                 "tokens": tokens, "old_logprobs": old, "advantages": advantages},
                                 self._policy_loss, iteration))
        check_finite(iteration, "train_policy", policy)

        phases = [r for r in self.timeline.records if r.iteration == iteration and r.manager_on == self.manager_on]
        out = {"iteration": iteration, "manager_on": self.manager_on, "reward": score.mean().item(),
               "kl": kl.mean().item(), "policy_loss": policy["loss"], "value_loss": critic["loss"],
               "clip_fraction": policy["clip_fraction"], "approx_kl": policy["approx_kl"],
               "policy_grad_norm": policy["grad_norm"], "seconds": time.perf_counter() - t_start,
               "checkpoint_seconds": checkpoint_wait,
               "phase_seconds": {r.phase: r.seconds for r in phases},
               "phase_colocated_bytes": {r.phase: r.colocated_bytes for r in phases},
               "moved_in_bytes": sum(r.moved_in_bytes for r in phases),
               "moved_out_bytes": sum(r.moved_out_bytes for r in phases),
               "transition_seconds": sum(r.transition_seconds for r in phases),
               "peak_device_bytes": {b: max(r.bundle_bytes.get(b, 0) for r in phases)
                                     for b in (phases[0].bundle_bytes if phases else {})}}
        if self.schedule is not None and self.manager_on:
            out["budget_bytes"] = {str(b): v for b, v in self.schedule.budget.items()}
        self.iterations.append(out)
        return out


def _progress_line(m: dict, total: int) -> str:
    phases = " ".join(f"{name} {m['phase_seconds'][name]:.2f}s/{m['phase_colocated_bytes'][name] / 2**20:.1f}MiB"
                      for name in m["phase_seconds"])
    mode = "" if m["manager_on"] else " [manager off]"
    return (f"iter {m['iteration'] + 1:>3}/{total}{mode} reward {m['reward']:.3f} "
            f"pg {m['policy_loss']:+.4f} vf {m['value_loss']:.4f} kl {m['kl']:+.4f} | {phases}")


def _versions() -> dict:
    of = software_versions()  # read without importing (megatron takes seconds)
    return {"torch": torch.__version__, "megatron-core": of["megatron-core"], "ray": of["ray"],
            "python": platform.python_version(), "machine": platform.machine(), "node": platform.node(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def prepare_output_dir(cfg: RunConfig, resuming: bool = False) -> Path:
    """Check ``cfg.output_dir`` before anything starts; return the path of its ``log.json``.

    Creates the directory and writes a first ``log.json`` (status ``starting``, no iterations):
    the write itself proves the directory writable. With ``output_dir_exists=error`` (the
    default) a ``log.json`` that holds iterations of another run, or that a live run on this
    machine is writing, stops the run instead; a log with no iterations (a run that failed
    to start) is replaced. With ``overwrite`` the old log and picture are replaced. With
    ``resuming`` the old log is the one the run continues (only a live writer stops it).

    Raises:
        OutputDirError: The directory cannot be created or written, or holds another run's results.
    """
    out = Path(cfg.output_dir)
    log_path = out / "log.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputDirError(f"cannot create output_dir {out}: {e.strerror or e}; choose another output_dir") from None
    if log_path.exists() and (cfg.output_dir_exists == "error" or resuming):
        try:
            old = json.loads(log_path.read_text())
            done, status = len(old["iterations"]), old.get("status", "completed")
            pid, node = old.get("pid"), old.get("versions", {}).get("node")
        except (OSError, ValueError, KeyError, TypeError) as e:
            if resuming:
                old, done, status, pid, node = {}, 0, "unreadable", None, None
            else:
                raise OutputDirError(f"output_dir {out} holds a log.json that is not a PPO run's log "
                                     f"({type(e).__name__}); choose another output_dir or set "
                                     "output_dir_exists=overwrite") from None
        if status in ("starting", "running") and pid and node == platform.node() and _pid_alive(pid):
            raise OutputDirError(f"another run (pid {pid}) is writing to output_dir {out}; choose another output_dir")
        if done and not resuming:
            resumable = ", resume it (--resume)" if latest_run_checkpoint(cfg.checkpoint_dir) else ""
            raise OutputDirError(f"output_dir {out} already holds the log of another run ({done} iteration(s), "
                                 f"{status}); choose another output_dir{resumable}, or set "
                                 "output_dir_exists=overwrite to replace it")
    try:
        write_json_atomic(log_path, {"status": "starting", "pid": os.getpid(), "versions": {"node": platform.node()},
                                     "config": json.loads(cfg.model_dump_json()), "iterations": []})
    except OSError as e:
        raise OutputDirError(f"cannot write {log_path}: {e.strerror or e}; choose a writable output_dir") from None
    (out / "memory_timeline.png").unlink(missing_ok=True)  # another run's picture must not pass for this one's
    return log_path


def find_resume_point(cfg: RunConfig, progress: Callable[[str], None] = print) -> Optional[tuple[Path, dict]]:
    """Where ``cfg.checkpoint.resume`` says the run continues from: ``(checkpoint, its run.json)``,
    or None for a fresh start. Checked before anything starts.

    Raises:
        ResumeError: ``resume=true`` and no complete checkpoint; or the config's model differs from
            the checkpoint's (each difference named).
    """
    mode, root = cfg.checkpoint.resume, cfg.checkpoint_dir
    if mode is False:
        return None
    intact = newest_intact_run_checkpoint(root, progress)
    if intact is None:
        if mode == "auto":
            progress(f"checkpoint.resume=auto: no complete checkpoint in {root}; starting from the beginning")
            return None
        raise ResumeError(f"nothing to resume: no complete checkpoint in {root}. Run without --resume (or with "
                          "checkpoint.resume=auto) to start from the beginning, or point checkpoint.directory "
                          "at the run's checkpoints")
    newest, state = intact
    blocking, changed = config_differences(state["config"], cfg)
    if blocking:
        raise ResumeError(f"cannot resume from {newest}: the config's model differs from the checkpoint's: "
                          + "; ".join(blocking) + ". Resume with the checkpoint's model settings, or start a new "
                          "run in another output_dir / checkpoint.directory")
    if changed:
        resharded = any(line.startswith("parallel.") for line in changed)
        progress("resuming with settings that differ from the checkpoint's: " + "; ".join(changed)
                 + ("; megatron reshards the trainers to the new split, whose RNG states start afresh (the "
                    "result is not bit-identical to the run continued on its own split)" if resharded else ""))
    return newest, state


def check_budget(cfg: RunConfig) -> None:
    """Before Ray starts: a ``memory.device_budget_mb`` below what one phase needs, estimated from
    the config (:func:`chatlearn_mem_ray.residency.estimate_sizes`), stops the run here. The plan
    made once the models are measured checks again, exactly.

    Raises:
        BudgetError: Naming the phase, its bytes and the budget.
    """
    budget = cfg.memory.device_budget_mb
    if budget is None or budget == "auto" or not cfg.memory.enabled:
        return
    try:
        ResidencySchedule(estimate_sizes(cfg), int(budget * 2**20))
    except ValueError as e:
        raise BudgetError(f"{e} (estimated from the config, before starting)") from None


def _prepare_checkpoints(cfg: RunConfig, resume: Optional[tuple[Path, dict]], progress: Callable[[str], None]) -> None:
    """Before Ray starts: the checkpoint directory is writable, and holds no other run's checkpoints."""
    root = cfg.checkpoint_dir
    if cfg.checkpoint.every == 0 and resume is None:
        return
    check_checkpoint_dir(root)
    for name in remove_temporaries(root):
        progress(f"removed {root / name}: a checkpoint save that never completed")
    if resume is None:
        earlier = list_run_checkpoints(root)
        if earlier and cfg.output_dir_exists == "error":
            raise CheckpointDirError(f"checkpoint.directory {root} holds checkpoints of an earlier run (newest: "
                                     f"{earlier[-1][1].name}); resume it (--resume or checkpoint.resume=auto), "
                                     "choose another checkpoint.directory, or set output_dir_exists=overwrite to "
                                     "delete them")
        for _, path in earlier:
            shutil.rmtree(path)
        if earlier:
            progress(f"deleted {len(earlier)} checkpoint(s) of an earlier run from {root} (output_dir_exists=overwrite)")


def _log(cfg: RunConfig, run: Optional[PPORun], versions: dict, status: str, seconds: float,
         error: Optional[str] = None, extra: Optional[dict] = None) -> dict:
    timeline = run.timeline if run is not None else MemoryTimeline()
    return {"status": status, "error": error, "pid": os.getpid(),
            "config": json.loads(cfg.model_dump_json()), "versions": versions,
            "iterations": run.iterations if run is not None else [], "memory_timeline": timeline.to_json(),
            "sync_checks": run.sync_checks if run is not None else [],
            "audits": run.audits if run is not None else {"runs": 0, "checks_clean": 0},
            "over_budget": run.over_budget if run is not None else [],
            "summary": {"memory_manager_on": timeline.summary(True), "memory_manager_off": timeline.summary(False),
                        "seconds": seconds}, **(extra or {})}


class _Terminate(BaseException):
    """Raised by the driver at a safe point once SIGTERM arrived (a BaseException: no ``except
    Exception`` on the way turns it into a failure)."""


class _SigtermWatch:
    """The driver's own SIGTERM handler for the length of a run, in place of Ray's (whose core
    worker installs one that prints a crash dump). The first SIGTERM only notes the time: the run
    stops at the end of the iteration. A second one stops it at once, as Ctrl-C does."""

    _UNSET = object()

    def __init__(self, progress: Callable[[str], None]):
        self.at: Optional[float] = None
        self.note = ""
        self._progress, self._previous = progress, self._UNSET

    def install(self) -> None:
        """Take SIGTERM (again after ``ray.init``); only the main thread can."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.signal(signal.SIGTERM, self._handle)
        if self._previous is self._UNSET:
            self._previous = previous

    def restore(self) -> None:
        if self._previous is not self._UNSET:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._previous = self._UNSET

    def _handle(self, signum, frame) -> None:
        if self.at is not None:
            raise _Terminate()
        self.at = time.monotonic()
        self._progress("SIGTERM received: the run stops once this iteration ends (a second SIGTERM stops it now)")


def _sigterm_checkpoint(cfg: RunConfig, run: "PPORun", record: dict, done: int, term: _SigtermWatch) -> str:
    """At the safe point after SIGTERM: make the newest checkpoint hold the ``done`` iterations
    when ``checkpoint.on_sigterm`` and the time left allow it; returns what was done, for the line."""
    ck = cfg.checkpoint
    if not ck.every or run.checkpointer is None:
        return "checkpoints are off (checkpoint.every=0)" if not ck.every else "the comparison iterations are not saved"
    run.checkpointer.complete()
    if record["checkpoints"] and record["checkpoints"][-1]["iterations_done"] == done:
        return f"it holds all {done} iterations"
    if not ck.on_sigterm:
        return "checkpoint.on_sigterm=false: no checkpoint saved on SIGTERM"
    last = record["checkpoints"][-1]["seconds"] if record["checkpoints"] else None
    left = ck.sigterm_grace_s - (time.monotonic() - term.at)
    if last is not None and last > left:
        return (f"no time to save the last iterations: the previous save took {last:.1f}s and "
                f"{max(0.0, left):.1f}s of checkpoint.sigterm_grace_s={ck.sigterm_grace_s:g} are left")
    run.where = (done - 1, "checkpoint")
    state = dict(run.state(), restarts=list(record["restarts"]), checkpoints=list(record["checkpoints"]))
    run.checkpointer.save(done, state)
    run.checkpointer.complete()
    return f"saved on SIGTERM, it holds all {done} iterations"


def _cluster_resources() -> dict:
    """CPUs and GPUs of the live nodes of the cluster this driver is connected to."""
    import ray

    return ray.cluster_resources()


def _elastic_config(cfg: RunConfig, error: BaseException, progress: Callable[[str], None]) -> RunConfig:
    """``cfg`` with the largest data-parallel size the live nodes hold (``checkpoint.elastic``), said
    in one line; re-raises ``error`` when no smaller layout fits or validates."""
    total = _cluster_resources()
    p, per = cfg.parallel, cfg.ray.cpus_per_rank
    fit = int(total.get("CPU", 0) // per)
    if _wants_gpu(cfg, total.get("GPU", 0)):
        fit = min(fit, int(total.get("GPU", 0)))
    ranks = fit // p.tensor_model_parallel_size * p.tensor_model_parallel_size
    if ranks < p.tensor_model_parallel_size or ranks >= p.world_size:
        raise error
    data = json.loads(cfg.model_dump_json())
    data["parallel"]["world_size"] = ranks
    try:
        smaller = RunConfig.model_validate(data)
    except ValueError as e:
        raise ResourceError(f"{error}; checkpoint.elastic cannot go on with {ranks} rank(s): {e}") from None
    progress(f"checkpoint.elastic: the cluster holds {ranks} of {p.world_size} rank(s) after waiting "
             f"ray.node_wait_s={cfg.ray.node_wait_s:g} s; going on with data-parallel size "
             f"{ranks // p.tensor_model_parallel_size} (was {p.data_parallel_size}), the checkpoint resharded to it. "
             "From here the results differ from those of the original layout")
    return smaller


def _restartable(e: BaseException) -> bool:
    """A lost actor process or a hung phase is worth a restart; an exception from code is not."""
    return isinstance(e, PhaseTimeoutError) or (isinstance(e, ActorFailedError) and e.died)


def _restart(cfg: RunConfig, error: BaseException, run: Optional[PPORun], record: dict, number: int,
             progress: Callable[[str], None]) -> Optional[tuple[Path, dict]]:
    """After an actor's death (or a hung phase): say what happened, record it, and return the
    checkpoint the run continues from (None: from the start)."""
    iteration, phase = run.where if run is not None else (None, "setup")
    done = len(run.iterations) if run is not None else 0
    intact = (newest_intact_run_checkpoint(cfg.checkpoint_dir, progress)
              if cfg.checkpoint.every or record["resumed_from"] else None)
    newest, state = intact if intact is not None else (None, None)
    back_to = state["iterations_done"] if state is not None else 0
    where = f" (in iteration {iteration + 1})" if iteration is not None else ""
    entry = {"number": number, "actor": getattr(error, "actor", None), "phase": phase,
             "iteration": iteration, "error": f"{type(error).__name__}: {error}", "iterations_done": done,
             "resumed_from": str(newest) if newest is not None else None, "iterations_redone": done - back_to,
             "at": time.time()}
    record["restarts"].append(entry)
    source = f"the checkpoint after iteration {back_to} ({newest})" if newest is not None else "the beginning"
    progress(f"restart {number} of {cfg.checkpoint.max_restarts}: {error}{where}; tearing every actor "
             f"down, starting them again and continuing from {source}: {done - back_to} completed "
             "iteration(s) lost and redone")
    return (newest, state) if newest is not None else None


def run_ppo(cfg: RunConfig, progress: Callable[[str], None] = print,
            on_iteration: Optional[Callable[[PPORun, int], None]] = None,
            on_phase: Optional[Callable[[PPORun, int, str], None]] = None,
            on_checkpoint: Optional[Callable[[Path], None]] = None) -> dict:
    """Run PPO as ``cfg`` says; write ``log.json`` and ``memory_timeline.png`` to ``cfg.output_dir``.

    ``output_dir`` (and the checkpoint directory) are checked before Ray starts. ``log.json`` is
    rewritten atomically after every iteration (``status``: ``running``), so a run that fails or
    is interrupted keeps every iteration it completed; at the end ``status`` is ``completed``,
    ``failed`` (with ``error``), ``interrupted`` (Ctrl-C) or ``terminated`` (SIGTERM).

    Checkpoints (the ``checkpoint`` section): every ``checkpoint.every`` iterations the trainers
    save their state from their host stores (see :mod:`chatlearn_mem_ray.checkpoints`);
    ``checkpoint.resume`` continues from the newest complete one (iteration counter, every
    trainer's state and RNG, the log and memory timeline so far). When an actor process dies or
    a phase times out, every actor is torn down, started again and the run continues from the
    newest checkpoint, up to ``checkpoint.max_restarts`` times; ``log.json`` lists each restart
    under ``restarts``.

    Args:
        progress: Receives one line per iteration, per checkpoint and per restart, and a summary.
        on_iteration: Called after each iteration with the run and the iteration index (tests use
            it to inspect or disturb the actors).
        on_phase: Called as each phase starts with the run, the iteration and the phase's name.
        on_checkpoint: Called with the temporary directory of each save before the trainers write.

    Returns:
        The log (also written as JSON): config, versions, iterations, memory timeline, summary,
        checkpoints, restarts and the final weights' SHA-256 per trainer rank.

    Raises:
        RunError: A subclass saying why the run stopped (the log is written first).
        RunInterrupted: Ctrl-C (a ``KeyboardInterrupt``), after the log was written and Ray shut down.
        RunTerminated: SIGTERM (a ``RunInterrupted``): the run stopped at the end of the iteration
            it was in, saved a checkpoint of it (``checkpoint.on_sigterm``), wrote the log
            (``status``: ``terminated``) and shut Ray down. Only when called from the main thread.
    """
    resume = find_resume_point(cfg, progress)
    check_budget(cfg)
    log_path = prepare_output_dir(cfg, resuming=resume is not None)
    _prepare_checkpoints(cfg, resume, progress)
    out_dir = log_path.parent
    t0 = time.perf_counter()
    versions = _versions()
    run: Optional[PPORun] = None
    ck = cfg.checkpoint
    total = cfg.ppo.iterations
    extra_its = cfg.memory.compare_iterations if cfg.memory.enabled else 0
    record: dict = {"resumed_from": None, "restarts": [], "checkpoints": [], "final_weights": {}, "nodes": {}}
    if resume is not None:
        record["resumed_from"] = {"checkpoint": str(resume[0]), "iterations_done": resume[1]["iterations_done"]}
        record["restarts"] = list(resume[1].get("restarts", []))  # those of the run it continues
        record["checkpoints"] = list(resume[1].get("checkpoints", []))

    def write(status: str, error: Optional[str] = None) -> dict:
        log = _log(cfg, run, versions, status, time.perf_counter() - t0, error, record)
        write_json_atomic(log_path, log)
        return log

    term = _SigtermWatch(progress)
    restarts_here = 0

    def attempt() -> None:
        nonlocal run
        t_start = time.perf_counter()
        with Colocation(cfg, progress, wait_s=cfg.ray.node_wait_s if restarts_here else 0.0) as colo:
            term.install()  # after ray.init, whose core worker installed its own handler
            record["nodes"] = dict(colo.nodes)
            if ck.every or resume is not None:
                colo.check_shared_dir(cfg.checkpoint_dir)
            run = PPORun(cfg, colo, progress, on_phase)
            if resume is not None:
                run.restore(*resume)
                progress(f"resumed from {resume[0]}: {run.next_iteration} iteration(s) done")
            progress(f"{len(colo.all_actors)} actors ready on {cfg.parallel.world_size} bundle(s) "
                     f"({'GPU' if colo.use_gpu else 'CPU'}) in {time.perf_counter() - t_start:.1f}s; "
                     f"memory manager {'on' if cfg.memory.enabled else 'off'}")
            if ck.every:
                run.checkpointer = RunCheckpointer(cfg, colo, progress, saved=record["checkpoints"])
                nbytes = sum(colo.call("setup", {a: a.checkpoint_nbytes.remote(ck.resharding)
                                                 for a in [*colo.policy, *colo.critic]}).values())
                check_room(cfg.checkpoint_dir, nbytes, ck.keep_last)
            start = run.next_iteration
            if cfg.memory.enabled:
                run.sleep_all()
                schedule = run.plan_memory()
                if schedule is not None:
                    record["residency_plan"] = schedule.summary()
                    moved = {b: p["bytes_moved"] for b, p in record["residency_plan"].items()}
                    aon = {b: p["all_or_nothing_bytes"] for b, p in record["residency_plan"].items()}
                    progress(f"device budget {', '.join(f'{v / 2**20:.1f} MiB' for v in schedule.budget.values())}: "
                             f"the plan copies {sum(moved.values()) / 2**20:.2f} MiB per iteration "
                             f"(all or nothing: {sum(aon.values()) / 2**20:.2f} MiB)")
            for it in range(start, total + extra_its):
                if it == total:
                    if run.checkpointer is not None:
                        run.checkpointer.complete()
                        run.checkpointer = None  # the comparison iterations are not saved
                    progress(f"comparison: {extra_its} more iteration(s) with the memory manager off")
                    run.wake_all()
                m = run.iteration(it)
                if run.checkpointer is not None and ((it + 1) % ck.every == 0 or it + 1 == total):
                    run.where = (it, "checkpoint")
                    saved_so_far = {"restarts": list(record["restarts"]), "checkpoints": list(record["checkpoints"])}
                    waited = run.checkpointer.save(it + 1, dict(run.state(), **saved_so_far),
                                                   before_calls=on_checkpoint)
                    m["checkpoint_seconds"] += waited
                    m["seconds"] += waited
                write("running")
                progress(_progress_line(m, total + extra_its))
                if on_iteration is not None:
                    on_iteration(run, it)
                if term.at is not None and it + 1 < total + extra_its:  # the safe point after SIGTERM
                    term.note = _sigterm_checkpoint(cfg, run, record, it + 1, term)
                    raise _Terminate()
            if run.checkpointer is not None:
                run.checkpointer.complete()
            record["final_weights"] = run.final_weights()

    term.install()
    try:
        while True:
            try:
                attempt()
                break
            except BaseException as e:
                if isinstance(e, ResourceError) and restarts_here and ck.elastic:
                    smaller = _elastic_config(cfg, e, progress)
                    record["restarts"][-1]["world_size"] = smaller.parallel.world_size
                    cfg = smaller
                    continue
                if not _restartable(e):
                    raise
                if restarts_here >= ck.max_restarts:
                    if ck.max_restarts:
                        progress(f"no restarts left (checkpoint.max_restarts={ck.max_restarts}); the run stops")
                    raise
                restarts_here += 1
                resume = _restart(cfg, e, run, record, restarts_here, progress)
    except _Terminate:
        done = len(run.iterations) if run is not None else 0
        _write_quietly(write, progress, "terminated", "stopped by SIGTERM")
        newest = latest_run_checkpoint(cfg.checkpoint_dir) if ck.every else None
        raise RunTerminated(done, log_path, newest.name if newest is not None else None,
                            term.note or "stopped before the iteration ended") from None
    except KeyboardInterrupt:
        done = len(run.iterations) if run is not None else 0
        _write_quietly(write, progress, "interrupted", "stopped by Ctrl-C")
        raise RunInterrupted(done, log_path) from None
    except BaseException as e:
        done = len(run.iterations) if run is not None else 0
        if _write_quietly(write, progress, "failed", f"{type(e).__name__}: {e}") and done:
            progress(f"the run stopped; log of its {done} completed iteration(s): {log_path}")
        raise
    finally:
        term.restore()
    log = write("completed")
    nodes = sorted(set(record["nodes"].values()))
    plot_timeline(run.timeline, out_dir / "memory_timeline.png",
                  f"colocated PPO, {cfg.parallel.world_size} rank(s), {len(run.iterations)} iterations, "
                  f"{len(nodes)} node(s): {', '.join(nodes[:4])}{' ...' if len(nodes) > 4 else ''}")
    for key, s in log["summary"].items():
        if isinstance(s, dict):
            progress(f"{key.replace('_', ' ')}: peak colocated {s['peak_colocated_bytes'] / 2**20:.2f} MiB "
                     f"({s['peak_phase']}) / largest phase {s['largest_phase_bytes'] / 2**20:.2f} MiB "
                     f"({s['largest_phase']}) = {s['ratio']:.3f}")
    progress(f"wrote {log_path} and {out_dir / 'memory_timeline.png'}")
    return log


def _write_quietly(write: Callable, progress: Callable[[str], None], status: str, error: str) -> bool:
    """Write the final log of a stopped run; a failure to write must not hide why it stopped."""
    try:
        write(status, error)
        return True
    except Exception as e:  # a full disk, an unserialisable metric
        progress(f"warning: could not write the log ({type(e).__name__}: {e})")
        return False
