"""Smoke test of the memory benchmark (tiny trainer, a few seconds): it runs end to end and its
outputs hold every figure. Targets are only checked to exist; wall-clock results are never asserted."""

import json

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("psutil")

from typer.testing import CliRunner  # noqa: E402

from chatlearn_mem_bench import PARTS  # noqa: E402
from chatlearn_mem_bench.config import COPY_PARTS, FULL  # noqa: E402
from chatlearn_mem_ray.cli import app  # noqa: E402

# The shipped bench configs and presets are checked in tests/unit/test_bench_config.py.


def test_benchmark_end_to_end(dist1, tmp_path):
    result = CliRunner().invoke(app, ["bench", "--config", "tiny", f"output_dir={tmp_path}", "name=smoke", "-q"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert out.startswith("command: chatlearn-mem bench --config tiny")
    last = out.strip().splitlines()
    assert last[-1].startswith("== ") and "targets met" in last[-1]  # targets are printed last

    res = json.loads((tmp_path / "smoke.json").read_text())
    assert (tmp_path / "smoke.md").read_text().count("| manager |") >= 10
    assert (tmp_path / "smoke.png").stat().st_size > 0
    assert res["command"].startswith("chatlearn-mem bench --config tiny")
    assert res["config"]["trainer"]["hidden_size"] == 64 and res["config"]["preset"] == "tiny"
    for key in ("torch", "megatron-core", "python"):
        assert res["versions"][key]
    for key in ("cpu_model", "cpu_count", "memory_total_bytes", "device", "torch_num_threads"):
        assert key in res["hardware"]

    rows = {(r["part"], r["method"], r["direction"]): r for r in res["timings"]}
    alternatives = ("per_tensor_new_host", "fresh_host_alloc", "replace_rebuild")
    for part in PARTS:
        methods = ("manager", "ceiling", "release_bound") + (alternatives if part in COPY_PARTS else ())
        for m in methods:
            for d in ("offload", "onload"):
                r = rows[(part, m, d)]
                assert len(r["samples_s"]) == res["config"]["repeats"]
                assert set(r["seconds"]) >= {"median", "q25", "q75", "min", "max"}
                if part in COPY_PARTS or part == FULL:
                    assert r["bytes_copied"] == res["model"]["bytes_per_part"][part] > 0
                    assert r["gb_per_s"] > 0
                if m == "manager" and (part != "grads" or d == "onload"):
                    assert r["vs_ceiling"] > 0 and r["vs_release_bound"] > 0
                if m in alternatives:
                    assert r["time_vs_manager"] > 0 and r["manager_is"] in ("faster", "slower", "noise")

    stages = {(x["part"], x["method"], x["stage"]): x for x in res["memory"]}
    for part in PARTS:
        before = stages[(part, "manager", "before")]
        offloaded = stages[(part, "manager", "after_offload")]
        onloaded = stages[(part, "manager", "after_onload")]
        assert before["device_bytes"] > 0 and offloaded["device_bytes"] == 0
        assert onloaded["device_bytes"] == before["device_bytes"]
        assert offloaded["rss_bytes"] > 0 and "pinned_bytes" in offloaded

    cycles = res["cycles"]["rows"]
    assert len(cycles) == res["config"]["cycles"]
    assert all(c["device_bytes_after_offload"] == 0 for c in cycles)
    assert res["integrity"]["tensors_bit_identical_after_all_methods"] and res["integrity"]["audit_ok"]

    # megatron-core's own offload (0.16+): weights and grads on CPU (its optimizer offload acts on
    # CUDA tensors only), with the same bytes as the manager and the device really released
    builtin = res["method_parts"]["megatron_builtin"]
    if res["versions"]["megatron-core"] < "0.16":
        assert builtin == []
    else:
        assert builtin == ["weights", "grads"]
        for part in builtin:
            assert stages[(part, "megatron_builtin", "after_offload")]["device_bytes"] == 0
            for d in ("offload", "onload"):
                r = rows[(part, "megatron_builtin", d)]
                assert r["manager_is"] in ("faster", "slower", "noise")
                assert r["bytes_copied"] == (res["model"]["bytes_per_part"]["weights"] if part == "weights" else 0)
        assert any("manager no slower (beyond spread) than megatron_builtin" in t["name"] for t in res["targets"])

    names = [t["name"] for t in res["targets"]]
    assert any("weights offload: manager >= 0.8 of ceiling" in n for n in names)
    assert any("optimizer_states onload: manager >= 0.8 of ceiling" in n for n in names)
    assert any("no slower" in n for n in names) and any(n.startswith("no growth") for n in names)
    assert all(isinstance(t["passed"], bool) and t["detail"] for t in res["targets"])

    # The GPU branches of the targets and the tables, on the same figures relabelled as CUDA ones
    # (no GPU here: this checks the bookkeeping, not CUDA).
    from chatlearn_mem_bench.report import markdown
    from chatlearn_mem_bench.run import check_targets

    gpu = json.loads(json.dumps(res))
    gpu["hardware"].update(device="cuda:0", gpu_name="fake")
    for x in gpu["memory"]:
        x.update(cuda_allocated_bytes=x["device_bytes"], cuda_reserved_bytes=x["device_bytes"])
    for c in gpu["cycles"]["rows"]:
        for stage in ("offload", "onload"):
            n = c[f"device_bytes_after_{stage}"]
            c.update({f"cuda_allocated_bytes_after_{stage}": n, f"cuda_reserved_bytes_after_{stage}": n})
    targets = {t["name"]: t for t in check_targets(gpu)}
    assert targets["cuda_reserved_bytes after full offload < 1% of onloaded"]["passed"]
    assert "main_weights onload: manager >= 0.9 of ceiling" in targets
    assert "full offload: manager >= 0.9 of ceiling" in targets and "full onload: manager >= 0.9 of ceiling" in targets
    assert not any(n.startswith("full ") for n in (t["name"] for t in res["targets"]))  # CPU: per part only
    assert any(n.endswith("faster than replace_rebuild") for n in targets)
    assert "CUDA reserved MiB" in markdown(gpu)
