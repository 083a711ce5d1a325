"""Tests of MemoryConfig: defaults, validation, byte rounding and pinning on a CPU-only machine."""

import pydantic
import pytest
import torch

from chatlearn_mem import MemoryConfig


def test_defaults():
    cfg = MemoryConfig()
    assert cfg.bucket_size_mb == 256.0
    assert cfg.bucket_size_bytes == 256 * 2**20
    assert cfg.pin_memory is None
    assert cfg.skip_unchanged_weights is True
    assert cfg.empty_cache is True
    assert cfg.cpu_huge_pages is True


def test_unknown_key_rejected_by_name():
    with pytest.raises(pydantic.ValidationError, match="bucket_size_gb") as info:
        MemoryConfig(bucket_size_gb=1)
    assert info.value.errors()[0]["type"] == "extra_forbidden"


@pytest.mark.parametrize("size", [0, -1, -0.5])
def test_non_positive_bucket_size_rejected(size):
    with pytest.raises(pydantic.ValidationError, match="bucket_size_mb") as info:
        MemoryConfig(bucket_size_mb=size)
    assert info.value.errors()[0]["type"] == "greater_than"


@pytest.mark.parametrize(
    "mb, expected",
    [
        (1.0, 2**20),
        (0.5, 2**19),
        (0.001, 1024),  # 1048.576 bytes rounds down to 2 * 512
        (1000 / 2**20, 512),  # 1000 bytes rounds down to 512
        (100 / 2**20, 512),  # below one alignment unit: clamped up to 512, never 0
        (1e-12, 512),
    ],
)
def test_bucket_size_bytes_rounding(mb, expected):
    assert MemoryConfig(bucket_size_mb=mb).bucket_size_bytes == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
def test_pin_memory_true_warns_and_resolves_false_without_cuda():
    cfg = MemoryConfig(pin_memory=True)
    with pytest.warns(UserWarning, match="pin_memory=True is ignored"):
        assert cfg.resolved_pin_memory() is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")
@pytest.mark.parametrize("pin", [None, False])
def test_pin_memory_default_and_false_resolve_false_without_cuda(pin, recwarn):
    assert MemoryConfig(pin_memory=pin).resolved_pin_memory() is False
    assert not [w for w in recwarn if "pin_memory" in str(w.message)]


def test_frozen():
    cfg = MemoryConfig(bucket_size_mb=4)
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.bucket_size_mb = 8
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        cfg.skip_unchanged_weights = False
    assert cfg.bucket_size_mb == 4
    assert cfg.skip_unchanged_weights is True


def test_cuda_contiguous_on_a_torch_that_cannot_lay_out_a_device_slab_is_refused(monkeypatch):
    # torch 2.11 (a GPU machine's) has no UntypedStorage._swap_data_ptr_: without the refusal the
    # option silently did nothing there (every storage kept its own allocation and copy)
    import chatlearn_mem.device_memory as dm
    from chatlearn_mem import ConfigError, Part
    from chatlearn_mem.manager import MemoryManagerBase

    monkeypatch.setattr(dm, "parks_cpu_memory", lambda: False)
    cuda = torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"cuda_contiguous=True needs torch.UntypedStorage._swap_data_ptr_.*"):
        MemoryManagerBase({Part.WEIGHTS: True}, cuda, MemoryConfig(cuda_contiguous=True))  # before any CUDA call
    dm.check_device_slab(False, cuda)  # not asked for
    dm.check_device_slab(True, torch.device("cpu"))  # no effect on a CPU device: nothing to refuse
    monkeypatch.setattr(dm, "parks_cpu_memory", lambda: True)
    dm.check_device_slab(True, cuda)
