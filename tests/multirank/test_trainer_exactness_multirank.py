"""Guarantee 1 on several ranks: full offload/onload cycles between train steps change nothing,
bit for bit, on every rank of a data-parallel and a tensor-parallel group (the single-model
trainer, as in tests/megatron/test_trainer_exactness.py). Both layouts run in one spawned
process group (see trainer_runs.spawn)."""

import pytest
from trainer_runs import STEPS, layout_spec, spawn

LAYOUTS = {
    name: layout_spec(name, world, tp=tp, steps=STEPS, precision="bf16", use_distributed_optimizer=True)
    for name, world, tp in [("dp2-distopt", 2, 1), ("tp2-distopt", 2, 2)]
}


@pytest.fixture(scope="module")
def world2():
    return spawn(list(LAYOUTS.values()), fn_name="exactness")


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_multirank_full_cycles_are_bit_exact(world2, name):
    results = world2[name]
    assert len(results) == LAYOUTS[name]["world"]
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["losses_equal"] and r["weights_equal"] and r["audit_ok"], r
        assert r["nb_losses_equal"] and r["nb_weights_equal"] and r["nb_audit_ok"], r  # blocking=False
        assert r["n_tensors"] > 0
    if LAYOUTS[name]["tp"] == 1:  # data parallel ranks see different data
        assert results[0]["losses"] != results[1]["losses"]
