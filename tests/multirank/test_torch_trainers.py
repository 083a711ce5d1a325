"""Plain PyTorch trainers on 1 and 2 data-parallel ranks (gloo): torch DDP (with and without
gradient bucket views), DDP with ZeroRedundancyOptimizer (both ``parameters_as_bucket_view``
settings, and ``overlap_with_ddp=True`` stepping inside DDP's comm hook), FSDP2 (``fully_shard``,
also with bf16 compute over fp32 shards) and Hugging Face Llama / Qwen2 under them.

For each: training with every kind of transition between the steps (all parts, weights only,
non-blocking, the optimizer's parts alone) bit-identical to a twin never put to sleep on every
rank, audits clean; what stays on the device after a full offload (an independent walk); bad
input and changes behind the manager's back refused naming what happened; checkpoints saved
asleep on 2 ranks and resumed on 1. Every spec of one world size runs in one spawned process
group (``torch_runs.spawn``): the process start and torch's import are paid once per group.
"""

import pytest
from torch_runs import check, spawn, spec

# torch alone, no megatron-core: the newest leg runs them (scripts/test.sh)
pytestmark = [pytest.mark.multirank, pytest.mark.newest_leg]

WRAPPERS = {
    "ddp": dict(wrapper="ddp"),
    "ddp-bucket-view": dict(wrapper="ddp", bucket_view=True),
    "zero": dict(wrapper="ddp", zero=True),
    "zero-bucket-view": dict(wrapper="ddp", zero=True, zero_bucket_view=True, bucket_view=True),
    "zero-overlap": dict(wrapper="ddp", zero=True, overlap=True, bucket_view=True),
    "fsdp2": dict(wrapper="fsdp2"),
    "fsdp2-bf16": dict(wrapper="fsdp2", mixed=True),
}
HF = {
    "hf-llama-fsdp2": dict(wrapper="fsdp2", model="llama"),
    "hf-qwen2-tied-zero": dict(wrapper="ddp", model="qwen2", tied=True, zero=True, zero_bucket_view=True),
}
SAVED = {"ddp-bucket-view", "zero-bucket-view", "fsdp2"}


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("torch_ckpt")


@pytest.fixture(scope="module")
def world2(ckpt_dir):
    specs = [spec(n, 2, **kw) for n, kw in {**WRAPPERS, **HF}.items()]
    specs += [spec(f"save-{n}", 2, fn="ckpt_save", dir=str(ckpt_dir / n), **WRAPPERS[n]) for n in sorted(SAVED)]
    return spawn(specs)


@pytest.fixture(scope="module")
def world1(world2, ckpt_dir):
    specs = [spec(n, 1, **kw) for n, kw in WRAPPERS.items()]
    specs += [spec(f"stays-{n}", 1, fn="what_stays", **kw) for n, kw in WRAPPERS.items()]
    specs.append(spec("misuse", 1, fn="misuse"))
    specs += [spec(f"load-{n}", 1, fn="ckpt_load", dir=str(ckpt_dir / n), **WRAPPERS[n]) for n in sorted(SAVED)]
    return spawn(specs)


def _exact(results: list[dict]) -> None:
    check(results)
    for r in results:
        assert r["losses_equal"], r["losses"]
        assert r["forwards_equal"], r
        assert r["differ"] == [] and r["compared"] > 10, r["differ"]
        assert r["released"] and all(n > 0 for n in r["released"])


@pytest.mark.parametrize("name", list(WRAPPERS) + list(HF))
def test_two_ranks_train_bit_identically_across_transitions(world2, name):
    results = world2[name]
    _exact(results)
    assert results[0]["losses"] != results[1]["losses"]  # each rank saw its own data


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_one_rank_trains_bit_identically_across_transitions(world1, name):
    _exact(world1[name])


@pytest.mark.parametrize("name", list(WRAPPERS))
def test_nothing_of_the_trainer_stays_on_the_device_after_a_full_offload(world1, name):
    (r,) = world1[f"stays-{name}"]
    check([r])
    assert r["asleep_device_bytes"] == 0 and r["audit_ok"], r
    # an independent walk of everything reachable from the model and optimizer: only AdamW's
    # step counters (4 bytes each) and FSDP2's device mesh's rank map, both host tensors by design
    steps = [p for p in r["leftovers"] if p.endswith("['step']")]
    others = [p for p in r["leftovers"] if not p.endswith("['step']")]
    assert steps and all(p.endswith(".mesh._rank_map") for p in others), r["leftovers"]
    kw = WRAPPERS[name]
    if kw.get("bucket_view"):  # DDP's gradient buckets are the .grads: released, regrown
        assert r["awake"]["grads"] > 0 and r["bucket_bytes_asleep"] == 0 < r["bucket_bytes_awake"]
        assert not r["warnings"]
    elif kw["wrapper"] == "ddp":  # they are a second copy in DDP's C++ reducer: said once
        assert r["awake"]["grads"] == 0 and len(r["warnings"]) == 1
        assert "gradient_as_bucket_view=False) keeps its gradient buckets" in r["warnings"][0]
    if kw["wrapper"] == "fsdp2":  # FSDP2's unsharded parameters were there; it freed them itself
        assert r["unsharded_awake"] > 0 and r["unsharded_asleep"] == 0
    assert isinstance(r["step_after"], float)


def test_bad_input_and_changes_behind_the_manager_are_refused_with_what_happened(world1):
    (r,) = world1["misuse"]
    check([r])
    assert r["pending"].startswith("ChatlearnMemError: cannot offload: a forward pass ran with gradients enabled")
    assert "DistributedDataParallel's reducer" in r["pending"] and "loss.backward()" in r["pending"]
    assert r["pending_nothing_moved"]
    assert r["dropped_output_offload"] == "not refused"  # a forward whose output was dropped
    assert any(
        "param blocks.0.fc1.weight has a new grad accumulator, not the one DistributedDataParallel hooked" in p
        for p in r["ddp_dtype_audit"]
    ), r["ddp_dtype_audit"]
    assert r["ddp_dtype_offload"].startswith("ExternalChangeError") and "blocks.0.fc1.weight" in r["ddp_dtype_offload"]
    assert any(
        "param blocks.1.fc2.bias .data is not a view of ZeroRedundancyOptimizer._buckets[0][0]" in p
        for p in r["zero_view_audit"]
    ), r["zero_view_audit"]
    assert "param.data = " in r["zero_view_offload"] and "blocks.1.fc2.bias" in r["zero_view_offload"]
    assert r["fsdp_early_optimizer"].startswith("ValueError: the optimizer was created before fully_shard")
    assert r["fsdp_then_ok"]
    assert r["ddp_over_fsdp"].startswith(
        ("UnsupportedLayoutError: DistributedDataParallel around an FSDP2 model", "DDP refused it")
    ), r["ddp_over_fsdp"]


@pytest.mark.parametrize("name", sorted(SAVED))
def test_a_checkpoint_saved_asleep_on_two_ranks_resumes_on_one(world2, world1, name):
    saved = world2[f"save-{name}"]
    check(saved)
    assert saved[0]["files"] == [".metadata", "__0_0.distcp", "__1_0.distcp", "chatlearn_checkpoint.json"]
    (r,) = world1[f"load-{name}"]
    check([r])
    assert r["saved_split"] == {"dp": 2}
    assert r["differ"] == [] and r["compared"] > 20, r["differ"]
    assert r["audit_ok"] and r["audit_after"] and isinstance(r["loss_after"], float)
