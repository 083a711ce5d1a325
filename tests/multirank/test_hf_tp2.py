"""Llama and Qwen2 checkpoints on two tensor-parallel ranks: each rank reads only its shard, the
gathered logits agree with ``transformers``, the ranks' shards export back to the files bit for
bit, a trained trainer exports asleep and re-imports exactly, sizes the TP size does not divide
are refused, and offload/onload stays exact on the new architecture (TP=2 and DP=2). All runs
share one spawned process group (see trainer_runs.spawn)."""

import pytest
import torch
from hf_checkpoints import hf_logits, make_checkpoint, tokens
from trainer_runs import STEPS, layout_spec, spawn

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")

TOLERANCE = 1e-5
CASES = {
    f"{family}-{attn}-{tie}": dict(family=family, kv_heads=kv, tied=tie == "tied")
    for family in ("llama", "qwen2")
    for attn, kv in (("mha", 4), ("gqa", 2))
    for tie in ("untied", "tied")
}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_tp2")
    specs = []
    for name, case in CASES.items():
        path = make_checkpoint(str(root / name), **case)
        torch.save(hf_logits(path, tokens()), root / f"{name}.pt")
        specs.append(layout_spec(name, 2, tp=2, kind="logits", path=path, reference=str(root / f"{name}.pt")))
    bf16 = make_checkpoint(str(root / "bf16"), family="qwen2", kv_heads=2, dtype=torch.bfloat16)
    specs.append(layout_spec("trained", 2, tp=2, kind="trained", path=bf16, out=str(root / "out")))
    odd = {"vocab": dict(vocab=127), "kv": dict(kv_heads=1)}
    for what, case in odd.items():
        specs.append(
            layout_spec(f"refused-{what}", 2, tp=2, kind="refused", path=make_checkpoint(str(root / what), **case))
        )
    arch = dict(
        precision="bf16",
        normalization="RMSNorm",
        activation="swiglu",
        ffn_hidden_size=96,
        position_embedding="rope",
        num_query_groups=2,
        add_bias_linear=False,
        add_qkv_bias=True,
    )
    specs.append(layout_spec("exactness", 2, tp=2, steps=STEPS // 2, kind="exactness", **arch))
    specs.append(layout_spec("exactness-dp2", 2, tp=1, steps=STEPS // 2, kind="exactness", **arch))
    for s in specs:  # the run's own keys, not GPTTrainerConfig fields
        s.update({k: s["cfg"].pop(k) for k in ("kind", "path", "reference", "out") if k in s["cfg"]})
    return spawn(specs, fn_name="hf_checkpoints:tp_run")


def _ok(results):
    assert len(results) == 2
    for r in results:
        assert "error" not in r, r.get("error")
    return results


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(CASES))
def test_tp2_logits_agree_and_shards_export_to_the_files(world2, name):
    results = _ok(world2[name])
    for r in results:
        print(f"{name} rank {r['rank']}: max |logits diff| = {r['diff']:.2e}")
        assert r["diff"] < TOLERANCE, r
        assert r["local_vocab"] == 64  # the output layer is split over the vocabulary
        assert r["read"] < 0.6 * r["file_bytes"], r  # its own shards (and the small norms), not the files
    assert results[0]["export_exact"] is True


@pytest.mark.multirank
def test_tp2_trained_export_asleep_reimports_exactly(world2):
    for r in _ok(world2["trained"]):
        assert r["asleep_device_bytes"] == 0 and r["changed"] and r["reimport_exact"], r


@pytest.mark.multirank
@pytest.mark.parametrize("what,match", [("vocab", "vocab_size=127"), ("kv", "num_key_value_heads=1")])
def test_tp2_refuses_sizes_the_tensor_parallel_size_does_not_divide(world2, what, match):
    for r in _ok(world2[f"refused-{what}"]):
        assert r["error_text"] and match in r["error_text"] and "tensor-parallel size 2" in r["error_text"], r


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["exactness", "exactness-dp2"], ids=["tp2", "dp2"])
def test_offload_onload_is_exact_on_the_new_architecture(world2, name):
    for r in _ok(world2[name]):
        assert r["losses_equal"] and r["weights_equal"] and r["audit_ok"], r
        assert r["nb_losses_equal"] and r["nb_weights_equal"] and r["nb_audit_ok"], r
