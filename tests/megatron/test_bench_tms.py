"""The benchmark's torch_memory_saver method on CPU (chatlearn_mem_bench.tms): without CUDA it is
skipped and the results say why; its worker's protocol, checksums and the rows, targets and report
it feeds run end to end with a stand-in for TMS (``--fake``: host copies, no TMS, nothing real
timed); a worker that dies is left out and the run goes on; one that brings back other bytes is
caught. The real TMS runs in tests/gpu/test_gpu_tms.py and the GPU validation's ``tms`` step."""

import json

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("psutil")

import torch  # noqa: E402

from chatlearn_mem_bench import tms  # noqa: E402
from chatlearn_mem_bench.config import load_config  # noqa: E402
from chatlearn_mem_bench.run import run_and_report  # noqa: E402
from chatlearn_mem_bench.tms_worker import FAKE_CORRUPT, FAKE_EXIT_ON  # noqa: E402

QUICK = ["repeats=3", "warmup=0", "cycles=2", "plot=false", "overlap=false", "soak_cycles=0", "tail_onloads=0"]


def _run(tmp_path, methods: str = "[torch_memory_saver]") -> dict:
    cfg = load_config("tiny", [f"output_dir={tmp_path}", "name=t", f"methods={methods}", *QUICK])
    run_and_report(cfg, "test", quiet=True, echo=lambda line: None)
    return json.loads((tmp_path / "t.json").read_text())


@pytest.fixture
def stand_in(monkeypatch):
    """The method runs here as on a GPU, its worker with the stand-in for TMS."""
    spawn = tms.TorchMemorySaverMethod.spawn.__func__
    monkeypatch.setattr(tms, "skip_reason", lambda cuda: None)
    monkeypatch.setattr(tms.TorchMemorySaverMethod, "spawn", classmethod(lambda cls, cfg: spawn(cls, cfg, fake=True)))


def test_without_cuda_the_method_is_skipped_and_the_results_say_why(dist1, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA here: the method runs")
    res = _run(tmp_path, "[fresh_host_alloc,torch_memory_saver]")  # an alternative every megatron-core runs
    assert res["skipped_methods"] == {
        "torch_memory_saver": "no CUDA: torch_memory_saver pauses CUDA allocations (GPU only)"
    }
    assert "torch_memory_saver" not in res["methods"] and "torch_memory_saver" not in res
    assert not any(r["method"] == "torch_memory_saver" for r in res["timings"])
    assert any(r["method"] == "fresh_host_alloc" for r in res["timings"]) and res["complete"]
    assert "Not run: `torch_memory_saver`: no CUDA" in (tmp_path / "t.md").read_text()


def test_the_worker_rounds_feed_rows_targets_and_the_report(dist1, tmp_path, stand_in):
    res = _run(tmp_path)
    assert res["skipped_methods"] == {} and res["complete"]
    rows = {(r["part"], r["direction"]): r for r in res["timings"] if r["method"] == "torch_memory_saver"}
    assert set(rows) == {
        (p, d) for p in ("weights", "main_weights", "optimizer_states", "full") for d in ("offload", "onload")
    }
    parts = res["model"]["bytes_per_part"]
    for (part, d), r in rows.items():
        assert len(r["samples_s"]) == 3 and r["time_vs_manager"] > 0 and r["bytes_copied"] == parts[part]
        with_grads = part in ("weights", "full")
        assert r["tms_released_bytes"] == parts[part] + (parts["grads"] if with_grads else 0)  # the stand-in's count
        assert r["tms_tag"] == {"weights": "model", "full": "(every tag)"}.get(part, part)
    worker = res["torch_memory_saver"]
    assert worker["worker"]["fake"] and worker["worker"]["bytes_per_part"] == parts  # the same trainer
    assert worker["failed"] is None and worker["parts_changed"] == [] and worker["same_forward_loss"]
    assert worker["bye"]["audit_ok"]
    names = {t["name"]: t for t in res["targets"]}
    assert "full offload: manager >= 5x faster than torch_memory_saver" in names
    assert names["integrity: torch_memory_saver's trainer bit-identical after every resume (checked in its worker)"][
        "passed"
    ]
    memory = [x for x in res["memory"] if x["method"] == "torch_memory_saver"]
    assert {x["stage"] for x in memory} == {"before", "after_offload", "after_onload"} and all(
        x["in_worker"] for x in memory
    )
    md = (tmp_path / "t.md").read_text()
    assert "## The manager against `torch_memory_saver`" in md and "| full | offload |" in md
    assert "a stand-in for torch_memory_saver" in md and "the same bits" in md


def test_a_worker_that_dies_is_left_out_and_one_that_changes_bytes_is_caught(dist1, tmp_path, stand_in, monkeypatch):
    monkeypatch.setenv(FAKE_EXIT_ON, "all")  # dies at the full part's pause, as TMS exit(1)s
    monkeypatch.setenv(FAKE_CORRUPT, "optimizer_states")
    res = _run(tmp_path)
    assert res["complete"]  # the run went on without it
    parts = {r["part"] for r in res["timings"] if r["method"] == "torch_memory_saver"}
    assert parts == {"weights", "main_weights", "optimizer_states"}
    worker = res["torch_memory_saver"]
    assert worker["failed"].startswith("full: the worker ended (exit status 1)")
    assert worker["parts_changed"] == ["optimizer_states"]
    integrity = next(t for t in res["targets"] if t["name"].startswith("integrity: torch_memory_saver"))
    assert (
        not integrity["passed"] and "optimizer_states" in integrity["detail"] and "failed: full" in integrity["detail"]
    )


def test_skip_reasons_and_the_workers_environment(monkeypatch, tmp_path):
    assert tms.skip_reason(False).startswith("no CUDA")
    monkeypatch.setattr(tms, "_tms_package", lambda: None)
    assert "torch_memory_saver is not installed" in tms.skip_reason(True)
    monkeypatch.setattr(tms, "_tms_package", lambda: tmp_path)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert "expandable_segments:True, which torch_memory_saver refuses" in tms.skip_reason(True)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")

    def missing():
        raise RuntimeError("expected exactly one .so matching 'x_cu13.*.so'")

    monkeypatch.setattr(tms, "preload_library", missing)
    assert (
        tms.skip_reason(True)
        == "torch_memory_saver cannot be loaded in this process: expected exactly one .so matching 'x_cu13.*.so'"
    )
    lib = tmp_path / "torch_memory_saver_hook_mode_preload_cu13.abi3.so"
    monkeypatch.setattr(tms, "preload_library", lambda: lib)
    monkeypatch.setattr(tms, "cuda_runtime_dir", lambda major=None: tmp_path / "nvidia/cu13/lib")
    env = tms.worker_env(False, {"LD_PRELOAD": "/other.so:/old/torch_memory_saver_x.so", "LD_LIBRARY_PATH": "/a"})
    assert env["LD_PRELOAD"] == f"{lib}:/other.so"
    assert env["LD_LIBRARY_PATH"] == f"{tmp_path / 'nvidia/cu13/lib'}:/a"
    assert (env["TMS_INIT_ENABLE"], env["TMS_INIT_ENABLE_CPU_BACKUP"], env["TMS_RETAIN_CPU_BACKUP"]) == ("1", "1", "0")
    assert tms.worker_env(True, {})["TMS_RETAIN_CPU_BACKUP"] == "1"
