"""The one-command GPU validation (scripts/gpu_validate.py) on CPU: its dry run, executed as CI would,
stops before the first CUDA call after checking the wheelhouse, the configs, the imports and the
GPU tier; its summary writers work on real results (the tiny benchmark, the device report)."""

import importlib.util
import io
import json
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
    _wheel(wh / f"chatlearn_mem-{version}-py3-none-any.whl",
           {"chatlearn_mem_bench/presets/gpu.yaml": "", "chatlearn_mem_ray/presets/gpu.yaml": ""})
    with tarfile.open(wh / "ray-2.60.0-cp312-pruned.tar.xz", "w:xz") as tf:
        data = b"__version__ = '2.60.0'\n"
        info = tarfile.TarInfo("ray/_version.py")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    return wh


def test_dry_run_checks_everything_and_stops_before_the_first_cuda_call(tmp_path):
    wh = _wheelhouse(tmp_path)
    out = subprocess.run([sys.executable, str(SCRIPT), "--dry-run", "--wheelhouse", str(wh), "--out",
                          str(tmp_path / "results")], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert f"wheelhouse {wh}: complete" in text
    assert "bench config: preset gpu + repeats=5" in text and "ppo config: preset gpu" in text
    assert "1 rank(s), 3 iterations" in text
    n = int(text.split("tests/gpu: ")[1].split()[0])
    assert n >= 9, text
    for step in gv.STEPS:
        assert f"  {step} (limit " in text
    assert "chatlearn_mem_ray bench --config gpu repeats=5 warmup=1 cycles=10" in text
    assert "chatlearn_mem_ray ppo --config gpu parallel.world_size=1" in text
    assert "_gpu-<gpu name>_validation.json" in text and "_gpu-<gpu name>_ppo/memory_timeline.png" in text
    assert out.stdout.strip().splitlines()[-1] == ("[gpu-validate] dry run ok: stopping before the first CUDA call "
                                             "(torch.cuda.is_available() comes next)")
    assert not (tmp_path / "results").exists()  # a dry run writes nothing


def test_wheelhouse_problems_are_named(tmp_path):
    wh = _wheelhouse(tmp_path)
    assert gv.check_wheelhouse(wh) == []
    (wh / "ray-2.60.0-cp312-pruned.tar.xz").unlink()
    _wheel(wh / "pydantic-2.13.0-py3-none-any.whl")
    _wheel(wh / "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl")
    (wh / f"megatron_core-{gv.MEGATRON_VERSION}-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl").rename(
        wh / "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl")
    problems = "\n".join(gv.check_wheelhouse(wh))
    assert "want one ray-<version>-cp312-pruned.tar.xz, found none" in problems
    assert "2 wheels of pydantic" in problems and "pip stops on two" in problems
    assert "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl is not for CPython 3.12" in problems
    assert f"the GPU run uses megatron-core {gv.MEGATRON_VERSION}" in problems
    assert "run `bash scripts/gpu_wheelhouse.sh`" in gv.check_wheelhouse(tmp_path / "missing")[0]


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

    from chatlearn_mem.testbed import gpt
    from chatlearn_mem_ray.cli import app

    res = CliRunner().invoke(app, ["bench", "--config", "tiny", f"output_dir={tmp_path}", "name=b", "-q",
                                   "repeats=3", "cycles=2", "plot=false"])
    assert res.exit_code == 0, res.output
    report = gv.measure_device_report(gpt.GPTTrainerConfig(), batch_size=2)
    assert report["after_offload"]["by_holder"]["manager_residue"] == 0 and report["audit_ok"]
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_gpu_manager" name="test_a" time="1.5"/>'
        '<testcase classname="tests.gpu.test_gpu_manager" name="test_b" time="0.1"><skipped message="no TE"/>'
        '</testcase><testcase classname="tests.gpu.test_gpu_memory" name="test_c" time="2">'
        '<failure message="boom">trace</failure></testcase></testsuite></testsuites>')
    (tmp_path / "report.json").write_text(json.dumps(report))
    ppo_dir = tmp_path / "p_ppo"
    ppo_dir.mkdir()
    summary = {"peak_colocated_bytes": 3 * 2**30, "peak_phase": "train_policy", "largest_phase_bytes": 3 * 2**30,
               "largest_phase": "train_policy", "ratio": 1.0, "phases": 15}
    (ppo_dir / "log.json").write_text(json.dumps({
        "summary": {"memory_manager_on": summary, "memory_manager_off": dict(summary, ratio=2.1), "seconds": 90.0},
        "iterations": [{}] * 4, "sync_checks": [{"iteration": 0, "equal": True}],
        "audits": {"runs": 12, "checks_clean": 12}}))
    results = {"date": "2026-11-23", "command": "scripts/gpu_validate.py", "environment": {"gpu_name": "Fake GPU"},
               "steps": []}
    for step, outputs in (("tests", []), ("report", []), ("bench", [str(tmp_path / "b.json")]),
                          ("ppo", [str(ppo_dir / "log.json")])):
        entry = {"step": step, "status": "ok", "seconds": 1.0, "outputs": outputs}
        gv._collect(step, results, tmp_path, entry)
        results["steps"].append(entry)
    assert results["steps"][0]["status"] == "failed" and results["steps"][0]["detail"] == "1 passed, 1 failed, 1 skipped"
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
