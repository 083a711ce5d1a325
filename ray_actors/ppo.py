"""A colocated PPO recipe on the colocation service: read it top to bottom, copy it, edit it.

One iteration runs five phases. The service onloads only what each phase declares and offloads it
when the phase ends, so the device holds one phase's models at a time:

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
restarts, SIGTERM) is :func:`chatlearn_mem_ray.supervisor.run_loop`'s work, and the memory side of
each phase the service's (:mod:`chatlearn_mem_ray.service`), not the recipe's.
"""

from __future__ import annotations

import functools

import torch

from chatlearn_mem_ray.config import RunConfig
from chatlearn_mem_ray.declare import EVERYTHING, WEIGHTS, Model, Phase
from chatlearn_mem_ray.errors import check_finite
from chatlearn_mem_ray.service import Loop, Service
from chatlearn_mem_ray.tasks import TASKS
from chatlearn_mem_ray.weight_sync import recompute_old_logprobs

__all__ = ["PPO", "gae", "policy_loss", "value_loss"]


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


# -- the loop ------------------------------------------------------------------------------
class PPO(Loop):
    """PPO with a critic on the colocation service: :meth:`step` runs the five phases once."""

    name = "ppo"
    title = "PPO"
    legend = (
        "reward: mean task reward of the rollouts, pg: policy-gradient (clipped PPO) loss, "
        "vf: value-function loss, kl: KL(policy || reference) per token, mm (vLLM rollout): max |policy - engine| "
        "log-prob of the sampled tokens; then per phase: seconds/MiB held on the devices"
    )
    cfg: RunConfig

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        ppo = cfg.ppo
        self._policy_loss = functools.partial(policy_loss, prompt_length=ppo.prompt_length, clip_ratio=ppo.clip_ratio)
        self._value_loss = functools.partial(value_loss, prompt_length=ppo.prompt_length, value_clip=ppo.value_clip)

    def models(self) -> list[Model]:
        cfg = self.cfg
        return [
            Model.trainer("policy", cfg.policy),
            Model.trainer("critic", cfg.critic, head="value"),
            Model.engine("rollout", cfg.policy, follows="policy", rollout=cfg.rollout),
            Model.inference("reference", cfg.policy),
        ]

    def phases(self) -> list[Phase]:
        return [
            Phase("generate", needs={"rollout": WEIGHTS}),
            Phase("reference", needs={"reference": WEIGHTS}),
            Phase("values", needs={"critic": WEIGHTS}),
            Phase("train_critic", needs={"critic": EVERYTHING}),
            Phase("train_policy", needs={"policy": EVERYTHING}),
        ]

    def step(self, svc: Service, index: int) -> dict:
        """Run the iteration at ``index`` (from 0: the iterations run before it); return its
        metrics, which ``log.json`` lists under ``iterations`` (with the service's figures):

        - ``reward``: mean task reward of the rollouts (the task's score, before the KL penalty).
        - ``kl``: KL(policy || reference) per response token, estimated on the rollouts
          (``logp_old - logp_ref``, averaged); ``kl_coef`` times it is the reward's penalty.
        - ``policy_loss`` (``pg`` on the console): the clipped policy-gradient loss;
          ``value_loss`` (``vf``): the clipped value-function loss; both averaged over the
          training steps. ``clip_fraction``, ``approx_kl``, ``policy_grad_norm``: of the policy's steps.
        - ``logprob_mismatch`` (vLLM rollout): max and mean |policy - engine| log-prob.
        """
        cfg, ppo = self.cfg, self.cfg.ppo
        number, comparison = svc.number(index)
        P = ppo.prompt_length
        g = torch.Generator().manual_seed(ppo.seed * 7919 + index)
        prompts = torch.randint(0, cfg.policy.vocab_size, (ppo.prompts_per_iteration, P), generator=g)
        train = dict(epochs=ppo.ppo_epochs, minibatch_size=ppo.minibatch_size, seed=ppo.seed + index)

        with svc.phase("generate") as p:
            if svc.stale("rollout"):
                p.sync("policy", "rollout")
            seed = ppo.seed * 1_000_003 + index
            tokens, old_logprobs = p.call("rollout", "generate", prompts, ppo.response_length, ppo.temperature, seed)[0]
        with svc.phase("reference") as p:
            ref_logprobs = p.call("reference", "logprobs", tokens, ppo.temperature)[0]
        with svc.phase("values") as p:
            values = p.forward("critic", tokens)

        old = old_logprobs[:, P - 1 :]  # (B, R)
        kl = old - ref_logprobs[:, P - 1 :]  # (B, R) per-token KL estimate
        score = TASKS[cfg.task.name](tokens[:, P:], cfg.task)  # (B,)
        rewards = -ppo.kl_coef * kl
        rewards[:, -1] += score
        old_values = values[:, P - 1 : -1]  # (B, R)
        advantages, returns = gae(rewards, old_values, ppo.gamma, ppo.lam)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)

        with svc.phase("train_critic") as p:
            batch = {"tokens": tokens, "old_values": old_values, "returns": returns}
            critic = p.train("critic", batch, self._value_loss, temperature=ppo.temperature, **train)
        check_finite(number, "train_critic", critic, comparison)
        mismatch: dict = {}  # with the vLLM rollout: |policy - engine| log-probs of the sampled tokens
        with svc.phase("train_policy") as p:
            own = old
            if cfg.rollout.engine == "vllm":  # PPO's old log-probs are the policy's own, recomputed
                own, mismatch = recompute_old_logprobs(p, "policy", tokens, old, P, ppo.temperature)
            batch = {"tokens": tokens, "old_logprobs": own, "advantages": advantages}
            policy = p.train("policy", batch, self._policy_loss, temperature=ppo.temperature, **train)
        check_finite(number, "train_policy", policy, comparison)

        out = {
            "reward": score.mean().item(),
            "kl": kl.mean().item(),
            "policy_loss": policy["loss"],
            "value_loss": critic["loss"],
            "clip_fraction": policy["clip_fraction"],
            "approx_kl": policy["approx_kl"],
            "policy_grad_norm": policy["grad_norm"],
        }
        if mismatch:
            out["logprob_mismatch"] = mismatch
        return out

    def progress_line(self, m: dict) -> str:
        mismatch = f" mm {m['logprob_mismatch']['max']:.1e}" if m.get("logprob_mismatch") else ""
        return (
            f"reward {m['reward']:.3f} pg {m['policy_loss']:+.4f} vf {m['value_loss']:.4f} kl {m['kl']:+.4f}{mismatch}"
        )
