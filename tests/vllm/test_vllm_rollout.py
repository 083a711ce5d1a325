"""The vLLM rollout engine on this machine's build of vLLM (CPU or CUDA): sampling from token ids
with the engine's log-probs, the weight update streamed tensor by tensor, and its failures.

Skipped where vLLM is not installed; CI installs it as docs/vllm.md says (`scripts/test.sh`)."""

import time
import warnings

import pytest
import torch
from hf_checkpoints import LLAMA_FIELDS

pytest.importorskip("vllm", reason="vLLM is not installed: see docs/vllm.md")
transformers = pytest.importorskip("transformers")

from chatlearn_mem.engines import digest  # noqa: E402
from chatlearn_mem.engines.vllm_rollout import (  # noqa: E402
    EngineError,
    EngineWarning,
    SyncVerificationError,
    VLLMRollout,
    canary_tokens,
    check_vllm_install,
    mismatch_bound,
)
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
assert TOL < mismatch_bound("fp32").mean_abs  # the tier's tolerance is tighter than the default bound


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf.save_random_hf(CFG, path, seed=0)
    return path


@pytest.fixture(scope="module")
def log_file(tmp_path_factory):
    return tmp_path_factory.mktemp("log") / "vllm.log"


@pytest.fixture(scope="module")
def engine(checkpoint, log_file):
    t0 = time.perf_counter()
    e = VLLMRollout(checkpoint, CFG, seed=0, max_num_seqs=8, log_file=log_file)
    e.wall_seconds = time.perf_counter() - t0  # the test's own clock around the constructor
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
    # start_seconds is the constructor's start and first generate: most of the constructor's time
    assert 0.5 * engine.wall_seconds < engine.start_seconds <= engine.wall_seconds


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


def _perturbed(items, target: str):
    """The stream, with ``target`` moved by one ulp in place after it was yielded: after the
    export's digest hashed it, before the engine copied it (vLLM copies a layer's weights once the
    layer's last one arrived, and k is not the last of the attention's)."""
    for name, t in items:
        t = t.clone()
        yield name, t
        if name == target:
            t.view(-1)[5] = torch.nextafter(t.view(-1)[5], torch.tensor(float("inf")))


def test_every_update_is_verified_by_a_digest_that_both_sides_compute(engine, reference):
    weights = sorted(_weights(reference).items())
    stats = engine.sync_weights(weights)
    exported = digest.StreamDigest(CFG)
    for name, t in weights:
        exported.update(name, t)
    held = engine.weights_digest()
    assert stats.digest == exported.result().hexdigest == held.hexdigest
    assert list(held.params) == [p.name for p in digest.engine_params(CFG)]  # every engine parameter, merged ones too
    assert 0 < stats.hash_seconds < stats.seconds and 0 < stats.verify_seconds < stats.seconds


def test_a_perturbed_or_incomplete_update_raises_before_anything_samples(engine, reference):
    weights = sorted(_weights(reference).items())
    target = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(
        SyncVerificationError, match="model.layers.1.self_attn.qkv_proj.weight is not the exported"
    ) as e:
        engine.sync_weights(_perturbed(weights, target))
    assert e.value.param == "model.layers.1.self_attn.qkv_proj.weight"
    with pytest.raises(EngineError, match="did not verify"):
        engine.generate(_prompts(), 2, temperature=1.0)
    with pytest.raises(EngineError, match="did not verify"):
        engine.score(_prompts())
    with pytest.raises(EngineError, match=r"incomplete: 1 tensor\(s\) missing \(first model.layers.0.mlp.up_proj"):
        engine.sync_weights([p for p in weights if p[0] != "model.layers.0.mlp.up_proj.weight"])
    with pytest.raises(EngineError, match="incomplete"):
        engine.generate(_prompts(), 2, temperature=1.0)
    assert engine.sync_weights(weights).digest is not None  # a complete, verified update: usable again
    engine.generate(_prompts(), 2, temperature=1.0)


def test_the_engine_side_digest_reads_what_the_engine_holds(engine, reference):
    weights = sorted(_weights(reference).items())
    before = engine.sync_weights(weights).digest

    def nudge_norm(worker):
        w = worker.model_runner.model.model.norm.weight
        w.data[0] = torch.nextafter(w.data[0], torch.tensor(float("inf")))

    engine._llm.collective_rpc(nudge_norm)  # behind the wrapper's back: only the engine's own read sees it
    try:
        held = engine.weights_digest()
        assert held.hexdigest != before
        synced = digest.StreamDigest(CFG)
        for name, t in weights:
            synced.update(name, t)
        assert synced.result().first_difference(held) == "model.norm.weight"
    finally:
        engine.sync_weights(weights)


def test_the_canary_agrees_with_the_trainers_log_probs_and_a_wrong_one_stops_the_engine(engine, reference):
    weights = sorted(_weights(reference).items())
    engine.sync_weights(weights)
    trainer = _logprobs(reference, canary_tokens(CFG.vocab_size), 1.0)[0]
    assert engine.check_canary(trainer).max_abs < TOL
    with pytest.raises(
        SyncVerificationError,
        match=r"canary's log-probs are off the trainer's by 0.002 at most .*\(bounds 0.001 and 0.0002 for fp32\)",
    ):
        engine.check_canary(trainer + 2e-3)
    with pytest.raises(EngineError, match="canary"):
        engine.generate(_prompts(), 2, temperature=1.0)
    engine.sync_weights(weights)
    with pytest.raises(SyncVerificationError, match="by nan at most"):  # a non-finite mismatch is an error too
        engine.check_canary(torch.full_like(trainer, float("nan")))
    engine.sync_weights(weights)


def test_the_engines_memory_is_its_weights_and_the_kv_cache_it_allocated(engine):
    memory = engine.memory()
    hf_bytes = 4 * sum(torch.Size(s).numel() for s in hf.hf_shapes(CFG).values())
    if engine.cuda:
        assert memory.device == "cuda" and memory.weights_bytes >= hf_bytes and memory.kv_cache_bytes > 0
    else:  # the CPU build: the configured KV cache (1 GiB), and every GEMM weight packed for its kernels
        assert memory.device == "cpu" and memory.kv_cache_bytes == 2**30
        assert hf_bytes <= memory.weights_bytes <= 2 * hf_bytes
    assert memory.total_bytes == memory.weights_bytes + memory.kv_cache_bytes


def test_the_engines_own_log_goes_to_its_file_and_a_sync_says_nothing_on_the_console(
    engine, reference, log_file, capfd
):
    weights = sorted(_weights(reference).items())
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        engine.sync_weights(weights)
        engine.generate(_prompts(), 2, temperature=1.0)
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # no "Reloading and processing weights", no benign "Failed to load weights"
    assert not [w for w in said if issubclass(w.category, EngineWarning)]
    text = log_file.read_text()
    assert "Reloading and processing weights" in text and "RotaryEmbedding: Failed to load weights" in text
    assert "Initializing a V1 LLM engine" in text  # its start-up too
    assert engine.log_file == str(log_file)


def test_the_install_check_passes_in_this_environment():
    assert check_vllm_install(timeout_s=300) in ("cpu", "cuda")
