"""Tests of InferenceMemoryManager on a small CPU module with mixed dtypes and tied weights."""

import threading
import warnings

import pytest
import torch
from torch import nn

from chatlearn_mem import ChatlearnMemError, InferenceMemoryManager, MemoryConfig, OffloadedError, Part

# enc.weight 256 + enc.bias 32 + fc.weight 128 + fc.bias 16 + scale (bf16) 8 + frozen 16
# + ids (int64) 32 + shift 16; dec.weight is enc.weight and counts once.
MODEL_BYTES = 504
SMALL = MemoryConfig(bucket_size_mb=1024 / 2**20)

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(_INT_OF[t.element_size()]).clone()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.dec = nn.Linear(8, 8, bias=False)
        self.dec.weight = self.enc.weight
        self.fc = nn.Linear(8, 4)
        self.scale = nn.Parameter(torch.randn(4).to(torch.bfloat16))
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)
        self.register_buffer("ids", torch.arange(4, dtype=torch.int64) * 3 + 2**40)
        self.register_buffer("shift", torch.randn(4))

    def forward(self, x):
        h = self.dec(torch.relu(self.enc(x)))
        return self.fc(h) * self.scale.float() + self.frozen + self.shift + (self.ids - 2**40).float()


def named(model):
    return list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers())


def snapshot(model):
    return {name: bits(t) for name, t in named(model)}


def assert_same(model, snap):
    current = dict(named(model))
    assert current.keys() == snap.keys()
    for name, b in snap.items():
        assert torch.equal(bits(current[name]), b), name


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Net()


@pytest.fixture
def x():
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(2))


@pytest.fixture
def mm(model):
    manager = InferenceMemoryManager(model, SMALL)
    yield manager
    manager.close()


def test_model_bytes_match_unique_storages(model):
    # Independent of the library: distinct storages by data pointer.
    by_ptr = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for _, t in named(model)}
    assert sum(by_ptr.values()) == MODEL_BYTES
    assert len(named(model)) == 9 and len(by_ptr) == 8


def test_residency_before_and_after_offload(model, mm):
    before = mm.residency()
    assert before.device_bytes == MODEL_BYTES
    assert before.by_category == {"weights": MODEL_BYTES}
    assert before.host_bytes == 0

    stats = mm.offload_weights()
    assert (stats.nbytes, stats.copied_bytes) == (MODEL_BYTES, MODEL_BYTES)
    assert mm.is_offloaded("weights")
    res = mm.residency()
    assert res.device_bytes == 0
    assert res.host_bytes >= MODEL_BYTES
    assert all(t.untyped_storage().nbytes() == 0 for _, t in named(model))

    mm.onload_weights()
    assert mm.residency().device_bytes == MODEL_BYTES


def test_onload_is_bit_exact_and_keeps_tied_weights(model, mm, x):
    snap = snapshot(model)
    out = model(x)
    mm.offload_weights()
    stats = mm.onload_weights()
    assert (stats.direction, stats.nbytes, stats.copied_bytes) == ("onload", MODEL_BYTES, MODEL_BYTES)
    assert_same(model, snap)
    assert model.dec.weight is model.enc.weight
    assert model.dec.weight.untyped_storage().data_ptr() == model.enc.weight.untyped_storage().data_ptr()
    assert model.frozen.requires_grad is False and model.fc.weight.requires_grad is True
    assert torch.equal(model(x), out)


def test_forward_while_offloaded_raises(model, mm, x):
    out = model(x)
    mm.offload_weights()
    with pytest.raises(OffloadedError, match="onload") as info:
        model(x)
    assert isinstance(info.value, ChatlearnMemError)
    mm.onload_weights()
    assert torch.equal(model(x), out)


def test_repeated_offload_and_onload_warn_and_do_nothing(model, mm):
    snap = snapshot(model)
    mm.offload_weights()
    host = mm.residency().host_bytes
    with pytest.warns(UserWarning, match="already offloaded"):
        assert mm.offload_weights() is None
    res = mm.residency()
    assert (res.device_bytes, res.host_bytes) == (0, host)
    assert mm.is_offloaded("weights")

    mm.onload_weights()
    with pytest.warns(UserWarning, match="already on the device"):
        assert mm.onload_weights() is None
    assert mm.residency().device_bytes == MODEL_BYTES
    assert_same(model, snap)


def test_unchanged_weights_are_not_copied_again(model, mm):
    snap = snapshot(model)
    assert mm.offload_weights().copied_bytes == MODEL_BYTES
    mm.onload_weights()
    stats = mm.offload_weights()
    assert (stats.nbytes, stats.copied_bytes) == (MODEL_BYTES, 0)
    assert mm.residency().device_bytes == 0
    mm.onload_weights()
    assert_same(model, snap)


def test_in_place_write_is_copied(model, mm):
    mm.offload_weights()
    mm.onload_weights()
    with torch.no_grad():
        model.fc.weight.add_(1)
        model.ids.add_(5)
    snap = snapshot(model)
    assert mm.offload_weights().copied_bytes == MODEL_BYTES
    mm.onload_weights()
    assert_same(model, snap)


def test_write_through_data_with_mark_dirty_is_copied(model, mm):
    mm.offload_weights()
    mm.onload_weights()
    model.fc.weight.data.add_(1)
    model.scale.data.mul_(2)
    mm.mark_weights_dirty()
    snap = snapshot(model)
    assert mm.offload_weights().copied_bytes == MODEL_BYTES
    mm.onload_weights()
    assert_same(model, snap)


@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_step_is_copied(model, mm, x, foreach):
    mm.offload_weights()
    mm.onload_weights()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, foreach=foreach)
    model(x).sum().backward()
    opt.step()
    snap = snapshot(model)
    assert mm.offload_weights().copied_bytes == MODEL_BYTES
    mm.onload_weights()
    assert_same(model, snap)


def test_load_state_dict_is_copied(model, mm):
    mm.offload_weights()
    mm.onload_weights()
    sd = {k: v + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(sd)
    snap = snapshot(model)
    assert mm.offload_weights().copied_bytes == MODEL_BYTES
    mm.onload_weights()
    assert_same(model, snap)


def test_skip_unchanged_disabled_always_copies(model):
    mm = InferenceMemoryManager(model, MemoryConfig(bucket_size_mb=1024 / 2**20, skip_unchanged_weights=False))
    snap = snapshot(model)
    for _ in range(3):
        assert mm.offload_weights().copied_bytes == MODEL_BYTES
        mm.onload_weights()
    assert_same(model, snap)


def test_audit_ok_when_resident_and_offloaded(mm):
    report = mm.audit()
    assert report.ok and report.checked > 0, str(report)
    mm.offload_weights()
    report = mm.audit()
    assert report.ok and report.checked > 0, str(report)
    mm.onload_weights()
    assert mm.audit().ok


def test_audit_reports_rebound_data(model, mm):
    model.fc.weight.data = model.fc.weight.data.clone()
    report = mm.audit()
    assert not report.ok
    assert report.checked > 0
    assert len(report.problems) == 1
    assert "fc.weight" in report.problems[0] and "rebound" in report.problems[0]


def test_audit_reports_replaced_parameter(model, mm):
    model.fc.bias = nn.Parameter(torch.zeros(4))
    report = mm.audit()
    assert not report.ok
    assert len(report.problems) == 1
    assert "fc.bias" in report.problems[0] and "replaced" in report.problems[0]


def test_fifty_cycles(model, mm, x):
    snap = snapshot(model)
    out = model(x)
    mm.offload_weights()
    host = mm.residency().host_bytes
    mm.onload_weights()
    for _ in range(50):
        mm.offload_weights()
        res = mm.residency()
        assert (res.device_bytes, res.host_bytes) == (0, host)
        mm.onload_weights()
        assert mm.residency().device_bytes == MODEL_BYTES
    assert_same(model, snap)
    assert torch.equal(model(x), out)


def test_rejects_non_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        InferenceMemoryManager(object())


def test_rejects_module_without_tensors():
    with pytest.raises(ValueError, match="no parameters or buffers"):
        InferenceMemoryManager(nn.ReLU())


def test_rejects_bad_config(model):
    with pytest.raises(TypeError, match="MemoryConfig"):
        InferenceMemoryManager(model, {"bucket_size_mb": 1})


def test_unknown_part(mm):
    with pytest.raises(ValueError, match=r"'grads' is not a part of this manager; its parts are \['weights'\]"):
        mm.is_offloaded("grads")
    with pytest.raises(ValueError, match=r"unknown part 'weight'; parts are \['weights'\]"):
        mm.offload(["weight"])
    assert not mm.is_offloaded(Part.WEIGHTS)  # nothing moved


def test_offload_and_onload_take_parts(model, mm):
    assert mm.parts == (Part.WEIGHTS,)
    assert mm.offload([]) == [] and not mm.is_offloaded("weights")  # nothing chosen, nothing moved
    (stats,) = mm.offload()
    assert stats.group == "weights" and mm.is_offloaded(Part.WEIGHTS)
    with pytest.warns(UserWarning, match="already offloaded"):
        assert mm.offload(Part.WEIGHTS) == []
    (stats,) = mm.onload("weights")
    assert stats.direction == "onload" and not mm.is_offloaded("weights")


def test_concurrent_offload_onload(model, mm, x):
    snap = snapshot(model)
    out = model(x)
    errors = []
    barrier = threading.Barrier(2)

    def loop(first, second):
        try:
            barrier.wait()
            for _ in range(20):
                first()
                second()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # interleaved calls make some of them warned no-ops
        threads = [
            threading.Thread(target=loop, args=(mm.offload_weights, mm.onload_weights)),
            threading.Thread(target=loop, args=(mm.onload_weights, mm.offload_weights)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    offloaded = mm.is_offloaded("weights")
    assert mm.residency().device_bytes == (0 if offloaded else MODEL_BYTES)
    assert mm.audit().ok
    if offloaded:
        mm.onload_weights()
    assert_same(model, snap)
    assert torch.equal(model(x), out)
