"""GRPO on text end to end through a local Ray cluster: prompts from a Parquet file, the preset's
tokenizer, a reward function given by its file path (run in a Ray task); a run stopped by Ctrl-C and
resumed sees exactly the prompts the undisturbed run saw and ends bit-identical; a reward function
that returns NaN stops the run naming the sample, with the newest checkpoint holding every completed
iteration."""

import json

import pytest
from golden_outcome import outcome

from chatlearn_mem_ray import RunInterrupted, load_grpo_config, run_grpo
from chatlearn_mem_ray.inputs.rewards import RewardError
from chatlearn_mem_ray.inputs.text_task import write_task
from chatlearn_mem_ray.job.checkpoints import latest_run_checkpoint, verify_run_checkpoint

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
pq = pytest.importorskip("pyarrow.parquet")

REWARD = '''
import math, os

def score(prompts, responses, answer, **fields):
    """The preset's partial credit; NaN for every response once a file named poison is beside this one."""
    if os.path.exists(os.path.join(os.path.dirname(__file__), "poison")):
        return [math.nan] * len(responses)
    return [sum(a == b for a, b in zip(r, t)) / len(t) - 0.25 * max(0, len(r) - len(t)) for r, t in zip(responses, answer)]
'''
SMALL = ["grpo.iterations=4", "grpo.prompts_per_iteration=8", "grpo.minibatch_size=16", "memory.compare_iterations=0"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A Parquet file of the copy task's prompts and a reward function in a file of its own."""
    import pyarrow as pa

    root = tmp_path_factory.mktemp("text_inputs")
    write_task("copy", root / "rows.jsonl", rows=64, seed=5)
    rows = [json.loads(line) for line in (root / "rows.jsonl").read_text().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), root / "prompts.parquet")
    (root / "reward.py").write_text(REWARD)
    return root


def _args(inputs, out, *more):
    return [
        *SMALL,
        f"output_dir={out}",
        f"data.train_files=[{inputs / 'prompts.parquet'}]",  # there: data.create writes only the tokenizer
        f"reward.function={inputs / 'reward.py'}:score",
        *more,
    ]


@pytest.fixture(scope="module")
def undisturbed(local_ray, inputs, tmp_path_factory):
    out = tmp_path_factory.mktemp("text_undisturbed")
    return run_grpo(load_grpo_config("cpu_grpo_text", _args(inputs, out)), progress=lambda line: None)


def test_a_run_on_text_logs_its_texts_rewards_and_the_rewards_seconds(undisturbed):
    its = undisturbed["iterations"]
    assert len(its) == 4 and undisturbed["status"] == "completed"
    for m in its:
        assert m["samples"] and all(s["prompt"].endswith(".=") for s in m["samples"])
        assert 0 <= m["reward_wait_seconds"] and 0 < m["reward_seconds"] < m["seconds"]
        assert 1 <= m["response_tokens"] <= 5


def test_a_resumed_run_on_text_continues_with_the_prompts_the_undisturbed_run_saw(undisturbed, inputs, tmp_path):
    args = _args(inputs, tmp_path, "checkpoint.every=1", "checkpoint.async_save=false")

    def ctrl_c(svc, it):
        if it == 1:
            raise KeyboardInterrupt

    with pytest.raises(RunInterrupted):
        run_grpo(load_grpo_config("cpu_grpo_text", args), progress=lambda line: None, on_iteration=ctrl_c)
    saved = json.loads((latest_run_checkpoint(tmp_path / "checkpoints") / "run.json").read_text())
    assert saved["loop"]["data_cursor"] == {"epoch": 0, "row": 16}  # 2 iterations of 8 prompts
    log = run_grpo(load_grpo_config("cpu_grpo_text", [*args, "checkpoint.resume=true"]), progress=lambda line: None)
    assert [m["samples"] for m in log["iterations"]] == [m["samples"] for m in undisturbed["iterations"]]
    assert outcome(log) == outcome(undisturbed)


def test_a_reward_that_returns_nan_stops_the_run_with_its_checkpoints_intact(local_ray, inputs, tmp_path):
    (tmp_path / "inputs").mkdir()
    for name in ("prompts.parquet", "reward.py"):
        (tmp_path / "inputs" / name).write_bytes((inputs / name).read_bytes())
    args = _args(tmp_path / "inputs", tmp_path / "run", "checkpoint.every=1")  # saves in the background

    def poison(svc, it):
        if it == 1:  # from iteration 3 on the reward function returns NaN
            (tmp_path / "inputs" / "poison").write_text("")

    with pytest.raises(RewardError, match=r"returned nan for sample 0 \(prompt '.*\.=', response") as e:
        run_grpo(load_grpo_config("cpu_grpo_text", args), progress=lambda line: None, on_iteration=poison)
    assert "reward.py:score" in str(e.value)
    log = json.loads((tmp_path / "run" / "log.json").read_text())
    assert log["status"] == "failed" and len(log["iterations"]) == 2
    newest = latest_run_checkpoint(tmp_path / "run" / "checkpoints")
    assert newest.name == "iter_00000002"  # the save still open when the reward failed was committed
    assert verify_run_checkpoint(newest)["iterations_done"] == 2
