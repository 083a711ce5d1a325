"""Run configs: shipped YAMLs validate, bad input fails before anything starts, with every problem."""

from pathlib import Path

import pytest
from typer.testing import CliRunner

from chatlearn_mem import ConfigError
from chatlearn_mem_cli.app import app
from chatlearn_mem_config_files import parse_overrides, preset_description, preset_names
from chatlearn_mem_ray import load_config
from chatlearn_mem_ray.actors.connect import check_resources
from chatlearn_mem_ray.errors import ResourceError
from chatlearn_mem_ray.loops.ppo import DEFAULT_PRESET, PRESETS, RunConfig

CONFIG_DIR = Path(__file__).parents[2] / "configs" / "ppo"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"cpu_tiny.yaml", "gpu.yaml"}
    assert preset_names(PRESETS) == [p.stem for p in CONFIGS]  # the package ships every file
    assert DEFAULT_PRESET in preset_names(PRESETS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    assert load_config(path.stem) == cfg  # by preset name, the same config


def test_overrides_are_typed_and_nested():
    assert parse_overrides(["ppo.iterations=5", "memory.enabled=false", "ray.address=auto", "a.b.c=0.5"]) == {
        "ppo": {"iterations": 5},
        "memory": {"enabled": False},
        "ray": {"address": "auto"},
        "a": {"b": {"c": 0.5}},
    }
    cfg = load_config(CONFIGS[0], ["ppo.iterations=5", "memory.enabled=false", "memory.manager.bucket_size_mb=8"])
    assert (cfg.ppo.iterations, cfg.memory.enabled, cfg.memory.manager.bucket_size_mb) == (5, False, 8)


def test_every_problem_is_listed_with_its_key():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["ppo.iterations=0", "ppo.kl_coef=-1", "policy.hidden_sizee=8", "ray.cpus_per_rank=x"])
    msg = str(e.value)
    assert "4 problems" in msg
    assert "ppo.iterations: Input should be greater than or equal to 1 (got 0)" in msg
    assert "ppo.kl_coef" in msg and "(got -1)" in msg
    assert "policy.hidden_sizee: unknown key" in msg
    assert "ray.cpus_per_rank" in msg


def test_cross_field_problems_name_the_values():
    with pytest.raises(ConfigError) as e:
        load_config(
            None,
            [
                "ppo.response_length=20",
                "critic.vocab_size=32",
                "parallel.world_size=3",
                "parallel.tensor_model_parallel_size=2",
            ],
        )
    assert "tensor_model_parallel_size (2) must divide world_size (3)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["ppo.response_length=20", "critic.vocab_size=32"])
    msg = str(e.value)
    assert "ppo.prompt_length + ppo.response_length (24) exceeds policy.seq_length (16)" in msg
    assert "critic.vocab_size (32) must equal policy.vocab_size (64)" in msg


@pytest.mark.parametrize(
    "bad, match",
    [
        (["ppo.iterations"], "is not key=value"),
        (["=3"], "is not key=value"),
        (["ppo..x=1"], "is not key=value"),
        (["ppo=1", "ppo.iterations=2"], "ppo was already given a value"),
    ],
)
def test_malformed_overrides(bad, match):
    with pytest.raises(ConfigError, match=match):
        parse_overrides(bad)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(tmp_path / "list.yaml")
    (tmp_path / "broken.yaml").write_text("ppo: {iterations: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "broken.yaml")


def test_more_ranks_than_resources_is_refused():
    cfg = load_config(None, ["parallel.world_size=4", "ppo.prompts_per_iteration=32"])
    with pytest.raises(ResourceError, match=r"4 rank\(s\) x ray.cpus_per_rank=1 need 4 CPUs but this machine has 2"):
        check_resources(cfg, cpus=2, gpus=0, where="this machine")
    gpu = load_config(None, ["parallel.world_size=2", "ray.use_gpu=true"])
    with pytest.raises(ResourceError, match="need 2 GPUs but the cluster has 1"):
        check_resources(gpu, cpus=64, gpus=1, where="the cluster")
    assert check_resources(gpu, cpus=64, gpus=2, where="the cluster") is True
    assert check_resources(cfg, cpus=8, gpus=0, where="x") is False


def test_cli_rejects_bad_config_before_starting_ray(tmp_path):
    import ray

    result = CliRunner().invoke(app, ["ppo", "--config", str(CONFIGS[0]), "ppo.iterations=-2", "bogus=1"])
    assert result.exit_code == 2
    assert "invalid config (2 problems)" in result.output and "bogus: unknown key" in result.output
    result = CliRunner().invoke(app, ["ppo", "--config", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and "does not exist" in result.output
    assert not ray.is_initialized()


def test_cli_refuses_more_ranks_than_cpus_before_starting_ray():
    import os

    import ray

    n = (os.cpu_count() or 1) + 1
    result = CliRunner().invoke(
        app, ["ppo", f"parallel.world_size={n}", f"ppo.prompts_per_iteration={8 * n}", "ray.num_cpus=null"]
    )
    assert result.exit_code == 1
    assert f"need {n} CPUs but this machine has {n - 1}" in result.output
    assert not ray.is_initialized()


def test_cli_bench_takes_the_same_config_syntax_as_ppo():
    result = CliRunner().invoke(app, ["bench", "--config", "tiny", "--print-config", "repeats=3"])
    assert result.exit_code == 0, result.output
    assert '"preset": "tiny"' in result.output and '"repeats": 3' in result.output
    result = CliRunner().invoke(app, ["bench", "--config", "tiny", "repeatz=3"])
    assert result.exit_code == 2 and "error: invalid config (1 problem)" in result.output
    assert "repeatz: unknown key" in result.output


def test_cli_ppo_without_config_runs_the_cpu_default():
    result = CliRunner().invoke(app, ["ppo", "--print-config"])
    assert result.exit_code == 0, result.output
    assert RunConfig.model_validate_json(result.output) == load_config(DEFAULT_PRESET)


def test_cli_unknown_preset_lists_the_presets():
    result = CliRunner().invoke(app, ["ppo", "--config", "cpu_tinny"])
    assert result.exit_code == 2
    assert (
        result.output.startswith("error: unknown config 'cpu_tinny'")
        and "cpu_tiny, cpu_tiny_llama, cpu_vllm, gpu" in result.output
    )
    assert "Traceback" not in result.output


def test_cli_lists_presets():
    result = CliRunner().invoke(app, ["presets"])
    assert result.exit_code == 0
    assert (
        "ppo: cpu_tiny, cpu_tiny_llama, cpu_vllm, gpu" in result.output
        and "bench: cpu, gpu, gpu_large, gpu_tms, tiny" in result.output
    )


def test_an_unknown_key_suggests_the_nearest_one_with_its_dotted_key(tmp_path):
    """Before: "policy.hidden_sizee: unknown key" alone."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ["policy.hidden_sizee=8", "memory.manager.bucket_size=8", "bogus=1"])
    msg = str(e.value)
    assert "policy.hidden_sizee: unknown key (did you mean policy.hidden_size?)" in msg
    assert "memory.manager.bucket_size: unknown key (did you mean memory.manager.bucket_size_mb?)" in msg
    assert "bogus: unknown key\n" in msg + "\n"  # nothing close: no guess
    (tmp_path / "run.yaml").write_text("ppo:\n  iteration: 3\ncheckpoint:\n  evry: 2\n")
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path / "run.yaml")
    assert "ppo.iteration: unknown key (did you mean ppo.iterations?)" in str(e.value)
    assert "checkpoint.evry: unknown key (did you mean checkpoint.every?)" in str(e.value)
    result = CliRunner().invoke(app, ["ppo", "ray.adress=auto"])
    assert result.exit_code == 2 and "ray.adress: unknown key (did you mean ray.address?)" in result.output


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_starts_with_a_one_line_summary(path):
    """`chatlearn-mem presets` prints the first line of each YAML: one sentence that stands alone."""
    first, second = path.read_text().splitlines()[:2]
    assert first.startswith("# ") and first.endswith(".") and len(first) <= 66, first
    assert second == "#" or not second.startswith("#"), f"the summary goes on: {second!r}"


def test_cli_lists_presets_with_their_summaries():
    """Before: the names alone."""
    from chatlearn_mem_bench.config import DEFAULT_PRESET as BENCH_DEFAULT
    from chatlearn_mem_bench.config import PRESETS as BENCH_PRESETS

    result = CliRunner().invoke(app, ["presets"])
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert f"ppo: cpu_tiny, cpu_tiny_llama, cpu_vllm, gpu, gpu_vllm (default: {DEFAULT_PRESET})" in lines
    assert f"bench: cpu, gpu, gpu_large, gpu_tms, tiny (default: {BENCH_DEFAULT})" in lines
    for presets in (PRESETS, BENCH_PRESETS):
        for name in preset_names(presets):
            summary = preset_description(presets, name)
            assert summary and any(line.split() == [name, *summary.split()] for line in lines), (name, lines)


def test_the_vllm_rollout_needs_a_checkpoint_and_plans_a_budget_on_gpus_too():
    cfg = load_config("cpu_vllm")
    assert cfg.rollout.engine == "vllm" and cfg.policy.from_hf is not None and cfg.policy.precision == "fp32"
    with pytest.raises(ConfigError, match=r"rollout.engine: vllm starts the engine from .*set policy.from_hf"):
        load_config(None, ["rollout.engine=vllm"])
    gpu = load_config("gpu_vllm")  # one GPU, a Qwen2-0.5B shape, written at first use
    assert gpu.rollout.engine == "vllm" and gpu.ray.use_gpu is True and gpu.policy.add_qkv_bias
    # a budget with vLLM on GPUs is accepted (test_a_vllm_budget_on_gpus_plans_... plans it)
    assert load_config("gpu_vllm", ["memory.device_budget_mb=60000"]).memory.device_budget_mb == 60000
    tp2 = load_config("cpu_vllm", ["parallel.world_size=2", "parallel.tensor_model_parallel_size=2"])
    assert tp2.parallel.tensor_model_parallel_size == 2  # the sync merges the ranks' shards (tests/vllm)
    assert load_config("cpu_vllm", ["memory.device_budget_mb=100", "ray.use_gpu=true"]).ray.use_gpu is True
    assert load_config("cpu_vllm", ["memory.device_budget_mb=100"]).memory.device_budget_mb == 100  # CPU: pinned
    with pytest.raises(ConfigError, match=r"rollout.engine"):
        load_config("cpu_vllm", ["rollout.engine=sglang"])


def test_a_vllm_budget_on_gpus_plans_the_engines_weights_and_kv_cache_as_it_reports_them():
    """On GPUs the engine sleeps, so it is planned like any model: one item, what its ``part_sizes``
    reports once it runs (weights and the KV cache vLLM sized from ``gpu_memory_utilization``), held
    in the generate phase only; a budget that holds its weights but not its KV cache is refused."""
    from types import SimpleNamespace

    from chatlearn_mem import Part
    from chatlearn_mem.engines.vllm_rollout import EngineMemory
    from chatlearn_mem_ray.actors.vllm import VLLMRolloutActor
    from chatlearn_mem_ray.loops.ppo import PPO
    from chatlearn_mem_ray.service.budget import estimate_sizes, pinned_items
    from chatlearn_mem_ray.service.declare import phase_demands
    from chatlearn_mem_ray.service.schedule import ResidencySchedule

    cfg = load_config("gpu_vllm", ["memory.device_budget_mb=60000"])
    loop = PPO(cfg)
    models, phases = loop.models(), loop.phases()
    assert pinned_items(cfg, models, use_gpu=True) == set()  # on CUDA the engine sleeps: not pinned
    engine = VLLMRolloutActor("rollout", cfg.policy.model_dump(), {}, cfg.rollout.model_dump())
    weights, kv = 988 * 2**20, 40 * 2**30  # a Qwen2-0.5B in bf16 and the KV cache of a large GPU
    engine.engine = SimpleNamespace(memory=lambda: EngineMemory(weights, kv, "cuda"))
    sizes = estimate_sizes(cfg, models)  # the trainers from their configs
    sizes["rollout"] = {Part(p): b for p, b in engine.part_sizes().items()}  # as the service measures it
    assert sizes["rollout"] == {Part.WEIGHTS: weights + kv}
    ws = cfg.parallel.world_size
    bundles = {a: b for m in models for a, b in zip(m.actor_names(ws), m.bundles(ws))}
    demands = phase_demands(models, phases, ws)
    names = [p.name for p in phases]
    roomy = ResidencySchedule(sizes, int(cfg.memory.device_budget_mb * 2**20), demands, bundles)
    assert all(("rollout", Part.WEIGHTS) in roomy.target(i) for i in range(len(names)))  # 60000 MiB hold it all
    tight = ResidencySchedule(sizes, weights + kv, demands, bundles)  # the generate phase's need, no more
    assert [("rollout", Part.WEIGHTS) in tight.target(i) for i in range(len(names))] == [n == "generate" for n in names]
    with pytest.raises(ValueError, match="generate needs"):  # its weights fit, its KV cache does not
        ResidencySchedule(sizes, weights + kv - 1, demands, bundles)
