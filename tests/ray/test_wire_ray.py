"""Tensors through Ray as their bytes, by the serializer the actors and the driver register
(:func:`chatlearn_mem_ray.actors.wire.register_tensor_serializer`), on Ray's own path: ``ray.put``
and a task's return, out of band into the object store (``tests/unit/test_wire.py`` checks the
payload itself without Ray)."""

import pytest
import torch

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

MiB = 2**20


@pytest.fixture(scope="module")
def put(local_ray):
    def _put(nbytes: int, registered: bool, view_of: int = 0) -> dict:
        """In a fresh worker process: ``ray.put`` a float32 tensor of ``nbytes`` (or a ``nbytes`` view of
        a ``view_of``-byte one) with or without the registered serializer; the peak growth of the
        process's private memory meanwhile, and the object's size in the store."""
        from chatlearn_mem_ray.actors.managed import PeakRSS
        from chatlearn_mem_ray.actors.wire import register_tensor_serializer

        if registered:
            register_tensor_serializer()
        base = torch.ones(max(nbytes, view_of) // 4)
        t = base[: nbytes // 4]
        with PeakRSS() as peak:
            ref = ray.put(t)
        size = ray.experimental.get_object_locations([ref])[ref]["object_size"]
        return {"private_bytes": peak.bytes, "object_bytes": size}

    # defined here: sent to the workers by value; max_calls=1: a fresh process each, registered or not
    return ray.remote(num_cpus=0, max_calls=1)(_put)


def test_a_tensor_goes_out_of_band_without_a_copy_in_the_sender(put):
    """pickle 5 hands the registered payload's numpy view to Ray, which writes it straight into the
    object store; torch's own pickling copies the bytes into the sender's private memory first."""
    ours = ray.get(put.remote(128 * MiB, registered=True))
    torchs = ray.get(put.remote(128 * MiB, registered=False))
    assert 128 * MiB <= ours["object_bytes"] < 129 * MiB
    assert ours["private_bytes"] < 32 * MiB, ours  # no copy of the tensor in the sender
    assert torchs["private_bytes"] >= 100 * MiB, torchs  # torch's pickle: a private copy first


def test_a_small_view_sends_only_its_own_bytes(put):
    ours = ray.get(put.remote(40, registered=True, view_of=64 * MiB))
    torchs = ray.get(put.remote(40, registered=False, view_of=64 * MiB))
    assert ours["object_bytes"] < 4096, ours
    assert torchs["object_bytes"] > 64 * MiB, torchs  # the whole storage


def test_a_returned_tensor_arrives_equal_writable_and_without_megatron(local_ray):
    """A task's return crosses the same way; the driver gets a tensor it owns (writable), read
    without importing anything but the wire module."""
    from chatlearn_mem_ray.actors.wire import register_tensor_serializer

    register_tensor_serializer()  # the driver, as the run's does

    @ray.remote(num_cpus=0)
    def make():
        from chatlearn_mem_ray.actors.wire import register_tensor_serializer

        register_tensor_serializer()
        return torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t()  # non-contiguous, no numpy dtype

    back = ray.get(make.remote())
    assert back.dtype == torch.bfloat16 and torch.equal(back, torch.arange(12, dtype=torch.bfloat16).reshape(3, 4).t())
    back.zero_()
    assert not back.any()
