"""Plain PyTorch trainers on a GPU (the torch-native backend): exactness against a twin with the
copies on CUDA streams and pinned memory, device memory really released, ``model.cpu()`` behind
the manager refused naming it, and AdamW's ``step`` never moved to the device (UniRL #441's trap).
Skipped with the reason where CUDA is not available (conftest). Not yet run on a GPU: the CPU
tiers run the same code paths with a CPU "device" (tests/unit/test_torch_trainer.py,
tests/multirank/test_torch_trainers.py)."""

import pytest
import torch
from torch_runs import TinyLM, batch, exactness, loss_of

from chatlearn_mem import ExternalChangeError, Part, TrainerMemoryManager


@pytest.mark.parametrize("spec", [dict(model="tiny"), dict(model="llama")], ids=["tiny", "hf-llama"])
def test_training_across_transitions_is_bit_identical_on_cuda(spec):
    r = exactness({**spec, "device": "cuda"})
    assert r["losses_equal"] and r["forwards_equal"] and r["differ"] == [], r


def _trained():
    torch.manual_seed(0)
    model = TinyLM(hidden=256, layers=4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mm = TrainerMemoryManager(model, opt)
    for s in range(2):
        loss_of(model, batch(s).cuda()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, mm


def test_a_full_offload_gives_the_device_memory_back_and_step_stays_on_the_host():
    model, opt, mm = _trained()
    torch.cuda.synchronize()
    awake, held = torch.cuda.memory_allocated(), mm.residency().device_bytes
    mm.offload()
    assert mm.residency().device_bytes == 0
    assert awake - torch.cuda.memory_allocated() >= held  # the allocator's bytes went, not just our count
    mm.onload()
    for state in opt.state.values():  # AdamW reads step with .item(): it never moves to the device
        assert state["step"].device.type == "cpu" and state["exp_avg"].device.type == "cuda"
    assert mm.audit().ok
    loss_of(model, batch(3).cuda()).backward()
    opt.step()


def test_model_cpu_behind_the_manager_is_refused_naming_it():
    model, opt, mm = _trained()
    model.cpu()
    report = mm.audit()
    assert any("lives on cpu but the trainer on cuda" in p and "model.cpu()" in p for p in report.problems), report
    with pytest.raises(ExternalChangeError, match=r"now live elsewhere \(model.cpu\(\)"):
        mm.offload(Part.WEIGHTS)
