"""Tests of chatlearn_mem.device_memory on CPU storages: what a release keeps, what it hands back to
the kernel, and what a regrow costs in page faults (measured, not assumed)."""

import os
import resource
import sys

import pytest
import torch

import chatlearn_mem.device_memory as dm

MiB = 2**20
PAGE = dm._PAGE

pytestmark = pytest.mark.skipif(not dm.parks_cpu_memory(), reason="this torch cannot move a storage's memory")


def test_release_empties_the_storage_and_keeps_its_memory(madvise_calls):
    t = torch.arange(2 * MiB, dtype=torch.int32)  # 8 MiB
    view = t.view(2, -1)[1, :4]
    s = t.untyped_storage()
    ptr, n = s.data_ptr(), s.nbytes()
    block = dm.release(s)
    assert s.nbytes() == 0 and block.nbytes == n and block.holder.data_ptr() == ptr == block.address
    ((address, length, advice),) = madvise_calls
    assert advice == dm._MADV_FREE
    # the whole 2 MiB pages inside the storage (part of one would split a transparent huge page)
    assert address % (2 * MiB) == 0 and length % (2 * MiB) == 0 and length >= n - 4 * MiB
    assert ptr <= address and address + length <= ptr + n
    dm.regrow(s, n, block)
    assert s.data_ptr() == ptr and s.nbytes() == n and block.holder.nbytes() == 0
    t.copy_(torch.arange(2 * MiB, dtype=torch.int32) * 2)  # the contents are the writer's to restore
    assert view.tolist() == [2 * MiB + 2 * k for k in range(4)]  # views made before still see it


def test_eager_release_hands_back_every_whole_page(madvise_calls):
    s = torch.ones(MiB + 100, dtype=torch.uint8).untyped_storage()
    ptr, n = s.data_ptr(), s.nbytes()
    dm.regrow(s, n, dm.release(s, lazy=False))
    ((address, length, advice),) = madvise_calls
    assert advice == dm._MADV_DONTNEED and address % PAGE == 0 and length % PAGE == 0
    assert ptr <= address < ptr + PAGE and ptr + n - PAGE < address + length <= ptr + n


def test_small_storages_are_kept_without_advice(madvise_calls):
    s = torch.ones(100, dtype=torch.float32).untyped_storage()
    block = dm.release(s)
    assert madvise_calls == [] and block.nbytes == 400
    dm.regrow(s, 400, block)
    assert s.nbytes() == 400


def test_regrow_without_a_block_advises_huge_pages_before_the_first_touch(madvise_calls):
    s = torch.UntypedStorage(0)
    dm.regrow(s, 6 * MiB + 5, None, huge_pages=True)
    assert s.nbytes() == 6 * MiB + 5 and s.resizable()
    ((address, length, advice),) = madvise_calls
    assert advice == dm._MADV_HUGEPAGE and address % (2 * MiB) == 0 and length >= 4 * MiB
    assert s.data_ptr() <= address and address + length <= s.data_ptr() + s.nbytes()
    torch.empty(0, dtype=torch.uint8).set_(s).fill_(9)  # writable to the last byte
    assert s[6 * MiB + 4] == 9


def test_regrow_with_a_block_of_another_size_maps_fresh_memory(madvise_calls):
    s = torch.ones(8 * MiB, dtype=torch.uint8).untyped_storage()
    block = dm.release(s)
    dm.regrow(s, 4 * MiB, block, huge_pages=False)
    assert s.nbytes() == 4 * MiB and s.data_ptr() != block.address
    assert block.holder.nbytes() == 8 * MiB  # left to its owner, freed when dropped


def test_zero_bytes_and_cuda_fall_back_to_resize(monkeypatch):
    s = torch.UntypedStorage(0)
    assert dm.release(s) is None
    dm.regrow(s, 0)
    assert s.nbytes() == 0
    monkeypatch.setattr(dm, "parks_cpu_memory", lambda: False)  # a torch without _swap_data_ptr_
    s = torch.ones(16, dtype=torch.uint8).untyped_storage()
    assert dm.release(s) is None and s.nbytes() == 0
    dm.regrow(s, 16)
    assert s.nbytes() == 16


def _faults_while(fn) -> int:
    """Page faults this thread takes while ``fn`` runs."""
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_FREE and RUSAGE_THREAD are Linux's")
def test_lazy_release_regrows_without_page_faults_eager_with_them():
    """The point of the lazy release: an onload writes into pages the kernel has not taken back
    (the machine is not short of memory here), so it takes no page fault; an eager release makes
    every page fault again. 64 MiB: at least 32 faults with huge pages, 16384 without."""
    t = torch.empty(64 * MiB, dtype=torch.uint8)
    s = t.untyped_storage()
    src = torch.full_like(t, 3)
    t.copy_(src)
    lazy, eager = [], []
    for out, is_lazy in ((lazy, True), (eager, False), (lazy, True), (eager, False)):
        block = dm.release(s, lazy=is_lazy)
        dm.regrow(s, 64 * MiB, block)
        out.append(_faults_while(lambda: t.copy_(src)))
    assert torch.equal(t, src)
    assert max(lazy) <= 4, lazy
    assert min(eager) >= 32, eager


def test_advise_huge_pages_skips_non_linux(monkeypatch, madvise_calls):
    monkeypatch.setattr(dm.sys, "platform", "darwin")
    assert not dm.advise_huge_pages(torch.ones(4 * MiB, dtype=torch.uint8).untyped_storage())
    assert madvise_calls == []


@pytest.mark.skipif(
    not os.path.isdir("/sys/kernel/mm/transparent_hugepage"), reason="kernel without transparent huge pages"
)
def test_advise_huge_pages_real_madvise_succeeds():
    t = torch.empty(8 * MiB, dtype=torch.uint8)
    assert dm.advise_huge_pages(t.untyped_storage())
    t.fill_(7)
    assert int(t[-1]) == 7
