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

The math is in :mod:`~chatlearn_mem_ray.loops.grpo.losses`, the config (``grpo``, ``reference``,
``data``, ``tokenizer``, ``reward``) in :mod:`~chatlearn_mem_ray.loops.grpo.config`.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from chatlearn_mem_ray.errors import check_finite
from chatlearn_mem_ray.inputs.data import PromptData, load_tokenizer
from chatlearn_mem_ray.inputs.rewards import RewardError, load_reward_function, score_remote, unwrap
from chatlearn_mem_ray.inputs.tasks import TASKS
from chatlearn_mem_ray.job import run_loop
from chatlearn_mem_ray.loops.grpo.config import GRPORunConfig
from chatlearn_mem_ray.loops.grpo.losses import group_advantages, grpo_loss, response_mask
from chatlearn_mem_ray.service.declare import EVERYTHING, WEIGHTS, Model, Phase
from chatlearn_mem_ray.service.loop import Loop
from chatlearn_mem_ray.service.service import Service
from chatlearn_mem_ray.service.weight_sync import engine_mismatch

__all__ = ["GRPO", "decode_responses", "run_grpo"]


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
            from chatlearn_mem_ray.inputs import text_task

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


def run_grpo(cfg: GRPORunConfig, progress: Callable[[str], None] = print, **hooks) -> dict:
    """:func:`~chatlearn_mem_ray.job.run_loop` of :class:`GRPO`; ``hooks`` as there."""
    return run_loop(GRPO, cfg, progress, **hooks)
