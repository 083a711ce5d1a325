"""A DeviceSlab (``MemoryConfig.cuda_contiguous``) exercised on the CPU.

The slab CUDA uses is made of torch tensors (segments) and pieces of them handed out through DLPack,
so the same code runs on a CPU device: these tests lay a CPU group out in one instead of the CPU's
mmap :class:`~chatlearn_mem.device_memory.Slab`. What only a GPU shows (the segments' stream
records, the allocator's reuse) is in tests/gpu.
"""

import pytest
import torch

import chatlearn_mem.group_transfer as gt
from chatlearn_mem import MemoryConfig
from chatlearn_mem.device_memory import DeviceSlab, Slab, own_memory
from chatlearn_mem.storage import StorageGroup

MiB = 2**20


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32).clone()


@pytest.fixture
def device_slab(monkeypatch):
    """Groups lay their storages out in a DeviceSlab where they would take a CPU Slab."""
    real = StorageGroup._slab_kind

    def kind(self, storages):
        k = real(self, storages)
        return DeviceSlab if k is Slab else k

    monkeypatch.setattr(StorageGroup, "_slab_kind", kind)


def _record(monkeypatch) -> list:
    actions = []
    real = gt.GroupTransfer.run

    def run(self, action):
        actions.append(action)
        real(self, action)

    monkeypatch.setattr(gt.GroupTransfer, "run", run)
    return actions


def _uses(t: torch.Tensor) -> int:
    """References to ``t``'s storage (the slab's, and each piece's through DLPack), less the one of
    the storage object made here to ask."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


def _group(chunk_mib: float = 8, **kw) -> StorageGroup:
    return StorageGroup("optimizer_states", True, MemoryConfig(bucket_size_mb=64, copy_chunk_mb=chunk_mib, **kw), True)


def _tensors(n: int = 12, mib: float = 2) -> list[torch.Tensor]:
    k = int(mib * MiB) // 4
    return [torch.arange(i * k, (i + 1) * k, dtype=torch.int32) * 7 for i in range(n)]


def _laid_out(n: int = 12, chunk_mib: float = 8, mib: float = 2):
    """``n`` storages of ``mib`` MiB in a group, offloaded and onloaded once: laid out in its slab.
    Returns ``(tensors, their bits, storages, group)``."""
    ts = _tensors(n, mib)
    storages = [t.untyped_storage() for t in ts]
    group = _group(chunk_mib)
    group.offload(storages)
    group.onload()
    return ts, [bits(t) for t in ts], storages, group


def test_segments_hold_consecutive_storages_at_the_stores_offsets(device_slab):
    ts, expected, storages, group = _laid_out()  # 12 x 2 MiB; segments of 8 MiB: four storages each
    views = [t[3:9] for t in ts]
    slab = group.slab
    assert isinstance(slab, DeviceSlab) and slab.starts == (0, 8 * MiB, 16 * MiB)
    offsets = group.store.flat_offsets
    for i, s in enumerate(storages):
        k = i // 4
        assert s.data_ptr() == slab.segment(k).data_ptr() + offsets[i] - slab.starts[k]
        assert not s.resizable()  # the documented price, as a CPU slab's
    assert all(torch.equal(bits(t), e) for t, e in zip(ts, expected))
    assert [v.tolist() for v in views] == [t[3:9].tolist() for t in ts]


def test_a_cycle_copies_once_per_segment_and_frees_every_segment(device_slab, monkeypatch):
    ts, expected, storages, group = _laid_out()
    actions = _record(monkeypatch)
    for _ in range(3):
        slab = group.slab
        segments = [slab.segment(k) for k in range(3)]
        assert [_uses(seg) for seg in segments] == [1 + 4] * 3  # the slab's and four pieces each
        actions.clear()
        group.offload(storages)
        copies = [a for a in actions if a[0] == gt.COPY_OUT]
        assert sorted(a[1] for a in copies) == [gt.SLAB - 2, gt.SLAB - 1, gt.SLAB]  # 12 storages, 3 copies
        assert all(a[5] == 8 * MiB for a in copies)
        assert all(s.nbytes() == 0 for s in storages) and slab.allocated == 0
        assert [_uses(seg) for seg in segments] == [1] * 3  # only this test holds them: freed with it
        del segments
        actions.clear()
        group.onload()
        assert len([a for a in actions if a[0] == gt.COPY_IN]) == 3
        assert [a[0] for a in actions].count(gt.GROW) == 12
        assert group.slab.allocated == 24 * MiB
        assert all(torch.equal(bits(t), e) for t, e in zip(ts, expected))


@pytest.mark.parametrize("mib", [2, 3], ids=["steps_on_segment_ends", "segments_across_steps"])
def test_an_offload_frees_each_segment_once_its_storages_are_released(device_slab, monkeypatch, mib):
    """A swap's side takes steps of ``copy_chunk_mb`` and regrows the other side as this one releases
    (R8): each segment goes back as soon as no storage holds a piece of it, not at the end. With
    3 MiB storages in 4 MiB steps a segment (two storages, 6 MiB) ends inside a later step's range
    of bytes than the one it starts in: it still goes when its last storage does."""
    ts, expected, storages, group = _laid_out(chunk_mib=4, mib=mib)
    slab = group.slab
    members = {}
    for i, k in enumerate(slab.placement(group.store.flat_offsets).segments):
        members.setdefault(k, set()).add(i)
    assert all(len(m) == 2 for m in members.values())
    checked = []
    real = gt.GroupTransfer.run

    def run(self, action):
        real(self, action)
        if action[0] == gt.HAND_BACK:
            released = set(self.released)
            dropped = {k for k in members if slab._segments[k] is None}
            assert dropped == {k for k, m in members.items() if m <= released}, (action, released)
            checked.append(slab.allocated)

    monkeypatch.setattr(gt.GroupTransfer, "run", run)
    group.start_offload(storages, paced=True).run_blocking()
    assert len(checked) >= len(members) // 2 and checked == sorted(checked, reverse=True) and checked[-1] == 0
    group.onload()
    assert all(torch.equal(bits(t), e) for t, e in zip(ts, expected))


def test_a_failed_onload_drops_the_segments_and_the_next_one_is_exact(device_slab, failing_regrow):
    ts, expected, storages, group = _laid_out()
    group.offload(storages)
    failing_regrow(6)  # two segments allocated by then
    with pytest.raises(RuntimeError, match="simulated device OOM"):
        group.onload()
    assert group.offloaded and all(s.nbytes() == 0 for s in storages)
    assert group.slab.allocated == 0  # the segments it allocated went with the rollback
    failing_regrow.disarm()
    group.onload()
    assert all(torch.equal(bits(t), e) for t, e in zip(ts, expected))


def test_a_failed_offload_puts_every_storage_back(device_slab, monkeypatch):
    # steps of 2 MiB, a segment per storage
    ts, expected, storages, group = _laid_out(chunk_mib=2 / gt.CPU_SLAB_STEP_MULTIPLIER)
    real = gt.GroupTransfer.run

    def fail_after_some_releases(self, action):
        if action[0] == gt.COPY_OUT and len(self.released) >= 5:
            raise RuntimeError("simulated copy failure")
        real(self, action)

    monkeypatch.setattr(gt.GroupTransfer, "run", fail_after_some_releases)
    with pytest.raises(RuntimeError, match="simulated copy failure"):
        group.offload(storages)
    assert not group.offloaded
    assert all(torch.equal(bits(t), e) for t, e in zip(ts, expected))
    monkeypatch.setattr(gt.GroupTransfer, "run", real)
    for _ in range(2):
        group.offload(storages)
        group.onload()
        assert all(torch.equal(bits(t), e) for t, e in zip(ts, expected))


def test_a_storage_that_left_the_slab_is_released_on_its_own_and_the_slab_is_laid_out_anew(device_slab, monkeypatch):
    ts, _, storages, group = _laid_out(4)
    old = group.slab
    seg = old.segment(0)
    assert own_memory(storages[1])  # someone gave it memory of its own (same bytes)
    ts[1].add_(5)
    actions = _record(monkeypatch)
    group.offload(storages)
    assert sorted(a[1] for a in actions if a[0] == gt.COPY_OUT) == [0, 1, 2, 3]  # one copy per storage
    assert group.slab is None  # forgotten: its segments go with the pieces
    group.onload()
    assert group.slab is not old and all(not s.resizable() for s in storages)
    # (on CUDA each piece goes with its release; on a CPU device a released storage's memory is
    # kept for its regrow, so the old pieces went when the onload took new ones)
    assert _uses(seg) == 1
    assert [int(t[0]) for t in ts] == [int(e[0]) + 5 * (i == 1) for i, e in enumerate(_tensors(4))]


def test_leaving_the_slab_gives_each_storage_memory_of_its_own(device_slab):
    ts, expected, storages, group = _laid_out(6)
    views = [t[5:7] for t in ts]
    seg = group.slab.segment(0)
    assert group.leave_slab(storages) == 6
    assert group.slab is None and _uses(seg) == 1  # nothing points into the segment any more
    assert all(s.resizable() for s in storages)
    assert all(torch.equal(bits(t), e) for t, e in zip(ts, expected))
    assert [v.tolist() for v in views] == [e[5:7].tolist() for e in expected]
    storages[0].resize_(0)  # other code may resize them again


def test_a_swap_between_device_slabs_never_holds_both_models(device_slab, monkeypatch):
    """R8 with segments: an incoming segment is allocated whole at the first regrow into it, and an
    outgoing one goes only with its hand-back, so the swap paces on segments: with no headroom the
    two slabs together never hold more than the larger model (paced on storages, they did)."""
    import threading

    from chatlearn_mem import InferenceMemoryManager, swap

    torch.manual_seed(0)
    a = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(16)])  # 32 storages, 1 MiB
    b = torch.nn.Sequential(*[torch.nn.Linear(128, 96) for _ in range(16)])
    expected = [p.detach().clone() for p in (*a.parameters(), *b.parameters())]
    # segments and steps of 128 KiB; the weights copied out every time (as after a train step)
    config = MemoryConfig(copy_chunk_mb=0.125, check_host_memory=False, skip_unchanged_weights=False)
    ma, mb = InferenceMemoryManager(a, config), InferenceMemoryManager(b, config)
    for m in (ma, mb):  # laid out in their slabs
        m.offload()
        m.onload()
    mb.offload()
    slabs = [m.state.group("weights").slab for m in (ma, mb)]
    assert all(isinstance(s, DeviceSlab) for s in slabs)
    sizes = [s.nbytes for s in slabs]
    lock, held = threading.Lock(), []
    # with no headroom, the first regrow in (on the caller's thread) waits until this much is out
    first_in, handed_back, grown_in = slabs[1].segment_nbytes(0), [0], threading.Event()
    real_block, real_hand_back = DeviceSlab.block, DeviceSlab.hand_back

    def block(self, *args):
        with lock:
            out = real_block(self, *args)
            held.append(sum(s.allocated for s in slabs))
        grown_in.set()
        return out

    def hand_back(self, *args):
        with lock:
            before = self.allocated
            out = real_hand_back(self, *args)
            handed_back[0] += before - self.allocated
        return out

    real_run = gt.GroupTransfer.run

    def run(self, action):
        # Once enough is out for the first regrow in, the copies out wait for it: the caller's thread
        # the pacing has just let go could be run late (50 ms was enough) while the copies out ran on
        # and emptied the outgoing slab first. Copies slowed down instead (2 ms each) left that race.
        if action[0] == gt.COPY_OUT and handed_back[0] >= first_in and not grown_in.wait(10):
            grown_in.set()  # no regrow in after 10 s: hold the copies no longer (held[0] says so below)
        real_run(self, action)

    monkeypatch.setattr(DeviceSlab, "block", block)
    monkeypatch.setattr(DeviceSlab, "hand_back", hand_back)
    monkeypatch.setattr(gt.GroupTransfer, "run", run)
    swap(out=ma, into=mb, headroom_bytes=0)
    assert held and max(held) <= max(sizes), (max(held), sizes)
    assert held[0] > sizes[1] // 2, held  # the first regrows in came while most of the model out was held
    assert slabs[0].allocated == 0 and slabs[1].allocated == sizes[1]
    swap(out=mb, into=ma)
    mb.onload()
    assert all(torch.equal(p, e) for p, e in zip((*a.parameters(), *b.parameters()), expected))
    ma.close()
    mb.close()


def test_each_segment_is_recorded_on_the_lanes_streams_once(monkeypatch):
    """R2/R3 with segments: a segment is allocated on the current stream and recorded once on each
    given stream (the copy lanes'), so that the allocator reuses it only after their copies; its
    pieces need no record of their own."""
    records = []
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda t, s: records.append((t.data_ptr(), s)))
    offsets, sizes = (0, 1024, 2048, 3072), (1000, 1000, 1000, 1000)
    slab = DeviceSlab(offsets, sizes, 2048, torch.device("cpu"), streams=("d2h", "h2d"))
    assert slab.starts == (0, 2048) and slab.nbytes == 4072
    pieces = [slab.block(off, n) for off, n in zip(offsets, sizes)]
    bases = [slab.segment(k).data_ptr() for k in range(2)]
    assert records == [(bases[0], "d2h"), (bases[0], "h2d"), (bases[1], "d2h"), (bases[1], "h2d")]
    assert [p.address for p in pieces] == [bases[0], bases[0] + 1024, bases[1], bases[1] + 1024]
    assert slab.nbytes_ending_in(0, 2048) == 2048 and slab.nbytes_ending_in(2048, 4072) == 2024
