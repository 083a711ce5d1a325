"""GRPO's loss, advantage and sampling options on numbers worked by hand from each paper's definition,
and the gradient of every loss option checked against finite differences (``torch.autograd.gradcheck``
in float64): the three aggregations (DAPO's token mean, GRPO's sequence mean, Dr. GRPO's constant
norm), the dual clip, GSPO's sequence ratio (its token-level form against the paper's sequence-level
objective), the RLOO and REINFORCE++ baselines, DAPO's dynamic sampling and the unbiased pass@k."""

import itertools
import math

import pytest
import torch

from chatlearn_mem_ray.loops.grpo.config import GRPOConfig, load_grpo_config
from chatlearn_mem_ray.loops.grpo.losses import LOSS_AGGS, advantages, grpo_loss
from chatlearn_mem_ray.loops.grpo.sampling import Rollouts, keep_groups, pass_at_k

P = 2  # prompt tokens: one prompt position before the response's positions


def _full(x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """(b, R) response positions -> (b, P-1+R) next-token positions."""
    return torch.cat([torch.full((x.shape[0], P - 1), fill, dtype=x.dtype), x], dim=1)


def _batch(new, old, adv, mask):
    mb = {"old_logprobs": _full(old, math.nan), "advantages": adv, "mask": _full(mask)}
    return (_full(new), torch.zeros_like(_full(new))), mb


KW = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.0, response_length=3)
# ratios 1.5, 1, 0.5 for response 0 (A = 1), 1 for response 1 (A = -1), which stopped after one token
NEW = torch.log(torch.tensor([[1.5, 1.0, 0.5], [1.0, 1.0, 1.0]]))
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
ADV = torch.tensor([1.0, -1.0])


@pytest.mark.parametrize(
    "loss_agg, expected",
    [
        ("token_mean", (-1.28 - 1.0 - 0.5 + 1.0) / 4),  # DAPO: 4 tokens, each once
        ("seq_mean_token_mean", ((-1.28 - 1.0 - 0.5) / 3 + 1.0) / 2),  # GRPO: each response once
        ("seq_mean_token_sum_norm", ((-1.28 - 1.0 - 0.5) / 3 + 1.0 / 3) / 2),  # Dr. GRPO: sums over 3
    ],
)
def test_each_aggregation_by_hand(loss_agg, expected):
    # token losses: -min(1.5, 1.28) = -1.28, -1, -min(0.5, 0.8) = -0.5; and -min(-1, -1) = +1
    loss, m = grpo_loss(*_batch(NEW, torch.zeros(2, 3), ADV, MASK), loss_agg=loss_agg, **KW)
    assert loss.item() == pytest.approx(expected)
    assert m["clip_fraction"] == pytest.approx(2 / 4)


def test_the_older_token_sum_flag_names_two_of_the_aggregations():
    args = _batch(NEW, torch.zeros(2, 3), ADV, MASK)
    for flag, agg in ((True, "seq_mean_token_sum_norm"), (False, "seq_mean_token_mean")):
        assert grpo_loss(*args, token_sum=flag, **KW)[0].item() == grpo_loss(*args, loss_agg=agg, **KW)[0].item()


def test_the_dual_clip_caps_a_negative_advantage_and_leaves_the_rest():
    new = torch.log(torch.tensor([[5.0, 2.0], [5.0, 2.0]])).requires_grad_()
    adv, mask = torch.tensor([-1.0, 1.0]), torch.ones(2, 2)
    (logprobs, ent), mb = _batch(new, torch.zeros(2, 2), adv, mask)
    loss, m = grpo_loss((logprobs, ent), mb, clip_ratio_c=3.0, loss_agg="token_mean", **KW)
    # A = -1: PPO's token losses are max(r, clip(r)) = 5 and 2; the cap 3 |A| takes 5 down to 3.
    # A = +1: -min(r, 1.28) = -1.28 twice, untouched by the dual clip.
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.28 - 1.28) / 4)
    assert m["dual_clip_fraction"] == pytest.approx(1 / 4)
    loss.backward()
    grad = new.grad  # (b, R): the response positions
    assert grad[0, 0] == 0.0  # capped: a constant, no push
    assert grad[0, 1].item() == pytest.approx(2.0 / 4)  # d(r)/d(logp) = r, over 4 tokens
    assert grad[1].tolist() == [0.0, 0.0]  # clipped above 1.28 with A > 0
    plain, _ = grpo_loss(*_batch(new.detach(), torch.zeros(2, 2), adv, mask), loss_agg="token_mean", **KW)
    assert plain.item() == pytest.approx((5.0 + 2.0 - 1.28 - 1.28) / 4)  # off unless set


def test_gspo_takes_the_geometric_mean_of_the_token_ratios_and_clips_per_sequence():
    old = torch.zeros(2, 2)
    new = torch.log(torch.tensor([[1.2, 0.9], [1.0002, 1.0]]))  # s = sqrt(1.08) = 1.0392; sqrt(1.0002) = 1.0001
    adv, mask = torch.tensor([1.0, 1.0]), torch.ones(2, 2)
    kw = dict(KW, clip_low=3e-4, clip_high=4e-4)  # the paper's clip range
    loss, m = grpo_loss(*_batch(new, old, adv, mask), policy_loss="gspo", **kw)
    s1 = math.sqrt(1.0002)
    assert loss.item() == pytest.approx((-(1 + 4e-4) - s1) / 2)  # the first sequence clipped at 1 + 4e-4
    assert m["clip_fraction"] == pytest.approx(2 / 4)  # both tokens of the clipped sequence
    token_level, _ = grpo_loss(*_batch(new, old, adv, mask), **kw)  # PPO's per-token clip of the same ratios
    assert token_level.item() != pytest.approx(loss.item())


def test_gspo_token_form_equals_the_papers_sequence_objective_in_value_and_gradient():
    """GSPO (Zheng et al. 2025, eq. 5-7): J = mean_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t
    log r_it). The implementation's token-level form, aggregated seq_mean_token_mean, is the same
    function with the same gradient (away from the clip's kinks)."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(4, 5, dtype=torch.float64, generator=g) * 0.01
    new = (old + torch.randn(4, 5, dtype=torch.float64, generator=g) * 0.01).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0], dtype=torch.float64)
    lo, hi = 0.005, 0.006
    loss, _ = grpo_loss(
        (_full(new), _full(new).detach()),
        {"old_logprobs": _full(old), "advantages": adv, "mask": _full(mask)},
        policy_loss="gspo",
        loss_agg="seq_mean_token_mean",
        clip_low=lo,
        clip_high=hi,
        kl_coef=0.0,
        response_length=5,
    )
    (grad,) = torch.autograd.grad(loss, new)
    s = torch.exp(((new - old) * mask).sum(1) / mask.sum(1))
    paper = -torch.min(s * adv, s.clamp(1 - lo, 1 + hi) * adv).mean()
    (paper_grad,) = torch.autograd.grad(paper, new)
    assert loss.item() == pytest.approx(paper.item(), rel=1e-12)
    assert torch.allclose(grad * mask, paper_grad * mask, rtol=1e-10, atol=1e-14)
    clipped = (s < 1 - lo) | (s > 1 + hi)
    assert clipped.any() and not clipped.all()  # the example has both cases


@pytest.mark.parametrize(
    "policy_loss, loss_agg, dual", list(itertools.product(("ppo_clip", "gspo"), LOSS_AGGS, (None, 3.0)))
)
def test_every_loss_option_has_the_gradient_finite_differences_give(policy_loss, loss_agg, dual):
    g = torch.Generator().manual_seed(1)
    old = torch.randn(3, 4, dtype=torch.float64, generator=g)
    # ratios well inside or well outside the clip ranges (no kink within the finite-difference step)
    offsets = torch.tensor([[0.05, -0.4, 0.3, 0.0], [1.4, 0.02, -0.01, 0.2], [-0.03, 0.04, 0.6, -0.7]])
    new0 = (old + offsets.to(torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64)
    ref = old + 0.1
    clip = (0.02, 0.03) if policy_loss == "gspo" else (0.2, 0.28)

    def f(new):
        loss, _ = grpo_loss(
            (_full(new), torch.zeros_like(_full(new))),
            {"old_logprobs": _full(old), "advantages": adv, "mask": _full(mask), "ref_logprobs": _full(ref)},
            policy_loss=policy_loss,
            loss_agg=loss_agg,
            clip_ratio_c=dual,
            clip_low=clip[0],
            clip_high=clip[1],
            kl_coef=0.1,
            response_length=4,
        )
        return loss

    assert torch.autograd.gradcheck(f, (new0,), eps=1e-6, atol=1e-8)


def test_rloo_takes_the_other_responses_mean_as_the_baseline():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.2, 0.4, 0.6, 0.8])
    a = advantages(r, 4, "rloo")
    # A_i = r_i - (sum of the other three) / 3
    assert a[:4].tolist() == pytest.approx([1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3])
    assert a[4:].tolist() == pytest.approx([0.2 - 1.8 / 3, 0.4 - 1.6 / 3, 0.6 - 1.4 / 3, 0.8 - 1.2 / 3])
    assert a.tolist() == pytest.approx((4 / 3 * advantages(r, 4, "dr_grpo")).tolist())  # = G/(G-1)(r - mean)


def test_reinforce_pp_whitens_the_group_centred_rewards_over_the_batchs_tokens():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0])  # two groups of 2: centred 0.5, -0.5, 0, 0
    even = advantages(r, 2, "reinforce_pp")
    assert even.tolist() == pytest.approx([x / math.sqrt(1 / 6 + 1e-8) for x in (0.5, -0.5, 0.0, 0.0)])
    lengths = torch.tensor([2, 1, 1, 1])
    a = advantages(r, 2, "reinforce_pp", lengths=lengths)
    # by hand: token-weighted mean 0.1, unbiased variance ((2 x 0.4^2 + 0.6^2 + 2 x 0.1^2) / 5) x 5/4 = 0.175
    assert a.tolist() == pytest.approx([(x - 0.1) / math.sqrt(0.175 + 1e-8) for x in (0.5, -0.5, 0.0, 0.0)])
    # verl's masked_whiten of the token matrix, each token carrying its response's value
    width = int(lengths.max())
    mask = (torch.arange(width)[None] < lengths[:, None]).float()
    values = torch.tensor([0.5, -0.5, 0.0, 0.0])[:, None] * mask
    n = mask.sum()
    mean = (values * mask).sum() / n
    var = (((values - mean) ** 2) * mask).sum() / n * n / (n - 1)
    assert a.tolist() == pytest.approx((((values - mean) * torch.rsqrt(var + 1e-8))[:, 0]).tolist())


def test_grpo_and_dr_grpo_advantages_stay_as_they_were():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    x = 0.5 / (torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item() + 1e-6)
    assert advantages(r, 4, "grpo").tolist() == pytest.approx([x, -x, -x, x])
    assert advantages(r, 4, "dr_grpo").tolist() == [0.5, -0.5, -0.5, 0.5]
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        advantages(r, 4, "ppo")


def test_dynamic_sampling_keeps_groups_with_a_spread_and_fills_up_in_order():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])  # groups of 2: flat, mixed, flat, mixed
    assert keep_groups(scores, 2, 2) == ([2, 3, 6, 7], 2, 0)
    assert keep_groups(scores, 2, 3) == ([0, 1, 2, 3, 6, 7], 1, 1)  # one flat group fills the batch
    assert keep_groups(scores, 2, 1) == ([2, 3], 2, 0)  # more mixed groups than needed: the first


def test_rounds_of_text_join_into_one_batch_padded_to_the_longest():
    a = Rollouts(torch.tensor([[1, 2, 3]]), torch.zeros(1, 2), torch.tensor([1]), torch.tensor([2]),
                 torch.tensor([1.0]), ["p"], ["r"], {"answer": ["x"]}, {"exact": 1.0})  # fmt: skip
    b = Rollouts(torch.tensor([[4, 5, 6, 7], [8, 9, 9, 9]]), torch.ones(2, 3), torch.tensor([2, 1]),
                 torch.tensor([2, 3]), torch.tensor([0.0, 0.5]), ["q", "s"], ["t", "u"], {"answer": ["y", "z"]},
                 {"exact": 0.0})  # fmt: skip
    c = Rollouts.cat([a, b], pad_id=0)
    assert c.tokens.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7], [8, 9, 9, 9]]
    assert math.isnan(c.logprobs[0, 2]) and c.logprobs[1:].tolist() == [[1.0] * 3] * 2
    assert c.fields == {"answer": ["x", "y", "z"]} and c.extra == {"exact": pytest.approx(1 / 3)}
    picked = c.take([2, 0])
    assert picked.texts == ["u", "r"] and picked.scores.tolist() == [0.5, 1.0]


def test_pass_at_k_is_the_unbiased_estimator():
    solved = torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    assert pass_at_k(solved, 1) == pytest.approx((1 / 4 + 0 + 1) / 3)
    assert pass_at_k(solved, 2) == pytest.approx(((1 - 3 / 6) + 0 + 1) / 3)  # 1 - C(3,2)/C(4,2) for c=1
    assert pass_at_k(solved, 4) == pytest.approx(2 / 3)  # any of the four


def test_the_variant_sets_the_defaults_and_explicit_keys_win():
    assert (GRPOConfig().estimator, GRPOConfig().loss_agg) == ("grpo", "seq_mean_token_mean")  # as every run before
    dr = GRPOConfig(variant="dr_grpo")
    assert (dr.estimator, dr.loss_agg) == ("dr_grpo", "seq_mean_token_sum_norm")
    mixed = GRPOConfig(variant="dr_grpo", estimator="rloo", loss_agg="token_mean")
    assert (mixed.estimator, mixed.loss_agg) == ("rloo", "token_mean")
    gspo = load_grpo_config("cpu_grpo", ["grpo.policy_loss=gspo"]).grpo
    assert gspo.ratio_clip == (3e-4, 4e-4) and (gspo.clip_low, gspo.clip_high) == (0.2, 0.28)  # its own defaults
