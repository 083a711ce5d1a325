"""The benchmark's configs: every shipped YAML validates, presets load, overrides apply
(no trainer is built; the end-to-end smoke run is tests/megatron/test_benchmarks.py)."""

from pathlib import Path

import pytest

pytest.importorskip("matplotlib")
pytest.importorskip("psutil")

from chatlearn_mem import ConfigError  # noqa: E402
from chatlearn_mem.config import preset_names  # noqa: E402
from chatlearn_mem_bench import BenchConfig, load_config  # noqa: E402
from chatlearn_mem_bench.config import PRESETS  # noqa: E402

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
    gpu = load_config("gpu")
    t = gpu.trainer  # 1B+ parameters: 12 h^2 per layer plus the embedding
    assert 12 * t.num_layers * t.hidden_size**2 + t.vocab_size * t.hidden_size > 1e9
    with pytest.raises(ConfigError, match="presets: cpu, gpu, tiny"):
        load_config("nope")
    with pytest.raises(ConfigError, match="repeatz: unknown key"):
        load_config("tiny", overrides=["repeatz=3"])


def test_a_file_named_like_a_preset_is_read_as_the_file_and_recorded_as_custom(tmp_path, monkeypatch):
    (tmp_path / "tiny").write_text("repeats: 7\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny")
    assert cfg.repeats == 7 and cfg.preset == "custom"  # the file, not the preset, and labelled so
