"""What GRPO does with sampled groups apart from training on them: one round of responses as a
batch (:class:`Rollouts`), DAPO's dynamic sampling (:func:`keep_groups`: the groups whose rewards
differ, filled up when the rounds run out) and the validation's figures (:func:`pass_at_k`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from math import comb
from typing import Optional, Sequence

import torch

__all__ = ["Rollouts", "keep_groups", "pass_at_k"]


@dataclass
class Rollouts:
    """One or more rounds of sampled groups: each prompt ``group_size`` times in a row.

    Attributes:
        tokens: (B, L) prompt then response, right-padded.
        logprobs: (B, L-1) the rollout's log-probs of each next token (None when greedy).
        lengths: (B,) each response's length in tokens (its EOS or stop string included).
        prompt_lengths: (B,) each prompt's length.
        scores: (B,) rewards, once scored.
        prompts, texts: On text: each row's prompt and response as text.
        fields: On text: each row's other fields, one list per field (for the reward).
        extra: On text: the means of the reward's other named scores.
    """

    tokens: torch.Tensor
    logprobs: Optional[torch.Tensor]
    lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    scores: Optional[torch.Tensor] = None
    prompts: Optional[list[str]] = None
    texts: Optional[list[str]] = None
    fields: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def take(self, rows: Sequence[int]) -> "Rollouts":
        """These rows, in this order."""
        idx = torch.tensor(list(rows), dtype=torch.long)
        pick = lambda xs: [xs[i] for i in rows] if xs is not None else None  # noqa: E731
        return Rollouts(
            self.tokens[idx],
            self.logprobs[idx] if self.logprobs is not None else None,
            self.lengths[idx],
            self.prompt_lengths[idx],
            self.scores[idx] if self.scores is not None else None,
            pick(self.prompts),
            pick(self.texts),
            {k: pick(v) for k, v in self.fields.items()},
            dict(self.extra),
        )

    @staticmethod
    def cat(parts: Sequence["Rollouts"], pad_id: int) -> "Rollouts":
        """Rounds as one batch: sequences right-padded to the longest (``pad_id``; log-probs NaN,
        off every response); the named scores' means weighted by each round's rows."""
        if len(parts) == 1:
            return parts[0]
        width = max(p.tokens.shape[1] for p in parts)

        def pad(t: torch.Tensor, to: int, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, to - t.shape[1]), value=value)

        n = sum(len(p) for p in parts)
        extra = {k: sum(p.extra[k] * len(p) for p in parts) / n for k in parts[0].extra}
        joined = {f.name: None for f in fields(Rollouts)}
        joined.update(
            tokens=torch.cat([pad(p.tokens, width, pad_id) for p in parts]),
            logprobs=(
                torch.cat([pad(p.logprobs, width - 1, float("nan")) for p in parts])
                if parts[0].logprobs is not None
                else None
            ),
            lengths=torch.cat([p.lengths for p in parts]),
            prompt_lengths=torch.cat([p.prompt_lengths for p in parts]),
            scores=torch.cat([p.scores for p in parts]),
            prompts=sum((p.prompts for p in parts), []) if parts[0].prompts is not None else None,
            texts=sum((p.texts for p in parts), []) if parts[0].texts is not None else None,
            fields={k: sum((p.fields[k] for p in parts), []) for k in parts[0].fields},
            extra=extra,
        )
        return Rollouts(**joined)


def keep_groups(scores: torch.Tensor, group_size: int, wanted: int) -> tuple[list[int], int, int]:
    """DAPO's dynamic sampling over (B,) scores in groups: the rows of the first ``wanted`` groups
    whose rewards differ, filled up (in order) with groups whose rewards are all equal when there are
    not enough.

    Returns:
        ``(rows, dropped, filled)``: the rows kept, in order; how many equal-reward groups were left
        out; how many were kept to fill the batch.
    """
    spread = scores.view(-1, group_size).std(dim=1) > 0  # (groups,)
    informative = [i for i, s in enumerate(spread.tolist()) if s][:wanted]
    flat = [i for i, s in enumerate(spread.tolist()) if not s]
    filled = flat[: wanted - len(informative)]
    groups = sorted(informative + filled)
    rows = [g * group_size + j for g in groups for j in range(group_size)]
    return rows, len(flat) - len(filled), len(filled)


def pass_at_k(solved: torch.Tensor, k: int) -> float:
    """The unbiased pass@k (Chen et al. 2021) over prompts: (prompts, n) booleans, ``n >= k``
    samples each: the mean of ``1 - C(n - c, k) / C(n, k)`` with ``c`` solved."""
    n = solved.shape[1]
    return sum(1.0 - comb(n - int(c), k) / comb(n, k) for c in solved.sum(dim=1).tolist()) / solved.shape[0]
