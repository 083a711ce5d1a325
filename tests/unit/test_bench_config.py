"""The benchmark's configs: every shipped YAML validates, presets load, overrides apply
(no trainer is built; the end-to-end smoke run is tests/megatron/test_benchmarks.py)."""

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("psutil")

from chatlearn_mem import ConfigError  # noqa: E402
from chatlearn_mem.models.gpt import estimate_part_bytes  # noqa: E402
from chatlearn_mem_bench import BenchConfig, load_config  # noqa: E402
from chatlearn_mem_bench.config import PRESETS  # noqa: E402
from chatlearn_mem_config_files import preset_names  # noqa: E402

CONFIG_DIR = Path(__file__).parents[2] / "configs" / "bench"


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    assert path.stem in preset_names(PRESETS)  # every file ships and is reachable as --config NAME
    cfg = load_config(str(path))
    assert cfg.repeats >= 3 and cfg.cycles >= 2 and cfg.preset == "custom"
    named = load_config(path.stem)
    assert named.trainer == cfg.trainer and named.preset == path.stem


def test_presets_load_and_overrides_apply():
    cfg = load_config("cpu", overrides=["trainer.num_layers=3", "repeats=5", "methods=[fresh_host_alloc]"])
    assert isinstance(cfg, BenchConfig) and cfg.preset == "cpu"
    assert cfg.trainer.num_layers == 3 and cfg.repeats == 5 and cfg.methods == ["fresh_host_alloc"]
    gpu = load_config("gpu")  # a real model for one GPU, sized for its validation step (see test_gpu_validate)
    assert estimate_part_bytes(gpu.trainer)["weights"] / 2 > 0.5e9 and gpu.pin_memory  # bf16: 2 bytes each
    assert not gpu.cuda_contiguous and load_config("gpu", overrides=["cuda_contiguous=true"]).cuda_contiguous
    with pytest.raises(ConfigError, match="presets: cpu, gpu, gpu_large, gpu_tms, tiny"):
        load_config("nope")
    with pytest.raises(ConfigError, match="repeatz: unknown key"):
        load_config("tiny", overrides=["repeatz=3"])


def test_a_file_named_like_a_preset_is_read_as_the_file_and_recorded_as_custom(tmp_path, monkeypatch):
    (tmp_path / "tiny").write_text("repeats: 7\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny")
    assert cfg.repeats == 7 and cfg.preset == "custom"  # the file, not the preset, and labelled so


# -- where results go ------------------------------------------------------------------------
def _stub_run(monkeypatch, calls):
    """run_and_report with the measuring and the writing stubbed: what it decides is real."""
    import chatlearn_mem_bench.report as report
    import chatlearn_mem_bench.run as run

    def run_benchmark(cfg, command, sink, echo):
        calls.append("measured")
        res = {"targets": [], "complete": True}
        sink(res)  # the first results name the files (cfg.name here)
        return res

    monkeypatch.setattr(run, "run_benchmark", run_benchmark)

    def write_outputs(res, out_dir, stem, plot, quiet):
        (out_dir / f"{stem}.json").write_text("new")
        return [out_dir / f"{stem}.json"]

    monkeypatch.setattr(report, "write_outputs", write_outputs)
    monkeypatch.setattr(report, "print_targets", lambda res, echo: None)
    return run.run_and_report


def test_the_default_output_dir_is_not_the_committed_results():
    assert load_config("cpu").output_dir == "runs/bench" and not load_config("cpu").overwrite


def test_results_of_the_same_name_are_never_replaced_unless_asked(tmp_path, monkeypatch):
    """Before: a run of the same day and hardware replaced them (committed results included)."""
    calls, lines = [], []
    run_and_report = _stub_run(monkeypatch, calls)
    stem = "2026-11-22_cpu-2core"
    (tmp_path / f"{stem}.json").write_text("committed")
    (tmp_path / f"{stem}_2.png").write_text("committed")
    cfg = load_config("tiny", [f"output_dir={tmp_path}", f"name={stem}"])
    paths = run_and_report(cfg, echo=lines.append)
    assert paths == [tmp_path / f"{stem}_3.json"]
    assert (tmp_path / f"{stem}.json").read_text() == "committed"
    assert f"{tmp_path / stem}.* exist (set overwrite=true to replace them); writing {stem}_3.* instead" in lines

    paths = run_and_report(
        load_config("tiny", [f"output_dir={tmp_path}", f"name={stem}", "overwrite=true"]), echo=lines.append
    )
    assert paths == [tmp_path / f"{stem}.json"] and paths[0].read_text() == "new"


def test_an_unwritable_output_dir_fails_before_measuring(tmp_path, monkeypatch):
    calls = []
    run_and_report = _stub_run(monkeypatch, calls)
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError, match=r"output_dir .*file/bench is not writable \(Not a directory\); choose another"):
        run_and_report(load_config("tiny", [f"output_dir={tmp_path / 'file' / 'bench'}"]), echo=lambda line: None)
    assert calls == []


def test_overlap_forward_is_a_shape_within_the_sequence_or_match_copy():
    assert load_config("cpu").overlap_forward == "match_copy"  # sized to the copy on the machine it runs on
    assert load_config("gpu").overlap_forward is None
    assert load_config("tiny", ["overlap_forward=[1,8]"]).overlap_forward == (1, 8)
    for bad in ("[1,200]", "[0,8]", "[1,1]", "fast"):
        with pytest.raises(ConfigError, match="overlap_forward"):
            load_config("tiny", [f"overlap_forward={bad}"])


def test_an_unknown_key_in_a_yaml_file_suggests_the_nearest_one(tmp_path):
    """Before: "repeatz: unknown key" alone."""
    (tmp_path / "bench.yaml").write_text("repeatz: 3\ntrainer:\n  num_layer: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "bench.yaml"))
    assert "repeatz: unknown key (did you mean repeats?)" in str(e.value)
    assert "trainer.num_layer: unknown key (did you mean trainer.num_layers?)" in str(e.value)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_starts_with_a_one_line_summary(path):
    """`chatlearn-mem presets` prints the first line of each YAML: one sentence that stands alone."""
    first, second = path.read_text().splitlines()[:2]
    assert first.startswith("# ") and first.endswith(".") and len(first) <= 66, first
    assert second == "#" or not second.startswith("#"), f"the summary goes on: {second!r}"
