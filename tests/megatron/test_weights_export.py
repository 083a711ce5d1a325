"""weights_state_dict() and iter_weights(): a sleeping model hands out its weights from the host store,
bit-exactly (iter_weights as views of it, without a copy of the model)."""

import pytest
import torch
from trainer_runs import train

from chatlearn_mem import InferenceMemoryManager, MemoryConfig
from chatlearn_mem.models import gpt
from chatlearn_mem.storage import StorageGroup


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("distopt", [True, False], ids=["distopt", "float16opt"])
def test_trainer_exports_from_host_store_without_onloading(dist1, distopt):
    cfg = gpt.GPTTrainerConfig(use_distributed_optimizer=distopt)
    _, _, mm, trainer = train(cfg, steps=2)
    resident = mm.weights_state_dict()
    expected = {
        k: v.detach().clone() for k, v in trainer.model.module.state_dict().items() if isinstance(v, torch.Tensor)
    }
    assert _equal(resident, expected)
    mm.offload()
    from_host = mm.weights_state_dict()
    assert mm.residency().device_bytes == 0  # nothing was brought back to read them
    assert mm.is_offloaded("weights")
    assert _equal(from_host, expected)
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in from_host.values())
    mm.onload()


def test_inference_export_after_update_reads_the_new_copy():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)).to(torch.bfloat16)
    mm = InferenceMemoryManager(model, MemoryConfig(bucket_size_mb=96 / 2**20))  # spans split buckets
    mm.offload_weights()
    mm.onload_weights()
    with torch.no_grad():
        model[0].weight.add_(1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    mm.offload_weights()
    assert _equal(mm.weights_state_dict(), expected)
    mm.onload_weights()


def test_read_host_refuses_foreign_tensors_and_resident_groups():
    group = StorageGroup("weights", keep_contents=True, config=MemoryConfig())
    t = torch.arange(10.0)
    view = t[2:8:2]  # views are made while resident (a released storage refuses new ones)
    with pytest.raises(ValueError, match="hold no host copy"):
        group.read_host(t)
    group.offload([t.untyped_storage()], token=None)
    with pytest.raises(ValueError, match="not a view of a storage of weights"):
        group.read_host(torch.zeros(3))
    assert torch.equal(group.read_host(view), torch.tensor([2.0, 4.0, 6.0]))
    group.onload()


def test_iter_weights_views_the_host_store_while_asleep_without_a_copy_of_the_model(dist1):
    """The weight sync's reader: the same tensors as weights_state_dict(), asleep as views of the host
    store (no new memory), awake as one copy at a time; an offload waits for a reader."""
    import threading

    from chatlearn_mem import Part

    _, _, mm, _ = train(gpt.GPTTrainerConfig(), steps=1)
    awake = dict(mm.iter_weights())
    mm.offload()
    copies = mm.weights_state_dict()
    views = dict(mm.iter_weights())
    assert views.keys() == copies.keys() == awake.keys()
    assert all(torch.equal(views[k], copies[k]) and torch.equal(views[k], awake[k]) for k in views)
    buckets = mm.state.group(Part.WEIGHTS).store.buckets
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in buckets]

    def bucket_of(first: int, nbytes: int):
        """The host-store bucket whose bytes hold ``[first, first + nbytes)`` (None: no one bucket does)."""
        return next((i for i, (lo, hi) in enumerate(spans) if lo <= first and first + nbytes <= hi), None)

    outside = [k for k, t in views.items() if bucket_of(t.data_ptr(), t.numel() * t.element_size()) is None]
    assert not outside, f"views not inside one bucket of the host store: {outside}"

    def new_bytes(tensors) -> int:
        """Bytes of the storages ``tensors`` hold outside the host store's buckets: memory the reader
        allocated (a view owns a storage of exactly its bytes, over a bucket's memory)."""
        own = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return sum(n for ptr, n in own.items() if bucket_of(ptr, n) is None)

    weight_bytes = sum(t.numel() * t.element_size() for t in views.values())
    assert new_bytes(views.values()) == 0  # no copy of the model: every view's storage is a bucket's memory
    assert new_bytes(copies.values()) >= weight_bytes > 0  # weights_state_dict copies, for scale
    mm.onload()
    reader = mm.iter_weights()
    mm.offload()
    next(reader)  # reading now: an offload that copies (the weights changed) waits for the reader
    done = threading.Event()
    t = threading.Thread(target=lambda: (mm.onload(), mm.mark_weights_dirty(), mm.offload(), done.set()))
    t.start()
    assert not done.wait(0.3)
    list(reader)
    t.join(30)
    assert done.is_set()
