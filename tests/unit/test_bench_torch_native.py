"""The bench's ``torch_native`` report on a tiny Llama, in this process (megatron-free): every way
of putting a plain PyTorch trainer to sleep is timed on both parts and directions, leaves the
trainer bit-identical, and the manager's sleep leaves only AdamW's host-side step counters; the
markdown section and the targets read those results."""

import types

import torch

from chatlearn_mem_bench.torch_native import (
    METHODS,
    PARTS,
    measure_torch_native,
    torch_native_lines,
    torch_native_targets,
)

TINY = types.SimpleNamespace(
    num_layers=1,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=None,
    ffn_hidden_size=None,
    vocab_size=64,
    seq_length=16,
)


def test_every_way_is_timed_and_leaves_the_trainer_bit_identical():
    tn = measure_torch_native(
        TINY, torch.device("cpu"), repeats=2, warmup=1, batch_size=2, bucket_size_mb=1, pin=False, echo=lambda s: None
    )
    assert {(r["method"], r["part"], r["direction"]) for r in tn["rows"]} == {
        (m, p, d) for m in METHODS for p in PARTS for d in ("offload", "onload")
    }
    assert all(r["seconds"]["min"] <= r["seconds"]["median"] <= r["seconds"]["max"] for r in tn["rows"])
    assert tn["bytes"]["full"] > tn["bytes"]["weights"] > 0
    assert tn["bit_identical"] == {m: True for m in METHODS}
    stays = tn["stays"]["manager"]
    assert stays["largest"] and all("['step']" in p for p in stays["largest"])
    assert (
        stays["device_bytes"] == 4 * 12
    )  # a 4-byte counter per parameter (embedding, 4 attention, 3 MLP, 3 norms, head)
    assert tn["stays"]["per_tensor_to_cpu"]["device_bytes"] is None  # a CPU device: not told apart
    targets = torch_native_targets(tn)
    assert [t["passed"] for t in targets] == [True, True], targets
    text = "\n".join(torch_native_lines(tn))
    assert "## Plain PyTorch trainer: the manager against what users do" in text
    assert text.count("| chatlearn-mem manager (torch-native backend) |") == 2
    assert "verl FSDP: every tensor .to('cpu') and back" in text and "1.00x" in text


def test_a_lost_bit_fails_its_target():
    tn = {
        "bit_identical": {"manager": True, "model_to": False},
        "stays": {"manager": {"device_bytes": 4, "largest": ["x['step'] (4 B)"]}},
    }
    assert [t["passed"] for t in torch_native_targets(tn)] == [False, True]
    tn["stays"]["manager"]["largest"].append("root0.model.embed_tokens.weight (1024 B)")
    assert [t["passed"] for t in torch_native_targets(tn)] == [False, False]
