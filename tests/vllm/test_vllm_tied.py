"""The vLLM rollout with tied embeddings, in a module of its own: vLLM keeps one engine's parallel
state per process, so this engine starts only once the other module's has closed."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: see docs/vllm.md")
transformers = pytest.importorskip("transformers")

from test_vllm_rollout import CFG, TOL, _logprobs, _prompts  # noqa: E402

from chatlearn_mem.engines.vllm_rollout import VLLMRollout  # noqa: E402
from chatlearn_mem.models import hf  # noqa: E402


def test_a_tied_head_follows_the_updated_embedding(tmp_path):
    # vLLM 0.32's in-place reload never reprocesses a tied head (it receives no weights of its own),
    # whose packed CPU copy then kept the old embedding: the PPO run's check found the engine 0.19 off
    # the policy after its first update.
    cfg = CFG.model_copy(update={"share_embeddings_and_output_weights": True})
    hf.save_random_hf(cfg, tmp_path, seed=0)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    engine = VLLMRollout(tmp_path, cfg, seed=0, max_num_seqs=8)
    try:
        g = torch.Generator().manual_seed(5)
        new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
        new = {k: v for k, v in new.items() if k in engine.names}
        assert "lm_head.weight" not in new  # tied: the export has no head of its own
        engine.sync_weights(iter(sorted(new.items())))
        model.load_state_dict(new, strict=False)  # the head follows: it is the same tensor
        tokens, _ = engine.generate(_prompts(), 6, temperature=1.0)
        assert (engine.score(tokens) - _logprobs(model, tokens, 1.0)).abs().max().item() < TOL
    finally:
        engine.close()
