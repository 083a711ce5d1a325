"""Tests of HostStore: span planning, zero-size entries, byte views and allocation failures."""

import gc
import weakref

import pytest
import torch

import chatlearn_mem.host_store as host_store_mod
from chatlearn_mem.host_store import HostStore, Span

ALIGN = 512


def check_plan(store: HostStore, sizes: list[int], bucket_size: int) -> None:
    """Asserts every invariant of a plan: exact cover, contiguity, alignment, bounds, no overlap."""
    assert store.sizes == tuple(sizes)
    assert len(store.spans) == len(sizes)
    for b in store.buckets:
        assert b.dtype == torch.uint8 and b.dim() == 1 and b.device.type == "cpu"
        assert 0 < b.numel() <= bucket_size
    assert store.nbytes == sum(b.numel() for b in store.buckets)
    used: dict[int, list[tuple[int, int]]] = {}
    for size, spans in zip(sizes, store.spans):
        if size == 0:
            assert spans == []
            continue
        assert spans[0].storage_offset == 0
        assert spans[0].bucket_offset % ALIGN == 0
        assert len(spans) >= -(-size // bucket_size)
        expected_offset = 0
        for s in spans:
            assert s.nbytes > 0
            assert s.storage_offset == expected_offset
            expected_offset += s.nbytes
            assert 0 <= s.bucket_offset
            assert s.bucket_offset + s.nbytes <= store.buckets[s.bucket].numel()
            used.setdefault(s.bucket, []).append((s.bucket_offset, s.bucket_offset + s.nbytes))
        assert expected_offset == size
    for intervals in used.values():
        intervals.sort()
        for (_, end), (start, _) in zip(intervals, intervals[1:]):
            assert end <= start, f"overlapping spans {intervals}"


@pytest.mark.parametrize(
    "sizes, bucket_size",
    [
        ([100], 4096),
        ([4096], 4096),
        ([1, 1, 1, 1], 4096),
        ([100, 1000, 3000], 2048),
        ([10_000], 1024),  # one storage over many buckets
        ([513, 7000, 12, 4096, 1], 2048),
        ([300, 300, 300], 1000),  # bucket size not a multiple of the alignment
        ([5000, 5000], 100),  # bucket smaller than one alignment unit
        ([2**20 + 3, 17, 2**19], 2**18),
    ],
)
def test_plan_invariants(sizes, bucket_size):
    check_plan(HostStore(sizes, bucket_size, pin=False), sizes, bucket_size)


def test_plan_exact_layout_with_split_storage():
    store = HostStore([100, 1000, 3000], 2048, pin=False)
    assert store.spans == [
        [Span(0, 0, 0, 100)],
        [Span(0, 512, 0, 1000)],
        # starts at the next aligned offset, fills bucket 0, then spans two more buckets
        [Span(0, 1536, 0, 512), Span(1, 0, 512, 2048), Span(2, 0, 2560, 440)],
    ]
    assert [b.numel() for b in store.buckets] == [2048, 2048, 440]
    assert store.nbytes == 4536


def test_zero_size_entries():
    sizes = [0, 10, 0, 0, 700, 0]
    store = HostStore(sizes, 1024, pin=False)
    check_plan(store, sizes, 1024)
    for i in (0, 2, 3, 5):
        assert store.views(i) == []
    assert store.spans[1] == [Span(0, 0, 0, 10)]
    assert store.spans[4] == [Span(0, 512, 0, 512), Span(1, 0, 512, 188)]


@pytest.mark.parametrize("sizes", [[], [0], [0, 0, 0]])
def test_nothing_to_store_allocates_nothing(sizes):
    store = HostStore(sizes, 1024, pin=False)
    assert store.buckets == []
    assert store.nbytes == 0


def test_views_round_trip_bytes():
    sizes = [100, 1000, 0, 3000, 5, 2048]
    store = HostStore(sizes, 1536, pin=False)
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen) for n in sizes]
    # Write every storage first, then read every storage: overlapping spans would clobber.
    for i, src in enumerate(data):
        for view, off in store.views(i):
            view.copy_(src[off : off + view.numel()])
    for i, src in enumerate(data):
        back = torch.zeros_like(src)
        covered = 0
        for view, off in store.views(i):
            assert view.dtype == torch.uint8
            back[off : off + view.numel()] = view
            covered += view.numel()
        assert covered == sizes[i]
        assert torch.equal(back, src)


def test_allocation_failure_propagates_and_keeps_nothing(monkeypatch):
    real = host_store_mod._allocate_host_bucket
    calls = []
    first: list[weakref.ref] = []

    def failing(nbytes, pin):
        calls.append(nbytes)
        if len(calls) == 2:
            raise MemoryError("simulated host OOM")
        t = real(nbytes, pin)
        first.append(weakref.ref(t))
        return t

    monkeypatch.setattr(host_store_mod, "_allocate_host_bucket", failing)
    with pytest.raises(MemoryError, match="simulated host OOM"):
        HostStore([4096, 4096, 4096], 4096, pin=False)
    assert calls == [4096, 4096]
    gc.collect()
    assert first and first[0]() is None, "the bucket allocated before the failure was kept alive"


@pytest.mark.parametrize("bucket_size", [0, -1])
def test_non_positive_bucket_size(bucket_size):
    with pytest.raises(ValueError, match="bucket_size must be > 0"):
        HostStore([10], bucket_size, pin=False)


# -- pinned stores: registered at their exact size, unregistered with the store ------------------------
@pytest.fixture
def fake_cuda_pinning(monkeypatch):
    """Stand-ins for cudaHostRegister / cudaHostUnregister recording what the store asks for (the
    real calls run in the GPU tier, tests/gpu/test_gpu_manager.py)."""
    calls = {"register": [], "unregister": []}

    def register(bucket):
        calls["register"].append((bucket.data_ptr(), bucket.numel()))

    def unregister(pointers):
        calls["unregister"].extend(pointers)
        pointers.clear()

    monkeypatch.setattr(host_store_mod, "_register", register)
    monkeypatch.setattr(host_store_mod, "_unregister", unregister)
    return calls


def test_pinned_buckets_are_page_aligned_exact_and_registered_once(fake_cuda_pinning):
    sizes = [3 * 2**20 + 100, 5000, 2**20]
    store = HostStore(sizes, 2 * 2**20, pin=True)
    check_plan(store, sizes, 2 * 2**20)
    assert [n for _, n in fake_cuda_pinning["register"]] == [b.numel() for b in store.buckets]
    assert store.nbytes == HostStore.planned_nbytes(sizes, 2 * 2**20)  # no power-of-two rounding
    assert all(b.data_ptr() % 4096 == 0 for b in store.buckets)
    ptrs = [p for p, _ in fake_cuda_pinning["register"]]
    store.close()
    assert sorted(fake_cuda_pinning["unregister"]) == sorted(ptrs) and store.buckets == []
    store.close()  # again: nothing left to unregister
    assert len(fake_cuda_pinning["unregister"]) == len(ptrs)


def test_collected_pinned_store_is_unregistered(fake_cuda_pinning):
    store = HostStore([10000, 20000], 16384, pin=True)
    n = len(store.buckets)
    del store
    gc.collect()
    assert len(fake_cuda_pinning["unregister"]) == n


def test_failed_registration_unregisters_what_was_registered(fake_cuda_pinning, monkeypatch):
    done = []

    def flaky(bucket):
        if len(done) == 2:
            raise RuntimeError("cudaHostRegister of a host bucket failed (cudaError 2)")
        done.append(bucket.data_ptr())

    monkeypatch.setattr(host_store_mod, "_register", flaky)
    with pytest.raises(RuntimeError, match="cudaError 2"):
        HostStore([4096] * 5, 4096, pin=True)
    assert sorted(fake_cuda_pinning["unregister"]) == sorted(done)


def test_group_closes_its_store_when_dropped_or_replanned(fake_cuda_pinning, monkeypatch):
    from chatlearn_mem import MemoryConfig
    from chatlearn_mem.storage import StorageGroup, unique_storages

    monkeypatch.setattr(MemoryConfig, "resolved_pin_memory", lambda self: True)
    tensors = [torch.randn(3000), torch.randn(500)]
    before = [t.clone() for t in tensors]
    group = StorageGroup("weights", True, MemoryConfig(bucket_size_mb=8 / 1024))
    storages = unique_storages(tensors, torch.device("cpu"))
    group.offload(storages)
    group.onload()
    first = len(fake_cuda_pinning["register"])
    assert first > 0 and not fake_cuda_pinning["unregister"]
    tensors[1].untyped_storage().resize_(4000)  # a size change re-plans the store: the old one is closed
    group.offload(unique_storages(tensors, torch.device("cpu")))
    assert len(fake_cuda_pinning["unregister"]) == first
    group.onload()
    group.drop_host_store()
    assert len(fake_cuda_pinning["unregister"]) == len(fake_cuda_pinning["register"])
    assert torch.equal(tensors[0], before[0])
