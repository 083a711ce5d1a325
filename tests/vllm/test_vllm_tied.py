"""The vLLM rollout with tied embeddings, in a module of its own: vLLM keeps one engine's parallel
state per process, so this engine starts only once the other module's has closed."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: see docs/vllm.md")
transformers = pytest.importorskip("transformers")

from test_vllm_rollout import CFG, TOL, _logprobs, _prompts  # noqa: E402

from chatlearn_mem.engines import _vllm_worker  # noqa: E402
from chatlearn_mem.engines.vllm_rollout import SyncVerificationError, VLLMRollout  # noqa: E402
from chatlearn_mem.models import hf  # noqa: E402

TIED = CFG.model_copy(update={"share_embeddings_and_output_weights": True})


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = tmp_path_factory.mktemp("tied")
    hf.save_random_hf(TIED, path, seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = VLLMRollout(path, TIED, seed=0, max_num_seqs=8)
    yield model, engine
    engine.close()


def _updated(model, engine, seed):
    g = torch.Generator().manual_seed(seed)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    return {k: v for k, v in new.items() if k in engine.names}


def test_a_tied_head_follows_the_updated_embedding(setup):
    # vLLM 0.32's in-place reload never reprocesses a tied head (it receives no weights of its own),
    # whose packed CPU copy then kept the old embedding: the PPO run's check found the engine 0.19 off
    # the policy after its first update.
    model, engine = setup
    new = _updated(model, engine, seed=5)
    assert "lm_head.weight" not in new  # tied: the export has no head of its own
    stats = engine.sync_weights(iter(sorted(new.items())))
    assert stats.digest == engine.weights_digest().hexdigest  # the head read back through its kernel
    model.load_state_dict(new, strict=False)  # the head follows: it is the same tensor
    tokens, _ = engine.generate(_prompts(), 6, temperature=1.0)
    assert (engine.score(tokens) - _logprobs(model, tokens, 1.0)).abs().max().item() < TOL


def test_the_digest_finds_a_tied_head_left_stale(setup, monkeypatch):
    # Without the wrapper's refresh, the bug above comes back: the digest, not the log-probs of a
    # later phase, now stops it at the update, naming the head.
    model, engine = setup
    monkeypatch.setattr(_vllm_worker, "refresh_tied_head", lambda worker: "skipped")
    new = _updated(model, engine, seed=6)
    with pytest.raises(SyncVerificationError, match="the engine's lm_head.weight is not the exported one") as e:
        engine.sync_weights(iter(sorted(new.items())))
    assert e.value.param == "lm_head.weight"  # the embedding itself took; only its packed head copy is old
    monkeypatch.undo()
    engine.sync_weights(iter(sorted(new.items())))
    tokens, _ = engine.generate(_prompts(), 6, temperature=1.0)
    model.load_state_dict(new, strict=False)
    assert (engine.score(tokens) - _logprobs(model, tokens, 1.0)).abs().max().item() < TOL
