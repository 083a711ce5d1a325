"""The payload a tensor crosses Ray as (:mod:`chatlearn_mem_ray.actors.wire`), without Ray.

Ray pickles with cloudpickle and pickle protocol 5; the actors and the driver add one reducer for
``torch.Tensor`` (:func:`~chatlearn_mem_ray.actors.wire.register_tensor_serializer`). Here the same
reducer goes into a cloudpickle pickler of this process, with the numpy views sent out of band as Ray
sends them, so the payload and the round trip are checked in the unit tier. The registration itself,
on Ray's own path (``ray.put``, a task's return, no copy in the sender), is tested in the Ray tier
(``tests/ray/test_wire_ray.py``).
"""

import io
import pickle

import pytest
import torch

from chatlearn_mem_ray.actors.wire import _tensor_from_payload, _tensor_to_payload

cloudpickle = pytest.importorskip("ray.cloudpickle")


def _pickler(f, buffers: list, registered: bool):
    """Ray's pickler with the reducer :func:`~chatlearn_mem_ray.actors.wire.register_tensor_serializer`
    installs (in ``CloudPickler.dispatch``, the class's dispatch table), or without it (as torch
    pickles a tensor), whatever this process registered before."""
    table = {k: v for k, v in cloudpickle.CloudPickler.dispatch_table.items() if k is not torch.Tensor}
    if registered:
        table[torch.Tensor] = lambda t: (_tensor_from_payload, (_tensor_to_payload(t),))
    pickler = type("Pickler", (cloudpickle.CloudPickler,), {"dispatch_table": table})
    return pickler(f, protocol=5, buffer_callback=buffers.append)


def _dumps(obj, registered: bool = True) -> tuple[bytes, list]:
    f, buffers = io.BytesIO(), []
    _pickler(f, buffers, registered).dump(obj)
    return f.getvalue(), buffers


def _round_trip(obj, registered: bool = True):
    data, buffers = _dumps(obj, registered)
    # Ray hands the receiver read-only views of the object store: so do these buffers
    return pickle.loads(data, buffers=[memoryview(bytes(b.raw())) for b in buffers])


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.randn(5, 7).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.tensor(3.5, dtype=torch.float64),  # 0-dim
        torch.empty(0, 4, dtype=torch.int64),
        torch.arange(24, dtype=torch.int32).reshape(4, 6).t(),  # non-contiguous
        torch.randn(3, dtype=torch.complex64),
    ],
    ids=["fp32", "bf16", "bool", "scalar", "empty", "transposed", "complex"],
)
def test_a_host_tensor_crosses_as_its_bytes_and_arrives_equal_and_writable(t):
    data, buffers = _dumps(t)
    if t.numel():
        assert len(buffers) == 1 and buffers[0].raw().nbytes == t.numel() * t.element_size()  # out of band
    back = _round_trip(t)
    assert back.dtype == t.dtype and back.shape == t.shape and back.is_contiguous()
    assert torch.equal(back, t)
    back.zero_()  # owned memory: the read-only received buffer was copied once
    assert not back.any()


def test_a_view_of_a_large_buffer_sends_only_its_own_elements():
    big = torch.zeros(1 << 20)
    _, buffers = _dumps(big[10:20])
    assert sum(b.raw().nbytes for b in buffers) == 10 * 4
    data, default = _dumps(big[10:20], registered=False)  # torch's own pickling sends the whole storage
    assert len(default) == 0 and len(data) > big.numel() * 4  # in band, every byte of it


def _tagged(t: torch.Tensor) -> torch.Tensor:
    t.tag = "kept"
    return t


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(3, requires_grad=True),
        lambda: torch.randn(3, dtype=torch.complex64).conj(),
        lambda: torch.randn(4, 4).to_sparse(),
        lambda: _tagged(torch.randn(3)),
        lambda: torch.nn.Parameter(torch.randn(3)),  # another type: Ray's default
    ],
    ids=["requires_grad", "conj", "sparse", "attribute", "parameter"],
)
def test_any_other_tensor_crosses_as_torch_pickles_it(make):
    t = make()
    back = _round_trip(t)
    assert type(back) is type(t) and back.requires_grad == t.requires_grad
    dense = (lambda x: x.to_dense()) if t.is_sparse else (lambda x: x)
    assert torch.equal(dense(back.detach()).resolve_conj(), dense(t.detach()).resolve_conj())
    assert getattr(back, "tag", None) == getattr(t, "tag", None)


def test_a_tensor_from_a_process_with_megatron_core_is_read_without_importing_it():
    """megatron-core 0.19 replaces ``torch.storage._load_from_bytes``, so torch's pickling of a
    tensor names megatron's loader and the driver imports megatron-core to read a rollout's tokens
    (seconds, and its notices on the run's console). The bytes payload names nothing of it."""
    pytest.importorskip("megatron.core")
    t = torch.arange(6)
    data, _ = _dumps(t)
    assert b"megatron" not in data and b"torch.storage" not in data
    default, _ = _dumps(t, registered=False)
    if torch.storage._load_from_bytes.__module__.startswith("megatron"):  # 0.19 and later
        assert b"megatron" in default  # what the driver had to import before
