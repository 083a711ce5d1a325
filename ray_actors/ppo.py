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
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from chatlearn_mem import Part
from chatlearn_mem_ray.cluster import Colocation
from chatlearn_mem_ray.config import RunConfig, TaskConfig
from chatlearn_mem_ray.errors import (AuditFailedError, NonFiniteLossError, OutputDirError, RunInterrupted,
                                      WeightSyncError)
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

    def __init__(self, cfg: RunConfig, colo: Colocation, progress: Callable[[str], None] = print):
        self.cfg, self.colo, self.progress = cfg, colo, progress
        self.timeline = MemoryTimeline()
        self.iterations: list[dict] = []
        self.sync_checks: list[dict] = []
        self.audits = {"runs": 0, "checks_clean": 0}
        self.manager_on = cfg.memory.enabled
        p = cfg.parallel
        self.tp = p.tensor_model_parallel_size
        self.dp = p.data_parallel_size
        ppo = cfg.ppo
        self._policy_loss = functools.partial(policy_loss, prompt_length=ppo.prompt_length,
                                              clip_ratio=ppo.clip_ratio)
        self._value_loss = functools.partial(value_loss, prompt_length=ppo.prompt_length,
                                             value_clip=ppo.value_clip)

    # -- memory ---------------------------------------------------------------------------
    def sleep_all(self) -> None:
        """Offload every model (after setup, before the first phase)."""
        c = self.colo
        c.call("sleep", {a: a.offload.remote() for a in c.all_actors})

    def wake_all(self) -> None:
        """Onload every model and keep it resident: the run continues with the manager off."""
        c = self.colo
        c.call("wake", {a: a.onload.remote() for a in c.all_actors})
        self.manager_on = False

    def _phase(self, iteration: int, name: str, needs: dict[Any, tuple[str, ...]], work: Callable[[], Any]):
        """Onload what ``needs`` names, do ``work``, record everyone's residency, offload."""
        c = self.colo
        t0 = time.perf_counter()
        if self.manager_on:
            c.call(name, {a: a.onload.remote(parts) for a, parts in needs.items()})
            if self.cfg.memory.audit:
                for a, problems in c.call(name, {a: a.audit.remote() for a in needs}).items():
                    self.audits["runs"] += 1
                    if problems:
                        raise AuditFailedError(f"audit of {c.names[a]} after onload in phase {name!r} "
                                               f"found {len(problems)} problem(s): {problems[:5]}")
                    self.audits["checks_clean"] += 1
        result = work()
        residency = c.call(name, {a: a.residency.remote() for a in c.all_actors})
        if self.manager_on:
            c.call(name, {a: a.offload.remote(parts) for a, parts in needs.items()})
        seconds = time.perf_counter() - t0
        self.timeline.add(iteration, name, self.manager_on, seconds,
                          {c.names[a]: parts for a, parts in needs.items()},
                          {c.names[a]: r for a, r in residency.items()})
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
                                                   ppo.ppo_epochs, ppo.minibatch_size, ppo.seed + iteration)
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
                                   lambda: c.call("reference", {c.reference: c.reference.logprobs.remote(tokens)})[c.reference])
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
               "phase_seconds": {r.phase: r.seconds for r in phases},
               "phase_colocated_bytes": {r.phase: r.colocated_bytes for r in phases}}
        self.iterations.append(out)
        return out


def _progress_line(m: dict, total: int) -> str:
    phases = " ".join(f"{name} {m['phase_seconds'][name]:.2f}s/{m['phase_colocated_bytes'][name] / 2**20:.1f}MiB"
                      for name in m["phase_seconds"])
    mode = "" if m["manager_on"] else " [manager off]"
    return (f"iter {m['iteration'] + 1:>3}/{total}{mode} reward {m['reward']:.3f} "
            f"pg {m['policy_loss']:+.4f} vf {m['value_loss']:.4f} kl {m['kl']:+.4f} | {phases}")


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> Optional[str]:
        try:
            return version(dist)  # without importing it (megatron takes seconds)
        except PackageNotFoundError:
            return None

    return {"torch": torch.__version__, "megatron-core": of("megatron-core"), "ray": of("ray"),
            "python": platform.python_version(), "machine": platform.machine(), "node": platform.node(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def write_json_atomic(path: Path, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` through a temporary file and ``os.replace``: a reader (or
    a run killed while writing) sees the old file or the new one, never half of one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left when the dump failed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def prepare_output_dir(cfg: RunConfig) -> Path:
    """Check ``cfg.output_dir`` before anything starts; return the path of its ``log.json``.

    Creates the directory and writes a first ``log.json`` (status ``starting``, no iterations):
    the write itself proves the directory writable. With ``output_dir_exists=error`` (the
    default) a ``log.json`` that holds iterations of another run, or that a live run on this
    machine is writing, stops the run instead; a log with no iterations (a run that failed
    to start) is replaced. With ``overwrite`` the old log and picture are replaced.

    Raises:
        OutputDirError: The directory cannot be created or written, or holds another run's results.
    """
    out = Path(cfg.output_dir)
    log_path = out / "log.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputDirError(f"cannot create output_dir {out}: {e.strerror or e}; choose another output_dir") from None
    if cfg.output_dir_exists == "error" and log_path.exists():
        try:
            old = json.loads(log_path.read_text())
            done, status = len(old["iterations"]), old.get("status", "completed")
            pid, node = old.get("pid"), old.get("versions", {}).get("node")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise OutputDirError(f"output_dir {out} holds a log.json that is not a PPO run's log ({type(e).__name__}); "
                                 "choose another output_dir or set output_dir_exists=overwrite") from None
        if status in ("starting", "running") and pid and node == platform.node() and _pid_alive(pid):
            raise OutputDirError(f"another run (pid {pid}) is writing to output_dir {out}; choose another output_dir")
        if done:
            raise OutputDirError(f"output_dir {out} already holds the log of another run ({done} iteration(s), "
                                 f"{status}); choose another output_dir, or set output_dir_exists=overwrite "
                                 "to replace it")
    try:
        write_json_atomic(log_path, {"status": "starting", "pid": os.getpid(), "versions": {"node": platform.node()},
                                     "config": json.loads(cfg.model_dump_json()), "iterations": []})
    except OSError as e:
        raise OutputDirError(f"cannot write {log_path}: {e.strerror or e}; choose a writable output_dir") from None
    (out / "memory_timeline.png").unlink(missing_ok=True)  # another run's picture must not pass for this one's
    return log_path


def _log(cfg: RunConfig, run: Optional[PPORun], versions: dict, status: str, seconds: float,
         error: Optional[str] = None) -> dict:
    timeline = run.timeline if run is not None else MemoryTimeline()
    return {"status": status, "error": error, "pid": os.getpid(),
            "config": json.loads(cfg.model_dump_json()), "versions": versions,
            "iterations": run.iterations if run is not None else [], "memory_timeline": timeline.to_json(),
            "sync_checks": run.sync_checks if run is not None else [],
            "audits": run.audits if run is not None else {"runs": 0, "checks_clean": 0},
            "summary": {"memory_manager_on": timeline.summary(True), "memory_manager_off": timeline.summary(False),
                        "seconds": seconds}}


def run_ppo(cfg: RunConfig, progress: Callable[[str], None] = print,
            on_iteration: Optional[Callable[[PPORun, int], None]] = None) -> dict:
    """Run PPO as ``cfg`` says; write ``log.json`` and ``memory_timeline.png`` to ``cfg.output_dir``.

    ``output_dir`` is checked (see :func:`prepare_output_dir`) before Ray starts. ``log.json`` is
    rewritten atomically after every iteration (``status``: ``running``), so a run that fails or
    is interrupted keeps every iteration it completed; at the end ``status`` is ``completed``,
    ``failed`` (with ``error``) or ``interrupted``.

    Args:
        progress: Receives one line per iteration and a summary.
        on_iteration: Called after each iteration with the run and the iteration index (tests use
            it to inspect or disturb the actors).

    Returns:
        The log (also written as JSON): config, versions, iterations, memory timeline, summary.

    Raises:
        RunError: A subclass saying why the run stopped (the log is written first).
        RunInterrupted: Ctrl-C (a ``KeyboardInterrupt``), after the log was written and Ray shut down.
    """
    log_path = prepare_output_dir(cfg)
    out_dir = log_path.parent
    t0 = time.perf_counter()
    versions = _versions()
    run: Optional[PPORun] = None

    def write(status: str, error: Optional[str] = None) -> dict:
        log = _log(cfg, run, versions, status, time.perf_counter() - t0, error)
        write_json_atomic(log_path, log)
        return log

    try:
        with Colocation(cfg, progress) as colo:
            progress(f"{len(colo.all_actors)} actors ready on {cfg.parallel.world_size} bundle(s) "
                     f"({'GPU' if colo.use_gpu else 'CPU'}) in {time.perf_counter() - t0:.1f}s; "
                     f"memory manager {'on' if cfg.memory.enabled else 'off'}")
            run = PPORun(cfg, colo, progress)
            if cfg.memory.enabled:
                run.sleep_all()
            total = cfg.ppo.iterations
            extra = cfg.memory.compare_iterations if cfg.memory.enabled else 0
            for it in range(total + extra):
                if it == total:
                    progress(f"comparison: {extra} more iteration(s) with the memory manager off")
                    run.wake_all()
                m = run.iteration(it)
                write("running")
                progress(_progress_line(m, total + extra))
                if on_iteration is not None:
                    on_iteration(run, it)
    except KeyboardInterrupt:
        done = len(run.iterations) if run is not None else 0
        _write_quietly(write, progress, "interrupted", "stopped by Ctrl-C")
        raise RunInterrupted(done, log_path) from None
    except BaseException as e:
        done = len(run.iterations) if run is not None else 0
        if _write_quietly(write, progress, "failed", f"{type(e).__name__}: {e}") and done:
            progress(f"the run stopped; log of its {done} completed iteration(s): {log_path}")
        raise
    log = write("completed")
    plot_timeline(run.timeline, out_dir / "memory_timeline.png",
                  f"colocated PPO, {cfg.parallel.world_size} rank(s), {len(run.iterations)} iterations")
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
