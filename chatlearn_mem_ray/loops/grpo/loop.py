"""A colocated GRPO recipe on the colocation service: read it top to bottom, copy it, edit it.

GRPO has no critic. Each prompt is sampled ``group_size`` times; a response's advantage is its
reward against its group's (``(r - mean) / (std + 1e-6)``, or ``r - mean`` for Dr. GRPO), the same
for every one of its tokens. One iteration runs two or three phases:

===============  ==========================  ==========================================
phase            models (parts onloaded)     work
===============  ==========================  ==========================================
generate         rollout (weights)           sync policy -> rollout when stale, sample
                                             (with dynamic sampling: more rounds, scored)
reference        reference (weights)         reference log-probs (only when kl_coef > 0)
train            policy (everything)         clipped policy-loss steps
validate         rollout (weights)           held-out prompts, scored (only when due)
===============  ==========================  ==========================================

With ``grpo.kl_coef`` 0 no reference model is launched at all: it is in no roster, timeline or
plan, and the device never holds it; without ``validation`` there is no validate phase.

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
from chatlearn_mem_ray.loops.grpo.losses import advantages as estimate
from chatlearn_mem_ray.loops.grpo.losses import group_advantages, grpo_loss, response_mask  # noqa: F401 (importable here)
from chatlearn_mem_ray.loops.grpo.sampling import Rollouts, keep_groups, pass_at_k
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
        "reference) per token (k3), mm (vLLM rollout): max |policy - engine| log-prob, rounds/dropped/filled "
        "(dynamic sampling): generation rounds, groups without reward spread left out and kept to fill the batch; "
        "then per phase: seconds/MiB held on the devices"
    )
    cfg: GRPORunConfig

    def __init__(self, cfg: GRPORunConfig):
        super().__init__(cfg)
        g = cfg.grpo
        clip_low, clip_high = g.ratio_clip
        self._loss = functools.partial(
            grpo_loss,
            clip_low=clip_low,
            clip_high=clip_high,
            kl_coef=g.kl_coef,
            response_length=g.response_length,
            loss_agg=g.loss_agg,
            policy_loss=g.policy_loss,
            clip_ratio_c=g.clip_ratio_c,
        )
        self.data = self.tokenizer = self.val = None
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
        phases.append(Phase("train", needs={"policy": EVERYTHING}))
        if self.cfg.validation.active:  # only the rollout awake
            phases.append(Phase("validate", needs={"rollout": WEIGHTS}))
        return phases

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
            held_out = Path(cfg.data.val_files[0]) if cfg.data.val_files else None
            if held_out is not None and not held_out.exists():
                text_task.write_task(cfg.data.create, held_out, seed=cfg.data.seed, split="val")
                progress(f"wrote the {cfg.data.create} task's {text_task.HELD_OUT} held-out prompts to {held_out}")
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
        if cfg.validation.active:
            self.val = PromptData(cfg.data, self.tokenizer, held_out=True)
            load_reward_function(cfg.reward.function, self.val.fields)
            v = cfg.validation
            n = min(len(self.val), v.max_prompts or len(self.val))
            self.val.prompts = self.val.prompts[:n]
            when = [f"every {v.every} iteration(s)"] if v.every else []
            progress(
                f"validation: {n} held-out prompt(s) from {len(cfg.data.val_files)} file(s), "
                f"{v.samples_per_prompt} sample(s) each, "
                f"{'greedy' if v.temperature == 0 else f'temperature {v.temperature:g}'}, "
                + " and ".join(when + (["before training"] if v.before_training else []))
            )

    def _eos_pad(self) -> tuple[tuple[int, ...], int]:
        """The tokenizer's EOS (a response stops there) and the id that pads."""
        eos = tuple(i for i in [self.tokenizer.eos_token_id] if i is not None)
        return eos, self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else (eos or (0,))[0]

    def state_dict(self) -> dict:
        return {"data_cursor": self.cursor} if self.cfg.data is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = state.get("data_cursor")

    # -- one iteration ----------------------------------------------------------------------
    def step(self, svc: Service, index: int) -> dict:
        """Run the iteration at ``index``; return its metrics (with the service's figures in
        ``log.json``): ``reward`` (mean reward of every response sampled), ``reward_std`` (the mean
        of each group's spread), ``solved_groups`` (share of groups with no spread: no signal),
        ``policy_loss``, ``clip_fraction``, ``entropy``, ``approx_kl``, ``kl`` (with the KL term),
        ``dual_clip_fraction`` (with the dual clip), ``policy_grad_norm``, ``logprob_mismatch``
        (vLLM rollout); with dynamic sampling ``sampling_rounds``, ``dropped_groups``,
        ``filled_groups`` and ``batch_reward`` (of the groups trained on); on text also
        ``reward_seconds`` (the reward function's, in its Ray task), ``reward_wait_seconds`` (of
        them, what the loop waited for after the reference phase), ``response_tokens`` (mean length),
        any other named score the reward returned (``reward_<name>``) and ``samples``; with
        validation ``validations`` (see :meth:`validate`)."""
        cfg, g = self.cfg, self.cfg.grpo
        number, comparison = svc.number(index)
        G, T = g.group_size, g.temperature
        out: dict = {}
        validations = []
        if index == 0 and self.val is not None and cfg.validation.before_training:
            validations.append(self.validate(svc, 0))
        cursor, rounds = self.cursor, []
        with svc.phase("generate") as p:
            if svc.stale("rollout"):
                p.sync("policy", "rollout")
            for r in range(1 + (g.dynamic_sampling_extra_rounds if g.dynamic_sampling else 0)):
                batch, cursor, pending = self._sample(p, index, r, cursor)
                rounds.append(batch)
                if not g.dynamic_sampling:
                    break
                self._score(batch, pending, out)  # dynamic sampling needs the rewards now
                if self._informative(rounds) >= g.prompts_per_iteration:
                    break
        if g.dynamic_sampling:
            rollouts, sampled = self._select(rounds, out)
        else:
            rollouts = sampled = rounds[0]
        ref = None
        if cfg.launches_reference:
            with svc.phase("reference") as p:
                ref = p.call("reference", "logprobs", rollouts.tokens, T)[0]  # (B, L-1); the reward runs meanwhile
        if not g.dynamic_sampling:
            self._score(rollouts, pending, out)
        if sampled.texts is not None:
            out.update({f"reward_{k}": v for k, v in sampled.extra.items()})
            out["response_tokens"] = sampled.lengths.float().mean().item()
            out["samples"] = [
                {"prompt": sampled.prompts[i], "response": sampled.texts[i], "reward": sampled.scores[i].item()}
                for i in range(0, len(sampled), G)[: cfg.tokenizer.log_samples]
            ]
        scores, tokens = rollouts.scores, rollouts.tokens
        mask = response_mask(rollouts.prompt_lengths, rollouts.lengths, tokens.shape[1] - 1)  # (B, L-1)
        advantages = estimate(scores, G, g.estimator, lengths=rollouts.lengths)
        spread = sampled.scores.view(-1, G).std(dim=1)  # (groups sampled,)
        old = rollouts.logprobs
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
        if self.data is not None:
            self.cursor = cursor  # the prompts of this iteration are used: the next batch starts after them
        if self.val is not None and not comparison and cfg.validation.due(number, self.iterations):
            validations.append(self.validate(svc, number))

        out = {
            "reward": sampled.scores.mean().item(),
            "reward_std": spread.mean().item(),
            "solved_groups": (spread == 0).float().mean().item(),
            "policy_loss": policy["loss"],
            "clip_fraction": policy["clip_fraction"],
            "entropy": policy["entropy"],
            "approx_kl": policy["approx_kl"],
            "policy_grad_norm": policy["grad_norm"],
            **{k: policy[k] for k in ("kl", "dual_clip_fraction") if k in policy},
            **out,
        }
        if mismatch:
            out["logprob_mismatch"] = mismatch
        if validations:
            out["validations"] = validations
        return out

    def _sample(self, p, index: int, round_: int, cursor: Optional[dict]) -> tuple[Rollouts, Optional[dict], object]:
        """One round in the generate phase ``p``: ``prompts_per_iteration`` prompts (the next ones of
        the data from ``cursor``, or random ids), each ``group_size`` times. Returns the rollouts,
        the data's cursor after them and, on text, the reward's pending Ray task."""
        cfg, g = self.cfg, self.cfg.grpo
        G, shift = g.group_size, 10**9 * round_  # round 0 draws exactly what a run without dynamic sampling does
        if self.data is None:  # random token ids, all of one length
            gen = torch.Generator().manual_seed(g.seed * 7919 + index + shift)
            rows = torch.randint(0, cfg.policy.vocab_size, (g.prompts_per_iteration, g.prompt_length), generator=gen)
            rows, prompts, eos, pad = rows.repeat_interleave(G, dim=0).tolist(), None, (), 0
        else:
            prompts, cursor = self.data.batch(g.prompts_per_iteration, cursor)
            rows = [list(q.tokens) for q in prompts for _ in range(G)]  # each prompt G times in a row: a group
            eos, pad = self._eos_pad()
        seed = g.seed * 1_000_003 + index + shift
        tokens, logprobs, lengths = p.call(
            "rollout", "generate_rows", rows, g.response_length, g.temperature, seed, eos, pad
        )[0]
        out = Rollouts(tokens, logprobs, lengths, torch.tensor([len(r) for r in rows]))
        if prompts is None:
            out.scores = TASKS[cfg.task.name](tokens[:, g.prompt_length :], cfg.task)  # (B,)
            return out, cursor, None
        out.texts, out.lengths = decode_responses(
            self.tokenizer, tokens, out.prompt_lengths, lengths, cfg.tokenizer.stop
        )
        out.prompts = [q.text for q in prompts for _ in range(G)]
        out.fields = {k: [q.fields[k] for q in prompts for _ in range(G)] for k in self.data.fields}
        return out, cursor, score_remote(cfg.reward.function, out.prompts, out.texts, out.fields)

    def _score(self, batch: Rollouts, pending, out: dict) -> None:
        """On text: wait for ``pending``'s scores into ``batch``, its timings and named scores into ``out``."""
        if pending is None:
            return
        t0 = time.perf_counter()
        batch.scores, batch.extra, seconds = _collect(pending, self.cfg.ray.phase_timeout_s)
        out["reward_seconds"] = out.get("reward_seconds", 0.0) + seconds
        out["reward_wait_seconds"] = out.get("reward_wait_seconds", 0.0) + time.perf_counter() - t0

    def _informative(self, rounds: list[Rollouts]) -> int:
        """Groups with a reward spread among ``rounds``."""
        G = self.cfg.grpo.group_size
        return sum(int((b.scores.view(-1, G).std(dim=1) > 0).sum()) for b in rounds)

    def _select(self, rounds: list[Rollouts], out: dict) -> tuple[Rollouts, Rollouts]:
        """Dynamic sampling: ``(the batch to train on, every response sampled)``, the counts into ``out``."""
        g = self.cfg.grpo
        sampled = Rollouts.cat(rounds, self._eos_pad()[1] if self.data is not None else 0)
        rows, dropped, filled = keep_groups(sampled.scores, g.group_size, g.prompts_per_iteration)
        chosen = sampled.take(rows)
        out.update(
            sampling_rounds=len(rounds),
            dropped_groups=dropped,
            filled_groups=filled,
            batch_reward=chosen.scores.mean().item(),
        )
        return chosen, sampled

    # -- validation ----------------------------------------------------------------------------
    def validate(self, svc: Service, iteration: int) -> dict:
        """Score the policy on the held-out prompts in the ``validate`` phase (only the rollout
        awake, synced first when stale): ``validation.samples_per_prompt`` responses each, greedy
        or at ``validation.temperature``, scored by ``reward.function``.

        Returns:
            ``{"iteration": iteration, "val/reward", "val/reward_<name>" (each named score),
            "val/pass@1", "val/pass@k" (k samples, k > 1), "val/response_tokens", "val/prompts",
            "samples"}``; ``iteration`` 0 is before training.
        """
        cfg, v = self.cfg, self.cfg.validation
        k, eos_pad = v.samples_per_prompt, self._eos_pad()
        prompts = self.val.prompts
        rows = [list(q.tokens) for q in prompts for _ in range(k)]
        with svc.phase("validate") as p:
            if svc.stale("rollout"):
                p.sync("policy", "rollout")
            seed = cfg.grpo.seed * 1_000_003 + 999_983 * (iteration + 1)
            args = (rows, cfg.grpo.response_length, v.temperature, seed, *eos_pad)
            tokens, _, lengths = p.call("rollout", "generate_rows", *args)[0]
            texts, lengths = decode_responses(
                self.tokenizer, tokens, torch.tensor([len(r) for r in rows]), lengths, cfg.tokenizer.stop
            )
            texts_of = [q.text for q in prompts for _ in range(k)]
            fields = {f: [q.fields[f] for q in prompts for _ in range(k)] for f in self.val.fields}
            scores, extra, _ = _collect(
                score_remote(cfg.reward.function, texts_of, texts, fields), cfg.ray.phase_timeout_s
            )
        solved = (scores >= v.pass_threshold).view(-1, k)  # (prompts, k)
        out = {
            "iteration": iteration,
            "val/reward": scores.mean().item(),
            **{f"val/reward_{name}": value for name, value in extra.items()},
            "val/pass@1": pass_at_k(solved, 1),
            **({f"val/pass@{k}": pass_at_k(solved, k)} if k > 1 else {}),
            "val/response_tokens": lengths.float().mean().item(),
            "val/prompts": len(prompts),
            "samples": [
                {"prompt": texts_of[i], "response": texts[i], "reward": scores[i].item()}
                for i in range(0, len(texts), k)[: cfg.tokenizer.log_samples]
            ],
        }
        return out

    def progress_line(self, m: dict) -> str:
        kl = f" kl {m['kl']:+.4f}" if "kl" in m else ""
        mismatch = f" mm {m['logprob_mismatch']['max']:.1e}" if m.get("logprob_mismatch") else ""
        line = (
            f"reward {m['reward']:.3f} loss {m['policy_loss']:+.4f} ent {m['entropy']:.3f} "
            f"clip {m['clip_fraction']:.3f}{kl}{mismatch}"
        )
        if "sampling_rounds" in m:
            line += f" rounds {m['sampling_rounds']} dropped {m['dropped_groups']} filled {m['filled_groups']}"
        samples = m.get("samples")
        if samples and (m["iteration"] == 1 or m["iteration"] % 5 == 0):
            s = samples[0]
            line += f"\n    sample: {s['prompt'][-60:]!r} -> {s['response'][:60]!r} (reward {s['reward']:.2f})"
        for v in m.get("validations", ()):
            when = "before training" if v["iteration"] == 0 else f"after iteration {v['iteration']}"
            figures = ", ".join(f"{k} {x:.3f}" for k, x in v.items() if k.startswith("val/") and isinstance(x, float))
            line += f"\n    validation {when}: {figures} ({v['val/prompts']} held-out prompts)"
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
