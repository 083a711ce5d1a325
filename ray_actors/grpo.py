"""A colocated GRPO recipe on the colocation service: read it top to bottom, copy it, edit it.

GRPO has no critic. Each prompt is sampled ``group_size`` times; a response's advantage is its
reward against its group's (``(r - mean) / (std + 1e-6)``, or ``r - mean`` for Dr. GRPO), the same
for every one of its tokens. One iteration runs two or three phases:

===============  ==========================  ==========================================
phase            models (parts onloaded)     work
===============  ==========================  ==========================================
generate         rollout (weights)           sync policy -> rollout when stale, sample
reference        reference (weights)         reference log-probs (only when kl_coef > 0)
train            policy (everything)         clipped policy-loss steps
===============  ==========================  ==========================================

With ``grpo.kl_coef`` 0 no reference model is launched at all: it is in no roster, timeline or
plan, and the device never holds it.

Math (per response token ``t``, ``r = exp(logp_t - logp_old_t)``; ``A`` the response's advantage):
``loss_t = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef * k3_t`` with the k3
estimator ``k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1`` (non-negative, unbiased for
KL(policy || reference)). GRPO averages each response's token losses, then the responses; Dr.
GRPO sums every token loss and divides by ``responses x response_length``.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from chatlearn_mem_ray.config import GRPORunConfig
from chatlearn_mem_ray.data import PromptData, load_tokenizer
from chatlearn_mem_ray.declare import EVERYTHING, WEIGHTS, Model, Phase
from chatlearn_mem_ray.errors import check_finite
from chatlearn_mem_ray.rewards import RewardError, load_reward_function, score_remote, unwrap
from chatlearn_mem_ray.service import Loop, Service
from chatlearn_mem_ray.tasks import TASKS
from chatlearn_mem_ray.weight_sync import engine_mismatch

__all__ = ["GRPO", "decode_responses", "group_advantages", "grpo_loss", "response_mask"]


# -- the math ------------------------------------------------------------------------------
def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """Each response's reward against its group's: (B,) rewards, consecutive groups of
    ``group_size`` responses to one prompt -> (B,) advantages.

    Args:
        scale: Divide by the group's standard deviation (``+ 1e-6``; GRPO); False: only subtract
            the group's mean (Dr. GRPO). A group whose rewards are all equal gets 0 either way.
    """
    groups = rewards.view(-1, group_size)  # (prompts, G)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, keepdim=True) + 1e-6)
    return centred.reshape(-1)


def grpo_loss(
    outputs,
    mb: dict,
    *,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    token_sum: bool,
    response_length: int,
):
    """The clipped GRPO objective on a minibatch's response tokens (see the module's docstring).

    Every tensor spans the whole sequence's next-token positions (b, T-1); ``mask`` picks the
    response's (its prompt's last position on, up to and including its EOS), which is all that
    counts, so prompts and responses of any length share one batch.

    Args:
        outputs: ``(logprobs, entropy)`` from the policy, each (b, T-1).
        mb: ``old_logprobs`` (b, T-1), ``advantages`` (b,), ``mask`` (b, T-1), and with ``kl_coef`` > 0
            ``ref_logprobs`` (b, T-1).
        token_sum: Dr. GRPO's normalisation (every token loss summed over the minibatch, divided by
            ``b x response_length``); False: each response's token losses averaged, then the responses.

    Returns:
        ``(loss, metrics)``: ``clip_fraction`` (tokens whose ratio was clipped), ``entropy`` (of the
        policy's next-token distribution, per token), ``approx_kl`` (``mean(old - new)``) and, with
        the KL term, ``kl`` (the k3 estimate per token).
    """
    new, entropy = outputs
    mask = mb["mask"]
    off = mask == 0  # off the response nothing counts (an engine's log-probs there may be NaN)
    old = mb["old_logprobs"].masked_fill(off, 0.0)
    ratio = torch.exp((new - old).masked_fill(off, 0.0))
    adv = mb["advantages"].unsqueeze(1)  # (b, 1): every token of a response shares its advantage
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)  # (b, T-1)
    if kl_coef > 0:
        d = (mb["ref_logprobs"].masked_fill(off, 0.0) - new).masked_fill(off, 0.0)
        k3 = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * k3
    if token_sum:
        loss = (per_token * mask).sum() / (mask.shape[0] * response_length)
    else:
        loss = ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()

    def mean(x: torch.Tensor) -> float:
        return ((x * mask).sum() / mask.sum().clamp(min=1)).item()

    with torch.no_grad():
        clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float()
        metrics = {
            "clip_fraction": mean(clipped),
            "entropy": mean(entropy),
            "approx_kl": mean(old - new),
        }
        if kl_coef > 0:
            metrics["kl"] = mean(k3)
    return loss, metrics


def response_mask(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) float: 1 on the next-token positions that predict each row's response tokens
    (from its prompt's last position, for its response's length)."""
    pos = torch.arange(width).unsqueeze(0)  # (1, width)
    start = (prompt_lengths - 1).unsqueeze(1)
    return ((pos >= start) & (pos < start + response_lengths.unsqueeze(1))).float()


# -- the loop ------------------------------------------------------------------------------
class GRPO(Loop):
    """GRPO on the colocation service: :meth:`step` runs generate, (reference,) train once.

    Without ``data`` the prompts are random token ids scored by ``task`` (the toy rule); with it,
    your prompts, tokenizer and ``reward.function`` (:meth:`prepare` loads and checks them before
    Ray starts), and each row's ``data`` position is part of the loop's state.
    """

    name = "grpo"
    title = "GRPO"
    legend = (
        "reward: mean task reward of the rollouts, loss: the clipped GRPO loss (with the KL term), ent: entropy of "
        "the policy per token, clip: share of tokens whose ratio was clipped, kl (KL term on): KL(policy || "
        "reference) per token (k3), mm (vLLM rollout): max |policy - engine| log-prob; then per phase: "
        "seconds/MiB held on the devices"
    )
    cfg: GRPORunConfig

    def __init__(self, cfg: GRPORunConfig):
        super().__init__(cfg)
        g = cfg.grpo
        self._loss = functools.partial(
            grpo_loss,
            clip_low=g.clip_low,
            clip_high=g.clip_high,
            kl_coef=g.kl_coef,
            token_sum=g.variant == "dr_grpo",
            response_length=g.response_length,
        )
        self.data = self.tokenizer = None
        self.cursor: Optional[dict] = None  # where the next batch of prompts starts (data runs)

    def models(self) -> list[Model]:
        cfg = self.cfg
        models = [
            Model.trainer("policy", cfg.policy),
            Model.engine("rollout", cfg.policy, follows="policy", rollout=cfg.rollout),
        ]
        if cfg.launches_reference:
            reference = cfg.policy
            if cfg.reference.from_hf is not None:
                reference = reference.model_copy(update={"from_hf": cfg.reference.from_hf, "create_hf": False})
            models.append(Model.inference("reference", reference))
        return models

    def phases(self) -> list[Phase]:
        phases = [Phase("generate", needs={"rollout": WEIGHTS})]
        if self.cfg.launches_reference:
            phases.append(Phase("reference", needs={"reference": WEIGHTS}))
        return phases + [Phase("train", needs={"policy": EVERYTHING})]

    # -- your data ---------------------------------------------------------------------------
    def prepare(self, progress: Callable[[str], None]) -> None:
        """With ``data``: write the built-in task's files when asked and missing, load the tokenizer
        and the prompts, and import and check the reward function (every problem a ``ConfigError``
        naming the file, row or function, before Ray starts)."""
        cfg = self.cfg
        if cfg.data is None:
            return
        if cfg.data.create is not None:
            from chatlearn_mem_ray import text_task

            first = Path(cfg.data.train_files[0])
            if not first.exists():
                text_task.write_task(cfg.data.create, first, seed=cfg.data.seed)
                progress(f"wrote the {cfg.data.create} task's prompts to {first}")
            if not (Path(cfg.tokenizer_dir) / "tokenizer.json").exists():
                text_task.write_tokenizer(cfg.tokenizer_dir)
                progress(f"wrote a character-level tokenizer to {cfg.tokenizer_dir}")
        self.tokenizer = load_tokenizer(cfg.tokenizer_dir, cfg.policy.vocab_size)
        self.data = PromptData(cfg.data, self.tokenizer)
        load_reward_function(cfg.reward.function, self.data.fields)
        dropped = f", {self.data.dropped} longer than data.max_prompt_tokens left out" if self.data.dropped else ""
        progress(
            f"data: {len(self.data)} prompts from {len(cfg.data.train_files)} file(s){dropped}; fields for the reward: "
            f"{', '.join(self.data.fields) or 'none'}; reward.function={cfg.reward.function}"
        )

    def state_dict(self) -> dict:
        return {"data_cursor": self.cursor} if self.cfg.data is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = state.get("data_cursor")

    # -- one iteration ----------------------------------------------------------------------
    def step(self, svc: Service, index: int) -> dict:
        """Run the iteration at ``index``; return its metrics (with the service's figures in
        ``log.json``): ``reward`` (mean reward), ``reward_std`` (the mean of each group's spread),
        ``solved_groups`` (share of groups with no spread: no signal), ``policy_loss``,
        ``clip_fraction``, ``entropy``, ``approx_kl``, ``kl`` (with the KL term),
        ``policy_grad_norm``, ``logprob_mismatch`` (vLLM rollout); on text also ``reward_seconds``
        (the reward function's, in its Ray task), ``reward_wait_seconds`` (of them, what the loop
        waited for after the reference phase), ``response_tokens`` (mean length), any other named
        score the reward returned (``reward_<name>``) and ``samples``."""
        cfg, g = self.cfg, self.cfg.grpo
        number, comparison = svc.number(index)
        G, T = g.group_size, g.temperature
        seed = g.seed * 1_000_003 + index
        out: dict = {}
        if self.data is None:  # random token ids, all of one length
            gen = torch.Generator().manual_seed(g.seed * 7919 + index)
            rows = torch.randint(0, cfg.policy.vocab_size, (g.prompts_per_iteration, g.prompt_length), generator=gen)
            rows, prompts, eos, pad = rows.repeat_interleave(G, dim=0).tolist(), None, (), 0
        else:
            prompts, cursor = self.data.batch(g.prompts_per_iteration, self.cursor)
            rows = [list(p.tokens) for p in prompts for _ in range(G)]  # each prompt G times in a row: a group
            eos = tuple(i for i in [self.tokenizer.eos_token_id] if i is not None)
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (eos or (0,))[0]

        with svc.phase("generate") as p:
            if svc.stale("rollout"):
                p.sync("policy", "rollout")
            tokens, rollout_logprobs, lengths = p.call(
                "rollout", "generate_rows", rows, g.response_length, T, seed, eos, pad
            )[0]
        prompt_lengths = torch.tensor([len(r) for r in rows])
        pending = None
        if prompts is not None:
            texts, lengths = decode_responses(self.tokenizer, tokens, prompt_lengths, lengths, cfg.tokenizer.stop)
            prompt_texts = [p.text for p in prompts for _ in range(G)]
            fields = {k: [p.fields[k] for p in prompts for _ in range(G)] for k in self.data.fields}
            pending = score_remote(cfg.reward.function, prompt_texts, texts, fields)  # runs beside the reference
        ref = None
        if cfg.launches_reference:
            with svc.phase("reference") as p:
                ref = p.call("reference", "logprobs", tokens, T)[0]  # (B, L-1)

        mask = response_mask(prompt_lengths, lengths, tokens.shape[1] - 1)  # (B, L-1)
        if pending is None:
            P = g.prompt_length
            scores = TASKS[cfg.task.name](tokens[:, P:], cfg.task)  # (B,)
        else:
            t0 = time.perf_counter()
            scores, extra, seconds = _collect(pending, svc.cfg.ray.phase_timeout_s)
            out.update(reward_seconds=seconds, reward_wait_seconds=time.perf_counter() - t0)
            out.update({f"reward_{k}": v for k, v in extra.items()})
            out["response_tokens"] = lengths.float().mean().item()
            out["samples"] = [
                {"prompt": prompt_texts[i], "response": texts[i], "reward": scores[i].item()}
                for i in range(0, len(texts), G)[: cfg.tokenizer.log_samples]
            ]
        advantages = group_advantages(scores, G, scale=g.variant == "grpo")
        spread = scores.view(-1, G).std(dim=1)  # (prompts,)
        old = rollout_logprobs
        mismatch: dict = {}
        with svc.phase("train") as p:
            if cfg.rollout.engine == "vllm":  # the old log-probs are the policy's own, recomputed
                old, mismatch = engine_mismatch(p, "policy", tokens, old, mask, T)
            batch = {"tokens": tokens, "old_logprobs": old, "advantages": advantages, "mask": mask}
            if ref is not None:
                batch["ref_logprobs"] = ref
            policy = p.train(
                "policy",
                batch,
                self._loss,
                epochs=g.epochs,
                minibatch_size=g.minibatch_size,
                seed=g.seed + index,
                temperature=T,
                entropy=True,
            )
        check_finite(number, "train", policy, comparison)
        if prompts is not None:
            self.cursor = cursor  # the prompts of this iteration are used: the next batch starts after them

        out = {
            "reward": scores.mean().item(),
            "reward_std": spread.mean().item(),
            "solved_groups": (spread == 0).float().mean().item(),
            "policy_loss": policy["loss"],
            "clip_fraction": policy["clip_fraction"],
            "entropy": policy["entropy"],
            "approx_kl": policy["approx_kl"],
            "policy_grad_norm": policy["grad_norm"],
            **({"kl": policy["kl"]} if "kl" in policy else {}),
            **out,
        }
        if mismatch:
            out["logprob_mismatch"] = mismatch
        return out

    def progress_line(self, m: dict) -> str:
        kl = f" kl {m['kl']:+.4f}" if "kl" in m else ""
        mismatch = f" mm {m['logprob_mismatch']['max']:.1e}" if m.get("logprob_mismatch") else ""
        line = (
            f"reward {m['reward']:.3f} loss {m['policy_loss']:+.4f} ent {m['entropy']:.3f} "
            f"clip {m['clip_fraction']:.3f}{kl}{mismatch}"
        )
        samples = m.get("samples")
        if samples and (m["iteration"] == 1 or m["iteration"] % 5 == 0):
            s = samples[0]
            line += f"\n    sample: {s['prompt'][-60:]!r} -> {s['response'][:60]!r} (reward {s['reward']:.2f})"
        return line


def decode_responses(
    tokenizer, tokens: torch.Tensor, prompt_lengths: torch.Tensor, lengths: torch.Tensor, stop: Sequence[str]
) -> tuple[list[str], torch.Tensor]:
    """Each row's response as text, and its length in tokens, cut at the first stop string.

    The text is everything the response holds but its final EOS: special tokens sampled on the way
    (a padding token, say) are kept as text, so a reward sees them and a policy cannot pass them off
    as nothing. The text leaves out the stop string; the length keeps the EOS's and the stop
    string's tokens (the policy learns to emit them). The same for both rollouts: the driver decodes
    what either generated.
    """
    eos = {tokenizer.eos_token_id} - {None}
    texts, out = [], lengths.clone()

    def text_of(ids: list[int]) -> str:
        return tokenizer.decode(ids[:-1] if ids and ids[-1] in eos else ids, skip_special_tokens=False)

    for i in range(tokens.shape[0]):
        start = int(prompt_lengths[i])
        ids = tokens[i, start : start + int(lengths[i])].tolist()
        text = text_of(ids)
        cut = min((text.find(s) for s in stop if s and s in text), default=-1)
        if cut >= 0:
            text = text[:cut]
            for k in range(1, len(ids) + 1):  # the first prefix whose text holds a stop string
                if any(s and s in text_of(ids[:k]) for s in stop):
                    out[i] = k
                    break
        texts.append(text)
    return texts, out


def _collect(pending, timeout_s: float) -> tuple[torch.Tensor, dict, float]:
    """The reward task's scores (B,), its other named scores' means and its seconds."""
    import ray
    from ray.exceptions import GetTimeoutError, RayTaskError

    try:
        result = ray.get(pending, timeout=timeout_s)
    except GetTimeoutError:
        raise RewardError(f"reward.function did not return within ray.phase_timeout_s={timeout_s:g} s") from None
    except RayTaskError as e:
        raise unwrap(e) from None
    return torch.tensor(result["scores"], dtype=torch.float32), result["extra"], result["seconds"]
