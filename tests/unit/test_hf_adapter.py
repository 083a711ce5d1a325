"""The Hugging Face adapter without megatron: the architecture fields of GPTTrainerConfig, the
config.json mapping, and every bad input refused in one line that names the fix."""

import json

import pydantic
import pytest
import torch
from hf_checkpoints import LLAMA_FIELDS

from chatlearn_mem.models.gpt import GPTTrainerConfig

hf = pytest.importorskip("chatlearn_mem.models.hf")
pytest.importorskip("safetensors", reason="the [hf] extra (safetensors) is not installed")

LLAMA = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=128,
    vocab_size=128,
    seq_length=64,
    norm_epsilon=1e-6,
    **LLAMA_FIELDS,
    precision="fp32",
)


def _megatron_state_dict(cfg: GPTTrainerConfig, tp: int = 1, rank: int = 0) -> dict[str, torch.Tensor]:
    """Distinct values in every megatron tensor of one of ``tp`` ranks (each element tells its place)."""
    family = hf.QWEN2 if cfg.add_qkv_bias else hf.LLAMA
    out = {}
    for i, e in enumerate(hf._entries(cfg, family)):
        shape = e.shard_shape(tp)
        n = torch.tensor(shape).prod().item()
        out[e.megatron] = (torch.arange(n, dtype=torch.float32) + 1000 * i + 100_000 * rank).view(shape)
    return out


def _checkpoint(tmp_path, **fields) -> tuple[str, GPTTrainerConfig]:
    cfg = GPTTrainerConfig(**{**LLAMA, **fields})
    path = tmp_path / "ckpt"
    hf.save_hf(hf.to_hf_state_dict(_megatron_state_dict(cfg), cfg), cfg, path)
    return str(path), cfg


def test_architecture_fields_default_to_the_gpt_and_are_validated():
    assert GPTTrainerConfig().is_gpt_architecture
    assert not GPTTrainerConfig(**LLAMA).is_gpt_architecture
    with pytest.raises(pydantic.ValidationError, match=r"num_query_groups \(3\) must divide num_attention_heads"):
        GPTTrainerConfig(num_query_groups=3)
    with pytest.raises(pydantic.ValidationError, match="set position_embedding='rope' or drop rotary_base"):
        GPTTrainerConfig(rotary_base=1e6)
    with pytest.raises(pydantic.ValidationError, match="hybrid model is built with the GPT architecture only"):
        GPTTrainerConfig(model_class="hybrid", normalization="RMSNorm")
    with pytest.raises(pydantic.ValidationError, match="Input should be 'gelu' or 'swiglu'"):
        GPTTrainerConfig(activation="relu")
    with pytest.raises(pydantic.ValidationError, match="greater than 0"):
        GPTTrainerConfig(norm_epsilon=0)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2"])
def test_config_round_trips_through_config_json(tmp_path, tied, qkv_bias):
    path, cfg = _checkpoint(tmp_path, share_embeddings_and_output_weights=tied, add_qkv_bias=qkv_bias)
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert written["architectures"] == ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"]
    assert written["tie_word_embeddings"] is tied and written["num_key_value_heads"] == 2
    assert hf.config_from_hf(path) == cfg
    assert hf.config_from_hf(path, lr=0.5, seq_length=16).seq_length == 16


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kv", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_export_merges_tensor_parallel_shards_by_query_group(kv, tp):
    """The merged q/k/v rows of each rank's group come back in Hugging Face's order: every q head,
    then every k head, then every v head; a single rank's export of the same weights agrees."""
    if kv % tp:
        pytest.skip("the tensor-parallel size must divide the key/value heads")
    cfg = GPTTrainerConfig(**{**LLAMA, "num_query_groups": kv, "add_qkv_bias": True})
    shards = [_megatron_state_dict(cfg, tp, r) for r in range(tp)]
    out = hf.to_hf_state_dict(shards, cfg)
    d, n = 16, 4 // kv  # head dim, query heads per group
    name = "decoder.layers.0.self_attention.linear_qkv.bias"
    q, k = out["model.layers.0.self_attn.q_proj.bias"], out["model.layers.0.self_attn.k_proj.bias"]
    for g in range(kv):  # group g lives on rank g // (kv // tp) at local group g % (kv // tp)
        r, local = divmod(g, kv // tp)
        rows = shards[r][name].view(kv // tp, (n + 2) * d)[local]
        assert torch.equal(q[g * n * d : (g + 1) * n * d], rows[: n * d])
        assert torch.equal(k[g * d : (g + 1) * d], rows[n * d : (n + 1) * d])
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    gate = out["model.layers.1.mlp.gate_proj.weight"]
    assert torch.equal(gate[: 128 // tp], shards[0][fc1][: 128 // tp])  # rank 0: its gate rows, then its up rows


def test_checkpoint_directory_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="if .* is a Hugging Face Hub name, download it first"):
        hf.config_from_hf("meta-llama/Llama-3.2-1B")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf.config_from_hf(str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf.config_from_hf(str(tmp_path))
    path, _ = _checkpoint(tmp_path)
    config = tmp_path / "ckpt" / "config.json"
    body = json.loads(config.read_text())
    config.write_text(json.dumps({**body, "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="'MistralForCausalLM'; supported: LlamaForCausalLM, Qwen2ForCausalLM"):
        hf.config_from_hf(path)
    for key, value, match in [
        ("hidden_act", "gelu", "hidden_act='gelu' is not supported"),
        ("attention_bias", True, "attention_bias=True is not supported"),
        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5}, "rope_type 'llama3' is not supported"),
        ("head_dim", 32, "only head_dim = hidden_size / num_attention_heads"),
    ]:
        config.write_text(json.dumps({**body, key: value}))
        with pytest.raises(ValueError, match=match):
            hf.config_from_hf(path)
    config.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="num_query_groups come from .* cannot be overridden"):
        hf.config_from_hf(path, num_query_groups=4)
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        hf.config_from_hf(path)


def test_export_errors():
    cfg = GPTTrainerConfig(**LLAMA)
    sd = _megatron_state_dict(cfg)
    with pytest.raises(ValueError, match="a Llama or Qwen2 model needs normalization='RMSNorm'"):
        hf.to_hf_state_dict(sd, GPTTrainerConfig())
    with pytest.raises(ValueError, match="lacks output_layer.weight"):
        hf.to_hf_state_dict({k: v for k, v in sd.items() if k != "output_layer.weight"}, cfg)
    with pytest.raises(ValueError, match="has head.weight, which the mapping does not know"):
        hf.to_hf_state_dict({**sd, "head.weight": torch.zeros(1)}, cfg)
    shard = _megatron_state_dict(cfg, tp=2)
    with pytest.raises(ValueError, match=r"shape \[64, 64\], expected \[128, 64\].*every tensor-parallel rank"):
        hf.to_hf_state_dict(shard, cfg)  # one rank's shards alone
    with pytest.raises(ValueError, match="vocab_size=128 is not divisible by the tensor-parallel size 3"):
        hf.to_hf_state_dict([sd] * 3, cfg)
    with pytest.raises(ValueError, match="lm_head.weight is missing"):
        out = hf.to_hf_state_dict(sd, cfg)
        del out["lm_head.weight"]
        hf.save_hf(out, cfg, "/nonexistent")


@pytest.mark.parametrize("tp", [1, 2])
def test_streamed_export_equals_the_whole_one_in_buckets_of_at_most_the_given_size(tp):
    cfg = GPTTrainerConfig(**{**LLAMA, "precision": "bf16"})
    shards = [{k: v.bfloat16() for k, v in _megatron_state_dict(cfg, tp, r).items()} for r in range(tp)]
    whole = hf.to_hf_state_dict(shards, cfg)
    streamed = list(hf.iter_hf_weights(shards, cfg))
    assert [n for n, _ in streamed] == list(whole)  # the checkpoint's order: embeddings, then layer by layer
    assert all(torch.equal(t, whole[n]) and t.dtype == torch.bfloat16 for n, t in streamed)
    largest = max(t.numel() * t.element_size() for t in whole.values())
    bucket = largest + 1
    buckets = list(hf.hf_weight_buckets(shards, cfg, bucket))
    assert [n for b in buckets for n, _ in b] == list(whole)
    assert all(sum(t.numel() * t.element_size() for _, t in b) <= bucket for b in buckets)
    assert len(buckets) > 1
    # a bucket smaller than one tensor: that tensor alone
    assert all(len(b) == 1 for b in hf.hf_weight_buckets(shards, cfg, 1))
    assert hf.hf_digest(iter(streamed)) == hf.hf_digest(reversed(list(whole.items())))


def test_streamed_export_checks_everything_before_the_first_tensor():
    cfg = GPTTrainerConfig(**LLAMA)
    sd = _megatron_state_dict(cfg)
    broken = {**sd, "decoder.layers.1.mlp.linear_fc2.weight": torch.zeros(3)}  # the last layer's tensor
    with pytest.raises(ValueError, match=r"linear_fc2.weight of tensor-parallel rank 0 has shape \[3\]"):
        hf.iter_hf_weights(broken, cfg)  # raised by the call, before anything was streamed
    with pytest.raises(ValueError, match="lacks output_layer.weight"):
        hf.hf_weight_buckets({k: v for k, v in sd.items() if k != "output_layer.weight"}, cfg, 2**20)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        hf.hf_weight_buckets(sd, cfg, 0)


def test_digest_tells_one_changed_bit_and_a_renamed_tensor():
    cfg = GPTTrainerConfig(**LLAMA)
    whole = hf.to_hf_state_dict(_megatron_state_dict(cfg), cfg)
    base = hf.hf_digest(whole.items())
    changed = dict(whole)
    name = "model.layers.1.mlp.down_proj.weight"
    changed[name] = whole[name].clone()
    changed[name].view(torch.int32)[0, 0] ^= 1  # one bit of one element
    assert hf.hf_digest(changed.items()) != base
    renamed = {("x." + k if k == name else k): v for k, v in whole.items()}
    assert hf.hf_digest(renamed.items()) != base
    assert hf.hf_digest({k: v.clone() for k, v in whole.items()}.items()) == base
    with pytest.raises(ValueError, match="occurs twice"):
        hf.hf_digest([(name, whole[name]), (name, whole[name])])


@pytest.mark.parametrize("tp", [1, 2])
def test_shard_streams_of_every_rank_merge_into_the_whole_export_bucket_by_bucket(tp):
    """A tensor-parallel policy feeds an engine without a whole copy anywhere: each rank streams
    its own shards in buckets with the same boundaries, the receiver merges one bucket of each."""
    cfg = GPTTrainerConfig(**{**LLAMA, "precision": "bf16"})
    shards = [{k: v.bfloat16() for k, v in _megatron_state_dict(cfg, tp, r).items()} for r in range(tp)]
    whole = list(hf.iter_hf_weights(shards, cfg))
    bucket = 40_000
    streams = [list(hf.megatron_shard_buckets(sd, cfg, tp, bucket)) for sd in shards]
    assert len({len(s) for s in streams}) == 1 and len(streams[0]) > 2
    for stream in streams:  # at most one bucket's bytes, unless a single tensor is larger
        assert all(len(b) == 1 or sum(t.numel() * t.element_size() for _, t in b) <= bucket for b in stream)
    merged = list(hf.merge_shard_buckets(zip(*streams), cfg))
    assert [n for n, _ in merged] == [n for n, _ in whole]
    assert all(torch.equal(a, b) and a.dtype == torch.bfloat16 for (_, a), (_, b) in zip(merged, whole))


def test_shard_streams_that_disagree_or_end_early_are_refused():
    cfg = GPTTrainerConfig(**LLAMA)
    shards = [_megatron_state_dict(cfg, 2, r) for r in range(2)]
    streams = [list(hf.megatron_shard_buckets(sd, cfg, 2, 40_000)) for sd in shards]
    with pytest.raises(ValueError, match="ended before .* tensor\\(s\\) missing"):
        list(hf.merge_shard_buckets(list(zip(*streams))[:-1], cfg))
    with pytest.raises(ValueError, match="rank 1's bucket names other tensors"):
        list(hf.merge_shard_buckets(zip(streams[0], streams[0][1:] + streams[0][:1]), cfg))
    with pytest.raises(ValueError, match="came twice"):
        list(hf.merge_shard_buckets([s for s in zip(*streams)] + [next(zip(*streams))], cfg))
    with pytest.raises(ValueError, match=r"this rank \(of 2\) has shape"):
        hf.megatron_shard_buckets(_megatron_state_dict(cfg), cfg, 2, 2**20)  # a whole model is no shard
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        hf.megatron_shard_buckets(shards[0], cfg, 2, 0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_streamed_export_in_several_files_loads_in_transformers_as_the_tensors_it_was_given(tmp_path, family):
    """:func:`save_hf_stream` (what a run's export writes): files of at most ``max_shard_bytes`` with
    their index, every tensor bit for bit what the stream held, the digest that of the stream."""
    transformers = pytest.importorskip("transformers")
    cfg = GPTTrainerConfig(**{**LLAMA, "add_qkv_bias": family == "qwen2"})
    shards = [_megatron_state_dict(cfg, 2, r) for r in range(2)]  # two tensor-parallel ranks, merged
    stream = list(hf.iter_hf_weights(shards, cfg))
    out = hf.save_hf_stream(iter(stream), cfg, tmp_path / "out", max_shard_bytes=64 * 1024)
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert out["files"] == len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {n for n, _ in stream} and out["bytes"] == index["metadata"]["total_size"]
    assert out["digest"] == hf.hf_digest(stream) and out["tensors"] == len(stream)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    loaded = model.state_dict()
    assert type(model).__name__ == ("Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM")
    for name, t in stream:
        assert torch.equal(loaded[name], t), name
    one = hf.save_hf_stream(iter(stream), cfg, tmp_path / "one")  # a small model: one file, no index
    assert one["files"] == 1 and (tmp_path / "one" / "model.safetensors").is_file() and one["digest"] == out["digest"]
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()


def test_a_streamed_export_refuses_a_stream_that_is_not_the_model(tmp_path):
    cfg = GPTTrainerConfig(**LLAMA)
    stream = list(hf.iter_hf_weights(_megatron_state_dict(cfg), cfg))
    with pytest.raises(ValueError, match=r"the stream ended before model.norm.weight \(1 tensor\(s\) missing\)"):
        hf.save_hf_stream(iter([t for t in stream if t[0] != "model.norm.weight"]), cfg, tmp_path / "a")
    with pytest.raises(ValueError, match="model.norm.weight came twice"):
        hf.save_hf_stream(iter(stream + stream[1:2]), cfg, tmp_path / "b")
    with pytest.raises(ValueError, match=r"lm_head.weight is torch.float16 \[128, 64\]; expected bf16 or fp32"):
        hf.save_hf_stream(iter([(n, t.half() if n == "lm_head.weight" else t) for n, t in stream]), cfg, tmp_path / "c")
