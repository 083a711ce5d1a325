"""GRPO's math: advantages within each prompt's group, the clipped objective with a KL term, and
which positions of a right-padded batch are a response's.

Math (per response token ``t``, ``r = exp(logp_t - logp_old_t)``; ``A`` the response's advantage):
``loss_t = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) + kl_coef * k3_t`` with the k3
estimator ``k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1`` (non-negative, unbiased for
KL(policy || reference)). GRPO averages each response's token losses, then the responses; Dr.
GRPO sums every token loss and divides by ``responses x response_length``.
"""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "grpo_loss", "response_mask"]


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
