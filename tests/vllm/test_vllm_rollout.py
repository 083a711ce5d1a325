"""The vLLM rollout engine on this machine's build of vLLM (CPU or CUDA): sampling from token ids
with the engine's log-probs, the weight update streamed tensor by tensor, and its failures.

Skipped where vLLM is not installed; CI installs it as docs/vllm.md says (`scripts/test.sh`)."""

import pytest
import torch
from hf_checkpoints import LLAMA_FIELDS

pytest.importorskip("vllm", reason="vLLM is not installed: see docs/vllm.md")
transformers = pytest.importorskip("transformers")

from chatlearn_mem.engines.vllm_rollout import EngineError, VLLMRollout  # noqa: E402
from chatlearn_mem.models import hf  # noqa: E402
from chatlearn_mem.models.gpt import GPTTrainerConfig  # noqa: E402

# vLLM's CPU attention needs a head dimension of 32 or more: 2 heads of 64, one key/value group.
CFG = GPTTrainerConfig(
    num_layers=2,
    hidden_size=128,
    num_attention_heads=2,
    num_query_groups=1,
    ffn_hidden_size=256,
    vocab_size=64,
    seq_length=32,
    norm_epsilon=1e-5,
    **LLAMA_FIELDS,
    share_embeddings_and_output_weights=False,
    precision="fp32",
)
TOL = 1e-5  # fp32 log-probs, engine against transformers on the same weights


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf.save_random_hf(CFG, path, seed=0)
    return path


@pytest.fixture(scope="module")
def engine(checkpoint):
    e = VLLMRollout(checkpoint, CFG, seed=0, max_num_seqs=8)
    yield e
    e.close()


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _logprobs(model, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, T - 1): log-probability of each next token at ``temperature``."""
    with torch.no_grad():
        logits = model(tokens).logits[:, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None])[..., 0]


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in hf_names()}


def hf_names() -> set[str]:
    from chatlearn_mem.engines.vllm_rollout import expected_names

    return expected_names(CFG)


def _prompts(n: int = 4, length: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n, length), generator=torch.Generator().manual_seed(seed))


def test_generate_samples_reproducibly_with_the_log_probs_the_trainer_computes(engine, reference):
    prompts = _prompts()
    tokens, logprobs = engine.generate(prompts, 8, temperature=0.7, seed=3)
    assert tokens.shape == (4, 13) and logprobs.shape == (4, 8) and torch.equal(tokens[:, :5], prompts)
    again, _ = engine.generate(prompts, 8, temperature=0.7, seed=3)
    assert torch.equal(again, tokens)  # a seed per request: the same tokens however they are batched
    other, _ = engine.generate(prompts, 8, temperature=0.7, seed=4)
    assert not torch.equal(other, tokens)
    ref = _logprobs(reference, tokens, 0.7)[:, 4:]
    assert (logprobs - ref).abs().max().item() < TOL  # after temperature, like the trainer's
    assert engine.score(tokens).sub(_logprobs(reference, tokens, 1.0)).abs().max().item() < TOL
    assert engine.start_seconds > 0


def test_a_streamed_update_takes_and_the_engine_serves_the_new_weights(engine, reference):
    before = _weights(reference)
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in before.items()}
    items = sorted(new.items())
    buckets = [items[i : i + 3] for i in range(0, len(items), 3)]  # lists of pairs, as hf_weight_buckets gives
    tokens, _ = engine.generate(_prompts(seed=2), 6, temperature=1.0, seed=0)
    old_scores = engine.score(tokens)
    stats = engine.sync_weights(buckets)
    assert stats.tensors == len(hf_names()) and stats.nbytes == sum(v.numel() * 4 for v in new.values())
    reference.load_state_dict(new, strict=False)
    try:
        scores = engine.score(tokens)
        assert (scores - _logprobs(reference, tokens, 1.0)).abs().max().item() < TOL
        assert (scores - old_scores).abs().max().item() > 1e-3  # the update took
    finally:
        reference.load_state_dict(before, strict=False)
        engine.sync_weights(iter(sorted(before.items())))  # pairs one by one
    assert (engine.score(tokens) - old_scores).abs().max().item() < TOL


def test_an_incomplete_update_is_an_error_and_sampling_waits_for_a_complete_one(engine, reference):
    weights = sorted(_weights(reference).items())
    with pytest.raises(EngineError, match=r"incomplete: 1 tensor\(s\) missing \(first model.norm.weight\)"):
        engine.sync_weights([p for p in weights if p[0] != "model.norm.weight"])
    with pytest.raises(EngineError, match="generate: the last weight update was incomplete"):
        engine.generate(_prompts(), 2, temperature=1.0)
    with pytest.raises(EngineError, match="came twice"):
        engine.sync_weights(weights + weights[:1])
    engine.sync_weights(weights)
    tokens, _ = engine.generate(_prompts(), 2, temperature=1.0)
    assert (engine.score(tokens) - _logprobs(reference, tokens, 1.0)).abs().max().item() < TOL


def test_another_architecture_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ValueError, match="Llama or Qwen2"):
        VLLMRollout(tmp_path, GPTTrainerConfig())


def test_sleep_on_a_cpu_build_is_said_once_and_keeps_the_engine_usable(engine):
    if engine.cuda:
        pytest.skip("a CUDA build sleeps: the GPU tier tests it")
    with pytest.warns(UserWarning, match="cannot sleep"):
        engine.sleep()
    engine.sleep()  # said once
    engine.wake_up()
    assert engine.generate(_prompts(), 2, temperature=1.0)[0].shape == (4, 7)
