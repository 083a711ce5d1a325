"""The one-command GPU validation (``python -m chatlearn_mem_bench.gpu_validate``, which
scripts/gpu_validate.sh runs) on CPU: its dry run, executed as CI would,
stops before the first CUDA call after checking the wheelhouse, the revision, the configs, the
benchmark's host memory plan and time estimate against their bounds, the imports and the GPU
tier; its summary writers work on real results (the tiny benchmark, the device report), a
benchmark cut short included."""

import io
import json
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from chatlearn_mem_bench.gpu_validate import (
    benches,
    bounds,
    checkout,
    device_report,
    main,
    ppo,
    steps,
    summary,
    wheelhouse,
)

pytestmark = pytest.mark.newest_leg  # the GPU machine runs the newest megatron-core (scripts/test.sh)


def _wheel(path: Path, files: dict = None) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in (files or {"placeholder.txt": "x"}).items():
            zf.writestr(name, text)


def _wheelhouse(tmp_path: Path) -> Path:
    """A wheelhouse with the names and layout scripts/gpu_wheelhouse.sh makes (tiny placeholder files)."""
    wh = tmp_path / "whl"
    wh.mkdir()
    version = checkout.repo_version()
    names = {
        "megatron_core": f"megatron_core-{wheelhouse.MEGATRON_VERSION}-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
        "pydantic": "pydantic-2.14.3-py3-none-any.whl",
        "pydantic_core": "pydantic_core-2.50.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
        "annotated_types": "annotated_types-0.8.0-py3-none-any.whl",
        "typing_inspection": "typing_inspection-0.4.5-py3-none-any.whl",
        "jsonschema": "jsonschema-4.25.1-py3-none-any.whl",
        "jsonschema_specifications": "jsonschema_specifications-2025.9.1-py3-none-any.whl",
        "referencing": "referencing-0.37.0-py3-none-any.whl",
        "rpds_py": "rpds_py-0.30.0-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "torch_memory_saver": "torch_memory_saver-0.0.10-cp39-abi3-manylinux2014_x86_64.whl",
        "nvidia_ml_py": "nvidia_ml_py-13.615.71-py3-none-any.whl",
    }
    assert set(names) | {"chatlearn_mem"} == set(wheelhouse.WHEELS)
    for name in names.values():
        _wheel(wh / name)
    presets = {f"chatlearn_mem_bench/presets/{p}.yaml": "" for p in benches.BENCH_STEPS.values()}
    _wheel(wh / f"chatlearn_mem-{version}-py3-none-any.whl", {**presets, "chatlearn_mem_ray/presets/gpu.yaml": ""})
    with tarfile.open(wh / "ray-2.60.0-cp312-pruned.tar.xz", "w:xz") as tf:
        data = b"__version__ = '2.60.0'\n"
        info = tarfile.TarInfo("ray/_version.py")
        info.size = len(data)
        tf.addfile(info, io.BytesIO(data))
    (wh / "REVISION").write_text((checkout.checkout_revision() or "f" * 40) + "\n")
    return wh


def test_dry_run_checks_everything_and_stops_before_the_first_cuda_call(tmp_path):
    wh = _wheelhouse(tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "chatlearn_mem_bench.gpu_validate",
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
    assert (
        "tms config: preset gpu_tms: 16 layers x 1536" in text
        and "methods megatron_builtin, torch_memory_saver" in text
    )
    assert "large config: preset gpu_large: 26 layers x 2560" in text and "release bound off" in text
    assert "1 rank(s), 2 iterations" in text
    n = int(text.split("tests/gpu: ")[1].split()[0])
    assert n >= 9, text
    # the budgets, and per bench step the host and device memory plans and the time estimate, each within its bound
    assert "time budget: tms 165 + report 45 + handoff 70 + large 180 + tests 100 = 560 s (at most 560 s)" in text
    for step, preset in (("tms", "gpu_tms"), ("large", "gpu_large")):
        plan = re.search(
            rf"{step} \({preset}\) host memory plan: peak ([\d.]+) GiB = ([\d.]+) GiB pinned \+ ([\d.]+) \w+ pageable",
            text,
        )
        assert plan and float(plan[1]) <= bounds.HOST_BOUND_BYTES / 2**30, text
        estimate = re.search(rf"{step} \({preset}\) time estimate: (\d+) s = setup \d+ s \+ parts \(weights", text)
        assert estimate and int(estimate[1]) <= bounds.ESTIMATE_SHARE * steps.BUDGET_S[step], text
        device = re.search(rf"{step} \({preset}\) device memory plan: peak ([\d.]+) GiB", text)
        assert device and float(device[1]) <= bounds.DEVICE_SHARE * bounds.GPU_DEVICE_BYTES / 2**30, text
    for step in steps.DEFAULT_STEPS:
        assert f"  {step} (budget {steps.BUDGET_S[step]} s" in text
    assert "  ppo (budget" not in text and "  bench (budget" not in text  # not by default
    assert "chatlearn_mem_cli bench --config gpu_tms output_dir=" in text and "revision=abc1234 -q" in text
    assert "chatlearn_mem_cli bench --config gpu_large output_dir=" in text
    assert "CHATLEARN_MEM_HANDOFF_JSON=" in text and "pytest tests/gpu/test_gpu_handoff.py" in text
    assert "--ignore=tests/gpu/test_gpu_handoff.py --ignore=tests/gpu/test_gpu_tms.py" in text
    assert "_gpu-<gpu name>_validation/tms.log" in text and "_gpu-<gpu name>_large.json" in text
    assert "_gpu-<gpu name>_validation.json" in text and "_gpu-<gpu name>_tms.md" in text
    assert out.stdout.strip().splitlines()[-1] == (
        "[gpu-validate] dry run ok: stopping before the first CUDA call (torch.cuda.is_available() comes next)"
    )
    assert not (tmp_path / "results").exists()  # a dry run writes nothing


def test_the_budgets_fit_one_call_and_the_ppo_step_is_last_and_optional():
    assert sum(steps.BUDGET_S[s] for s in steps.DEFAULT_STEPS) <= steps.TOTAL_BUDGET_S <= 570
    assert set(steps.BUDGET_S) == set(steps.STEPS) and set(steps.DEFAULT_STEPS) <= set(steps.STEPS)
    # the issue's figures first: the manager against torch_memory_saver, then what stays on the device
    assert steps.DEFAULT_STEPS[:2] == ("tms", "report") and list(steps.DEFAULT_STEPS) == [
        s for s in steps.STEPS if s in steps.DEFAULT_STEPS
    ]
    assert steps.STEPS[-1] == "ppo" and steps.OPTIONAL == ("ppo",)
    entries = steps.plan(Path("/o"), "s", ["ppo", "tests"], Path("/w"), "r")  # given out of order
    assert [e["step"] for e in entries] == ["tests", "ppo"] and [e["optional"] for e in entries] == [False, True]
    lines, problems = bounds.check_bounds(["bench", "ppo", "tms", "large"])
    assert problems == ["the steps' budgets add up to 775 s, over 560 s: run fewer steps per call"], problems


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
        monkeypatch.setattr(bounds, "HOST_BOUND_BYTES", 2**30)
    else:
        monkeypatch.setattr(bounds, "BUDGET_S", {**steps.BUDGET_S, "bench": 10})
    assert main(["--dry-run", "--steps", "bench", "--revision", "r"]) == 2
    out = capsys.readouterr().out
    assert "[gpu-validate] error: the bench " in out and expected in out, out
    assert "dry run failed: 1 problem(s)" in out


def test_the_revision_comes_from_the_wheelhouse_when_the_copy_has_no_git(tmp_path, monkeypatch, capsys):
    """The copy of the repository on the GPU machine has no .git. Before: the results said git
    "unknown" (git ran in the installed package's folder)."""
    wh = _wheelhouse(tmp_path)
    (wh / "REVISION").write_text("0123abcd\n")
    assert checkout.source_revision("given", str(wh)) == ("given", "--revision")
    monkeypatch.setattr(checkout, "checkout_revision", lambda: None)
    assert checkout.source_revision(None, str(wh)) == ("0123abcd", str(wh / "REVISION"))
    # a copy whose .git is an older commit, the newer one's changes dirty on it: the run recorded
    # that older commit, while the library it ran was the wheel's
    monkeypatch.setattr(checkout, "checkout_revision", lambda: "9d15a7e+dirty")
    revision, source = checkout.source_revision(None, str(wh))
    assert revision == "0123abcd" and source.endswith(
        "the wheel's; git in " + str(checkout.REPO) + " says 9d15a7e+dirty"
    )
    monkeypatch.setattr(checkout, "checkout_revision", lambda: "0123abcd")
    assert checkout.source_revision(None, str(wh)) == ("0123abcd", f"git in {checkout.REPO}")
    # the same commit with changes in the checkout: its "+dirty" stays on the record
    monkeypatch.setattr(checkout, "checkout_revision", lambda: "0123abcd+dirty")
    assert checkout.source_revision(None, str(wh)) == ("0123abcd+dirty", f"git in {checkout.REPO}")
    # no --wheelhouse: the library is the checkout's own, whatever a leftover .whl/REVISION says
    monkeypatch.setattr(checkout, "checkout_revision", lambda: "9d15a7e")
    assert checkout.source_revision(None, None) == ("9d15a7e", f"git in {checkout.REPO}")
    monkeypatch.setattr(checkout, "checkout_revision", lambda: None)
    assert checkout.source_revision(None, str(tmp_path / "none")) == (None, "")
    bench = next(e for e in steps.plan(tmp_path, "s", ["bench"], tmp_path, "0123abcd") if e["step"] == "bench")
    assert "revision=0123abcd" in bench["command"]
    assert main(["--dry-run", "--steps", "bench", "--wheelhouse", str(tmp_path / "none")]) == 2
    assert "error: no source revision: pass --revision, run from a git checkout" in capsys.readouterr().out


def test_the_ppo_config_is_the_command_lines(monkeypatch):
    """The benchmark does not import the app: the ppo step's config, and the trainer the report step
    measures, are what `chatlearn-mem ppo --config gpu ... --print-config` resolves; a config the
    command refuses is a ConfigError quoting it."""
    from chatlearn_mem.errors import ConfigError

    cfg = ppo.ppo_config()
    assert (cfg["parallel"]["world_size"], cfg["ppo"]["iterations"], cfg["memory"]["verify_sync"]) == (1, 2, True)
    policy = ppo.policy_config()  # configs/ppo/gpu.yaml's policy
    assert (policy.num_layers, policy.hidden_size, policy.vocab_size, policy.precision) == (24, 1024, 32000, "bf16")
    monkeypatch.setattr(ppo, "PPO_OVERRIDES", ("ppo.iterations=0",))
    with pytest.raises(ConfigError, match=r"(?s)--print-config` exited 2: .*ppo\.iterations"):
        ppo.ppo_config()


def test_wheelhouse_problems_are_named(tmp_path):
    wh = _wheelhouse(tmp_path)
    assert wheelhouse.check_wheelhouse(wh) == []
    (wh / "ray-2.60.0-cp312-pruned.tar.xz").unlink()
    _wheel(wh / "pydantic-2.13.0-py3-none-any.whl")
    _wheel(wh / "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl")
    (
        wh / f"megatron_core-{wheelhouse.MEGATRON_VERSION}-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl"
    ).rename(wh / "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl")
    (wh / "REVISION").unlink()
    problems = "\n".join(wheelhouse.check_wheelhouse(wh))
    assert "no REVISION file (the source revision the wheel was built from)" in problems
    assert "want one ray-<version>-cp312-pruned.tar.xz, found none" in problems
    assert "2 wheels of pydantic" in problems and "pip stops on two" in problems
    assert "numpy-2.0.0-cp311-cp311-manylinux_2_17_x86_64.whl is not for CPython 3.12" in problems
    assert f"the GPU run uses megatron-core {wheelhouse.MEGATRON_VERSION}" in problems
    assert "run `bash scripts/gpu_wheelhouse.sh`" in wheelhouse.check_wheelhouse(tmp_path / "missing")[0]
    if checkout.checkout_revision():  # a wheel built from another commit than this checkout's
        (wh / "REVISION").write_text("0" * 40)
        assert any(
            p.startswith(f"built from {'0' * 40}, but this checkout is at ") for p in wheelhouse.check_wheelhouse(wh)
        )


def test_dry_run_with_a_broken_wheelhouse_fails_with_exit_2(tmp_path, capsys):
    wh = _wheelhouse(tmp_path)
    next(wh.glob("chatlearn_mem-*.whl")).unlink()
    assert main(["--dry-run", "--wheelhouse", str(wh), "--steps", "bench"]) == 2
    out = capsys.readouterr().out
    assert "error: wheelhouse" in out and "no wheel of chatlearn_mem" in out
    assert "dry run failed: 1 problem(s)" in out


def test_the_real_run_without_cuda_says_to_use_the_dry_run(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--steps", "tests"]) == 2
    assert "no CUDA device here" in capsys.readouterr().out and not any(tmp_path.iterdir())


def test_unknown_step_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--dry-run", "--steps", "tests,benchmark"])
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
    report = device_report.measure_device_report(gpt.GPTTrainerConfig(), batch_size=2)
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
    colocated = {
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
                    "memory_manager_on": colocated,
                    "memory_manager_off": dict(colocated, ratio=2.1),
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
        "command": "python -m chatlearn_mem_bench.gpu_validate",
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
        steps.collect(step, results, tmp_path, entry)
        results["steps"].append(entry)
    assert (
        results["steps"][0]["status"] == "failed" and results["steps"][0]["detail"] == "1 passed, 1 failed, 1 skipped"
    )
    assert [t["outcome"] for t in results["tests"]] == ["passed", "skipped", "failed"]
    assert results["bench_targets"] and results["ppo"]["sync_ok"] and results["ppo"]["audits_ok"]
    paths = summary.write_results(results, tmp_path / "out", "2026-11-23_gpu-fake")
    assert [p.name for p in paths] == [f"2026-11-23_gpu-fake_validation.{x}" for x in ("json", "md", "png")]
    md = paths[1].read_text()
    assert "| tests | failed |" in md and "| test_gpu_memory::test_c | failed | 2.0 | boom |" in md
    assert "## What stays on the device after a full offload" in md and "manager_residue" in md
    assert "## Benchmark targets" in md and "memory manager off: peak colocated 3.00 GiB" in md
    assert json.loads(paths[0].read_text())["report"]["audit_ok"] and paths[2].stat().st_size > 10_000
    assert steps.gpu_slug("NVIDIA H100 80GB HBM3") == "gpu-nvidia-h100-80gb-hbm3"

    # A benchmark that wrote all its results and was stopped while exiting (on an H100 and an H200
    # the step was cut at its limit 30-50 s after the last target was printed) is done, not failed.
    written = (tmp_path / "b.json").stat().st_mtime
    entry = {"step": "bench", "status": "timed out after 279 s", "outputs": [str(tmp_path / "b.json")]}
    done = dict(entry, ended_at=written + 40)
    steps.collect("bench", {}, tmp_path, done)
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
        steps.collect(step, partial, cut, entry)
        partial["steps"].append(entry)
    assert [(t["test"], t["outcome"]) for t in partial["tests"]] == [
        ("test_gpu_manager::test_a", "passed"),
        ("test_gpu_memory::test_c", "failed"),
    ]
    assert "missing parts grads, main_weights, optimizer_states, full" in partial["steps"][1]["detail"]
    assert partial["steps"][1]["status"] == "timed out after 10 s"  # cut before it finished: a failure
    assert "Incomplete run" in (tmp_path / "c.md").read_text() and (tmp_path / "c.png").stat().st_size > 10_000
    assert {t["name"].split(":")[0] for t in partial["bench_targets"]} >= {"weights offload", "weights onload"}


def test_the_sleep_target_is_the_context_plus_one_percent_of_the_awake_state():
    MiB = 2**20
    asleep = {
        "total_bytes": 600 * MiB,
        "per_process": True,
        "by_holder": {"cuda_context": 500 * MiB, "nccl_communicators": 100 * MiB},
    }
    t = device_report.sleep_target(500 * MiB, 10 * 2**30, asleep)
    assert t["passed"] and t["bound_bytes"] == int(500 * MiB + 0.01 * 10 * 2**30)
    assert (
        "600 MiB held by this process (NVML) against 602 MiB" in t["detail"]
        and "nccl_communicators 100 MiB" in t["detail"]
    )
    t = device_report.sleep_target(500 * MiB, 10 * 2**30, {**asleep, "total_bytes": 700 * MiB, "per_process": False})
    assert not t["passed"] and "held by the device" in t["detail"]


def test_the_issue_52_steps_are_collected_and_summarised(dist1, tmp_path):
    """The tms and large benches (a tiny run's JSON shaped as theirs), the handoff test's figures and
    a GPU-shaped report go into the summary: the manager against its peers per part, the largest
    trainer's full cycle, what another process got, the process view and the sleep target."""
    from typer.testing import CliRunner

    from chatlearn_mem_cli.app import app

    quick = ["repeats=3", "cycles=2", "plot=false", "overlap=false", "soak_cycles=0", "tail_onloads=0", "methods=[]"]
    res = CliRunner().invoke(app, ["bench", "--config", "tiny", f"output_dir={tmp_path}", "name=b", "-q", *quick])
    assert res.exit_code == 0, res.output
    bench = json.loads((tmp_path / "b.json").read_text())
    peer = [
        dict(r, method="torch_memory_saver", time_vs_manager=7.5, manager_is="faster", tms_released_bytes=3 * 2**20)
        for r in bench["timings"]
        if r["method"] == "manager" and r["part"] != "grads"
    ]
    tms = dict(bench, timings=bench["timings"] + peer, skipped_methods={})
    tms["torch_memory_saver"] = {"worker": {"version": "0.0.10"}, "parts_changed": [], "failed": None}
    (tmp_path / "s_tms.json").write_text(json.dumps(tms))
    (tmp_path / "s_large.json").write_text(json.dumps(dict(bench, skipped_methods={})))
    work = tmp_path / "work"
    work.mkdir()
    (work / "junit_handoff.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.gpu.test_gpu_handoff" name="test_take" time="9.5"/>'
        "</testsuite></testsuites>"
    )
    GiB, MiB = 2**30, 2**20
    take = {
        "trainer_state_bytes": 1.5 * GiB,
        "freed_by_the_offload_bytes": 1.6 * GiB,
        "free_when_asleep_bytes": 70 * GiB,
        "engine_got_bytes": 69 * GiB,
        "engine_free_seen_bytes": 69.3 * GiB,
        "engine_got_over_state": 46.0,
        "engine_seconds": 2.0,
    }
    hold = {"trainer_state_bytes": 1.5 * GiB, "engine_held_bytes": 69 * GiB, "released": True}
    hold["parts_still_offloaded_after_the_failed_onload"] = ["grads", "weights", "main_weights", "optimizer_states"]
    (work / "handoff.json").write_text(json.dumps({"take": take, "hold": hold}))

    def state(total, allocated, reserved, outside):
        process = {"pid": 1, "allocated": allocated, "reserved": reserved, "outside_allocator": outside}
        return {"total_bytes": total, "per_process": True, "process": process, "by_holder": {"cuda_context": 500 * MiB}}

    after = state(610 * MiB, 2 * MiB, 4 * MiB, 600 * MiB)
    report = {
        "parameters": 350e6,
        "managed_bytes": 5 * GiB,
        "audit_ok": True,
        "before_offload": state(6 * GiB, 5 * GiB, 5.2 * GiB, 700 * MiB),
        "after_offload_kept": state(700 * MiB, 40 * MiB, 42 * MiB, 600 * MiB),
        "after_offload_released": after,
        "after_offload": after,
        "release": {
            "cublas_workspaces_bytes": 32 * MiB,
            "allocator_cache_bytes": 38 * MiB,
            "process_bytes": 38 * MiB,
            "per_process": True,
            "seconds": 0.002,
        },
        "step_after_offload_kept_s": 0.100,
        "step_after_offload_released_s": 0.101,
        "target": device_report.sleep_target(500 * MiB, 20 * GiB, after),
        "nccl": {
            "nccl_version": "2.28.3",
            "communicator_bytes": 100 * MiB,
            "destroy_s": 0.05,
            "freed_by_destroy_bytes": 90 * MiB,
            "create_s": 0.3,
            "recreate_s": 0.2,
        },
        "teardown": {"returned": True, "seconds": 0.5, "freed_bytes": 300 * MiB, "per_process": True},
        "text": "device memory still held on cuda:0",
    }
    (work / "report.json").write_text(json.dumps(report))
    results = {"date": "2026-11-28", "command": "x", "environment": {"gpu_name": "Fake GPU"}, "steps": []}
    for step, outputs in (
        ("tms", [str(tmp_path / "s_tms.json")]),
        ("report", [str(work / "report.json")]),
        ("handoff", [str(work / "handoff.json")]),
        ("large", [str(tmp_path / "s_large.json")]),
    ):
        entry = {"step": step, "status": "ok", "seconds": 1.0, "outputs": outputs, "log": str(work / f"{step}.log")}
        steps.collect(step, results, work, entry)
        results["steps"].append(entry)
    details = {e["step"]: e["detail"] for e in results["steps"]}
    assert "targets met; methods manager" in details["tms"] and details["handoff"].startswith(
        "1 passed; the other process got 69.0 GiB"
    )
    assert "PASS: 610 MiB held by this process (NVML)" in details["report"]
    assert set(results["benches"]) == {"tms", "large"} and "bench_targets" not in results
    md = summary.summarise(results)
    assert "## The manager against torch_memory_saver (`tms` step, gpu_tms)" in md
    assert re.search(r"\| full \| offload \| [\d.]+ \| [\d.]+ \| \*\*7\.5x\*\* \|", md), md
    assert "torch_memory_saver 0.0.10: parts whose bytes changed after a resume: none" in md
    assert "| asleep, the default offload | 610 | NVML | 2 | 4 | 600 |" in md
    assert (
        "gave back 32 MiB of cuBLAS workspaces and 38 MiB of the allocator's cache" in md
        and "101.0 ms with it, 100.0 ms without" in md
    )
    assert "**PASS** after a full offload: the process holds <= its CUDA context + 1% of its awake state" in md
    assert "NCCL 2.28.3 (one rank): a communicator holds 100 MiB" in md
    assert "took 500 ms and gave back 300 MiB outside the allocator (NVML)" in md
    assert "the other process got 69.00 GiB (46.0x the state)" in md and "left grads, weights" in md
    assert "## The largest trainer on one GPU (`large` step, gpu_large" in md and "| full offload |" in md
    assert "## Targets of the `tms` step (gpu_tms:" in md and "## Targets of the `large` step" in md
    paths = summary.write_results(results, tmp_path / "out", "2026-11-28_gpu-fake")
    assert paths[2].stat().st_size > 10_000  # the plot, from the tms bench's timings
