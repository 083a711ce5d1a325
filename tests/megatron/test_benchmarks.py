"""Smoke test of the memory benchmark (tiny trainer, a few seconds): it runs end to end and its
outputs hold every figure; a run killed half way keeps its finished parts and its report is rebuilt
from them; a host memory plan that does not fit is refused before anything is measured; the GPU
methods' pinned buffers are allocated and freed as documented. Targets are only checked to exist;
wall-clock results are never asserted."""

import contextlib
import json
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("psutil")

import torch  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from chatlearn_mem.device_memory import storage_key  # noqa: E402
from chatlearn_mem_bench import PARTS  # noqa: E402
from chatlearn_mem_bench.config import COPY_PARTS, FULL  # noqa: E402
from chatlearn_mem_cli.app import app  # noqa: E402

# The shipped bench configs and presets are checked in tests/unit/test_bench_config.py.


def test_benchmark_end_to_end(dist1, tmp_path):
    result = CliRunner().invoke(
        app, ["bench", "--config", "tiny", f"output_dir={tmp_path}", "name=smoke", "-q", "revision=abc123"]
    )
    assert result.exit_code == 0, result.output
    assert torch.distributed.is_initialized()  # the session's group, which the command did not create
    out = result.output
    assert out.startswith("command: chatlearn-mem bench --config tiny")
    last = out.strip().splitlines()
    assert last[-1].startswith("== ") and "targets met" in last[-1]  # targets are printed last
    # the plan and the estimate come before anything is timed (and so before the results file)
    assert out.index("host memory plan: peak ") < out.index("time estimate: ") < out.index("results so far in ")
    assert "then, not in that estimate: the onload tail (5 weights onloads) and the soak (6 full cycles" in out

    res = json.loads((tmp_path / "smoke.json").read_text())
    assert res["git_revision"] == "abc123" and res["complete"] and res["missing_parts"] == []
    assert list(res["part_seconds"]) == list(PARTS) and res["time_estimate"]["total_s"] > 0
    # The plan from the config alone matches the trainer's bytes, and its figures are the run's own:
    # the manager's store is what residency() reports, the ceiling buffer the full copy, allocated once.
    from chatlearn_mem_bench.config import load_config
    from chatlearn_mem_bench.plan import estimate_part_sizes, part_bytes

    estimated = part_bytes(estimate_part_sizes(load_config("tiny").trainer))
    assert all(abs(estimated[p] - n) <= 0.001 * n + 512 for p, n in res["model"]["bytes_per_part"].items())
    plan = {i["what"]: i for i in res["host_memory_plan"]["items"]}
    assert plan["manager host store"]["bytes"] == res["cycles"]["rows"][0]["host_bytes_after_offload"]
    full = res["model"]["bytes_per_part"]["full"]
    assert plan["ceiling host buffer (shared with release_bound)"]["bytes"] == full
    assert {x["host_bytes"] for x in res["memory"] if x["method"] == "ceiling"} == {full}  # every part: no re-pinning
    assert (
        res["host_memory_plan"]["peak_bytes"]
        == (res["host_memory_plan"]["pinned_bytes"] + res["host_memory_plan"]["pageable_bytes"])
        > 0
    )
    assert not any(res["pays_empty_cache"].values())  # CPU: no CUDA cache to empty
    assert (tmp_path / "smoke.md").read_text().count("| manager |") >= 10
    assert (tmp_path / "smoke.png").stat().st_size > 0
    assert res["command"].startswith("chatlearn-mem bench --config tiny")
    assert res["config"]["trainer"]["hidden_size"] == 64 and res["config"]["preset"] == "tiny"
    assert "checkpoint" not in res and "planner" not in res  # opt-in reports: off by default
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
                if m == "manager":  # the manager's own count of its host work, per timed call
                    assert r["host_seconds"]["n"] == res["config"]["repeats"] and r["host_seconds"]["median"] > 0
                    assert r["host_share"] == r["host_seconds"]["median"] / r["seconds"]["median"]
                    assert 1 <= r["steps"] <= r["actions"]

    # the overlap rows: each against its serial counterpart, spreads, the forward-alone bound
    overlap = {r["name"]: r for r in res["overlap"]}
    assert list(overlap) == ["onload_then_forward", "swap", "full_cycle"]
    for r in overlap.values():
        assert len(r["serial_samples_s"]) == len(r["overlapped_samples_s"]) == res["config"]["repeats"]
        assert r["ratio"] == r["overlapped_s"] / r["serial_s"] and r["ratio_spread"][0] <= r["ratio_spread"][1]
        assert r["threads"] == 1  # overlap_threads: a core left to the copy lane
    # both measured; which is longer is the machine's business (a wall-clock order flips under load)
    otf = overlap["onload_then_forward"]
    assert otf["forward_alone_s"] > 0 and otf["onload_alone_s"] > 0 and otf["serial_s"] > 0
    assert 0 < otf["first_module_bytes"] < res["model"]["bytes_per_part"]["weights"]
    assert otf["first_module_copy_s"] > 0 and len(otf["first_module_copy_samples_s"]) == res["config"]["repeats"]
    assert otf["best_possible_s"] == max(otf["forward_alone_s"] + otf["first_module_copy_s"], otf["onload_alone_s"])
    # CPU: the same schedule with plain copies, the forward beside the copy (contention counted)
    assert len(otf["plain_overlap_samples_s"]) == res["config"]["repeats"] and otf["plain_overlap_s"] > 0
    assert otf["contended_best_s"] == max(otf["plain_overlap_s"], otf["best_possible_s"])
    assert otf["contended_best_ratio"] == otf["contended_best_s"] / otf["serial_s"]
    assert len(otf["onload_samples_s"]) == res["config"]["repeats"]
    assert overlap["swap"]["copy_bound_ratio"] > 0  # CPU: two host copies at once, against serial
    assert (
        overlap["swap"]["out_bytes"] == res["model"]["bytes_per_part"]["full"] + res["model"]["bytes_per_part"]["grads"]
    )
    assert {t["name"] for t in res["targets"]} >= {
        "overlap onload_then_forward: overlapped <= 0.85 of serial",
        "overlap swap: overlapped <= 0.85 of serial",
    }
    assert "## Overlap" in (tmp_path / "smoke.md").read_text()
    assert any(i["what"].startswith("overlap rows") for i in res["host_memory_plan"]["items"])

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
    assert res["integrity"]["changed_by"] == {}
    assert res["detached_grad_hooks"] == {}  # on one device no method drops an accumulator node

    # the repeated rows: the weights onload beside a plain copy, and the soak with training between cycles
    tail = res["onload_tail"]
    assert len(tail["samples_onload_s"]) == len(tail["samples_copy_s"]) == 5
    assert tail["bytes"] == res["model"]["bytes_per_part"]["weights"] and tail["onload_over_copy"] > 0
    assert tail["p90_over_median"] >= 1.0
    soak = res["soak"]
    assert [s["cycle"] for s in soak["samples"]] == [0, 2, 4, 6] and soak["audit_ok"]
    assert all(s["rss_bytes"] > 0 for s in soak["samples"])
    names = {t["name"] for t in res["targets"]}
    assert {
        "weights onload (blocking) <= 1.3x a plain copy of its bytes",
        "weights onload tail: 90th percentile <= 1.5x the median",
        "soak: rss flat with training between cycles",
        "weights onload: manager >= 0.9 of the release bound",
        "overlap swap: within 0.05 of its bound (two copies at once)",
    } <= names
    md = (tmp_path / "smoke.md").read_text()
    assert "## Weights onload, 5 times" in md and "## Soak: 6 full cycles" in md

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
    from chatlearn_mem_bench.targets import check_targets

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
    cpu_full = [n for n in (t["name"] for t in res["targets"]) if n.startswith("full ")]
    assert cpu_full == [
        "full offload: manager >= 0.9 of the release bound",
        "full onload: manager >= 0.9 of the release bound",
    ]
    assert any(n.endswith("faster than replace_rebuild") for n in targets)
    assert "CUDA reserved MiB" in markdown(gpu)
    assert "## The manager's host work" in md and "the host time includes the copies" in md
    assert "On CUDA the host only issues the copies" in markdown(gpu)


def test_the_checkpoint_and_planner_reports_run_when_asked_for(dist1, tmp_path):
    """``checkpoint: true`` and ``planner: true`` (what scripts/measure_checkpoint.py and
    measure_planner.py measured): rows in the JSON, a section in the markdown, a target each, the
    checkpoint's buffers in the host memory plan; the saves' sleeps and wakes leave the trainer exact.
    Figures are not asserted (wall clock on a shared machine)."""
    from chatlearn_mem.checkpoint import list_checkpoints
    from chatlearn_mem.mcore.layout import megatron_core_release
    from chatlearn_mem_bench.checkpoint_saves import KINDS
    from chatlearn_mem_bench.planner_speed import FACTORS

    ckpt = tmp_path / "ckpt"
    quick = ["repeats=3", "cycles=2", "plot=false", "overlap=false", "soak_cycles=0", "tail_onloads=0", "methods=[]"]
    reports = ["checkpoint=true", "checkpoint_repeats=1", f"checkpoint_dir={ckpt}"]
    reports += ["planner=true", "planner_seeds=1", "planner_repeats=1"]
    result = CliRunner().invoke(
        app, ["bench", "--config", "tiny", f"output_dir={tmp_path}", "name=r", *quick, *reports]
    )
    assert result.exit_code == 0, result.output
    assert "then, not in that estimate: the checkpoint report (6 saves) and the planner report (8 plans)" in (
        result.output
    )
    res = json.loads((tmp_path / "r.json").read_text())
    ck = res["checkpoint"]
    # megatron-core 0.13 has no dp_reshardable format: those saves are said not measured, not failed
    dp = megatron_core_release() >= (0, 14)
    assert sorted(ck["seconds"]) == sorted(k for k in KINDS if dp or not k.endswith("_dp"))
    assert all(len(v) == 1 for v in ck["samples_s"].values())
    assert bool(ck["not_measured"]) is not dp and ck["saves_asleep"] == (4 if dp else 2)
    # the checkpoint holds the copied parts' bytes (the weights, main weights and optimizer states;
    # the parts' buffers have some padding besides)
    full = res["model"]["bytes_per_part"]["full"]
    assert 0.99 * full <= ck["tensor_bytes"] <= full
    assert ck["asleep_device_bytes_max"] == 0 and ck["dir"] == str(ckpt)
    assert all(0 <= share < 1 for share in ck["manifest_share_of_save"].values())
    last = 6 if dp else 3
    assert list_checkpoints(str(ckpt)) == [str(ckpt / f"step_{last:08d}")]  # keep_last=1: the last save stays
    plan = {i["what"]: i for i in res["host_memory_plan"]["items"]}
    assert plan["checkpoint report: plain-write buffer"]["held_by"] == "checkpoint"
    pl = res["planner"]
    assert [(r["kind"], r["factor"]) for r in pl["rows"]] == [(k, f) for k in ("models", "random") for f in FACTORS]
    assert all(r["bytes_moved"] <= r["all_or_nothing_bytes"] for r in pl["rows"])
    assert pl["slowest_median_ms"] == max(r["median_ms"] for r in pl["rows"])
    names = {t["name"]: t for t in res["targets"]}
    assert names["checkpoint: a sleeping trainer is saved holding 0 device bytes"]["passed"]
    assert "residency planner: every plan of 64 x 8 under 100 ms" in names
    assert names["integrity: tensors bit-identical after every method, audit ok"]["passed"]
    md = (tmp_path / "r.md").read_text()
    assert "## Checkpoint saves against a plain write" in md and "| save, default, trainer asleep |" in md
    assert "## The residency planner on 8 schedules of 64 items x 8 phases" in md


# -- a run cut short ---------------------------------------------------------------------------
def test_the_integrity_row_names_the_method_and_part_whose_bytes_changed(dist1, tmp_path, monkeypatch):
    """The integrity row once said only that the bytes differed after all methods (two GPU runs);
    each method's last round is now checked against the bytes before the part's rounds."""
    from chatlearn_mem_bench import alternatives as methods

    restore = methods.ReplaceRebuild.restore

    def corrupting_restore(self, part):
        restore(self, part)
        if part == "main_weights":
            with torch.no_grad():
                methods.logical_tensors(self.mm, self.trainer, part)[0].view(-1)[0] += 1

    monkeypatch.setattr(methods.ReplaceRebuild, "restore", corrupting_restore)
    overrides = ["methods=[replace_rebuild]", "overlap=false", "soak_cycles=0", "tail_onloads=0", "repeats=3"]
    result = CliRunner().invoke(
        app, ["bench", "--config", "tiny", f"output_dir={tmp_path}", "name=broken", "-q", *overrides]
    )
    assert result.exit_code == 0, result.output
    res = json.loads((tmp_path / "broken.json").read_text())
    assert res["integrity"]["changed_by"] == {"replace_rebuild": ["main_weights"]}
    assert not res["integrity"]["tensors_bit_identical_after_all_methods"]
    (row,) = [t for t in res["targets"] if t["name"].startswith("integrity")]
    assert not row["passed"] and row["detail"] == "bytes changed by replace_rebuild (main_weights); audit ok"
    assert (
        "replace_rebuild left main_weights with other bytes than before its rounds."
        in (tmp_path / "broken.md").read_text()
    )


def test_a_killed_run_keeps_its_finished_parts_and_the_report_names_the_missing_ones(tmp_path):
    """SIGKILL once the first part's rows are in the JSON: those rows stay, and the markdown and the
    PNG are rebuilt from the JSON alone, naming what is missing. Before: results were written only
    at the end, so a killed or timed-out run left nothing. The child holds before its second part
    until it is killed, so the kill never races the run's progress."""
    out = tmp_path / "bench"
    path = out / "k.json"
    child = (
        "import sys, threading\n"
        "import chatlearn_mem_bench.run as run\n"
        "timed, parts = run.time_part, []\n"
        "def first_part_only(*args, **kwargs):\n"
        "    parts.append(args[0])\n"
        "    if len(parts) > 1:\n"
        "        threading.Event().wait()  # held here until killed\n"
        "    return timed(*args, **kwargs)\n"
        "run.time_part = first_part_only\n"
        "from chatlearn_mem_cli.__main__ import main\n"
        "sys.argv = ['chatlearn-mem', *sys.argv[1:]]\n"
        "main()\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            child,
            "bench",
            "--config",
            "tiny",
            f"output_dir={out}",
            "name=k",
            "repeats=20",
            "plot=false",
            "-q",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if path.exists() and json.loads(path.read_text())["part_seconds"]:  # written atomically
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stdout.read().decode()[-3000:]

    res = json.loads(path.read_text())
    done = list(res["part_seconds"])
    missing = [p for p in PARTS if p not in done]
    assert not res["complete"] and done == [PARTS[0]] and res["missing_parts"] == missing == list(PARTS[1:])
    assert "cycles" not in res and "integrity" not in res
    rows = {(r["part"], r["method"], r["direction"]) for r in res["timings"]}
    for part in done:
        for m in ("manager", "ceiling", "release_bound"):
            assert {(part, m, "offload"), (part, m, "onload")} <= rows
    assert not any(r["part"] in missing for r in res["timings"])
    assert all(len(r["samples_s"]) == 20 for r in res["timings"])
    assert "Incomplete run" in (out / "k.md").read_text()  # the markdown written with every part says so too

    (out / "k.md").unlink()
    result = CliRunner().invoke(app, ["bench-report", str(path)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out / 'k.md'}" in result.output and f"wrote {out / 'k.png'}" in result.output
    assert (out / "k.png").stat().st_size > 10_000
    md = (out / "k.md").read_text()
    assert f"missing parts {', '.join(missing)}; the repeated full cycles; the integrity check" in md
    assert "| weights | offload | manager |" in md and f"| {missing[-1]} | offload | manager |" not in md
    assert "| weights offload: manager >= 0.8 of ceiling |" in md  # the targets of the rows measured
    assert "## Targets" in md and "no growth" not in md


def test_bench_report_refuses_a_file_that_is_not_a_benchmark_results_json(tmp_path):
    (tmp_path / "log.json").write_text(json.dumps({"iterations": []}))
    result = CliRunner().invoke(app, ["bench-report", str(tmp_path / "log.json")])
    assert result.exit_code == 2 and "is not a chatlearn-mem benchmark's results" in result.output
    assert "Traceback" not in result.output


# -- host memory --------------------------------------------------------------------------------
def test_a_plan_that_does_not_fit_is_refused_before_anything_is_measured(dist1, tmp_path, monkeypatch):
    """The usable host memory forced low: one error line with the planned pinned and pageable bytes,
    the usable bytes and a preset that fits; no part timed, no file written."""
    import chatlearn_mem_bench.run as run
    from chatlearn_mem import host_memory

    usable = 2**30 + 50 * 2**20  # the default 1 GiB margin + 50 MiB
    monkeypatch.setattr(
        host_memory, "usable_host_memory", lambda: host_memory.HostMemory(usable, (("MemAvailable", usable),))
    )
    timed = []
    monkeypatch.setattr(run, "time_part", lambda *args: timed.append(args[0]) or [])
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "--config",
            "tiny",
            "trainer.num_layers=8",
            "trainer.hidden_size=256",
            f"output_dir={tmp_path}",
            "name=r",
            "-q",
        ],
    )
    assert result.exit_code == 1, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in result.output, result.output
    assert re.fullmatch(
        r"error: the benchmark would hold up to 0\.0 MiB pinned \+ (\d+\.\d) MiB pageable = \1 MiB of host "
        r"memory, but the process can use 50\.0 MiB \(MemAvailable 1\.05 GiB; minus a 1\.00 GiB margin\); nothing "
        r"was measured\. Use a smaller preset: --config tiny \(plans \d+\.\d MiB\), or fewer alternatives "
        r"\(methods=\[\]\)\.",
        errors[0],
    ), errors[0]
    assert float(re.search(r"\+ (\d+\.\d) MiB", errors[0]).group(1)) > 50
    assert result.output.index("host memory plan: peak") < result.output.index("error:")
    assert timed == [] and list(tmp_path.iterdir()) == []


@pytest.fixture
def fake_cuda_pinning(monkeypatch):
    """cudaHostRegister / cudaHostUnregister stand-ins recording the pointers and sizes (the GPU
    methods' pinning logic, run on CPU; the real calls run in tests/gpu)."""
    import chatlearn_mem.host_store as host_store

    calls = {"register": [], "unregister": []}
    monkeypatch.setattr(host_store, "_register", lambda b: calls["register"].append((b.data_ptr(), b.numel())))
    monkeypatch.setattr(host_store, "_unregister", lambda ptrs: (calls["unregister"].extend(ptrs), ptrs.clear()))
    return calls


@contextlib.contextmanager
def trained_manager():
    """The default GPT trainer after one step (Adam's states exist), under a manager that copies
    every part each time (as the bench's manager does); closed at the end."""
    from chatlearn_mem import MemoryConfig, TrainerMemoryManager
    from chatlearn_mem.models import gpt

    cfg = gpt.GPTTrainerConfig()
    trainer = gpt.build_gpt_trainer(cfg)
    trainer.train_step(gpt.synthetic_batch(cfg, 0, batch_size=2))
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(skip_unchanged_weights=False))
    try:
        yield trainer, mm
    finally:
        mm.close()


def test_gpu_methods_pin_once_or_every_cycle_as_documented(dist1, fake_cuda_pinning):
    """The ceiling pins one host buffer for the run (none per part) and unpins it at the end;
    fresh_host_alloc pins a new buffer of each storage's exact size on every offload and unpins it
    after the onload. Before: both went through torch's caching pinned allocator, whose cached
    blocks fresh_host_alloc reused (never allocating) and whose power-of-two blocks the ceiling
    took again for every part."""
    from chatlearn_mem_bench.alternatives import FreshHostAlloc
    from chatlearn_mem_bench.methods import CeilingMethod, logical_tensors, part_storages

    with trained_manager() as (trainer, mm):
        ceiling = CeilingMethod(mm, trainer, pin=True)
        ceiling.prepare(device_bytes=4096, host_bytes=3000)
        for n in (1000, 3000, 2000):  # one buffer sliced per part
            ceiling.use(n)
            assert ceiling.offload("weights") == n and ceiling.onload("weights") == n
        assert [n for _, n in fake_cuda_pinning["register"]] == [3000] and not fake_cuda_pinning["unregister"]
        ceiling.release()
        assert fake_cuda_pinning["unregister"] == [fake_cuda_pinning["register"][0][0]]

        fresh = FreshHostAlloc(mm, trainer, pin=True)
        sizes = sorted(s.nbytes() for s in part_storages(mm, "optimizer_states"))
        states = logical_tensors(mm, trainer, "optimizer_states")
        before = [t.detach().clone() for t in states]
        for cycle in range(3):
            fake_cuda_pinning["register"].clear()
            fake_cuda_pinning["unregister"].clear()
            assert fresh.offload("optimizer_states") == sum(sizes)
            assert sorted(n for _, n in fake_cuda_pinning["register"]) == sizes  # new, exact, every cycle
            assert fresh.host_bytes() == (sum(sizes), sum(sizes)) and not fake_cuda_pinning["unregister"]
            fresh.onload("optimizer_states")
            assert sorted(fake_cuda_pinning["unregister"]) == sorted(p for p, _ in fake_cuda_pinning["register"])
            assert fresh.host_bytes() == (0, 0)
        assert all(a.equal(b) for a, b in zip(before, states)) and mm.audit().ok


def test_megatron_builtin_full_cycle_leaves_the_manager_its_own_storages(dist1, monkeypatch):
    """On a GPU megatron's optimizer offload moves main weights and states to the host and its
    restore brings them back as new device tensors. The benchmark left them so: the manager then
    offloaded its stale storages while the live ones stayed (7.3 GB of 18.4 GB still allocated after
    a full offload on an H200) and the integrity checksum differed. restore() now copies them back
    into the manager's storages. On CPU megatron's calls are no-ops, so they are replaced here by
    what they do on a GPU: its offload moves the tensors on the device (a new tensor each), not
    AdamW's step counters, which live on the host; its restore moves every tensor not on the device
    there, the step counters too (on an H100 they came back as CUDA tensors, and the integrity
    checksum differed)."""
    from chatlearn_mem_bench.alternatives import MegatronBuiltin
    from chatlearn_mem_bench.methods import logical_tensors, part_storages

    with trained_manager() as (trainer, mm):
        method = MegatronBuiltin(mm, trainer, pin=False)
        if not method.available:
            pytest.skip("this megatron-core has no built-in offload (added in 0.16)")

        def move(opt, steps: bool):  # megatron's offload_to_cpu / restore_from_cpu, as on a GPU
            for leaf in opt.chained_optimizers:
                for p in (p for g in leaf.optimizer.param_groups for p in g["params"]):
                    p.data = p.data.clone()
                for st in leaf.optimizer.state.values():
                    for k, v in st.items():
                        if torch.is_tensor(v) and (k != "step" or steps):
                            st[k] = v.clone()

        monkeypatch.setattr(trainer.optimizer, "offload_to_cpu", lambda: move(trainer.optimizer, steps=False))
        monkeypatch.setattr(trainer.optimizer, "restore_from_cpu", lambda: move(trainer.optimizer, steps=True))
        parts = ("main_weights", "optimizer_states")
        before = {p: [t.detach().clone() for t in logical_tensors(mm, trainer, p)] for p in parts}
        storages = {p: part_storages(mm, p) for p in parts}
        steps = [st["step"] for leaf in trainer.optimizer.chained_optimizers for st in leaf.optimizer.state.values()]
        assert steps
        method.offload(FULL)
        on_host = {storage_key(x) for x in steps}  # as on a GPU, where the device storages are the rest
        assert all(s.nbytes() == 0 for p in parts for s in storages[p] if storage_key(s) not in on_host)  # released
        method.onload(FULL)
        method.restore(FULL)
        assert mm.audit().ok, mm.audit()
        now_steps = [
            st["step"] for leaf in trainer.optimizer.chained_optimizers for st in leaf.optimizer.state.values()
        ]
        assert all(a is b for a, b in zip(steps, now_steps))  # the host's own step counters again
        for p in parts:
            now = logical_tensors(mm, trainer, p)
            assert all(a.equal(b) for a, b in zip(before[p], now)) and len(now) == len(before[p])
        mm.offload()  # frees the optimizer's live tensors: they are the manager's storages again
        live = [
            v
            for leaf in trainer.optimizer.chained_optimizers
            for st in leaf.optimizer.state.values()
            for v in st.values()
            if torch.is_tensor(v) and v.numel() > 1
        ]
        assert live and all(v.untyped_storage().nbytes() == 0 for v in live)
        mm.onload()


def test_the_overlap_forward_batch(dist1):
    """onload_then_forward's forward: the bench batch, a given shape, or one sequence sized to the copy."""
    import torch

    from chatlearn_mem import TrainerMemoryManager
    from chatlearn_mem.models import gpt
    from chatlearn_mem_bench.config import load_config
    from chatlearn_mem_bench.overlap import forward_batch

    cfg = load_config("tiny")
    full = gpt.synthetic_batch(cfg.trainer, 1, batch_size=cfg.batch_size)
    assert torch.equal(forward_batch(cfg), full)
    assert torch.equal(forward_batch(cfg.model_copy(update={"overlap_forward": (1, 8)})), full[:1, :8])
    trainer = gpt.build_gpt_trainer(cfg.trainer)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    try:
        batch = forward_batch(
            cfg.model_copy(update={"overlap_forward": "match_copy"}), trainer, mm, torch.device("cpu")
        )
        assert batch.shape[0] == 1 and 2 <= batch.shape[1] <= cfg.trainer.seq_length
        assert torch.equal(batch, full[:1, : batch.shape[1]])
        assert not mm.is_offloaded("weights")  # the calibration leaves the weights resident
    finally:
        mm.close()


def test_the_onload_timeline_shows_each_module_starting_after_its_own_bytes(dist1):
    """onload_then_forward's timed run: every module of the forward starts after its own bytes
    landed (the per-module fences); with copies slower than the forward (each copy delayed), the
    forward starts before the last bytes land and ends after they did."""
    from trainer_runs import slow_lanes

    from chatlearn_mem import MemoryConfig, TrainerMemoryManager
    from chatlearn_mem.models import gpt
    from chatlearn_mem_bench.overlap import onload_timeline

    cfg = gpt.GPTTrainerConfig()
    trainer = gpt.build_gpt_trainer(cfg)
    # steps of 64 KiB: a module's bytes end a step (the default's 64 MiB would be one step here)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(copy_chunk_mb=1 / 16))
    with contextlib.closing(mm):
        batch = gpt.synthetic_batch(cfg, 1, batch_size=2)

        def forward():
            with torch.no_grad():
                trainer.loss(batch)

        with slow_lanes(3e-3):
            t = onload_timeline(trainer, mm, torch.device("cpu"), forward)
        mods = t["modules"]
        assert len(mods) == len(mm.state.weight_users) > 3
        ran = [m for m in mods if m["started_ms"] is not None]
        assert ran and all(m["arrived_ms"] is not None and m["started_ms"] >= m["arrived_ms"] for m in ran), ran
        assert mods[0]["module"].endswith("embedding.word_embeddings") and mods[0]["bytes"] > 0
        assert t["first_start_ms"] < t["last_arrival_ms"] <= t["end_ms"] and t["last_start_ms"] <= t["end_ms"]
        assert 0 < t["submit_ms"] < t["end_ms"]
        assert not mm.is_offloaded("weights") and mm.audit().ok
