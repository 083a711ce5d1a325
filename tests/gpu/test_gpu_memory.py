"""On a GPU: what a full offload gives back to CUDA (allocated, reserved, with and without
expandable segments) and what the device report says stays. Skipped without CUDA (conftest)."""

import os
import subprocess
import sys

import pytest
import torch
from trainer_runs import BATCH

from chatlearn_mem import MemoryConfig, TrainerMemoryManager, device_report
from chatlearn_mem.models import gpt

CFG = gpt.GPTTrainerConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32000, seq_length=128)
EXPANDABLE = "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")


def _trainer(config: MemoryConfig):
    trainer = gpt.build_gpt_trainer(CFG)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, config)
    trainer.train_step(gpt.synthetic_batch(CFG, 0, batch_size=BATCH))
    torch.cuda.synchronize()
    return trainer, mm


@pytest.mark.parametrize("empty_cache", [True, False], ids=["empty_cache", "no_empty_cache"])
def test_full_offload_frees_allocated_and_reserved(dist1, empty_cache):
    trainer, mm = _trainer(MemoryConfig(empty_cache=empty_cache))
    segments = torch.cuda.memory_snapshot()
    if EXPANDABLE and segments and "is_expandable" in segments[0]:  # the child of the test below
        assert any(seg["is_expandable"] for seg in segments), "expandable_segments did not take effect"
    resident = mm.residency()
    managed = resident.device_bytes
    restorable = managed - resident.by_category["other"]  # derived .grad tensors are dropped, not restored
    alloc0, res0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    mm.offload()
    alloc1, res1 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    assert alloc0 - alloc1 >= 0.99 * managed, f"allocated fell {alloc0 - alloc1} of {managed} managed bytes"
    if empty_cache:
        assert res0 - res1 >= 0.9 * managed, f"reserved fell {res0 - res1} of {managed} managed bytes"
    else:
        assert res0 - res1 < 0.1 * managed, "reserved fell without empty_cache"
        torch.cuda.empty_cache()
        assert res0 - torch.cuda.memory_reserved() >= 0.9 * managed
    mm.onload()
    assert torch.cuda.memory_allocated() - alloc1 >= 0.99 * restorable
    assert mm.audit().ok


def test_full_offload_frees_allocated_and_reserved_with_expandable_segments():
    if EXPANDABLE:
        pytest.skip("already running with expandable segments (this is the child process)")
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    test = f"{__file__}::test_full_offload_frees_allocated_and_reserved"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "2 passed" in out.stdout, out.stdout[-2000:]


def test_device_report_after_a_full_offload(dist1):
    trainer, mm = _trainer(MemoryConfig())
    mm.offload()
    base = device_report(trainer.model, trainer.optimizer, managers=[mm])
    assert base.by_holder["manager_residue"] == 0
    assert base.cuda["allocated"] == torch.cuda.memory_allocated()
    assert base.by_holder["allocator_cache"] == base.cuda["reserved"] - base.cuda["allocated"]
    assert base.total_bytes == sum(base.by_holder.values()) <= base.cuda["device_total"]
    assert base.by_holder["outside_allocator"] > 0  # at least the CUDA context
    n = 8 * 2**20  # a multiple of the allocator's 512-byte rounding: counted exactly
    trainer.model.module.my_cache = torch.empty(n, dtype=torch.uint8, device="cuda")
    unreachable = torch.empty(n, dtype=torch.uint8, device="cuda")  # held by this test only
    report = device_report(trainer.model, trainer.optimizer, managers=[mm])
    assert report.by_holder["model_other"] - base.by_holder["model_other"] == n
    assert report.by_holder["other_allocated"] - base.by_holder["other_allocated"] == n
    assert ("root0.module.my_cache", n) in report.largest["model_other"]
    del trainer.model.module.my_cache, unreachable
    print(report.format())
    mm.onload()
    assert mm.audit().ok
