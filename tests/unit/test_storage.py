"""Tests of StorageGroup on CPU tensors: in-place release/restore, host-copy tokens, failures."""

import sys

import pytest
import torch

import chatlearn_mem.device_memory as device_memory
import chatlearn_mem.group_transfer as storage_mod
import chatlearn_mem.host_store as host_store_mod
from chatlearn_mem import MemoryConfig, TransferStats
from chatlearn_mem.storage import StorageGroup, storage_key, unique_storages

CPU = torch.device("cpu")
# 1 KiB buckets: every storage below is split across several buckets or shares one.
SMALL = MemoryConfig(bucket_size_mb=1024 / 2**20)

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``t`` (NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().view(_INT_OF[t.element_size()]).clone()


def make_tensors():
    """A float32 base with views of it, plus bf16, int64 and a larger float32 tensor."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(64, generator=gen)
    base[0] = -0.0
    base[1] = float("inf")
    base[2] = torch.tensor(0x7FC00123, dtype=torch.int32).view(torch.float32)  # NaN with payload
    views = [
        base[3:19],
        base.view(8, 8),
        base[10:42].view(4, 8),
        base.view(torch.int32)[::2],
        base[::3],
        base.view(8, 8).t(),
    ]
    bf16 = torch.randn(33, generator=gen).to(torch.bfloat16)
    i64 = torch.randint(-(2**40), 2**40, (17,), dtype=torch.int64, generator=gen)
    big = torch.randn(1000, generator=gen)
    return [base, *views, bf16, i64, big]


class Quiet(list):
    """A list whose repr does not read the elements: printing a released storage crashes torch."""

    def __repr__(self):
        return f"<{len(self)} items>"


@pytest.fixture
def tensors():
    return Quiet(make_tensors())


@pytest.fixture
def storages(tensors):
    return Quiet(unique_storages(tensors, CPU))


def snapshot(tensors):
    return [(storage_key(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), bits(t)) for t in tensors]


def assert_restored(tensors, snap):
    for t, (key, offset, shape, stride, b) in zip(tensors, snap):
        assert storage_key(t) == key
        assert t.storage_offset() == offset
        assert (tuple(t.shape), tuple(t.stride())) == (shape, stride)
        assert t.data_ptr() == t.untyped_storage().data_ptr() + offset * t.element_size()
        assert torch.equal(bits(t), b)


def test_unique_storages_dedups_in_first_seen_order(tensors):
    base, bf16, i64, big = tensors[0], tensors[-3], tensors[-2], tensors[-1]
    meta = torch.empty(4, device="meta")
    found = unique_storages([None, *tensors, meta, base], CPU)
    assert [storage_key(s) for s in found] == [storage_key(t) for t in (base, bf16, i64, big)]
    assert [s.nbytes() for s in found] == [256, 66, 136, 4000]


def test_offload_releases_and_onload_restores_every_view(tensors, storages):
    snap = snapshot(tensors)
    group = StorageGroup("weights", True, SMALL)
    total = sum(s.nbytes() for s in storages)

    out = group.offload(storages)
    assert group.offloaded
    assert all(s.nbytes() == 0 for s in storages)
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    assert [n for _, n in group.released] == [256, 66, 136, 4000]
    assert (out.group, out.direction, out.nbytes, out.copied_bytes) == ("weights", "offload", total, total)
    assert group.host_bytes >= total

    back = group.onload()
    assert not group.offloaded
    assert group.released == []
    assert (back.direction, back.nbytes, back.copied_bytes) == ("onload", total, total)
    assert [s.nbytes() for s in storages] == [256, 66, 136, 4000]
    assert_restored(tensors, snap)
    # The views still alias the base: a write through one is seen through the others.
    tensors[0][10] = 123.5
    assert tensors[2][1, 2].item() == 123.5 and tensors[3][0, 0].item() == 123.5


def test_keep_contents_false_restores_zeros(tensors, storages):
    group = StorageGroup("grads", False, SMALL)
    total = sum(s.nbytes() for s in storages)
    out = group.offload(storages)
    assert all(s.nbytes() == 0 for s in storages)
    assert (out.nbytes, out.copied_bytes) == (total, 0)
    assert group.store is None and group.host_bytes == 0
    back = group.onload()
    assert (back.nbytes, back.copied_bytes) == (total, 0)
    for t in tensors:
        assert torch.equal(bits(t), torch.zeros_like(bits(t)))


def test_equal_token_skips_copy_but_still_releases(tensors, storages):
    snap = snapshot(tensors)
    group = StorageGroup("weights", True, SMALL)
    total = sum(s.nbytes() for s in storages)
    assert group.offload(storages, token="T").copied_bytes == total
    group.onload()
    group.set_host_token("T")

    out = group.offload(storages, token="T")
    assert (out.nbytes, out.copied_bytes) == (total, 0)
    assert out.gb_per_s == 0.0
    assert all(s.nbytes() == 0 for s in storages)
    group.onload()
    assert_restored(tensors, snap)

    group.set_host_token("T")
    assert group.offload(storages, token="U").copied_bytes == total
    group.onload()
    assert_restored(tensors, snap)


def test_none_token_always_copies(storages):
    group = StorageGroup("weights", True, SMALL)
    total = sum(s.nbytes() for s in storages)
    for _ in range(2):
        assert group.offload(storages, token=None).copied_bytes == total
        group.onload()
        group.set_host_token(None)


def test_version_token_catches_in_place_write(tensors, storages):
    def token():
        return tuple(t._version for t in tensors)

    group = StorageGroup("weights", True, SMALL)
    group.offload(storages, token())
    group.onload()
    group.set_host_token(token())

    tensors[1].add_(1.0)  # a write through a view bumps the version shared with the base
    tensors[-2][3] = 42
    expected = snapshot(tensors)
    out = group.offload(storages, token())
    assert out.copied_bytes == sum(n for _, n in group.released) == 4458
    group.onload()
    assert_restored(tensors, expected)
    assert tensors[-2][3].item() == 42


def test_host_store_reused_across_cycles(tensors, storages):
    snap = snapshot(tensors)
    group = StorageGroup("weights", True, SMALL)
    group.offload(storages)
    store, host = group.store, group.host_bytes
    assert len(store.buckets) > 1
    group.onload()
    for _ in range(5):
        group.offload(storages)
        assert group.store is store
        assert group.host_bytes == host
        group.onload()
        assert_restored(tensors, snap)


def test_size_change_replans_store(tensors, storages):
    group = StorageGroup("weights", True, SMALL)
    group.offload(storages)
    group.onload()
    old = group.store
    head = bits(tensors[-1])
    storages[-1].resize_(8000)
    group.offload(storages)
    assert group.store is not old
    assert group.store.sizes == (256, 66, 136, 8000)
    group.onload()
    assert storages[-1].nbytes() == 8000
    assert torch.equal(bits(tensors[-1]), head)


@pytest.mark.parametrize("contiguous", [False, True], ids=["own_memory", "slab"])
def test_onload_failure_rolls_back(failing_regrow, tensors, storages, contiguous):
    snap = snapshot(tensors)
    group = StorageGroup("weights", True, SMALL, contiguous=contiguous)
    if contiguous:  # the storages in the slab first
        group.offload(storages)
        group.onload()
    group.offload(storages)
    released = group.released
    calls = failing_regrow(3)
    with pytest.raises(RuntimeError, match="simulated device OOM"):
        group.onload()
    assert len(calls) == 3
    assert all(s.nbytes() == 0 for s in storages)
    assert group.offloaded
    assert [(storage_key(s), n) for s, n in group.released] == [(storage_key(s), n) for s, n in released]

    failing_regrow.disarm()
    group.onload()
    assert not group.offloaded
    assert_restored(tensors, snap)


@pytest.mark.parametrize("exc", [MemoryError, RuntimeError])
def test_offload_failure_releases_nothing(monkeypatch, tensors, storages, exc):
    snap = snapshot(tensors)
    sizes = [s.nbytes() for s in storages]
    group = StorageGroup("weights", True, SMALL)
    real = host_store_mod._allocate_host_bucket
    calls = []

    def failing(nbytes, pin):
        calls.append(nbytes)
        if len(calls) == 2:
            raise exc("simulated host allocation failure")
        return real(nbytes, pin)

    monkeypatch.setattr(host_store_mod, "_allocate_host_bucket", failing)
    with pytest.raises(exc, match="simulated host allocation failure"):
        group.offload(storages, token="T")
    assert [s.nbytes() for s in storages] == sizes
    assert not group.offloaded
    assert group.store is None and group.host_bytes == 0
    assert_restored(tensors, snap)

    monkeypatch.setattr(host_store_mod, "_allocate_host_bucket", real)
    out = group.offload(storages, token="T")
    assert out.copied_bytes == sum(sizes)
    assert all(s.nbytes() == 0 for s in storages)
    group.onload()
    assert_restored(tensors, snap)


def test_pin_memory_true_without_cuda_warns_and_works(tensors, storages):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only fallback")
    snap = snapshot(tensors)
    group = StorageGroup("weights", True, MemoryConfig(bucket_size_mb=1024 / 2**20, pin_memory=True))
    with pytest.warns(UserWarning, match="pin_memory=True is ignored"):
        group.offload(storages)
    assert group.store.pinned is False
    group.onload()
    assert_restored(tensors, snap)


def test_empty_group():
    group = StorageGroup("other", True, SMALL)
    out = group.offload([])
    assert (out.nbytes, out.copied_bytes) == (0, 0)
    assert group.offloaded
    assert group.onload().nbytes == 0
    assert not group.offloaded


@pytest.mark.parametrize("empty", [True, False], ids=["no_storages", "cpu_storages"])
def test_caller_event_of_a_cuda_manager_is_ignored_for_storages_not_on_cuda(storages, empty):
    # A manager on a CUDA device passes its caller's event (R1) to every group it offloads; a group
    # with no storages (a critic's part that holds nothing) runs on a CPU lane, which has no stream
    # to wait with. It used to queue the wait anyway and fail with "'NoneType' object has no
    # attribute 'wait_event'" (seen on an H200 in the colocated PPO run).
    group = StorageGroup("weights", True, SMALL)
    live = [] if empty else storages
    before = [bytes(storage_mod._byte_view(s).numpy()) for s in live]
    t = group.start_offload(live, None, caller_event=object())
    assert storage_mod._run_blocking(t).nbytes == sum(len(b) for b in before)
    assert all(s.nbytes() == 0 for s in live)
    group.onload()
    assert [bytes(storage_mod._byte_view(s).numpy()) for s in live] == before


def test_transfer_stats_fields(storages):
    group = StorageGroup("weights", True, SMALL)
    out = group.offload(storages)
    back = group.onload()
    for stats in (out, back):
        assert isinstance(stats, TransferStats)
        assert stats.seconds >= 0
        assert stats.gb_per_s >= 0
    assert TransferStats("w", "offload", 10, 2 * 10**9, 2.0).gb_per_s == pytest.approx(1.0)
    assert TransferStats("w", "offload", 10, 0, 2.0).gb_per_s == 0.0
    assert TransferStats("w", "onload", 10, 10, 0.0).gb_per_s == 0.0
    with pytest.raises(AttributeError):
        out.copied_bytes = 0


# -- a CPU storage's memory: kept while offloaded, moved back by the onload -------------------
MiB = 2**20


@pytest.mark.parametrize("mode, advice", [("lazy", device_memory._MADV_FREE), ("eager", device_memory._MADV_DONTNEED)])
def test_cycles_move_the_same_memory_out_and_back(madvise_calls, mode, advice):
    t = torch.arange(3 * MiB, dtype=torch.int32)  # 12 MiB
    view = t[5:9]
    expected = bits(t)
    s = t.untyped_storage()
    group = StorageGroup("weights", True, MemoryConfig(bucket_size_mb=4, cpu_release=mode))
    group.offload([s])
    group.onload()  # the first onload gives the storage memory with huge pages advised, before any touch
    assert [c[2] for c in madvise_calls] == [advice, device_memory._MADV_HUGEPAGE]
    ptr = s.data_ptr()
    for _ in range(3):
        group.offload([s])
        assert s.nbytes() == 0 and group.parked_count == 1
        assert madvise_calls[-1][2] == advice  # the kept pages are handed back to the kernel
        group.onload()
        assert s.data_ptr() == ptr and not group.parked_count  # the same memory, nothing allocated
        assert torch.equal(bits(t), expected) and view.tolist() == [5, 6, 7, 8]
    assert [c[2] for c in madvise_calls[2:]] == [advice] * 3  # no more huge page advice: nothing allocated


def test_dropped_grads_come_back_zeroed_in_their_own_memory(madvise_calls):
    t = torch.ones(2 * MiB, dtype=torch.float32)  # 8 MiB
    group = StorageGroup("grads", False, MemoryConfig())
    group.offload([t.untyped_storage()])
    group.onload()
    ptr = t.data_ptr()
    t.fill_(1)
    group.offload([t.untyped_storage()])
    group.onload()
    assert t.data_ptr() == ptr and torch.count_nonzero(t) == 0


def test_without_huge_pages_a_storage_keeps_its_first_memory(madvise_calls):
    t = torch.arange(MiB, dtype=torch.int32)
    ptr = t.data_ptr()
    group = StorageGroup("weights", True, MemoryConfig(cpu_huge_pages=False))
    for _ in range(2):
        group.offload([t.untyped_storage()])
        group.onload()
        assert t.data_ptr() == ptr and torch.equal(t, torch.arange(MiB, dtype=torch.int32))


def test_a_regrown_storage_stays_resizable_by_others():
    t = torch.arange(MiB, dtype=torch.int32)
    s = t.untyped_storage()
    group = StorageGroup("weights", True, MemoryConfig())
    group.offload([s])
    group.onload()
    s.resize_(0)  # what megatron-core's own offload calls do
    s.resize_(4 * MiB)
    assert s.nbytes() == 4 * MiB


def test_a_storage_regrown_without_its_memory_gets_fresh_huge_pages(madvise_calls):
    t = torch.arange(3 * MiB, dtype=torch.int32)
    expected = bits(t)
    s = t.untyped_storage()
    group = StorageGroup("weights", True, MemoryConfig(bucket_size_mb=4))
    group.offload([s])
    group.drop_parked()  # as if the kept memory had been given up
    madvise_calls.clear()
    group.onload()
    assert torch.equal(bits(t), expected)
    ((address, length, advice),) = madvise_calls
    assert advice == device_memory._MADV_HUGEPAGE
    ptr = s.data_ptr()
    assert address % (2 * MiB) == 0 and ptr <= address and address + length <= ptr + 12 * MiB
    assert length >= 8 * MiB


def test_huge_pages_off_by_config_and_for_small_storages(madvise_calls):
    big = torch.ones(2 * MiB, dtype=torch.float32)
    small = torch.ones(MiB // 2, dtype=torch.float32)  # 2 MiB: below the 4 MiB threshold
    for t, config in ((big, MemoryConfig(cpu_huge_pages=False)), (small, MemoryConfig())):
        group = StorageGroup("weights", True, config)
        group.offload([t.untyped_storage()])
        group.drop_parked()
        group.onload()
    assert all(advice != device_memory._MADV_HUGEPAGE for _, _, advice in madvise_calls)
    assert torch.equal(big, torch.ones_like(big)) and torch.equal(small, torch.ones_like(small))


@pytest.mark.parametrize("contiguous", [False, True], ids=["own_memory", "slab"])
def test_offload_rolled_back_moves_the_kept_memory_back(monkeypatch, madvise_calls, contiguous):
    a, b = torch.arange(MiB, dtype=torch.int32), torch.arange(MiB, dtype=torch.int32) * 3
    expected = bits(a), bits(b)
    # steps of 1 MiB in a slab too (CPU_SLAB_STEP_MULTIPLIER chunks): a copy follows a release
    config = MemoryConfig(bucket_size_mb=64, copy_chunk_mb=1 / storage_mod.CPU_SLAB_STEP_MULTIPLIER)
    group = StorageGroup("weights", True, config, contiguous=contiguous)
    group.offload([a.untyped_storage(), b.untyped_storage()])
    group.onload()
    ptrs = a.data_ptr(), b.data_ptr()
    real = storage_mod.GroupTransfer.run

    def fail_after_first_release(self, action):
        if action[0] == storage_mod.COPY_OUT and self.released:
            raise RuntimeError("simulated copy failure")
        real(self, action)

    monkeypatch.setattr(storage_mod.GroupTransfer, "run", fail_after_first_release)
    with pytest.raises(RuntimeError, match="simulated copy failure"):
        group.offload([a.untyped_storage(), b.untyped_storage()])
    assert not group.offloaded and not group.parked_count
    assert (a.data_ptr(), b.data_ptr()) == ptrs
    assert torch.equal(bits(a), expected[0]) and torch.equal(bits(b), expected[1])


def test_host_view_shares_the_store_within_a_bucket_and_copies_across():
    config = MemoryConfig(bucket_size_mb=512 / 2**20)  # 512-byte buckets (the smallest)
    big = torch.arange(200, dtype=torch.float32)  # 800 bytes: split across two buckets
    small = torch.arange(8, dtype=torch.bfloat16)
    inner, across, strided = small[2:6], big[120:140], small[::2]  # views made while resident
    expected = [inner.clone(), across.clone(), strided.clone()]
    group = StorageGroup("weights", keep_contents=True, config=config)
    group.offload([small.untyped_storage(), big.untyped_storage()], token=None)
    views = [group.host_view(t) for t in (inner, across, strided)]
    assert all(torch.equal(v, e) and v.dtype == e.dtype for v, e in zip(views, expected))
    buckets = [range(b.data_ptr(), b.data_ptr() + b.numel()) for b in group.store.buckets]
    assert views[0].data_ptr() in buckets[0]  # no copy: the store's bytes
    assert views[0].untyped_storage().nbytes() == 8  # a storage of exactly its bytes, not the bucket
    assert all(views[1].data_ptr() not in b for b in buckets)  # spans two buckets: a copy
    group.onload()


def test_offload_waits_while_a_reader_holds_the_host_store():
    import threading

    t = torch.arange(16, dtype=torch.float32)
    group = StorageGroup("weights", keep_contents=True, config=MemoryConfig())
    group.offload([t.untyped_storage()], token=None)
    group.onload()
    with group.reading():  # an asynchronous checkpoint save still reading the host copy
        assert group.readers == 1
        t.add_(1)  # new device contents; an offload now would copy them over the host copy
        done = threading.Event()
        worker = threading.Thread(target=lambda: (group.offload([t.untyped_storage()], token=None), done.set()))
        worker.start()
        assert not done.wait(0.5), "offload overwrote the host store while a reader held it"
        assert bits(group.store.buckets[0][:64].view(torch.float32)).equal(bits(torch.arange(16.0)))
    worker.join()
    assert done.is_set() and group.readers == 0
    assert torch.equal(group.read_host(t), torch.arange(16.0) + 1)
    group.onload()


# -- a contiguous group on a CPU device: its storages in one slab ------------------------------
def _record_actions(monkeypatch) -> list:
    actions = []
    real = storage_mod.GroupTransfer.run

    def run(self, action):
        actions.append(action)
        real(self, action)

    monkeypatch.setattr(storage_mod.GroupTransfer, "run", run)
    return actions


def test_a_contiguous_group_moves_many_storages_in_one_copy_and_one_hand_back(monkeypatch, madvise_calls):
    ts = [torch.arange(i * MiB // 2, (i + 1) * MiB // 2, dtype=torch.int32) * 7 for i in range(12)]  # 2 MiB each
    views = [t[3:9] for t in ts]
    expected = [bits(t) for t in ts]
    storages = [t.untyped_storage() for t in ts]
    group = StorageGroup("optimizer_states", True, MemoryConfig(bucket_size_mb=64, copy_chunk_mb=64), contiguous=True)
    group.offload(storages)  # the storages' own memory: a copy and a release each
    group.onload()  # regrown into the slab, at the host store's offsets
    offsets = group.store.flat_offsets
    base = storages[0].data_ptr()
    assert [s.data_ptr() - base for s in storages] == list(offsets)  # laid out as the host store
    actions = _record_actions(monkeypatch)
    for _ in range(3):
        madvise_calls.clear()
        actions.clear()
        group.offload(storages)
        copies = [a for a in actions if a[0] == storage_mod.COPY_OUT]
        assert len(copies) == 1 and copies[0][5] == offsets[-1] + 2 * MiB  # 24 MiB in one copy
        assert [a[0] for a in actions].count(storage_mod.HAND_BACK) == 1
        ((address, length, advice),) = madvise_calls  # one madvise for twelve storages
        assert advice == device_memory._MADV_FREE and address == base and length == 24 * MiB
        assert all(s.nbytes() == 0 for s in storages)
        actions.clear()
        group.onload()
        assert len([a for a in actions if a[0] == storage_mod.COPY_IN]) == 1
        assert storages[0].data_ptr() == base  # the same memory, nothing allocated
        assert all(torch.equal(bits(t), e) for t, e in zip(ts, expected))
        assert [v.tolist() for v in views] == [(torch.arange(3, 9) + i * MiB // 2).mul(7).tolist() for i in range(12)]


def test_a_cpu_slab_takes_coarser_steps_unless_a_swap_paces_it():
    """A slab's copies merge within a step, so on a CPU device its steps are its copy calls: an
    offload or onload nothing paces takes steps of CPU_SLAB_STEP_MULTIPLIER chunks; a swap's side
    (``paced``) keeps steps of one chunk, which the other side's regrows follow (R8)."""
    ts = [torch.full((MiB // 4,), i, dtype=torch.int32) for i in range(32)]  # 32 storages of 1 MiB
    expected = [bits(t) for t in ts]
    storages = [t.untyped_storage() for t in ts]
    group = StorageGroup("optimizer_states", True, MemoryConfig(copy_chunk_mb=1), contiguous=True)
    group.offload(storages)
    group.onload()  # into the slab
    steps = {}
    for paced in (False, True):
        t = group.start_offload(storages, paced=paced)
        steps["offload", paced] = len(t.plan.steps)
        t.run_blocking()
        t = group.start_onload(paced=paced)
        steps["onload", paced] = len(t.plan.steps)
        t.run_blocking()
        assert all(torch.equal(bits(x), e) for x, e in zip(ts, expected))
    m = storage_mod.CPU_SLAB_STEP_MULTIPLIER
    assert steps["offload", True] >= 32 and steps["onload", True] >= 32  # a step per MiB
    assert steps["offload", False] <= 32 // m + 1 and steps["onload", False] <= 32 // m + 1
    own = StorageGroup("optimizer_states", True, MemoryConfig(copy_chunk_mb=1), contiguous=False)
    own.offload(storages)
    own.onload()
    assert len(own.start_offload(storages).plan.steps) >= 32  # no slab, no merged copies: unchanged
    own.transfer.run_blocking()
    own.onload()


def test_a_swap_paces_its_slabs_in_steps_of_one_chunk(monkeypatch):
    """swap() starts both sides paced, so that a CPU slab keeps steps of ``copy_chunk_mb`` there."""
    seen = []
    real_off, real_on = StorageGroup.start_offload, StorageGroup.start_onload

    def start_offload(self, storages, token=None, caller_event=None, paced=False):
        seen.append(("offload", paced))
        return real_off(self, storages, token, caller_event, paced)

    def start_onload(self, users=None, token=None, paced=False):
        seen.append(("onload", paced))
        return real_on(self, users, token, paced)

    monkeypatch.setattr(StorageGroup, "start_offload", start_offload)
    monkeypatch.setattr(StorageGroup, "start_onload", start_onload)
    from chatlearn_mem import InferenceMemoryManager, swap

    a, b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    ma, mb = InferenceMemoryManager(a, MemoryConfig()), InferenceMemoryManager(b, MemoryConfig())
    mb.offload()
    seen.clear()
    swap(out=ma, into=mb)
    assert seen and all(paced for _, paced in seen), seen
    seen.clear()
    ma.onload()
    mb.offload()
    assert seen and not any(paced for _, paced in seen), seen
    mb.onload()
    ma.close()
    mb.close()


@pytest.mark.parametrize("mib_each", [2, 1.5])
def test_a_slab_hands_its_pages_back_as_the_offload_progresses(monkeypatch, madvise_calls, mib_each):
    """Each step of a slab's offload ends by handing back the whole huge pages that no storage holds
    any more (not one hand-back after the last copy): a swap paces the incoming regrows on the
    outgoing releases (R8), so a released storage's pages must go back with its release."""
    n = int(mib_each * MiB) // 4
    ts = [torch.full((n,), i, dtype=torch.int32) for i in range(12)]
    storages = [t.untyped_storage() for t in ts]
    cfg = MemoryConfig(bucket_size_mb=64, copy_chunk_mb=4)  # steps of 4 MiB: two or three storages
    group = StorageGroup("optimizer_states", True, cfg, contiguous=True)
    group.offload(storages)
    group.onload()  # into the slab
    offsets = group.store.flat_offsets
    base = storages[0].data_ptr()
    end = offsets[-1] + storages[-1].nbytes()
    actions = _record_actions(monkeypatch)
    madvise_calls.clear()
    group.start_offload(storages, paced=True).run_blocking()  # a swap's side: steps of copy_chunk_mb
    hand_backs = [a for a in actions if a[0] == storage_mod.HAND_BACK]
    assert len(hand_backs) >= 4
    # consecutive ranges from the slab's start to its end, each inner end on a huge page
    assert hand_backs[0][1] == 0 and hand_backs[-1][2] == end
    assert all(a[2] == b[1] for a, b in zip(hand_backs, hand_backs[1:]))
    assert all(h[2] % device_memory.HUGE_PAGE == 0 for h in hand_backs[:-1])
    for h in hand_backs:  # every storage in a range was released before it was handed back
        at = actions.index(h)
        inside = [i for i, off in enumerate(offsets) if off < h[2] and h[1] < off + storages[i].nbytes()]
        fully = [i for i in inside if h[1] <= offsets[i] and offsets[i] + storages[i].nbytes() <= h[2]]
        assert fully, h
        released = {a[1] for a in actions[:at] if a[0] == storage_mod.RELEASE}
        assert set(inside) <= released, (h, inside, released)
    # the first pages went back before the last storage's bytes were copied
    last_copy = max(k for k, a in enumerate(actions) if a[0] == storage_mod.COPY_OUT)
    assert actions.index(hand_backs[0]) < last_copy
    # the kernel was asked for the whole huge pages of the layout, each once
    assert [c[2] for c in madvise_calls] == [device_memory._MADV_FREE] * len(madvise_calls)
    spans = sorted((a - base, a - base + length) for a, length, _ in madvise_calls)
    assert spans[0][0] == 0 and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    assert spans[-1][1] == end // device_memory.HUGE_PAGE * device_memory.HUGE_PAGE
    group.onload()
    assert all(torch.equal(t, torch.full((n,), i, dtype=torch.int32)) for i, t in enumerate(ts))


def test_a_group_that_is_not_contiguous_copies_and_releases_each_storage(monkeypatch, madvise_calls):
    ts = [torch.ones(MiB, dtype=torch.int32) * i for i in range(6)]  # 4 MiB each
    storages = [t.untyped_storage() for t in ts]
    group = StorageGroup("weights", True, MemoryConfig(bucket_size_mb=64, copy_chunk_mb=64))
    group.offload(storages)
    group.onload()
    actions = _record_actions(monkeypatch)
    madvise_calls.clear()
    group.offload(storages)
    assert len([a for a in actions if a[0] == storage_mod.COPY_OUT]) == 6
    assert storage_mod.HAND_BACK not in [a[0] for a in actions]
    assert [c[2] for c in madvise_calls] == [device_memory._MADV_FREE] * 6
    group.onload()
    assert all(torch.equal(t, torch.ones(MiB, dtype=torch.int32) * i) for i, t in enumerate(ts))


def test_a_contiguous_group_keeps_every_view_exact_over_cycles(tensors, storages):
    snap = snapshot(tensors)
    group = StorageGroup("weights", True, SMALL, contiguous=True)  # 1 KiB buckets: storages split across them
    for _ in range(3):
        group.offload(storages)
        assert all(s.nbytes() == 0 for s in storages)
        group.onload()
        assert_restored(tensors, snap)
    tensors[0][10] = 123.5  # the views still alias their base
    assert tensors[2][1, 2].item() == 123.5 and tensors[3][0, 0].item() == 123.5
    with pytest.raises(RuntimeError, match="not resizable"):
        storages[0].resize_(0)  # the documented limit of a slab


def test_a_storage_that_left_the_slab_is_copied_on_its_own_and_comes_back(monkeypatch):
    ts = [torch.arange(MiB, dtype=torch.int32) + i for i in range(4)]
    storages = [t.untyped_storage() for t in ts]
    group = StorageGroup("main_weights", True, MemoryConfig(bucket_size_mb=64), contiguous=True)
    group.offload(storages)
    group.onload()
    in_slab = [s.data_ptr() for s in storages]
    moved = torch.UntypedStorage(storages[1].nbytes())
    moved.copy_(storages[1])
    storages[1]._swap_data_ptr_(moved)  # someone gave it other memory (same bytes)
    ts[1].add_(5)
    actions = _record_actions(monkeypatch)
    group.offload(storages)
    copies = [a for a in actions if a[0] == storage_mod.COPY_OUT]
    assert sorted(a[1] for a in copies) == [0, 1, 2, 3]  # not through the slab: one copy per storage
    group.onload()  # back into the slab
    assert [s.data_ptr() for s in storages] == in_slab
    assert [int(t[0]) for t in ts] == [0, 6, 2, 3]


def _resident_kib(address: int, nbytes: int) -> int:
    """Resident KiB of the mappings that overlap ``[address, address + nbytes)`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo < address + nbytes and address < hi
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps are Linux's")
@pytest.mark.parametrize("mode", ["lazy", "eager"])
def test_a_slab_really_hands_its_pages_back(mode):
    # the real madvise: a shared anonymous mapping (Python's mmap default) refuses MADV_FREE, and its
    # offloaded pages would stay resident
    ts = [torch.full((MiB,), i, dtype=torch.int32) for i in range(8)]  # 8 x 4 MiB
    storages = [t.untyped_storage() for t in ts]
    group = StorageGroup("optimizer_states", True, MemoryConfig(bucket_size_mb=64, cpu_release=mode), contiguous=True)
    group.offload(storages)
    group.onload()
    slab = group.slab
    assert _resident_kib(slab.address, slab.nbytes) >= 32 * 1024
    group.offload(storages)
    assert slab.hand_back(lazy=mode == "lazy")  # what the offload's last action did: the kernel took it
    if mode == "eager":
        assert _resident_kib(slab.address, slab.nbytes) < 4 * 1024  # gone at once
    group.onload()
    assert all(torch.equal(t, torch.full((MiB,), i, dtype=torch.int32)) for i, t in enumerate(ts))


def test_closing_the_manager_gives_slab_storages_memory_of_their_own():
    from chatlearn_mem import InferenceMemoryManager

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(3)])
    weight = model[1].weight
    view = weight[2:4, :8]
    expected = [p.detach().clone() for p in model.parameters()]
    mm = InferenceMemoryManager(model, MemoryConfig(check_host_memory=False))
    mm.offload()
    mm.onload()  # now in one slab
    assert not any(p.untyped_storage().resizable() for p in model.parameters())
    mm.close()
    assert all(p.untyped_storage().resizable() for p in model.parameters())
    assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))
    assert torch.equal(view, expected[2][2:4, :8])  # views still see the same bytes
    weight.untyped_storage().resize_(0)  # other code may resize them again


def _extent_by_dimensions(t):  # the formula for any layout: the oracle of the fast path
    return 0 if t.numel() == 0 else 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b[:12].view(3, 4),  # contiguous
        lambda b: b[5:17].view(3, 4),  # contiguous, at an offset
        lambda b: b[:12].view(3, 4).t(),  # transposed
        lambda b: b[:24].view(4, 6)[:, 1:4],  # a column slice: strided
        lambda b: b[::3],  # a step
        lambda b: b[:4].view(4, 1).expand(4, 5),  # stride 0
        lambda b: b[:4].view(1, 4).as_strided((1, 4), (99, 1)),  # a size-1 dimension with any stride
        lambda b: b[:0],  # empty
        lambda b: b[7],  # a scalar view
    ],
)
def test_extent_is_the_reach_of_the_dimensions_for_every_layout(make):
    from chatlearn_mem.storage import extent

    t = make(torch.arange(64, dtype=torch.float32))
    assert extent(t) == _extent_by_dimensions(t)
