"""GRPO without Ray: its presets, its bad input (one error line, exit code 2, nothing started), and
its math on hand-checked numbers (group advantages, both loss normalisations, the two clips, the
k3 KL term)."""

import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from chatlearn_mem import ConfigError
from chatlearn_mem_cli.app import app
from chatlearn_mem_config_files import preset_names
from chatlearn_mem_ray.loops.grpo.config import DEFAULT_GRPO_PRESET, GRPO_PRESETS, GRPORunConfig, load_grpo_config
from chatlearn_mem_ray.loops.grpo.loop import group_advantages, grpo_loss

CONFIGS = sorted((Path(__file__).parents[2] / "configs" / "grpo").glob("*.yaml"))


def test_the_grpo_presets_ship_and_validate(tmp_path):
    assert {p.stem for p in CONFIGS} == {
        "cpu_grpo",
        "cpu_grpo_text",
        "cpu_grpo_torch",
        "cpu_grpo_torch_vllm",
        "cpu_grpo_vllm",
        "gpu_grpo",
        "gpu_grpo_math",
    }
    assert preset_names(GRPO_PRESETS) == [p.stem for p in CONFIGS] and DEFAULT_GRPO_PRESET == "cpu_grpo"
    from chatlearn_mem.models import hf
    from chatlearn_mem.models.gpt import GPTTrainerConfig

    qwen2 = GPTTrainerConfig(  # stands in for the user's checkpoint that gpu_grpo_math names (none ships)
        num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        vocab_size=64, seq_length=1024, normalization="RMSNorm", activation="swiglu", position_embedding="rope",
        add_bias_linear=False, add_qkv_bias=True, share_embeddings_and_output_weights=True,
    )  # fmt: skip
    hf.save_random_hf(qwen2, tmp_path / "qwen2")
    own = {"gpu_grpo_math": [f"policy.from_hf={tmp_path / 'qwen2'}"]}
    for path in CONFIGS:
        cfg = load_grpo_config(path, own.get(path.stem, []))
        assert isinstance(cfg, GRPORunConfig) and load_grpo_config(path.stem, own.get(path.stem, [])) == cfg
        assert path.read_text().startswith("# ") and cfg.grpo.group_size >= 2
    with pytest.raises(ConfigError, match="put the checkpoint there"):  # without it: where to put it
        load_grpo_config("gpu_grpo_math")


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["grpo.group_size=1"], "grpo.group_size: must be >= 2, got 1"),
        (["grpo.kl_coef=0.01", "reference=null"], "grpo.kl_coef=0.01 needs a reference model, and reference is null"),
        (["grpo.minibatch_size=5"], "grpo.minibatch_size (5) must divide the responses per data-parallel rank (32"),
        (["grpo.variant=ppo"], "grpo.variant"),
        (["memory.device_budget_mb=1"], "train needs 1.88 MiB but the budget is 1.00 MiB"),
        (["grpo.loss_agg=sum"], "grpo.loss_agg: Input should be 'token_mean', 'seq_mean_token_mean' or 'seq_mean"),
        (["grpo.policy_loss=ppo"], "grpo.policy_loss: Input should be 'ppo_clip' or 'gspo' (got 'ppo')"),
        (["grpo.estimator=gae"], "grpo.estimator: Input should be 'grpo', 'dr_grpo', 'rloo' or 'reinforce_pp'"),
        (["grpo.clip_ratio_c=0.5"], "grpo.clip_ratio_c: Input should be greater than 1"),
        (["grpo.dynamic_sampling=true", "grpo.group_size=1"], "nor can grpo.dynamic_sampling find one whose rewards"),
        (["export.hf_every=5"], "export to Hugging Face are LlamaForCausalLM and Qwen2ForCausalLM; set policy.from_hf"),
        (["logger=[console,neptune]"], "logger.1: Input should be 'console', 'tensorboard', 'wandb' or 'mlflow'"),
        (["validation.every=5"], "score the policy on held-out prompts: set data.val_files"),
        (["validation.samples_per_prompt=4"], "with validation.temperature=0 (greedy) samples the same response"),
    ],
)
def test_bad_grpo_input_is_one_error_line_and_exit_code_2_before_anything_starts(tmp_path, overrides, said):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["grpo", f"output_dir={out}", *overrides])
    assert result.exit_code == 2, result.output
    assert said in result.output and result.output.startswith("error: ")
    assert "Traceback" not in result.output and not out.exists()  # nothing started, nothing written


@pytest.mark.parametrize(
    "overrides, said",
    [
        (["data.train_files=[{out}/copy.jsonl,{missing}]"], "missing.jsonl does not exist"),  # the 2nd of 2
        (["reward.function=no_such_module:score"], "cannot be imported: ModuleNotFoundError"),
        (["data.prompt_key=question"], "row 1 has no field 'question'"),
        (["data.val_files=[{out}/copy/val.jsonl,{missing}]"], "data.val_files: {missing} does not exist"),  # 2nd of 2
        (["data.val_files=[{bad}]"], "bad.jsonl, line 2: not JSON"),
        (["data.val_files=[{bad_row}]"], "bad_row.jsonl, row 1 has no field 'prompt'"),
    ],
)
def test_bad_data_or_reward_is_one_error_line_and_exit_code_2_before_ray(tmp_path, overrides, said):
    """What a run on text reads is checked before Ray starts (the preset writes its own data,
    tokenizer and checkpoint first); a problem is one error line naming the file, row or function."""
    out = tmp_path / "run"
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a.=", "answer": "a"}\n{"prompt": "b.=", "answer"\n')
    (tmp_path / "bad_row.jsonl").write_text('{"question": "a.=", "answer": "a"}\n')
    missing = str(tmp_path / "missing.jsonl")
    said = said.replace("{missing}", missing)
    args = [
        o.replace("{missing}", missing).replace("{out}", str(out)).replace("{bad}", str(tmp_path / "bad.jsonl"))
        for o in overrides
    ]
    args = [a.replace("{bad_row}", str(tmp_path / "bad_row.jsonl")) for a in args]
    result = CliRunner().invoke(app, ["grpo", "--config", "cpu_grpo_text", f"output_dir={out}", *args])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]  # after the lines saying what the preset wrote
    assert last.startswith("error: ") and said in last and "Traceback" not in result.output
    assert "starting a local Ray cluster" not in result.output
    assert not (out / "memory_timeline.png").exists()


def test_a_reference_is_launched_only_with_a_kl_term():
    assert not GRPORunConfig().launches_reference  # kl_coef 0 by default
    assert GRPORunConfig.model_validate({"grpo": {"kl_coef": 0.001}}).launches_reference
    assert not GRPORunConfig.model_validate({"reference": None}).launches_reference  # no KL term: fine
    with pytest.raises(ConfigError):
        load_grpo_config(None, ["grpo.kl_coef=0.1", "reference=null"])


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])  # two groups of 4
    a = group_advantages(rewards, 4)
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # unbiased, as verl's torch.std
    x = 0.5 / (std + 1e-6)
    assert a[:4].tolist() == pytest.approx([x, -x, -x, x])
    assert a[4:].tolist() == [0.0] * 4  # a group that all scored the same: no signal
    dr = group_advantages(rewards, 4, scale=False)  # Dr. GRPO: no division by the std
    assert dr.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]


def _full(x: torch.Tensor, P: int, fill: float = 0.0) -> torch.Tensor:
    """(b, R) response positions -> (b, P-1+R) next-token positions: ``P - 1`` prompt positions first."""
    return torch.cat([torch.full((x.shape[0], P - 1), fill), x], dim=1)


def _outputs(new: torch.Tensor, P: int):
    """(logprobs, entropy) as the policy returns them over every next-token position."""
    logprobs = _full(new, P)
    return logprobs, torch.full_like(logprobs, 2.0)


def test_the_loss_clips_each_side_apart_and_normalises_both_ways():
    P = 2
    old = torch.zeros(2, 3)
    new = torch.log(torch.tensor([[1.5, 1.0, 0.5], [1.0, 1.0, 1.0]]))  # ratios 1.5, 1, 0.5 / 1, 1, 1
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # the second response stopped after a token
    # the engine's log-probs of the prompt positions are NaN: nothing off the mask may count
    mb = {"old_logprobs": _full(old, P, math.nan), "advantages": torch.tensor([1.0, -1.0]), "mask": _full(mask, P)}
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.0, response_length=3)
    loss, m = grpo_loss(_outputs(new, P), mb, token_sum=False, **kw)
    # response 0 (A = 1): -min(1.5, 1.28) = -1.28, -1, -min(0.5, 0.8) = -0.5; response 1 (A = -1): +1
    per_response = [(-1.28 - 1.0 - 0.5) / 3, 1.0]
    assert loss.item() == pytest.approx(sum(per_response) / 2)
    assert m["clip_fraction"] == pytest.approx(2 / 4)  # 1.5 above 1.28 and 0.5 below 0.8, of 4 tokens that count
    assert m["entropy"] == pytest.approx(2.0)
    token_sum, _ = grpo_loss(_outputs(new, P), mb, token_sum=True, **kw)
    assert token_sum.item() == pytest.approx((-1.28 - 1.0 - 0.5 + 1.0) / 6)  # summed, over 2 responses x 3 tokens
    wide, _ = grpo_loss(_outputs(new, P), mb, token_sum=False, **{**kw, "clip_high": 0.6})
    assert wide.item() == pytest.approx(((-1.5 - 1.0 - 0.5) / 3 + 1.0) / 2)  # clip higher lets 1.5 through


def test_the_kl_term_is_the_k3_estimator():
    P = 2
    new = torch.tensor([[math.log(0.5)]])
    ref = torch.tensor([[math.log(0.25)]])
    mb = {
        "old_logprobs": _full(new.clone(), P),
        "advantages": torch.zeros(1),
        "mask": _full(torch.ones(1, 1), P),
        "ref_logprobs": _full(ref, P),
    }
    kw = dict(clip_low=0.2, clip_high=0.2, kl_coef=0.5, token_sum=False, response_length=1)
    loss, m = grpo_loss(_outputs(new, P), mb, **kw)
    d = math.log(0.25) - math.log(0.5)
    k3 = math.exp(d) - d - 1
    assert m["kl"] == pytest.approx(k3) and loss.item() == pytest.approx(0.5 * k3)
    same, m_same = grpo_loss(_outputs(new, P), {**mb, "ref_logprobs": _full(new.clone(), P)}, **kw)
    assert m_same["kl"] == 0 and same.item() == 0  # zero when the policy agrees with the reference
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # and never negative, wherever the two stand
        a, b = torch.rand(2, generator=g) * 0.98 + 0.01
        _, m_ab = grpo_loss(
            _outputs(torch.log(a).view(1, 1), P), {**mb, "ref_logprobs": _full(torch.log(b).view(1, 1), P)}, **kw
        )
        assert m_ab["kl"] >= 0


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb", "mlflow"])
def test_a_tracker_that_is_not_installed_is_one_error_line_naming_its_extra(tmp_path, monkeypatch, tracker):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else find_spec(name, *a))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["grpo", f"output_dir={out}", f"logger=[console,{tracker}]"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: logger: {tracker} needs the {tracker} package, which is not installed")
    assert f"pip install 'chatlearn-mem[{tracker}]'" in result.output and not out.exists()  # nothing started


def test_a_tracker_that_cannot_start_is_one_error_line_before_ray(tmp_path):
    pytest.importorskip("mlflow")
    out = tmp_path / "run"
    bad = ["logger=[console,mlflow]", "trackers.mlflow_tracking_uri=nosuchscheme://x"]
    result = CliRunner().invoke(app, ["grpo", f"output_dir={out}", *bad])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: logger: mlflow could not start (") and "leave mlflow out of logger" in last
    assert "starting a local Ray cluster" not in result.output
