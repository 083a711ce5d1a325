"""GRPO's math: advantages within each prompt's group, the policy loss (PPO's clipped ratio or GSPO's
sequence ratio, an optional dual clip, a KL term), how token losses are aggregated, and which
positions of a right-padded batch are a response's.

Advantages (rewards ``r`` of one prompt's ``G`` responses; every token of a response shares its
response's advantage):

- ``grpo`` (Shao et al. 2024): ``(r_i - mean(r)) / (std(r) + 1e-6)``, the unbiased std.
- ``dr_grpo`` (Liu et al. 2025, "Understanding R1-Zero-like training"): ``r_i - mean(r)``.
- ``rloo`` (Ahmadian et al. 2024; Kool et al. 2019): ``r_i - mean_{j != i} r_j``, the others'
  mean as the baseline, which is ``G / (G - 1) * (r_i - mean(r))``.
- ``reinforce_pp`` (REINFORCE++ with a group baseline, Hu 2025): ``r_i - mean(r)``, then whitened
  over the whole batch's response tokens (each response weighted by its length, as verl and
  OpenRLHF do): ``(a - mu) / sqrt(var + 1e-8)``, ``var`` unbiased.

Policy loss per response token ``t`` of response ``i``, with advantage ``A``:

- ``ppo_clip``: ``r_t = exp(logp_t - old_t)``, ``loss_t = -min(r_t A, clip(r_t, 1 - clip_low, 1 +
  clip_high) A)``.
- ``gspo`` (Zheng et al. 2025): the sequence ratio ``s_i = exp(mean_t(logp_t - old_t))`` (the
  geometric mean of the token ratios) clipped per sequence to ``[1 - clip_low, 1 + clip_high]``
  (the paper's 3e-4 and 4e-4): ``loss_t = -min(s_i A, clip(s_i) A)`` with GSPO-token's gradient
  ``s_i * grad logp_t``. With ``seq_mean_token_mean`` this is the paper's objective, value and
  gradient.
- dual clip (``clip_ratio_c = c > 1``, Ye et al. 2020): for ``A < 0`` the loss is capped at ``-c A``,
  so a ratio far above 1 on a bad response does not push without bound.
- the KL term (``kl_coef > 0``): ``+ kl_coef * k3_t`` with ``k3_t = exp(ref_t - logp_t) - (ref_t -
  logp_t) - 1`` (non-negative, unbiased for KL(policy || reference)).

Aggregation over a minibatch's response tokens (``mask``):

- ``token_mean`` (DAPO; verl's default): every token counts once, ``sum / tokens``.
- ``seq_mean_token_mean`` (GRPO's paper): each response's token mean, then the mean over responses.
- ``seq_mean_token_sum_norm`` (Dr. GRPO): each response's token sum over the constant
  ``response_length``, then the mean over responses; no length rescales a gradient.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = [
    "ESTIMATORS",
    "LOSS_AGGS",
    "POLICY_LOSSES",
    "advantages",
    "aggregate",
    "group_advantages",
    "grpo_loss",
    "response_mask",
]

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
"""The advantage estimators (``grpo.estimator``)."""
LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
"""The ways token losses become the loss (``grpo.loss_agg``)."""
POLICY_LOSSES = ("ppo_clip", "gspo")
"""The policy losses (``grpo.policy_loss``)."""


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """Each response's reward against its group's: (B,) rewards, consecutive groups of
    ``group_size`` responses to one prompt -> (B,) advantages.

    Args:
        scale: Divide by the group's standard deviation (``+ 1e-6``; GRPO); False: only subtract
            the group's mean (Dr. GRPO). A group whose rewards are all equal gets 0 either way.
    """
    return advantages(rewards, group_size, "grpo" if scale else "dr_grpo")


def advantages(
    rewards: torch.Tensor, group_size: int, estimator: str, lengths: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """(B,) advantages of (B,) rewards in consecutive groups of ``group_size`` (see the module).

    Args:
        estimator: One of :data:`ESTIMATORS`.
        lengths: (B,) response lengths in tokens, the weights of ``reinforce_pp``'s whitening over
            the batch's tokens (None: every response weighs the same).

    Raises:
        ValueError: An unknown estimator.
    """
    groups = rewards.view(-1, group_size)  # (prompts, G)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if estimator == "grpo":
        return (centred / (groups.std(dim=1, keepdim=True) + 1e-6)).reshape(-1)
    if estimator == "dr_grpo":
        return centred.reshape(-1)
    if estimator == "rloo":
        baseline = (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)  # the others' mean
        return (groups - baseline).reshape(-1)
    if estimator == "reinforce_pp":
        a = centred.reshape(-1)  # (B,)
        w = torch.ones_like(a) if lengths is None else lengths.to(a.dtype)
        tokens = w.sum()
        mu = (w * a).sum() / tokens
        var = (w * (a - mu) ** 2).sum() / tokens * (tokens / (tokens - 1))  # unbiased, over tokens
        return (a - mu) * torch.rsqrt(var + 1e-8)
    raise ValueError(f"unknown advantage estimator {estimator!r}; one of {', '.join(ESTIMATORS)}")


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, loss_agg: str, response_length: int) -> torch.Tensor:
    """The loss of (b, T) token losses over the response tokens ``mask`` picks (see the module).

    Raises:
        ValueError: An unknown aggregation.
    """
    if loss_agg == "token_mean":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if loss_agg == "seq_mean_token_mean":
        return ((per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)).mean()
    if loss_agg == "seq_mean_token_sum_norm":
        return (per_token * mask).sum() / (mask.shape[0] * response_length)
    raise ValueError(f"unknown loss aggregation {loss_agg!r}; one of {', '.join(LOSS_AGGS)}")


def grpo_loss(
    outputs,
    mb: dict,
    *,
    clip_low: float,
    clip_high: float,
    kl_coef: float,
    response_length: int,
    loss_agg: str = "seq_mean_token_mean",
    policy_loss: str = "ppo_clip",
    clip_ratio_c: Optional[float] = None,
    token_sum: Optional[bool] = None,
):
    """The GRPO objective on a minibatch's response tokens (see the module's docstring).

    Every tensor spans the whole sequence's next-token positions (b, T-1); ``mask`` picks the
    response's (its prompt's last position on, up to and including its EOS), which is all that
    counts, so prompts and responses of any length share one batch.

    Args:
        outputs: ``(logprobs, entropy)`` from the policy, each (b, T-1).
        mb: ``old_logprobs`` (b, T-1), ``advantages`` (b,), ``mask`` (b, T-1), and with ``kl_coef`` > 0
            ``ref_logprobs`` (b, T-1).
        clip_low, clip_high: The ratio's clip range ``[1 - clip_low, 1 + clip_high]`` (of the
            sequence ratio with ``gspo``).
        loss_agg: One of :data:`LOSS_AGGS`.
        policy_loss: One of :data:`POLICY_LOSSES`.
        clip_ratio_c: The dual clip's cap (> 1) for negative advantages; None: off.
        token_sum: The older name of the aggregation: True is ``seq_mean_token_sum_norm``, False
            ``seq_mean_token_mean`` (None: ``loss_agg`` decides).

    Returns:
        ``(loss, metrics)``: ``clip_fraction`` (tokens whose ratio was clipped), ``entropy`` (of the
        policy's next-token distribution, per token), ``approx_kl`` (``mean(old - new)``), with the
        dual clip ``dual_clip_fraction`` (tokens it capped) and, with the KL term, ``kl`` (the k3
        estimate per token).
    """
    if token_sum is not None:
        loss_agg = "seq_mean_token_sum_norm" if token_sum else "seq_mean_token_mean"
    new, entropy = outputs
    mask = mb["mask"]
    off = mask == 0  # off the response nothing counts (an engine's log-probs there may be NaN)
    old = mb["old_logprobs"].masked_fill(off, 0.0)
    log_ratio = (new - old).masked_fill(off, 0.0)  # (b, T-1)
    if policy_loss == "gspo":
        seq = (log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (b,) log s_i
        log_ratio = (seq.detach().unsqueeze(1) + (new - new.detach())).masked_fill(off, 0.0)  # value s_i
    elif policy_loss != "ppo_clip":
        raise ValueError(f"unknown policy loss {policy_loss!r}; one of {', '.join(POLICY_LOSSES)}")
    ratio = torch.exp(log_ratio)
    adv = mb["advantages"].unsqueeze(1)  # (b, 1): every token of a response shares its advantage
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)  # (b, T-1)
    if clip_ratio_c is not None:
        capped = torch.min(per_token, -clip_ratio_c * adv)
        dual = (adv < 0) & (capped < per_token)
        per_token = torch.where(adv < 0, capped, per_token)
    if kl_coef > 0:
        d = (mb["ref_logprobs"].masked_fill(off, 0.0) - new).masked_fill(off, 0.0)
        k3 = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * k3
    loss = aggregate(per_token, mask, loss_agg, response_length)

    def mean(x: torch.Tensor) -> float:
        return ((x * mask).sum() / mask.sum().clamp(min=1)).item()

    with torch.no_grad():
        clipped = ((ratio < 1 - clip_low) | (ratio > 1 + clip_high)).float()
        metrics = {
            "clip_fraction": mean(clipped),
            "entropy": mean(entropy),
            "approx_kl": mean(old - new),
        }
        if clip_ratio_c is not None:
            metrics["dual_clip_fraction"] = mean(dual.float())
        if kl_coef > 0:
            metrics["kl"] = mean(k3)
    return loss, metrics


def response_mask(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) float: 1 on the next-token positions that predict each row's response tokens
    (from its prompt's last position, for its response's length)."""
    pos = torch.arange(width).unsqueeze(0)  # (1, width)
    start = (prompt_lengths - 1).unsqueeze(1)
    return ((pos >= start) & (pos < start + response_lengths.unsqueeze(1))).float()
