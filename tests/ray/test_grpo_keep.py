"""A GRPO run a user keeps, end to end through a local Ray cluster on ``cpu_grpo_text``: held-out
validation whose reward rises, the policy exported as Hugging Face directories that ``transformers``
loads and greedy-decodes as the trainer did and whose tensors are the trainer's bit for bit, the
same call from a loop's own code, all four loggers read back with their own readers, and a run
stopped by Ctrl-C and resumed that repeats no validation and continues the same tracker runs; then
``cpu_grpo`` learning with each loss and sampling option (slow)."""

import json

import pytest
import torch
from trackers_readback import mlflow_run, tensorboard_run, wandb_offline_run

from chatlearn_mem_ray import RunInterrupted, load_grpo_config, run_grpo
from chatlearn_mem_ray.actors.modeling import weights_digest
from chatlearn_mem_ray.job.trackers import flat_metrics

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
for module in ("tensorboard", "wandb", "mlflow"):
    pytest.importorskip(module, reason=f"the [{module}] extra is not installed")

KEEP = [
    "grpo.iterations=20",
    "memory.compare_iterations=0",  # the final weights are iteration 20's: the last export's
    "export.hf_every=10",
    "checkpoint.every=5",
    "checkpoint.async_save=false",
    "tokenizer.log_samples=16",  # every held-out prompt's greedy response in the log
    "logger=[console,tensorboard,wandb,mlflow]",
]


def _megatron_digest(directory, config) -> str:
    """The exported Hugging Face tensors put back in megatron's names and layout (one rank), hashed
    as the trainer hashes its own weights (``final_weights``)."""
    from safetensors.torch import load_file

    from chatlearn_mem.models import hf

    tensors = load_file(str(directory / "model.safetensors"))
    state = {
        e.megatron: hf._join_megatron(e, [tensors[n] for n in e.hf], config, 1) for e in hf._entries(config, hf.LLAMA)
    }
    return weights_digest(state)


@pytest.fixture(scope="module")
def kept(local_ray, tmp_path_factory):
    """cpu_grpo_text stopped by Ctrl-C after iteration 12 and resumed to 20; a loop's own export
    after iteration 3; then resumed once more, finished, to export again (``export.on_resume``)."""
    out = tmp_path_factory.mktemp("kept")
    cfg = load_grpo_config("cpu_grpo_text", [*KEEP, f"output_dir={out}"])
    lines, mine = [], []

    def hooks(svc, it):
        if it == 2:
            mine.append(svc.export_hf("policy", out / "mine", tokenizer=cfg.tokenizer_dir))  # the Python API
        if it == 11:
            raise KeyboardInterrupt

    with pytest.raises(RunInterrupted):
        run_grpo(cfg, progress=lines.append, on_iteration=hooks)
    first = json.loads((out / "log.json").read_text())
    resumed = load_grpo_config("cpu_grpo_text", [*KEEP, f"output_dir={out}", "checkpoint.resume=true"])
    log = run_grpo(resumed, progress=lines.append)
    again = load_grpo_config(
        "cpu_grpo_text", [*KEEP, f"output_dir={out}", "checkpoint.resume=true", "export.on_resume=true"]
    )
    (out / "hf" / "iter_00000020" / "model.safetensors").unlink()  # the finished run's export, damaged
    finished = run_grpo(again, progress=lines.append)
    return {"out": out, "first": first, "log": log, "finished": finished, "lines": lines, "cfg": resumed, "mine": mine}


def test_validation_runs_on_held_out_prompts_and_its_reward_rises(kept):
    log, lines = kept["log"], kept["lines"]
    vals = log["validations"]
    assert [v["iteration"] for v in vals] == [0, 10, 20]  # before training, every 10; none repeated on resume
    assert all(v["val/prompts"] == 16 for v in vals)
    assert vals[-1]["val/reward"] > vals[0]["val/reward"] + 0.3, [round(v["val/reward"], 3) for v in vals]
    assert all(set(v) >= {"val/reward", "val/reward_exact", "val/pass@1", "val/response_tokens"} for v in vals)
    held_out = {json.loads(line)["prompt"] for line in (kept["out"] / "copy" / "val.jsonl").read_text().splitlines()}
    trained = {s["prompt"] for m in log["iterations"] for s in m.get("samples", [])}
    assert len(held_out) == 16 and not held_out & trained  # never trained on
    assert {s["prompt"] for m in log["iterations"] for v in m.get("validations", []) for s in v["samples"]} == held_out
    validates = [p for p in log["memory_timeline"] if p["phase"] == "validate"]
    assert [p["iteration"] for p in validates] == [1, 10, 20]  # the one before training belongs to iteration 1
    assert all(set(p["active"]) == {"rollout"} and p["seconds"] > 0 for p in validates)  # only the rollout awake
    assert sum("validation after iteration 10: val/reward" in line for line in lines) == 1
    assert all(
        "phase_seconds" in m and "validate" in m["phase_seconds"]
        for m in log["iterations"]
        if m["iteration"] in (10, 20)
    )


def test_the_exports_are_the_trainers_weights_and_transformers_decodes_as_the_trainer(kept):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log, out, cfg = kept["log"], kept["out"], kept["cfg"]
    assert [e["iteration"] for e in log["exports"]] == [10, 20]
    last = out / "hf" / "iter_00000020"
    assert _megatron_digest(last, cfg.policy) == log["final_weights"]["policy_0"]  # bit for bit
    files = {p.name for p in last.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "chatlearn_export.json",
    } <= files
    assert not list((out / "hf").glob(".tmp.*"))  # written under a temporary name, renamed whole
    tok = AutoTokenizer.from_pretrained(str(last))
    generation = json.loads((last / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tok.eos_token_id == 1 and generation["pad_token_id"] == tok.pad_token_id
    model = AutoModelForCausalLM.from_pretrained(str(last))
    assert model.dtype == torch.float32  # the run's precision
    val = log["iterations"][-1]["validations"][-1]  # greedy responses of the trainer's weights after iteration 20
    assert val["iteration"] == 20 and len(val["samples"]) == 16
    assert sum(bool(s["response"]) for s in val["samples"]) >= 4  # responses, not only EOS: a comparison that can fail
    for s in val["samples"]:
        ids = tok(s["prompt"], add_special_tokens=False, return_tensors="pt").input_ids
        new = model.generate(ids, max_new_tokens=5, do_sample=False)[0, ids.shape[1] :].tolist()
        text = tok.decode(new[:-1] if new and new[-1] == tok.eos_token_id else new).split(".")[0]
        assert text == s["response"], (s, new)
    [mine] = kept["mine"]
    assert json.loads((out / "mine" / "chatlearn_export.json").read_text())["digest"] == mine["digest"]
    assert mine["tensors"] == 20 and mine["digest"] != log["exports"][0]["digest"]  # after iteration 3
    exported = {m["iteration"]: m["export_seconds"] for m in log["iterations"] if "export_seconds" in m}
    assert list(exported) == [10, 20] and all(0 < s < 60 for s in exported.values())


def test_a_finished_run_resumed_exports_again_only_when_asked(kept):
    finished = kept["finished"]
    assert len(finished["iterations"]) == 20 and finished["exports"][-1]["iteration"] == 20
    assert (kept["out"] / "hf" / "iter_00000020" / "model.safetensors").is_file()  # written again
    assert finished["exports"][-1]["digest"] == kept["log"]["exports"][-1]["digest"]  # the same weights


def test_every_metric_validation_and_the_picture_reach_each_tracker(kept):
    log, out, first = kept["log"], kept["out"], kept["first"]
    its = log["iterations"]
    assert first["trackers"] == log["trackers"] and set(log["trackers"]) == {"wandb", "mlflow"}  # continued
    keys = {k for m in its for k in flat_metrics(m)}
    val_keys = {k for v in log["validations"] for k in v if k.startswith("val/")}
    assert {"reward", "policy_loss", "phase_seconds/train", "phase_colocated_bytes/generate"} <= keys

    tb = tensorboard_run(out / "tensorboard")
    assert keys | val_keys <= set(tb["scalars"]), sorted(keys | val_keys - set(tb["scalars"]))
    assert [s for s, _ in tb["scalars"]["reward"]] == list(range(1, 21))  # the resumed half's steps follow on
    assert [s for s, _ in tb["scalars"]["val/reward"]] == [0, 10, 20]
    assert tb["images"]["memory_timeline"] and "config/text_summary" in tb["texts"]

    wb = wandb_offline_run(out)
    assert set(wb["ids"]) == {log["trackers"]["wandb"]}  # one W&B run, resumed in a second directory
    logged = {k for row in wb["history"] for k in row}
    assert keys | val_keys <= logged, sorted(keys | val_keys - logged)
    steps = sorted({row["_step"] for row in wb["history"] if "reward" in row})
    assert steps == list(range(1, 21)) and wb["images"] and wb["config"]["grpo.iterations"] == 20

    mf = mlflow_run(out, log["trackers"]["mlflow"])
    names = {k.replace("@", "_at_") for k in keys | val_keys}
    assert names <= set(mf["metrics"]), sorted(names - set(mf["metrics"]))
    assert sorted({s for s, _ in mf["metrics"]["reward"]}) == list(range(1, 21))  # 11, 12 logged twice (redone)
    assert "memory_timeline.png" in mf["artifacts"] and mf["params"]["grpo.iterations"] == "20"
    for m in its:  # the values, not only the names
        assert dict(mf["metrics"]["reward"])[m["iteration"]] == pytest.approx(m["reward"])


@pytest.mark.slow  # a second world of two ranks: about a minute more
def test_a_tensor_parallel_policy_exports_its_shards_merged_bit_for_bit(local_ray, tmp_path):
    """TP=2: each rank streams its own shards; the export, cut back into each rank's shards, is
    what each rank holds (its ``final_weights``)."""
    from safetensors.torch import load_file

    from chatlearn_mem.models import hf

    tp2 = ["parallel.world_size=2", "parallel.tensor_model_parallel_size=2", "grpo.iterations=2"]
    cfg = load_grpo_config("cpu_grpo_text", [*tp2, "memory.compare_iterations=0", f"output_dir={tmp_path}"])
    log = run_grpo(cfg, progress=lambda line: None)
    tensors = load_file(str(tmp_path / "hf" / "iter_00000002" / "model.safetensors"))
    for rank in range(2):
        state = {}
        for e in hf._entries(cfg.policy, hf.LLAMA):
            pieces = [hf._read_shard(_Slice(tensors[n]), tuple(tensors[n].shape), e.kind, 2, rank) for n in e.hf]
            state[e.megatron] = hf._join_megatron(e, pieces, cfg.policy, 2)
        assert weights_digest(state) == log["final_weights"][f"policy_{rank}"], rank


class _Slice:
    """A tensor as safetensors' ``get_slice`` serves it (indexing only)."""

    def __init__(self, t):
        self.t = t

    def __getitem__(self, index):
        return self.t[index]


OPTIONS = {
    "token_mean": ["grpo.loss_agg=token_mean"],
    "gspo": ["grpo.policy_loss=gspo"],
    "rloo": ["grpo.estimator=rloo"],
    "dynamic_sampling": ["grpo.dynamic_sampling=true"],
}


@pytest.mark.slow  # one cpu_grpo run each, about a minute
@pytest.mark.parametrize("option", OPTIONS)
def test_cpu_grpo_learns_with_each_option(local_ray, tmp_path, option):
    cfg = load_grpo_config("cpu_grpo", [*OPTIONS[option], "memory.compare_iterations=0", f"output_dir={tmp_path}"])
    log = run_grpo(cfg, progress=lambda line: None)
    its = log["iterations"]
    mean = lambda ms: sum(m["reward"] for m in ms) / len(ms)  # noqa: E731
    assert mean(its[-5:]) > mean(its[:5]) + 0.3, [round(m["reward"], 3) for m in its]  # as the default run learns
    if option == "dynamic_sampling":
        assert all(1 <= m["sampling_rounds"] <= 4 for m in its) and any(m["sampling_rounds"] > 1 for m in its)
        assert all(m["dropped_groups"] >= 0 and m["filled_groups"] >= 0 for m in its)
