"""The PPO recipe's log-probabilities describe the distribution the rollout samples from: at a
temperature other than 1 the sampled tokens' log-probs are those of softmax(logits / T)."""

import pytest
import torch

from chatlearn_mem.models import gpt


@pytest.fixture
def model(dist1):
    cfg = gpt.GPTTrainerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
    m = gpt.build_gpt_model(cfg)
    m.eval()
    return m


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_logprobs_are_those_of_the_tempered_distribution(model, temperature):
    from chatlearn_mem_ray.actors import modeling

    tokens = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(tokens[:, :-1], torch.arange(11).expand(3, 11), None).float()  # (B, T-1, V)
        expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens[:, 1:, None])[..., 0]
        got = modeling.sequence_logprobs(model, tokens, temperature)
    assert got.shape == (3, 11)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_generate_then_logprobs_match_the_sampling_probabilities(model):
    """What the bug got wrong: tokens sampled at T=0.5 were scored under T=1."""
    from chatlearn_mem_ray.actors import modeling

    prompts = torch.randint(0, 64, (4, 3), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        tokens = modeling.generate(model, prompts, 5, 0.5, torch.Generator().manual_seed(2))
        lp = modeling.sequence_logprobs(model, tokens, 0.5)[:, 2:]  # (B, 5): the sampled tokens
        for t in range(5):
            prefix = tokens[:, : 3 + t]
            logits = model(prefix, torch.arange(prefix.shape[1]).expand_as(prefix), None)[:, -1, :].float()
            probs = torch.softmax(logits / 0.5, dim=-1)
            sampled = probs.gather(-1, tokens[:, 3 + t, None])[:, 0]
            torch.testing.assert_close(lp[:, t].exp(), sampled, rtol=1e-4, atol=1e-6)


def test_temperature_zero_is_refused():
    from chatlearn_mem import ConfigError
    from chatlearn_mem_ray import load_config, modeling

    with pytest.raises(ValueError, match="temperature must be > 0"):
        modeling.sequence_logprobs(None, torch.zeros(1, 2, dtype=torch.long), 0.0)
    with pytest.raises(ConfigError, match=r"ppo\.temperature: Input should be greater than 0"):
        load_config("cpu_tiny", ["ppo.temperature=0"])
