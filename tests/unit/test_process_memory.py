"""The driver's view of a process (chatlearn_mem.process_memory) and the device report's split of what
the walk cannot see, on CPU: without CUDA everything says "not measured here: no CUDA"; with the
CUDA calls and NVML replaced by a fake device, the figures and the release are what they say. The
real GPU runs in tests/gpu/test_gpu_process_memory.py."""

import importlib
import os
import sys
import types

import pytest
import torch

from chatlearn_mem import device_report, process_memory

report_module = importlib.import_module("chatlearn_mem.device_report")  # the package exports the function

MiB = 2**20
GiB = 2**30


def test_without_cuda_nothing_is_measured_and_the_report_says_so():
    if torch.cuda.is_available():
        pytest.skip("a machine with CUDA: the fake device below covers the logic")
    assert process_memory.process_memory() is None
    assert process_memory.release_idle_memory() is None
    report = device_report(torch.nn.Linear(4, 4), device="cpu", measured={"nccl_communicators": 5})
    assert report.process is None and report.cuda is None and report.measured == {}
    assert "the driver's view: not measured here: no CUDA" in report.format()
    assert not report.per_process and report.to_dict()["process"] is None


class FakeDevice:
    """What torch.cuda and NVML report for one device: the allocator's counters, cuBLAS workspaces
    among the allocated bytes, the process's bytes outside the allocator, another process's bytes."""

    def __init__(self):
        self.total = 80 * GiB
        self.allocated = 100 * MiB
        self.cublas = 32 * MiB  # part of allocated
        self.reserved = 300 * MiB
        self.outside = 700 * MiB  # context, NCCL: this process's bytes outside the allocator
        self.others = 500 * MiB  # another process on the GPU
        self.nvml = "listed"  # "listed", "absent", "no memory", "missing module"

    def used(self) -> int:
        return self.reserved + self.outside + self.others

    def clear_cublas(self):
        self.allocated -= self.cublas
        self.cublas = 0

    def empty_cache(self):
        self.reserved = self.allocated


@pytest.fixture
def fake_cuda(monkeypatch):
    dev = FakeDevice()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (dev.total - dev.used(), dev.total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: dev.allocated)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: dev.reserved)
    monkeypatch.setattr(torch.cuda, "empty_cache", dev.empty_cache)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", dev.clear_cublas, raising=False)
    props = types.SimpleNamespace(uuid="1234abcd-0000-0000-0000-000000000000")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)

    pynvml = types.ModuleType("pynvml")
    pynvml.nvmlInit = lambda: None

    def by_uuid(uuid):
        assert uuid == "GPU-1234abcd-0000-0000-0000-000000000000", uuid
        return "handle0"

    def processes(handle):
        assert handle == "handle0"
        me = os.getpid() if dev.nvml != "absent" else os.getpid() + 1
        mine = None if dev.nvml == "no memory" else dev.reserved + dev.outside
        return [
            types.SimpleNamespace(pid=me, usedGpuMemory=mine),
            types.SimpleNamespace(pid=1, usedGpuMemory=dev.others),
        ]

    pynvml.nvmlDeviceGetHandleByUUID = by_uuid
    pynvml.nvmlDeviceGetComputeRunningProcesses = processes
    monkeypatch.setitem(sys.modules, "pynvml", pynvml)
    monkeypatch.setattr(process_memory, "_nvml_ready", None)
    return dev


def test_process_memory_reads_nvml_for_this_process_and_the_allocator(fake_cuda):
    pm = process_memory.process_memory()
    assert pm.device == "cuda:0" and pm.pid == os.getpid()
    assert (pm.allocated, pm.reserved, pm.cached) == (100 * MiB, 300 * MiB, 200 * MiB)
    assert pm.nvml_process_used == 1000 * MiB and pm.per_process and pm.used == 1000 * MiB
    assert pm.outside_allocator == 700 * MiB  # this process's: the other process does not count
    assert pm.device_used == 1500 * MiB and pm.device_total == 80 * GiB
    assert pm.to_dict()["outside_allocator"] == 700 * MiB and pm.nvml_note == f"NVML, pid {os.getpid()}"


@pytest.mark.parametrize(
    "nvml, note",
    [
        ("absent", "NVML does not list this process"),
        ("no memory", "NVML lists this process but not its memory"),
        ("missing module", "NVML not read: pynvml is not installed (pip install nvidia-ml-py)"),
    ],
)
def test_without_nvml_for_this_process_the_figures_are_the_devices_and_say_so(fake_cuda, monkeypatch, nvml, note):
    fake_cuda.nvml = nvml
    if nvml == "missing module":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    pm = process_memory.process_memory()
    assert pm.nvml_process_used is None and not pm.per_process and note in pm.nvml_note
    assert pm.used == pm.device_used == 1500 * MiB
    assert pm.outside_allocator == 1200 * MiB  # other processes count here now: the note says so


def test_release_clears_the_workspaces_then_empties_the_cache(fake_cuda):
    rel = process_memory.release_idle_memory()
    assert rel.cleared_workspaces and rel.cublas_workspaces_bytes == 32 * MiB
    assert rel.allocator_cache_bytes == 232 * MiB  # 300 reserved -> 68 allocated
    assert rel.per_process and rel.process_bytes == 232 * MiB and rel.seconds >= 0
    assert (fake_cuda.allocated, fake_cuda.reserved) == (68 * MiB, 68 * MiB)
    again = process_memory.release_idle_memory(measure=False)
    assert again.cublas_workspaces_bytes == again.allocator_cache_bytes == 0 and again.process_bytes is None


def test_release_without_emptying_the_cache_leaves_the_workspaces_blocks_reserved(fake_cuda):
    rel = process_memory.release_idle_memory(empty_cache=False)
    assert rel.cublas_workspaces_bytes == 32 * MiB and rel.allocator_cache_bytes == 0
    assert (fake_cuda.allocated, fake_cuda.reserved) == (68 * MiB, 300 * MiB)


def test_release_without_the_torch_call_still_empties_the_cache(fake_cuda, monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces", raising=False)
    rel = process_memory.release_idle_memory()
    assert not rel.cleared_workspaces and rel.cublas_workspaces_bytes == 0
    assert rel.allocator_cache_bytes == 200 * MiB


def test_the_report_splits_what_the_walk_cannot_see_when_measured(fake_cuda):
    model = torch.nn.Linear(4, 4)  # on the host: the walk claims nothing on the fake device
    measured = {"cuda_context": 500 * MiB, "nccl_communicators": 150 * MiB, "cublas_workspaces": 32 * MiB}
    report = device_report(model, device="cuda:0", measured=measured)
    h = report.by_holder
    assert report.per_process and report.total_bytes == 1000 * MiB == sum(h.values())
    assert (h["cublas_workspaces"], h["other_allocated"]) == (32 * MiB, 68 * MiB)
    assert h["allocator_cache"] == 200 * MiB
    assert (h["nccl_communicators"], h["cuda_context"], h["outside_allocator"]) == (150 * MiB, 500 * MiB, 50 * MiB)
    assert report.measured == measured and report.to_dict()["process"]["nvml_process_used"] == 1000 * MiB
    remains = report.remains()
    assert [r[0] for r in remains][:2] == ["cuda_context", "allocator_cache"]
    assert all(why == report_module.WHY_IT_STAYS[h_] for h_, _, why in remains)
    text = report.format()
    assert "(this process (NVML))" in text and "why what remains stays:" in text and "ncclCommSuspend" in text
    # a measured figure larger than what contains it takes all of it, no more
    big = device_report(model, device="cuda:0", measured={"nccl_communicators": 10 * GiB})
    assert big.by_holder["nccl_communicators"] == 700 * MiB and big.by_holder["outside_allocator"] == 0
    with pytest.raises(ValueError, match="measured takes cuda_context, nccl_communicators, cublas_workspaces"):
        device_report(model, device="cuda:0", measured={"nccl": 1})


def test_every_holder_says_what_it_is_and_why_it_stays():
    assert set(report_module.HOLDERS) == set(report_module.WHY_IT_STAYS)
    assert set(report_module.MEASURED) <= set(report_module.HOLDERS)


def test_the_manager_releases_idle_memory_after_a_full_offload_on_cuda_only(monkeypatch):
    """TrainerMemoryManager.offload(release_idle_memory=None): once the offload has settled, on CUDA,
    when every part is offloaded (True: after any offload; False: never)."""
    from chatlearn_mem.trainer import TrainerMemoryManager

    calls = []
    monkeypatch.setattr(
        process_memory,
        "release_idle_memory",
        lambda device, measure=True, empty_cache=True: calls.append((device, measure, empty_cache)),
    )
    offloaded = {"weights": True, "grads": True}
    fake = types.SimpleNamespace(
        device=torch.device("cuda", 0),
        parts=tuple(offloaded),
        state=types.SimpleNamespace(offloaded=offloaded.get),
        config=types.SimpleNamespace(empty_cache=False),
    )
    [release] = TrainerMemoryManager._idle_release(fake, None)
    release()
    # the allocator's counters only (no NVML query), and the manager's empty_cache setting kept
    assert calls == [(torch.device("cuda", 0), False, False)]
    offloaded["grads"] = False  # a partial offload: the trainer is not asleep
    release()
    assert len(calls) == 1
    [forced] = TrainerMemoryManager._idle_release(fake, True)
    forced()
    assert len(calls) == 2
    assert TrainerMemoryManager._idle_release(fake, False) == []
    fake.device = torch.device("cpu")
    assert TrainerMemoryManager._idle_release(fake, None) == []
