"""The one-command GPU validation (scripts/gpu_validate.py) on CPU: its dry run, executed as CI would,
stops before the first CUDA call after checking the wheelhouse, the revision, the configs, the
benchmark's host memory plan and time estimate against their bounds, the imports and the GPU
tier; its summary writers work on real results (the tiny benchmark, the device report), a
benchmark cut short included."""

import importlib.util
import io
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_validate.py"


def _module():
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gv = _module()


def _wheel(path: Path, files: dict = None) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in (files or {"placeholder.txt": "x"}).items():
            zf.writestr(name, text)


def _wheelhouse(tmp_path: Path) -> Path:
    """A wheelhouse with the names and layout scripts/gpu_wheelhouse.sh makes (tiny placeholder files)."""
    wh = tmp_path / "whl"
    wh.mkdir()
    version = gv._repo_version()
    names = {
        "megatron_core": f"megatron_core-{gv.MEGATRON_VERSION}-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        "pydantic": "pydantic-2.14.3-py3-none-any.whl",
        "pydantic_core": "pydantic_core-2.50.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "annotated_types": "annotated_types-0.8.0-py3-none-any.whl",
        "typing_inspection": "typing_inspection-0.4.5-py3-none-any.whl",
        "jsonschema": "jsonschema-4.25.1-py3-none-any.whl",
        "jsonschema_specifications": "jsonschema_specifications-2025.9.1-py3-none-any.whl",
        "referencing": "referencing-0.37.0-py3-none-any.whl",
        "rpds_py": "rpds_py-0.30.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
    }
    assert set(names) | {"chatlearn_mem"} == set(gv.WHEELS)
    for name in names.values():
        _wheel(wh / name)
    _wheel(
        wh / f"chatlearn_mem-{version}-py3-none-any.whl",
        {"chatlearn_mem_bench/presets/gpu.yaml": "", "chatlearn_mem_ray/presets/gpu.yaml": ""},
    )
    with tarfile.open(wh / "ray-2.60.0-cp312-pruned.tar.xz", "w:xz") as tf:
        data = b"__version__ = '2.60.0'\n"
        info = tarfile.TarInfo("ray/_version.py")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    (wh / "REVISION").write_text((gv._checkout_revision() or "f" * 40) + "\n")
    return wh


def test_dry_run_checks_everything_and_stops_before_the_first_cuda_call(tmp_path):
    wh = _wheelhouse(tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--dry-run",
            "--wheelhouse",
            str(wh),
            "--out",
            str(tmp_path / "results"),
            "--revision",
            "abc1234",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert f"wheelhouse {wh}: complete" in text and "revision: abc1234 (from --revision)" in text
    assert "bench config: preset gpu: 16 layers x 1536" in text and "ppo config: preset gpu" in text
    assert "1 rank(s), 2 iterations" in text
    n = int(text.split("tests/gpu: ")[1].split()[0])
    assert n >= 9, text
    # the budgets, the host memory plan and the time estimate, each within its bound
    assert "time budget: tests 100 + report 30 + bench 270 + ppo 160 = 560 s (at most 560 s); ppo optional" in text
    plan = re.search(r"bench host memory plan: peak ([\d.]+) GiB = ([\d.]+) GiB pinned \+ ([\d.]+) GiB pageable", text)
    assert plan and float(plan[1]) <= gv.HOST_BOUND_BYTES / 2**30, text
    estimate = re.search(r"bench time estimate: (\d+) s = setup \d+ s \+ parts \(weights \d+ s, grads", text)
    assert estimate and int(estimate[1]) <= gv.ESTIMATE_SHARE * gv.BUDGET_S["bench"], text
    for step in gv.STEPS:
        assert f"  {step} (budget {gv.BUDGET_S[step]} s" in text
    assert "  ppo (budget 160 s, optional): " in text
    assert "chatlearn_mem_cli bench --config gpu output_dir=" in text and "revision=abc1234 -q" in text
    assert "chatlearn_mem_cli ppo --config gpu parallel.world_size=1" in text
    assert "_gpu-<gpu name>_validation/bench.log" in text
    assert "_gpu-<gpu name>_validation.json" in text and "_gpu-<gpu name>_ppo/memory_timeline.png" in text
    assert out.stdout.strip().splitlines()[-1] == (
        "[gpu-validate] dry run ok: stopping before the first CUDA call (torch.cuda.is_available() comes next)"
    )
    assert not (tmp_path / "results").exists()  # a dry run writes nothing


def test_the_budgets_fit_one_call_and_the_ppo_step_is_last_and_optional():
    assert sum(gv.BUDGET_S.values()) <= gv.TOTAL_BUDGET_S <= 570 and set(gv.BUDGET_S) == set(gv.STEPS)
    assert gv.STEPS[-1] == "ppo" and gv.OPTIONAL == ("ppo",)
    entries = gv.plan(Path("/o"), "s", ["ppo", "tests"], Path("/w"), "r")  # given out of order
    assert [e["step"] for e in entries] == ["tests", "ppo"] and [e["optional"] for e in entries] == [False, True]


@pytest.mark.parametrize(
    "bound, expected",
    [
        (
            "HOST_BOUND_BYTES",
            "of host memory, over its bound of 1 GiB (half the GPU machine's 128 GiB): shrink configs/bench/gpu.yaml",
        ),
        ("BUDGET_S", "over 90% of its 10 s budget: shrink configs/bench/gpu.yaml (trainer, repeats, cycles)"),
    ],
)
def test_dry_run_fails_when_the_bench_exceeds_its_bounds(monkeypatch, capsys, bound, expected):
    if bound == "HOST_BOUND_BYTES":
        monkeypatch.setattr(gv, "HOST_BOUND_BYTES", 2**30)
    else:
        monkeypatch.setattr(gv, "BUDGET_S", {**gv.BUDGET_S, "bench": 10})
    assert gv.main(["--dry-run", "--steps", "bench", "--revision", "r"]) == 2
    out = capsys.readouterr().out
    assert "[gpu-validate] error: the bench " in out and expected in out, out
    assert "dry run failed: 1 problem(s)" in out


def test_the_revision_comes_from_the_wheelhouse_when_the_copy_has_no_git(tmp_path, monkeypatch, capsys):
    """The copy of the repository on the GPU machine has no .git. Before: the results said git
    "unknown" (git ran in the installed package's folder)."""
    wh = _wheelhouse(tmp_path)
    (wh / "REVISION").write_text("0123abcd\n")
    assert gv.source_revision("given", str(wh)) == ("given", "--revision")
    monkeypatch.setattr(gv, "_checkout_revision", lambda: None)
    assert gv.source_revision(None, str(wh)) == ("0123abcd", str(wh / "REVISION"))
    # a copy whose .git is an older commit, the newer one's changes dirty on it: the run recorded
    # that older commit, while the library it ran was the wheel's
    monkeypatch.setattr(gv, "_checkout_revision", lambda: "9d15a7e+dirty")
    revision, source = gv.source_revision(None, str(wh))
    assert revision == "0123abcd" and source.endswith("the wheel's; git in " + str(gv.REPO) + " says 9d15a7e+dirty")
    monkeypatch.setattr(gv, "_checkout_revision", lambda: "0123abcd")
    assert gv.source_revision(None, str(wh)) == ("0123abcd", f"git in {gv.REPO}")
    # the same commit with changes in the checkout: its "+dirty" stays on the record
    monkeypatch.setattr(gv, "_checkout_revision", lambda: "0123abcd+dirty")
    assert gv.source_revision(None, str(wh)) == ("0123abcd+dirty", f"git in {gv.REPO}")
    # no --wheelhouse: the library is the checkout's own, whatever a leftover .whl/REVISION says
    monkeypatch.setattr(gv, "_checkout_revision", lambda: "9d15a7e")
    assert gv.source_revision(None, None) == ("9d15a7e", f"git in {gv.REPO}")
    monkeypatch.setattr(gv, "_checkout_revision", lambda: None)
    assert gv.source_revision(None, str(tmp_path / "none")) == (None, "")
    bench = next(e for e in gv.plan(tmp_path, "s", ["bench"], tmp_path, "0123abcd") if e["step"] == "bench")
    assert "revision=0123abcd" in bench["command"]
    assert gv.main(["--dry-run", "--steps", "bench", "--wheelhouse", str(tmp_path / "none")]) == 2
    assert "error: no source revision: pass --revision, run from a git checkout" in capsys.readouterr().out


def test_wheelhouse_problems_are_named(tmp_path):
    wh = _wheelhouse(tmp_path)
    assert gv.check_wheelhouse(wh) == []
    (wh / "ray-2.60.0-cp312-pruned.tar.xz").unlink()
    _wheel(wh / "pydantic-2.13.0-py3-none-any.whl")
    _wheel(wh / "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl")
    (wh / f"megatron_core-{gv.MEGATRON_VERSION}-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl").rename(
        wh / "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    )
    (wh / "REVISION").unlink()
    problems = "\n".join(gv.check_wheelhouse(wh))
    assert "no REVISION file (the source revision the wheel was built from)" in problems
    assert "want one ray-<version>-cp312-pruned.tar.xz, found none" in problems
    assert "2 wheels of pydantic" in problems and "pip stops on two" in problems
    assert "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl is not for CPython 3.12" in problems
    assert f"the GPU run uses megatron-core {gv.MEGATRON_VERSION}" in problems
    assert "run `bash scripts/gpu_wheelhouse.sh`" in gv.check_wheelhouse(tmp_path / "missing")[0]
    if gv._checkout_revision():  # a wheel built from another commit than this checkout's
        (wh / "REVISION").write_text("0" * 40)
        assert any(p.startswith(f"built from {'0' * 40}, but this checkout is at ") for p in gv.check_wheelhouse(wh))


def test_dry_run_with_a_broken_wheelhouse_fails_with_exit_2(tmp_path, capsys):
    wh = _wheelhouse(tmp_path)
    next(wh.glob("chatlearn_mem-*.whl")).unlink()
    assert gv.main(["--dry-run", "--wheelhouse", str(wh), "--steps", "bench"]) == 2
    out = capsys.readouterr().out
    assert "error: wheelhouse" in out and "no wheel of chatlearn_mem" in out
    assert "dry run failed: 1 problem(s)" in out


def test_the_real_run_without_cuda_says_to_use_the_dry_run(tmp_path, capsys):
    assert gv.main(["--out", str(tmp_path), "--steps", "tests"]) == 2
    assert "no CUDA device here" in capsys.readouterr().out and not any(tmp_path.iterdir())


def test_unknown_step_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        gv.main(["--dry-run", "--steps", "tests,benchmark"])
    assert e.value.code == 2 and "unknown step(s) ['benchmark']" in capsys.readouterr().err


def test_summary_files_from_real_results(dist1, tmp_path):
    """The validation's JSON, markdown and PNG from a tiny benchmark run, a device report measured
    here and a PPO log and junit file shaped as the GPU run writes them."""
    from typer.testing import CliRunner

    from chatlearn_mem.models import gpt
    from chatlearn_mem_cli.app import app

    res = CliRunner().invoke(
        app,
        ["bench", "--config", "tiny", f"output_dir={tmp_path}", "name=b", "-q", "repeats=3", "cycles=2", "plot=false"],
    )
    assert res.exit_code == 0, res.output
    report = gv.measure_device_report(gpt.GPTTrainerConfig(), batch_size=2)
    assert report["after_offload"]["by_holder"]["manager_residue"] == 0 and report["audit_ok"]
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_gpu_manager" name="test_a" time="1.5"/>'
        '<testcase classname="tests.gpu.test_gpu_manager" name="test_b" time="0.1"><skipped message="no TE"/>'
        '</testcase><testcase classname="tests.gpu.test_gpu_memory" name="test_c" time="2">'
        '<failure message="boom">trace</failure></testcase></testsuite></testsuites>'
    )
    (tmp_path / "report.json").write_text(json.dumps(report))
    ppo_dir = tmp_path / "p_ppo"
    ppo_dir.mkdir()
    summary = {
        "peak_colocated_bytes": 3 * 2**30,
        "peak_phase": "train_policy",
        "largest_phase_bytes": 3 * 2**30,
        "largest_phase": "train_policy",
        "ratio": 1.0,
        "phases": 15,
    }
    (ppo_dir / "log.json").write_text(
        json.dumps(
            {
                "summary": {
                    "memory_manager_on": summary,
                    "memory_manager_off": dict(summary, ratio=2.1),
                    "seconds": 90.0,
                },
                "iterations": [{}] * 4,
                "sync_checks": [{"iteration": 0, "equal": True}],
                "audits": {"runs": 12, "checks_clean": 12},
            }
        )
    )
    results = {
        "date": "2026-11-23",
        "command": "scripts/gpu_validate.py",
        "environment": {"gpu_name": "Fake GPU"},
        "steps": [],
    }
    for step, outputs in (
        ("tests", []),
        ("report", []),
        ("bench", [str(tmp_path / "b.json")]),
        ("ppo", [str(ppo_dir / "log.json")]),
    ):
        entry = {"step": step, "status": "ok", "seconds": 1.0, "outputs": outputs, "log": str(tmp_path / f"{step}.log")}
        gv._collect(step, results, tmp_path, entry)
        results["steps"].append(entry)
    assert (
        results["steps"][0]["status"] == "failed" and results["steps"][0]["detail"] == "1 passed, 1 failed, 1 skipped"
    )
    assert [t["outcome"] for t in results["tests"]] == ["passed", "skipped", "failed"]
    assert results["bench_targets"] and results["ppo"]["sync_ok"] and results["ppo"]["audits_ok"]
    paths = gv.write_results(results, tmp_path / "out", "2026-11-23_gpu-fake")
    assert [p.name for p in paths] == [f"2026-11-23_gpu-fake_validation.{x}" for x in ("json", "md", "png")]
    md = paths[1].read_text()
    assert "| tests | failed |" in md and "| test_gpu_memory::test_c | failed | 2.0 | boom |" in md
    assert "## What stays on the device after a full offload" in md and "manager_residue" in md
    assert "## Benchmark targets" in md and "memory manager off: peak colocated 3.00 GiB" in md
    assert json.loads(paths[0].read_text())["report"]["audit_ok"] and paths[2].stat().st_size > 10_000
    assert gv.gpu_slug("NVIDIA H100 80GB HBM3") == "gpu-nvidia-h100-80gb-hbm3"

    # A benchmark that wrote all its results and was stopped while exiting (on an H100 and an H200
    # the step was cut at its limit 30-50 s after the last target was printed) is done, not failed.
    written = (tmp_path / "b.json").stat().st_mtime
    entry = {"step": "bench", "status": "timed out after 279 s", "outputs": [str(tmp_path / "b.json")]}
    done = dict(entry, ended_at=written + 40)
    gv._collect("bench", {}, tmp_path, done)
    assert done["status"] == "ok" and "stopped at its limit 40 s after writing its results" in done["detail"]

    # Steps cut off by their budget: a benchmark that finished only its first part gets its
    # markdown and plot from its JSON and says what is missing; tests without a junit file are
    # read from the streamed log.
    bench = json.loads((tmp_path / "b.json").read_text())
    bench.update(
        complete=False,
        missing_parts=["grads", "main_weights", "optimizer_states", "full"],
        timings=[r for r in bench["timings"] if r["part"] == "weights"],
        memory=[x for x in bench["memory"] if x["part"] == "weights"],
        part_seconds={"weights": bench["part_seconds"]["weights"]},
    )
    for key in ("cycles", "integrity", "targets"):
        del bench[key]
    (tmp_path / "c.json").write_text(json.dumps(bench))
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "tests.log").write_text(
        "tests/gpu/test_gpu_manager.py::test_a PASSED                [ 10%]\n"
        "tests/gpu/test_gpu_memory.py::test_c FAILED                 [ 20%]\n"
    )
    partial = {"date": "2026-11-23", "command": "x", "steps": []}
    for step, outputs in (("tests", []), ("bench", [str(tmp_path / "c.json")])):
        entry = {"step": step, "status": "timed out after 10 s", "outputs": outputs, "log": str(cut / f"{step}.log")}
        gv._collect(step, partial, cut, entry)
        partial["steps"].append(entry)
    assert [(t["test"], t["outcome"]) for t in partial["tests"]] == [
        ("test_gpu_manager::test_a", "passed"),
        ("test_gpu_memory::test_c", "failed"),
    ]
    assert "missing parts grads, main_weights, optimizer_states, full" in partial["steps"][1]["detail"]
    assert partial["steps"][1]["status"] == "timed out after 10 s"  # cut before it finished: a failure
    assert "Incomplete run" in (tmp_path / "c.md").read_text() and (tmp_path / "c.png").stat().st_size > 10_000
    assert {t["name"].split(":")[0] for t in partial["bench_targets"]} >= {"weights offload", "weights onload"}
