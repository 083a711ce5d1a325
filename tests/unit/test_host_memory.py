"""Host memory the process can use (cgroup v2 / v1 limits, MemAvailable) and the offload refusal."""

import pytest
import torch

from chatlearn_mem import HostMemoryError, InferenceMemoryManager, MemoryConfig, host_memory

GiB = 2**30


@pytest.fixture
def fake_system(tmp_path, monkeypatch):
    """A fake /sys/fs/cgroup, /proc/self/cgroup and /proc/meminfo; returns a writer."""
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(host_memory, "_CGROUP_ROOT", str(root))
    monkeypatch.setattr(host_memory, "_SELF_CGROUP", str(tmp_path / "self_cgroup"))
    monkeypatch.setattr(host_memory, "_MEMINFO", str(tmp_path / "meminfo"))

    def write(self_cgroup="0::/\n", meminfo_kb=None, files=None):
        (tmp_path / "self_cgroup").write_text(self_cgroup)
        if meminfo_kb is not None:
            (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {meminfo_kb} kB\n")
        for rel, text in (files or {}).items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    return write


def test_cgroup_v2_limit_counts_reclaimable_cache_as_free(fake_system):
    fake_system(
        "0::/job\n",
        meminfo_kb=20 * 2**20,
        files={
            "job/memory.max": f"{8 * GiB}\n",
            "job/memory.current": f"{7 * GiB}\n",
            "job/memory.stat": f"anon 100\ninactive_file {GiB}\n",
        },
    )
    m = host_memory.usable_host_memory()
    assert m.nbytes == 2 * GiB  # 8 - (7 - 1): the page cache is reclaimable
    assert [n for _, n in m.sources] == [2 * GiB, 20 * GiB]
    assert "cgroup v2" in m.describe() and "limit 8.00 GiB, free 2.00 GiB" in m.describe()
    assert "MemAvailable 20.00 GiB" in m.describe()


def test_ancestor_limit_and_memavailable_take_the_smallest(fake_system):
    fake_system(
        "0::/a/b\n",
        meminfo_kb=3 * 2**20,
        files={
            "a/b/memory.max": "max\n",
            "a/b/memory.current": "10\n",
            "a/memory.max": f"{64 * GiB}\n",
            "a/memory.current": f"{GiB}\n",
        },
    )
    m = host_memory.usable_host_memory()
    assert m.nbytes == 3 * GiB  # MemAvailable is smaller than the ancestor's room (63 GiB)
    assert len(m.sources) == 2


def test_cgroup_v1_limit_and_unlimited(fake_system):
    fake_system(
        "4:memory:/docker/x\n",
        meminfo_kb=50 * 2**20,
        files={
            "memory/memory.limit_in_bytes": f"{4 * GiB}\n",
            "memory/memory.usage_in_bytes": f"{3 * GiB}\n",
            "memory/memory.stat": f"inactive_file 5\ntotal_inactive_file {GiB // 2}\n",
        },
    )
    assert host_memory.usable_host_memory().nbytes == GiB + GiB // 2
    fake_system(
        "4:memory:/docker/x\n", meminfo_kb=50 * 2**20, files={"memory/memory.limit_in_bytes": "9223372036854771712\n"}
    )  # v1 for "no limit"
    m = host_memory.usable_host_memory()
    assert m.nbytes == 50 * GiB and [w for w, _ in m.sources] == ["MemAvailable"]


def test_nothing_readable_means_unknown(fake_system):
    fake_system("")
    m = host_memory.usable_host_memory()
    assert m.nbytes is None and m.describe() == "no source readable"


def test_this_machine_reports_something():
    m = host_memory.usable_host_memory()
    assert m.nbytes is None or m.nbytes >= 0


def _module():
    torch.manual_seed(0)
    return torch.nn.Linear(256, 256)  # 257 KiB


def test_inference_offload_refused_before_anything_changes(monkeypatch):
    module = _module()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    mm = InferenceMemoryManager(module, MemoryConfig(host_memory_margin_mb=0.25))
    monkeypatch.setattr(
        host_memory, "usable_host_memory", lambda: host_memory.HostMemory(300 * 1024, (("MemAvailable", 300 * 1024),))
    )
    with pytest.raises(
        HostMemoryError,
        match=r"it would allocate 0\.00 GiB of host memory \(weights 0\.00 GiB\) "
        r"but the process can use only 0\.00 GiB \(MemAvailable 0\.00 GiB; minus "
        r"host_memory_margin_mb=0\.25 MiB\)\. Free host memory",
    ):
        mm.offload()
    assert not mm.is_offloaded("weights") and mm.residency().host_bytes == 0
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
    mm.close()
    # The same budget without the margin fits: offload, and the reused store needs nothing more.
    mm = InferenceMemoryManager(module, MemoryConfig(host_memory_margin_mb=0))
    mm.offload()
    mm.onload()
    monkeypatch.setattr(host_memory, "usable_host_memory", lambda: host_memory.HostMemory(0, ()))
    mm.offload()
    mm.onload()
    assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
    mm.close()


def test_check_can_be_disabled_and_unknown_memory_is_not_refused(monkeypatch):
    module = _module()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    usable = {"now": host_memory.HostMemory(0, ())}  # none free: refused unless the check is off
    monkeypatch.setattr(host_memory, "usable_host_memory", lambda: usable["now"])
    for config in (MemoryConfig(check_host_memory=False), MemoryConfig()):
        if config.check_host_memory:
            usable["now"] = host_memory.HostMemory(None, ())  # unknown: not refused either
        mm = InferenceMemoryManager(module, config)
        mm.offload()
        res = mm.residency()
        assert mm.is_offloaded("weights") and res.device_bytes == 0 and res.host_bytes > 0
        mm.onload()
        assert all(torch.equal(v, module.state_dict()[k]) for k, v in before.items())
        mm.close()


def test_margin_must_not_be_negative():
    with pytest.raises(ValueError, match="host_memory_margin_mb"):
        MemoryConfig(host_memory_margin_mb=-1)
