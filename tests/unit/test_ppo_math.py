"""The PPO recipe's math and the weight-sync helpers, on hand-checked numbers (no Ray)."""

import pytest
import torch

from chatlearn_mem_ray.actors import modeling
from chatlearn_mem_ray.inputs.tasks import TaskConfig, token_range_reward
from chatlearn_mem_ray.loops.ppo import gae, policy_loss, value_loss
from chatlearn_mem_ray.service.weight_sync import weight_sync_mismatch


def test_token_range_reward():
    responses = torch.tensor([[0, 1, 20, 63], [16, 15, 3, 64]])
    assert token_range_reward(responses, TaskConfig(target_low=0, target_high=16)).tolist() == [0.5, 0.5]
    assert token_range_reward(responses, TaskConfig(target_low=16, target_high=64)).tolist() == [0.5, 0.25]


def test_gae_matches_the_recursion_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.75]])
    gamma, lam = 0.9, 0.5
    d2 = 1.0 - 0.75
    d1 = 0.0 + gamma * 0.75 - 0.25
    d0 = 0.0 + gamma * 0.25 - 0.5
    a2 = d2
    a1 = d1 + gamma * lam * a2
    a0 = d0 + gamma * lam * a1
    adv, ret = gae(rewards, values, gamma, lam)
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]]))
    assert torch.allclose(ret, adv + values)


def test_policy_loss_clips_the_ratio():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 0.5]]))  # ratios 1.5 and 0.5
    logprobs = torch.cat([torch.zeros(1, 1), new], dim=1)  # prompt_length 2: response starts at index 1
    mb = {"old_logprobs": old, "advantages": torch.tensor([[1.0, -1.0]])}
    loss, metrics = policy_loss(logprobs, mb, prompt_length=2, clip_ratio=0.2)
    # token 0: min(1.5, 1.2) * 1 = 1.2; token 1: min(0.5 * -1, 0.8 * -1) = -0.8
    assert loss.item() == pytest.approx(-(1.2 - 0.8) / 2)
    assert metrics["clip_fraction"] == 1.0


def test_value_loss_clips_around_the_old_value():
    values = torch.tensor([[9.0, 2.0, 9.0]])  # prompt_length 1: response values are positions 0..1
    mb = {"old_values": torch.tensor([[1.0, 1.0]]), "returns": torch.tensor([[2.0, 2.0]])}
    loss, _ = value_loss(values, mb, prompt_length=1, value_clip=0.5)
    # position 0: max((9-2)^2, (1.5-2)^2) = 49; position 1: max(0, (1.5-2)^2) = 0.25
    assert loss.item() == pytest.approx(0.5 * (49 + 0.25) / 2)


def test_tensor_parallel_split_and_merge_round_trip():
    state = {"col": torch.arange(24.0).view(6, 4), "row": torch.arange(12.0).view(2, 6), "norm": torch.ones(4)}
    dims = {"col": 0, "row": 1, "norm": -1}
    shards = modeling.split_tensor_parallel(state, dims, 2)
    assert shards[0]["col"].shape == (3, 4) and shards[1]["row"].shape == (2, 3)
    assert shards[1]["norm"] is state["norm"]
    merged = modeling.merge_tensor_parallel(shards, dims)
    assert all(torch.equal(merged[k], state[k]) for k in state)


def test_digest_sees_every_bit_and_the_names():
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "s": torch.tensor(3.0)}
    same = {"s": torch.tensor(3.0), "w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16)}
    assert modeling.weights_digest(a) == modeling.weights_digest(same)
    flipped = {"w": a["w"].clone(), "s": a["s"]}
    flipped["w"].view(torch.int16)[0] ^= 1  # one mantissa bit
    assert modeling.weights_digest(flipped) != modeling.weights_digest(a)
    assert modeling.weights_digest({"v": a["w"], "s": a["s"]}) != modeling.weights_digest(a)
    assert weight_sync_mismatch(["x", "y"], ["x", "y"]) is None
    assert "shard(s) [1]" in weight_sync_mismatch(["x", "y"], ["x", "z"])
