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

Running it as a job (Ray started, the iterations looped, the log written, checkpoints, resume,
restarts, SIGTERM) is :func:`chatlearn_mem_ray.supervisor.run_ppo`'s work, not the recipe's.
"""

from __future__ import annotations

import functools
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from chatlearn_mem import Part
from chatlearn_mem_ray import weight_sync
from chatlearn_mem_ray.config import RunConfig, TaskConfig
from chatlearn_mem_ray.errors import NonFiniteLossError
from chatlearn_mem_ray.phases import PhaseRunner
from chatlearn_mem_ray.schedule import ResidencySchedule
from chatlearn_mem_ray.timeline import MemoryTimeline

if TYPE_CHECKING:
    from chatlearn_mem_ray.colocation import Colocation

__all__ = [
    "PPORun",
    "TASKS",
    "check_finite",
    "gae",
    "policy_loss",
    "token_range_reward",
    "value_loss",
]


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
    new = logprobs[:, prompt_length - 1 :]  # (b, R): log p of each response token
    ratio = torch.exp(new - mb["old_logprobs"])
    adv = mb["advantages"]
    loss = -torch.min(ratio * adv, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * adv).mean()
    with torch.no_grad():
        metrics = {
            "clip_fraction": ((ratio - 1).abs() > clip_ratio).float().mean().item(),
            "approx_kl": (mb["old_logprobs"] - new).mean().item(),
        }
    return loss, metrics


def value_loss(values: torch.Tensor, mb: dict, *, prompt_length: int, value_clip: float):
    """Clipped value regression on the response tokens. ``values`` (b, T) from the critic."""
    v = values[:, prompt_length - 1 : -1]  # (b, R): value before each response token
    old = mb["old_values"]
    clipped = old + (v - old).clamp(-value_clip, value_clip)
    loss = 0.5 * torch.max((v - mb["returns"]) ** 2, (clipped - mb["returns"]) ** 2).mean()
    return loss, {"value_mean": v.mean().item()}


def check_finite(iteration: int, phase: str, metrics: dict, comparison: bool = False) -> None:
    """Stop the run when a phase's loss (or any other metric) is NaN or infinite.

    Args:
        iteration: The iteration's number (from 1, see :meth:`PPORun.number`).
        comparison: Whether it is a manager-off comparison iteration.

    Raises:
        NonFiniteLossError: Naming the iteration, the phase and the values.
    """
    bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
    if bad:
        raise NonFiniteLossError(iteration, phase, bad, comparison)


# -- the loop ------------------------------------------------------------------------------
class PPORun:
    """A PPO run on a :class:`Colocation`; :meth:`iteration` runs the five phases once.

    Two counts of an iteration: its *index* (from 0, in the order run: what seeds the prompts and
    the sampling, what :meth:`iteration` and the ``on_phase`` callback take) and its *number* (from
    1: what the console, ``log.json`` and the memory picture show, see :meth:`number`).

    Args:
        cfg: The run config.
        colo: The actors, set up.
        progress: Called with the warnings of a residency plan.
        on_phase: Called as each phase starts with the run, the iteration's index and the phase.
    """

    def __init__(
        self,
        cfg: RunConfig,
        colo: Colocation,
        progress: Callable[[str], None] = print,
        on_phase: Optional[Callable[["PPORun", int, str], None]] = None,
    ):
        self.cfg, self.colo, self.progress, self.on_phase = cfg, colo, progress, on_phase
        self.checkpointer = None  # a RunCheckpointer when the run saves checkpoints
        self.where: tuple[Optional[int], str] = (None, "setup")  # (iteration index, phase) now running
        self.phases = PhaseRunner(cfg, colo, progress)  # the memory each phase moves, and its record
        self.iterations: list[dict] = []
        self.sync_checks: list[dict] = []
        self.weight_sync: Optional[dict] = None  # the vLLM rollout's, for the iteration in progress
        self.manager_on = cfg.memory.enabled
        self._comparison_from: Optional[int] = None  # index of the first manager-off comparison iteration
        p = cfg.parallel
        self.tp = p.tensor_model_parallel_size
        self.dp = p.data_parallel_size
        ppo = cfg.ppo
        self._policy_loss = functools.partial(policy_loss, prompt_length=ppo.prompt_length, clip_ratio=ppo.clip_ratio)
        self._value_loss = functools.partial(value_loss, prompt_length=ppo.prompt_length, value_clip=ppo.value_clip)

    @property
    def timeline(self) -> MemoryTimeline:
        """Every phase's residency and transitions so far."""
        return self.phases.timeline

    @property
    def audits(self) -> dict:
        """``{"runs", "checks_clean"}``: the audits after each phase's onload."""
        return self.phases.audits

    @property
    def schedule(self) -> Optional[ResidencySchedule]:
        """With ``memory.device_budget_mb``: the residency plan (see :meth:`plan_memory`)."""
        return self.phases.schedule

    @property
    def over_budget(self) -> list[dict]:
        """Phases measured above their device's budget."""
        return self.phases.over_budget

    # -- checkpoints ----------------------------------------------------------------------
    def state(self) -> dict:
        """What a run checkpoint keeps of the driver: the config, the log and the memory timeline so far."""
        state = {
            "config": json.loads(self.cfg.model_dump_json()),
            "iterations": self.iterations,
            "memory_timeline": self.timeline.to_json(),
            "sync_checks": self.sync_checks,
            "audits": self.audits,
        }
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
        c.call(
            "resume",
            {
                a: a.load_checkpoint.remote(str(Path(path) / role / step), verify=False)
                for role in ("policy", "critic")
                for a in getattr(c, role)
            },
        )
        self.iterations = [dict(m) for m in state["iterations"]]
        self.phases.timeline = MemoryTimeline.from_json(state["memory_timeline"])
        self.sync_checks = list(state["sync_checks"])
        self.phases.audits = dict(state["audits"])

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

    def final_weights(self) -> dict[str, str]:
        """SHA-256 of every trainer rank's weights (read from the host store when asleep)."""
        c = self.colo
        return {
            c.names[a]: d
            for a, d in c.call("final", {a: a.weights_digest.remote() for a in [*c.policy, *c.critic]}).items()
        }

    # -- memory ---------------------------------------------------------------------------
    def sleep_all(self) -> None:
        """Offload every model (after setup, before the first phase)."""
        c = self.colo
        c.call("sleep", {a: a.offload.remote() for a in c.all_actors})
        if self.schedule is not None:
            self.schedule.clear()

    def plan_memory(self) -> Optional[ResidencySchedule]:
        """With ``memory.device_budget_mb`` and the manager on: :meth:`PhaseRunner.plan
        <chatlearn_mem_ray.phases.PhaseRunner.plan>` (call with every model asleep)."""
        return self.phases.plan() if self.manager_on else None

    def wake_all(self) -> None:
        """Onload every model and keep it resident: the run continues with the manager off, its
        iterations numbered as comparison iterations (:meth:`number`)."""
        c = self.colo
        c.call("wake", {a: a.onload.remote() for a in c.all_actors})
        self.manager_on = False
        self._comparison_from = self.next_iteration

    def _phase(self, index: int, name: str, needs: dict[Any, tuple[str, ...]], work: Callable[[], Any]):
        """Onload what ``needs`` names, do ``work``, record everyone's residency, offload
        (:meth:`chatlearn_mem_ray.phases.PhaseRunner.run`)."""
        self.where = (index, name)
        if self.on_phase is not None:
            self.on_phase(self, index, name)
        return self.phases.run(self.number(index)[0], name, needs, work, self.manager_on)

    def _by_dp_rank(self, group: list) -> list[list]:
        """Actors of a trainer grouped by data-parallel rank."""
        out: list[list] = [[] for _ in range(self.dp)]
        for a in group:
            out[self.colo.ranks[self.colo.names[a]]["dp_rank"]].append(a)
        return out

    def _shard(self, batch: dict, dp_rank: int) -> dict:
        n = next(iter(batch.values())).shape[0] // self.dp
        return {k: v[dp_rank * n : (dp_rank + 1) * n] for k, v in batch.items()}

    def _first_tp_outputs(self, group: list, results: dict) -> torch.Tensor:
        """Concatenate the outputs of tensor-parallel rank 0 of every data-parallel rank."""
        return torch.cat([results[ranks[0]] for ranks in self._by_dp_rank(group)], dim=0)

    # -- phases ---------------------------------------------------------------------------
    def _sync_and_generate(self, index: int, prompts: torch.Tensor):
        c, ppo = self.colo, self.cfg.ppo
        senders = self._by_dp_rank(c.policy)[0]  # tensor-parallel ranks of data-parallel rank 0
        if self.cfg.rollout.engine == "vllm":
            self.weight_sync = weight_sync.sync_engine(self, index, senders)
        else:
            weight_sync.sync_rollout_model(self, index, senders)
        seed = ppo.seed * 1_000_003 + index
        return c.call(
            "generate", {c.rollout: c.rollout.generate.remote(prompts, ppo.response_length, ppo.temperature, seed)}
        )[c.rollout]

    def forward_on(self, phase: str, group: list, tokens: torch.Tensor, *args) -> torch.Tensor:
        """``forward(tokens, *args)`` on every rank of ``group``, each data-parallel rank on its
        share of ``tokens``; the outputs of tensor-parallel rank 0, concatenated."""
        c = self.colo
        results = c.call(
            phase,
            {
                a: a.forward.remote(self._shard({"t": tokens}, c.ranks[c.names[a]]["dp_rank"])["t"], *args)
                for a in group
            },
        )
        return self._first_tp_outputs(group, results)

    def _critic_values(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward_on("values", self.colo.critic, tokens)

    def _train(self, phase: str, group: list, batch: dict, loss_fn: Callable, index: int) -> dict:
        c, ppo = self.colo, self.cfg.ppo
        results = c.call(
            phase,
            {
                a: a.train.remote(
                    self._shard(batch, c.ranks[c.names[a]]["dp_rank"]),
                    loss_fn,
                    ppo.ppo_epochs,
                    ppo.minibatch_size,
                    ppo.seed + index,
                    ppo.temperature,
                )
                for a in group
            },
        )
        firsts = [ranks[0] for ranks in self._by_dp_rank(group)]
        return {k: sum(results[a][k] for a in firsts) / len(firsts) for k in results[firsts[0]]}

    def iteration(self, index: int) -> dict:
        """Run the iteration at ``index`` (from 0: the iterations run before it); return (and keep)
        its metrics, which ``log.json`` lists under ``iterations``:

        - ``iteration``, ``manager_on``: its number (from 1; the comparison iterations from 1 again,
          with ``manager_on`` false, see :meth:`number`) and whether the manager switched models.
        - ``reward``: mean task reward of the rollouts (the task's score, before the KL penalty).
        - ``kl``: KL(policy || reference) per response token, estimated on the rollouts
          (``logp_old - logp_ref``, averaged); ``kl_coef`` times it is the reward's penalty.
        - ``policy_loss`` (``pg`` on the console): the clipped policy-gradient loss;
          ``value_loss`` (``vf``): the clipped value-function loss; both averaged over the
          training steps. ``clip_fraction``, ``approx_kl``, ``policy_grad_norm``: of the policy's steps.
        - seconds, bytes and transitions of the iteration and of each phase.
        """
        c, cfg, ppo = self.colo, self.cfg, self.cfg.ppo
        number, comparison = self.number(index)
        P = ppo.prompt_length
        t_start = time.perf_counter()
        g = torch.Generator().manual_seed(ppo.seed * 7919 + index)
        prompts = torch.randint(0, cfg.policy.vocab_size, (ppo.prompts_per_iteration, P), generator=g)

        tokens, old_logprobs = self._phase(
            index, "generate", {c.rollout: (Part.WEIGHTS,)}, lambda: self._sync_and_generate(index, prompts)
        )
        ref_logprobs = self._phase(
            index,
            "reference",
            {c.reference: (Part.WEIGHTS,)},
            lambda: c.call("reference", {c.reference: c.reference.logprobs.remote(tokens, ppo.temperature)})[
                c.reference
            ],
        )
        values = self._phase(
            index, "values", {a: (Part.WEIGHTS,) for a in c.critic}, lambda: self._critic_values(tokens)
        )

        old = old_logprobs[:, P - 1 :]  # (B, R)
        kl = old - ref_logprobs[:, P - 1 :]  # (B, R) per-token KL estimate
        score = TASKS[cfg.task.name](tokens[:, P:], cfg.task)  # (B,)
        rewards = -ppo.kl_coef * kl
        rewards[:, -1] += score
        old_values = values[:, P - 1 : -1]  # (B, R)
        advantages, returns = gae(rewards, old_values, ppo.gamma, ppo.lam)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

        checkpoint_wait = 0.0
        if self.checkpointer is not None:  # the trainers are about to change: commit the open save
            self.where = (index, "checkpoint")
            checkpoint_wait = self.checkpointer.complete()
        critic = self._phase(
            index,
            "train_critic",
            {a: tuple(Part) for a in c.critic},
            lambda: self._train(
                "train_critic",
                c.critic,
                {"tokens": tokens, "old_values": old_values, "returns": returns},
                self._value_loss,
                index,
            ),
        )
        check_finite(number, "train_critic", critic, comparison)
        mismatch: dict = {}  # with the vLLM rollout: |policy - engine| log-probs of the sampled tokens

        def train_policy():
            own = old
            if cfg.rollout.engine == "vllm":  # PPO's old log-probs are the policy's own, recomputed
                own, found = weight_sync.recompute_old_logprobs(self, index, tokens, old)
                mismatch.update(found)
            return self._train(
                "train_policy",
                c.policy,
                {"tokens": tokens, "old_logprobs": own, "advantages": advantages},
                self._policy_loss,
                index,
            )

        policy = self._phase(index, "train_policy", {a: tuple(Part) for a in c.policy}, train_policy)
        check_finite(number, "train_policy", policy, comparison)

        phases = [r for r in self.timeline.records if r.iteration == number and r.manager_on == self.manager_on]
        out = {
            "iteration": number,
            "manager_on": self.manager_on,
            "reward": score.mean().item(),
            "kl": kl.mean().item(),
            "policy_loss": policy["loss"],
            "value_loss": critic["loss"],
            "clip_fraction": policy["clip_fraction"],
            "approx_kl": policy["approx_kl"],
            "policy_grad_norm": policy["grad_norm"],
            "seconds": time.perf_counter() - t_start,
            "checkpoint_seconds": checkpoint_wait,
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
        if mismatch:
            out["logprob_mismatch"] = mismatch
        if cfg.rollout.engine == "vllm" and self.weight_sync is not None:
            out["weight_sync"] = dict(self.weight_sync, share_of_iteration=self.weight_sync["seconds"] / out["seconds"])
            self.weight_sync = None
        if self.schedule is not None and self.manager_on:
            out["budget_bytes"] = {str(b): v for b, v in self.schedule.budget.items()}
        self.iterations.append(out)
        return out
