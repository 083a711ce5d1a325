"""Qwen2 through the real engine: q/k/v biases, grouped-query attention (4 heads, 2 key/value
groups), a vocabulary vLLM pads (100 rows to 128), tied and untied embeddings. One engine per
tying, one after the other (vLLM keeps one engine's parallel state per process).

Each engine starts from a random checkpoint, then takes an update streamed the way the PPO app
streams it: two tensor-parallel ranks' megatron shards, in buckets, merged into Hugging Face
tensors on the way (``hf.megatron_shard_buckets`` / ``hf.merge_shard_buckets``). The megatron
layout is written here by hand, from the layout's definition, so that the digest checks the whole
chain: megatron shards -> Hugging Face tensors -> vLLM's merged parameters."""

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed: see docs/vllm.md")
transformers = pytest.importorskip("transformers")

from hf_checkpoints import LLAMA_FIELDS  # noqa: E402
from test_vllm_rollout import TOL, _logprobs  # noqa: E402

from chatlearn_mem.engines import digest  # noqa: E402
from chatlearn_mem.engines.vllm_rollout import VLLMRollout, mismatch_bound  # noqa: E402
from chatlearn_mem.models import hf  # noqa: E402
from chatlearn_mem.models.gpt import GPTTrainerConfig  # noqa: E402

TP = 2


def qwen2_config(tied: bool) -> GPTTrainerConfig:
    return GPTTrainerConfig(
        num_layers=2,
        hidden_size=128,
        num_attention_heads=4,  # head dimension 32: the least vLLM's CPU attention takes
        num_query_groups=2,
        ffn_hidden_size=256,
        vocab_size=100,
        seq_length=32,
        norm_epsilon=1e-6,
        **{**LLAMA_FIELDS, "add_qkv_bias": True, "rotary_base": 1000000.0},
        share_embeddings_and_output_weights=tied,
        precision="fp32",
    )


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def setup(request, tmp_path_factory):
    cfg = qwen2_config(request.param)
    path = tmp_path_factory.mktemp(f"qwen2_{request.param}")
    hf.save_random_hf(cfg, path, seed=0)
    assert hf.family_of(cfg) is hf.QWEN2 and hf.config_from_hf(path).add_qkv_bias
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = VLLMRollout(path, cfg, seed=0, max_num_seqs=8, log_file=path / "vllm.log")
    yield cfg, model, engine
    engine.close()


def _stream_digest(cfg, weights) -> digest.WeightsDigest:
    d = digest.StreamDigest(cfg)
    for name, t in weights.items():
        d.update(name, t)
    return d.result()


def _hf_weights(model, cfg) -> dict[str, torch.Tensor]:
    names = hf.hf_shapes(cfg)
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k in names}


def megatron_shards(w: dict[str, torch.Tensor], cfg: GPTTrainerConfig, tp: int) -> list[dict[str, torch.Tensor]]:
    """Each tensor-parallel rank's megatron state dict of the Hugging Face weights ``w``: q, k, v
    interleaved by query group (whole groups per rank), gate and up fused per rank, the vocabulary
    and column-parallel outputs cut by rows, row-parallel inputs by columns, norms replicated."""
    d = cfg.hidden_size // cfg.num_attention_heads
    groups = cfg.num_query_groups
    per_rank = groups // tp
    shards = []
    for r in range(tp):
        sd = {
            "embedding.word_embeddings.weight": w["model.embed_tokens.weight"].chunk(tp)[r],
            "decoder.final_layernorm.weight": w["model.norm.weight"],
        }
        if not cfg.share_embeddings_and_output_weights:
            sd["output_layer.weight"] = w["lm_head.weight"].chunk(tp)[r]
        for i in range(cfg.num_layers):
            a, m, out = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp", f"decoder.layers.{i}"
            for kind in ("weight", "bias"):
                q, k, v = (w[f"{a}.{x}_proj.{kind}"] for x in "qkv")
                rest = q.shape[1:]
                mine = slice(r * per_rank, (r + 1) * per_rank)
                grouped = [t.reshape(groups, -1, *rest)[mine] for t in (q, k, v)]  # (G, heads x d, ...)
                assert grouped[1].shape[1] == d
                sd[f"{out}.self_attention.linear_qkv.{kind}"] = torch.cat(grouped, 1).reshape(-1, *rest)
            sd[f"{out}.self_attention.linear_proj.weight"] = w[f"{a}.o_proj.weight"].chunk(tp, 1)[r]
            gate, up = w[f"{m}.gate_proj.weight"].chunk(tp)[r], w[f"{m}.up_proj.weight"].chunk(tp)[r]
            sd[f"{out}.mlp.linear_fc1.weight"] = torch.cat([gate, up])
            sd[f"{out}.mlp.linear_fc2.weight"] = w[f"{m}.down_proj.weight"].chunk(tp, 1)[r]
            sd[f"{out}.input_layernorm.weight"] = w[f"model.layers.{i}.input_layernorm.weight"]
            sd[f"{out}.pre_mlp_layernorm.weight"] = w[f"model.layers.{i}.post_attention_layernorm.weight"]
        shards.append(sd)
    return shards


def _tokens(cfg, seed=0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (4, 24), generator=torch.Generator().manual_seed(seed))


def test_the_engine_loads_the_checkpoint_bit_for_bit_and_scores_as_transformers(setup):
    cfg, model, engine = setup
    # the engine's own loader (not our sync) filled it: its digest is the checkpoint's
    assert engine.weights_digest() == _stream_digest(cfg, _hf_weights(model, cfg))
    tokens = _tokens(cfg)
    assert (engine.score(tokens) - _logprobs(model, tokens, 1.0)).abs().max().item() < TOL


def test_an_update_from_tensor_parallel_megatron_shards_verifies_and_serves_the_new_weights(setup):
    cfg, model, engine = setup
    before = _hf_weights(model, cfg)
    g = torch.Generator().manual_seed(7)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in before.items()}  # biases become non-zero
    streams = [hf.megatron_shard_buckets(sd, cfg, TP, 64 * 1024) for sd in megatron_shards(new, cfg, TP)]
    stats = engine.sync_weights(hf.merge_shard_buckets(zip(*streams), cfg))
    try:
        assert stats.tensors == len(new) and stats.digest == _stream_digest(cfg, new).hexdigest
        assert engine.weights_digest().hexdigest == stats.digest
        model.load_state_dict(new, strict=False)  # tied: the head follows, it is the embedding
        tokens = _tokens(cfg, seed=1)
        mismatch = (engine.score(tokens) - _logprobs(model, tokens, 1.0)).abs().max().item()
        assert mismatch < TOL < mismatch_bound(cfg.precision).max_abs
        _, logprobs = engine.generate(tokens[:, :4], 8, temperature=0.7, seed=2)
        assert torch.isfinite(logprobs).all()
    finally:
        model.load_state_dict(before, strict=False)
        engine.sync_weights(sorted(before.items()))
