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

The module holds the loop's whole config too (:class:`RunConfig`: the shared
:class:`~chatlearn_mem_ray.config.LoopConfig` with the critic and the ``ppo`` section). Running it
as a job (Ray started, the iterations looped, the log written, checkpoints, resume, restarts,
SIGTERM) is :func:`~chatlearn_mem_ray.job.run_loop`'s work (:func:`run_ppo`), and the memory side
of each phase the service's (:mod:`chatlearn_mem_ray.service`), not the recipe's.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Callable, ClassVar

import torch
from pydantic import Field, model_validator

from chatlearn_mem_ray.config import LoopConfig, Section, TrainerModelConfig
from chatlearn_mem_ray.errors import check_finite
from chatlearn_mem_ray.inputs.tasks import TASKS
from chatlearn_mem_ray.job import run_loop
from chatlearn_mem_ray.service.declare import EVERYTHING, WEIGHTS, Model, Phase
from chatlearn_mem_ray.service.loop import Loop
from chatlearn_mem_ray.service.service import Service
from chatlearn_mem_ray.service.weight_sync import recompute_old_logprobs

__all__ = ["DEFAULT_PRESET", "PPO", "PPOConfig", "PRESETS", "RunConfig", "gae", "policy_loss", "run_ppo", "value_loss"]

PRESETS = resources.files("chatlearn_mem_ray.presets")
"""The shipped PPO presets (``configs/ppo/*.yaml`` in the repository, installed with the package)."""
DEFAULT_PRESET = "cpu_tiny"
"""What ``chatlearn-mem ppo`` runs without ``--config``: the CPU default (about 30 s on 2 cores)."""


# -- the config ----------------------------------------------------------------------------
class PPOConfig(Section):
    """PPO hyper-parameters and batch shape."""

    iterations: int = Field(20, ge=1)
    """Rollout + train iterations, numbered 1 to ``iterations`` on the console (``iter 3/20``), in
    ``log.json`` and in the memory picture; the checkpoint ``iter_<K>`` holds iterations 1 to K."""
    prompts_per_iteration: int = Field(32, ge=1)
    """Prompts sampled per iteration (one response each); divided among data-parallel ranks."""
    prompt_length: int = Field(4, ge=1)
    """Tokens per prompt (random ids)."""
    response_length: int = Field(8, ge=1)
    """Tokens generated per prompt (fixed length, no early stop)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (> 0: greedy decoding has no log-probabilities for PPO to optimise). The
    rollout samples at it, and every log-probability (the policy's ratio, the reference's KL) is
    taken under the same tempered distribution."""
    ppo_epochs: int = Field(2, ge=1)
    """Passes over each iteration's batch."""
    minibatch_size: int = Field(8, ge=1)
    """Sequences per optimizer step on each data-parallel rank."""
    clip_ratio: float = Field(0.2, gt=0)
    """PPO clip range of the probability ratio."""
    value_clip: float = Field(0.2, gt=0)
    """Clip range of the value prediction around the rollout's value."""
    kl_coef: float = Field(0.05, ge=0)
    """Per-token KL penalty towards the reference model, subtracted from the reward."""
    gamma: float = Field(1.0, gt=0, le=1)
    """Discount."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    seed: int = 0
    """Seed of prompts and sampling."""

    @model_validator(mode="after")
    def _whitening_defined(self) -> "PPOConfig":
        n = self.prompts_per_iteration * self.response_length
        if n < 2:
            raise ValueError(
                f"ppo.prompts_per_iteration x ppo.response_length must be >= 2, got "
                f"{self.prompts_per_iteration} x {self.response_length}: advantages are "
                "whitened by their standard deviation, which one advantage does not have"
            )
        return self


_TRUNK_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "vocab_size",
    "seq_length",
    "num_query_groups",
    "ffn_hidden_size",
    "normalization",
    "norm_epsilon",
    "activation",
    "position_embedding",
    "rotary_base",
    "add_bias_linear",
    "add_qkv_bias",
    "share_embeddings_and_output_weights",
    "precision",
)
"""What a critic copies from a policy with ``from_hf``, so that the checkpoint's trunk fits it."""


_DEFAULT_CRITIC = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64, seq_length=16, lr=3e-3, seed=4321
)


def _default_critic() -> TrainerModelConfig:
    return TrainerModelConfig(**_DEFAULT_CRITIC)


class RunConfig(LoopConfig):
    """A whole colocated PPO run."""

    loop_section: ClassVar[str] = "ppo"
    model_sections: ClassVar[tuple[str, ...]] = ("policy", "critic")
    presets: ClassVar = PRESETS

    critic: TrainerModelConfig = Field(default_factory=_default_critic)
    """The critic trainer (a GPT trunk with a scalar value head). When the policy has
    ``from_hf`` and the critic does not say otherwise, the critic starts from the same
    checkpoint's trunk, with the policy's architecture and shape."""
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    output_dir: Path = Path("runs/ppo")
    """Where the JSON log and the memory timeline PNG go. Checked writable before Ray starts;
    ``log.json`` is rewritten (atomically) after every iteration. Each iteration's entry holds
    ``reward`` (mean task reward of the rollouts), ``policy_loss`` (``pg`` on the console: the
    policy-gradient loss), ``value_loss`` (``vf``: the value-function loss), ``kl`` (KL(policy ||
    reference) per token) and the phases' seconds and device bytes."""

    @classmethod
    def _derive(cls, data: dict) -> dict:
        if not isinstance(data.get("policy"), dict) or not data["policy"].get("from_hf"):
            return data
        policy = data["policy"]
        if isinstance(data.get("critic"), dict):
            critic = dict(data["critic"])
        else:  # the default critic's own settings; its shape is the checkpoint's
            critic = {k: v for k, v in _DEFAULT_CRITIC.items() if k not in _TRUNK_FIELDS}
        if "from_hf" in critic:
            return data
        for field in _TRUNK_FIELDS:
            if field in policy:
                critic.setdefault(field, policy[field])
        critic["from_hf"] = policy["from_hf"]
        critic["create_hf"] = policy.get("create_hf", False)  # written once, from the policy's config
        return {**data, "critic": critic}

    def _model_problems(self) -> list[str]:
        if self.critic.vocab_size != self.policy.vocab_size:
            return [
                f"critic.vocab_size ({self.critic.vocab_size}) must equal policy.vocab_size ({self.policy.vocab_size})"
            ]
        return []

    def _batch_problems(self) -> list[str]:
        ppo, dp = self.ppo, self.parallel.data_parallel_size
        if ppo.prompts_per_iteration % dp:
            return [
                f"ppo.prompts_per_iteration ({ppo.prompts_per_iteration}) must be "
                f"divisible by the data-parallel size ({dp})"
            ]
        if (ppo.prompts_per_iteration // dp) % ppo.minibatch_size:
            return [
                f"ppo.minibatch_size ({ppo.minibatch_size}) must divide the prompts per "
                f"data-parallel rank ({ppo.prompts_per_iteration // dp})"
            ]
        return []


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


def run_ppo(cfg: RunConfig, progress: Callable[[str], None] = print, **hooks) -> dict:
    """:func:`~chatlearn_mem_ray.job.run_loop` of :class:`PPO`; ``hooks`` as there."""
    return run_loop(PPO, cfg, progress, **hooks)
