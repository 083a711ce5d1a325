"""What a PPO run leaves behind, without Ray: output_dir checked first, log.json rewritten
atomically after every iteration, kept on failure, NaN and Ctrl-C.

The actors are replaced by a stand-in colocation and a scripted ``PPO.step``; the service, the
job's loop, the log writing and the error handling are the real ones. The real loop's NaN check and Ctrl-C
through Ray are in tests/ray/.
"""

import json
import math
import os

import pytest
from typer.testing import CliRunner

from chatlearn_mem import ConfigError
from chatlearn_mem_cli.app import app
from chatlearn_mem_ray import load_config
from chatlearn_mem_ray.errors import (
    ActorFailedError,
    NonFiniteLossError,
    OutputDirError,
    PhaseTimeoutError,
    RunInterrupted,
    check_finite,
)
from chatlearn_mem_ray.job import prepare, stops
from chatlearn_mem_ray.job import run as job_run
from chatlearn_mem_ray.job.checkpoints import write_json_atomic
from chatlearn_mem_ray.job.prepare import prepare_output_dir
from chatlearn_mem_ray.loops.ppo import PPO, run_ppo
from chatlearn_mem_ray.service import service


class FakeColocation:
    """Stands in for :class:`Colocation`: no Ray, no actors; records whether it was closed."""

    made: list = []

    def __init__(self, cfg, models=(), progress=None, wait_s=0.0):
        self.cfg, self.closed, self.all_actors, self.use_gpu = cfg, False, [], False
        self.wait_s = wait_s
        self.actors_of = {m.name: [] for m in models}
        self.names, self.nodes, self.ranks, self.bundle_of = {}, {}, {}, {}
        FakeColocation.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True

    def call(self, phase, refs, timeout_s=None):
        return {}

    def check_shared_dir(self, directory):
        pass


@pytest.fixture
def fake_run(monkeypatch):
    """Scripted iterations: ``script[i]`` is raised at iteration ``i`` (a callable is called)."""
    FakeColocation.made = []
    script: dict = {}

    def step(self, svc, it):
        action = script.get(it)
        if callable(action):
            action(svc, it)
        elif action is not None:
            raise action
        return {"reward": 0.25 + it / 100, "kl": 0.0, "policy_loss": -0.1, "value_loss": 0.5}

    monkeypatch.setattr(service, "Colocation", FakeColocation)
    monkeypatch.setattr(PPO, "step", step)
    monkeypatch.setattr(
        job_run, "plot_timeline", lambda timeline, path, title, mismatch=None: path.write_bytes(b"\x89PNG fake")
    )
    return script


def _cfg(tmp_path, *overrides):
    return load_config(
        "cpu_tiny", ["ppo.iterations=3", "memory.compare_iterations=0", f"output_dir={tmp_path}", *overrides]
    )


def _log(tmp_path) -> dict:
    return json.loads((tmp_path / "log.json").read_text())


def test_log_json_is_rewritten_after_every_iteration(fake_run, tmp_path):
    seen = []
    fake_run.update({i: (lambda run, it: seen.append(_log(tmp_path))) for i in range(3)})
    log = run_ppo(_cfg(tmp_path), progress=lambda line: None)
    # Before iteration i the log on disk holds the i iterations completed so far.
    assert [len(s["iterations"]) for s in seen] == [0, 1, 2]
    assert [s["status"] for s in seen] == ["starting", "running", "running"]
    on_disk = _log(tmp_path)
    assert on_disk["status"] == "completed" and on_disk == json.loads(json.dumps(log))
    assert [m["iteration"] for m in on_disk["iterations"]] == [1, 2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.json", "memory_timeline.png"]  # no temp file left
    assert FakeColocation.made[0].closed


def test_console_and_log_number_iterations_alike_and_the_comparison_apart(fake_run, tmp_path):
    """One numbering: iterations 1..N of ppo.iterations=N on the console (i/N) and in log.json,
    the manager-off comparison iterations from 1 again (manager off 1/C); iter_<K> holds 1..K."""
    lines = []
    log = run_ppo(
        _cfg(tmp_path, "ppo.iterations=2", "memory.compare_iterations=1", "checkpoint.every=1"), progress=lines.append
    )
    heads = [line.split(" reward ")[0] for line in lines if line.startswith("iter ")]
    assert heads == ["iter   1/2", "iter   2/2", "iter manager off 1/1"]
    assert [(m["iteration"], m["manager_on"]) for m in log["iterations"]] == [(1, True), (2, True), (1, False)]
    assert [c["iterations_done"] for c in log["checkpoints"]] == [1, 2]  # after "iter 1/2", after "iter 2/2"


def test_a_run_numbers_its_iterations_from_1_and_its_comparison_iterations_again(tmp_path, monkeypatch):
    monkeypatch.setattr(service, "Colocation", FakeColocation)
    cfg = _cfg(tmp_path, "ppo.iterations=2")
    loop = PPO(cfg)
    run = service.Service(cfg, loop.models(), loop.phases())
    assert [run.number(i) for i in range(3)] == [(1, False), (2, False), (3, False)]
    run.iterations = [{}, {}]
    run.wake_all()  # the manager off: what follows is the comparison
    assert [run.number(i) for i in range(4)] == [(1, False), (2, False), (1, True), (2, True)]
    with pytest.raises(NonFiniteLossError, match="^manager-off iteration 1, phase 'train_policy': non-finite"):
        check_finite(1, "train_policy", {"loss": math.nan}, comparison=True)


def test_the_progress_line_is_explained_once_before_the_first_iteration(fake_run, tmp_path):
    """pg, vf, kl and reward are said in words once, before the first progress line; a restart
    does not say it again."""
    fake_run[1] = _dies_once(ActorFailedError("critic_0", "values", "the actor process died", died=True))
    lines = []
    run_ppo(_cfg(tmp_path, "checkpoint.max_restarts=1"), progress=lines.append)
    legend = [i for i, line in enumerate(lines) if line.startswith("reward: ")]
    assert legend and legend[0] < min(i for i, line in enumerate(lines) if line.startswith("iter "))
    assert len(legend) == 1 and len(FakeColocation.made) == 2
    assert lines[legend[0]] == (
        "reward: mean task reward of the rollouts, pg: policy-gradient (clipped PPO) loss, "
        "vf: value-function loss, kl: KL(policy || reference) per token, mm (vLLM rollout): max |policy - engine| "
        "log-prob of the sampled tokens; then per phase: seconds/MiB held on the devices"
    )


@pytest.mark.parametrize(
    "error, status",
    [
        (ActorFailedError("critic_0", "generate", "the actor process died (RayActorError)"), "failed"),
        (NonFiniteLossError(3, "train_policy", {"loss": math.nan}), "failed"),
    ],
)
def test_a_failed_run_keeps_the_iterations_it_completed(fake_run, tmp_path, error, status):
    fake_run[2] = error
    lines = []
    with pytest.raises(type(error)):
        run_ppo(_cfg(tmp_path), progress=lines.append)
    log = _log(tmp_path)
    assert log["status"] == status and log["error"] == f"{type(error).__name__}: {error}"
    assert [m["iteration"] for m in log["iterations"]] == [1, 2]
    assert lines[-1] == f"the run stopped; log of its 2 completed iteration(s): {tmp_path / 'log.json'}"
    assert FakeColocation.made[0].closed


def test_ctrl_c_writes_the_log_and_says_where(fake_run, tmp_path):
    fake_run[2] = KeyboardInterrupt()
    with pytest.raises(RunInterrupted) as e:
        run_ppo(_cfg(tmp_path), progress=lambda line: None)
    assert isinstance(e.value, KeyboardInterrupt)  # code that catches KeyboardInterrupt still does
    assert str(e.value) == f"stopped by Ctrl-C after 2 iterations; log: {tmp_path / 'log.json'}"
    assert e.value.iterations == 2
    log = _log(tmp_path)
    assert log["status"] == "interrupted" and len(log["iterations"]) == 2
    assert FakeColocation.made[0].closed  # Ray shut down before the message


def test_ctrl_c_through_the_command_exits_130_with_one_line(fake_run, tmp_path):
    fake_run[1] = KeyboardInterrupt()
    result = CliRunner().invoke(
        app, ["ppo", "ppo.iterations=3", "memory.compare_iterations=0", f"output_dir={tmp_path}"]
    )
    assert result.exit_code == 130, result.output
    assert (
        result.output.strip().splitlines()[-1] == f"stopped by Ctrl-C after 1 iteration; log: {tmp_path / 'log.json'}"
    )
    assert "Traceback" not in result.output


# -- output_dir ----------------------------------------------------------------------------
def test_another_runs_results_are_not_overwritten_unless_asked(fake_run, tmp_path):
    run_ppo(_cfg(tmp_path), progress=lambda line: None)
    before = (tmp_path / "log.json").read_text()
    with pytest.raises(OutputDirError) as e:
        run_ppo(_cfg(tmp_path), progress=lambda line: None)
    assert str(e.value) == (
        f"output_dir {tmp_path} already holds the log of another run (3 iteration(s), "
        "completed); choose another output_dir, or set output_dir_exists=overwrite to replace it"
    )
    assert (tmp_path / "log.json").read_text() == before
    assert len(FakeColocation.made) == 1  # refused before Ray

    fake_run[0] = ActorFailedError("policy_0", "generate", "boom")
    with pytest.raises(ActorFailedError):
        run_ppo(_cfg(tmp_path, "output_dir_exists=overwrite"), progress=lambda line: None)
    assert _log(tmp_path)["status"] == "failed"
    assert not (tmp_path / "memory_timeline.png").exists()  # the old run's picture went with its log


def test_a_log_without_iterations_is_replaced(fake_run, tmp_path):
    """A run that failed before its first iteration (no Ray, a bad address) holds no results."""
    fake_run[0] = ActorFailedError("policy_0", "setup", "boom")
    with pytest.raises(ActorFailedError):
        run_ppo(_cfg(tmp_path), progress=lambda line: None)
    fake_run.clear()
    assert run_ppo(_cfg(tmp_path), progress=lambda line: None)["status"] == "completed"


def test_a_live_run_in_the_same_output_dir_is_refused(tmp_path):
    cfg = _cfg(tmp_path)
    prepare_output_dir(cfg)  # this process: "starting", and alive
    with pytest.raises(OutputDirError, match=f"another run \\(pid {os.getpid()}\\) is writing to output_dir"):
        prepare_output_dir(cfg)


def test_a_foreign_log_json_is_not_replaced(tmp_path):
    (tmp_path / "log.json").write_text("not json")
    with pytest.raises(OutputDirError, match="holds a log.json that is not a run's log"):
        prepare_output_dir(_cfg(tmp_path))
    assert (tmp_path / "log.json").read_text() == "not json"


def test_an_output_dir_that_cannot_be_created_fails_before_ray_with_one_line(fake_run, tmp_path):
    (tmp_path / "file").write_text("")
    result = CliRunner().invoke(app, ["ppo", f"output_dir={tmp_path / 'file' / 'run'}"])
    assert result.exit_code == 1
    assert result.output.strip() == (
        f"error: cannot create output_dir {tmp_path / 'file' / 'run'}: Not a directory; choose another output_dir"
    )
    assert FakeColocation.made == []


def test_an_output_dir_that_cannot_be_written_fails_before_ray(tmp_path, monkeypatch):
    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(prepare, "write_json_atomic", read_only)  # root ignores chmod: fail the write itself
    with pytest.raises(
        OutputDirError, match="cannot write .*log.json: Permission denied; choose a writable output_dir"
    ):
        prepare_output_dir(_cfg(tmp_path))


def test_log_write_is_atomic(tmp_path):
    path = tmp_path / "log.json"
    write_json_atomic(path, {"iterations": [1]})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"iterations": [1, 2], "bad": object()})  # fails half way through the dump
    assert json.loads(path.read_text()) == {"iterations": [1]}
    assert [p.name for p in tmp_path.iterdir()] == ["log.json"]


# -- NaN -----------------------------------------------------------------------------------
def test_a_non_finite_loss_names_iteration_and_phase():
    check_finite(1, "train_policy", {"loss": 0.5, "grad_norm": 1.0})
    with pytest.raises(NonFiniteLossError) as e:
        check_finite(5, "train_critic", {"loss": math.nan, "grad_norm": math.inf, "value_mean": 0.1})
    assert (e.value.iteration, e.value.phase) == (5, "train_critic")
    assert str(e.value).startswith("iteration 5, phase 'train_critic': non-finite loss=nan, grad_norm=inf")


# -- config --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides",
    [
        ["ppo.prompts_per_iteration=1", "ppo.minibatch_size=1", "ppo.response_length=1"],
    ],
)
def test_a_config_whose_advantage_whitening_is_undefined_is_rejected(overrides):
    with pytest.raises(ConfigError) as e:
        load_config("cpu_tiny", overrides)
    assert "ppo.prompts_per_iteration x ppo.response_length must be >= 2, got 1 x 1" in str(e.value)
    assert "standard deviation" in str(e.value)
    load_config("cpu_tiny", ["ppo.prompts_per_iteration=1", "ppo.minibatch_size=1"])  # 8 advantages: defined


def test_the_whitening_rule_matches_the_math():
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the degrees of freedom
        assert torch.isnan(torch.randn(1, 1).std())  # one advantage: what the rule rejects
    assert torch.isfinite(torch.randn(1, 2).std())  # two: what it allows


# -- restarts (checkpoint.max_restarts) ------------------------------------------------------
def _dies_once(error):
    fired = []

    def action(run, it):
        if not fired:
            fired.append(it)
            raise error

    return action


@pytest.mark.parametrize(
    "error",
    [
        ActorFailedError("critic_0", "values", "the actor process died", died=True),
        PhaseTimeoutError("phase 'values' did not finish within 600 s"),
    ],
    ids=["died", "timeout"],
)
def test_a_dead_actor_or_hung_phase_restarts_every_actor_within_max_restarts(fake_run, tmp_path, error):
    fake_run[1] = _dies_once(error)
    lines = []
    log = run_ppo(_cfg(tmp_path, "checkpoint.max_restarts=1"), progress=lines.append)
    assert [m["iteration"] for m in log["iterations"]] == [1, 2, 3]
    assert len(FakeColocation.made) == 2 and all(c.closed for c in FakeColocation.made)  # torn down, started again
    [restart] = log["restarts"]
    assert restart["number"] == 1 and restart["resumed_from"] is None and restart["iterations_redone"] == 1
    assert any(
        line.startswith("restart 1 of 1: ")
        and "continuing from the beginning: 1 completed iteration(s) lost and redone" in line
        for line in lines
    ), lines
    assert _log(tmp_path)["restarts"] == log["restarts"]


def test_past_max_restarts_the_run_stops_naming_actor_and_phase(fake_run, tmp_path):
    died = ActorFailedError("critic_0", "values", "the actor process died", died=True)
    fake_run[1] = died
    lines = []
    with pytest.raises(ActorFailedError) as e:
        run_ppo(_cfg(tmp_path, "checkpoint.max_restarts=2"), progress=lines.append)
    assert e.value is died and "critic_0" in str(e.value) and "'values'" in str(e.value)
    assert len(FakeColocation.made) == 3
    assert "no restarts left (checkpoint.max_restarts=2); the run stops" in lines
    log = _log(tmp_path)
    assert log["status"] == "failed" and [r["number"] for r in log["restarts"]] == [1, 2]


def test_an_exception_in_an_actors_code_is_not_retried(fake_run, tmp_path):
    fake_run[1] = ActorFailedError("critic_0", "values", "ValueError: bad shape")  # died=False
    with pytest.raises(ActorFailedError):
        run_ppo(_cfg(tmp_path, "checkpoint.max_restarts=3"), progress=lambda line: None)
    assert len(FakeColocation.made) == 1 and _log(tmp_path)["restarts"] == []


def test_after_a_lost_node_the_restart_waits_for_room_then_goes_on_smaller_when_elastic(
    fake_run, tmp_path, monkeypatch
):
    """A rank's node is lost in iteration 2: the restart's Colocation may wait ray.node_wait_s for
    room (the first one does not wait); when the room never comes back, checkpoint.elastic goes on
    with the data-parallel size the live nodes hold, says that results now differ, and logs it;
    without elastic the ResourceError stops the run."""
    from chatlearn_mem_ray.errors import ResourceError

    class ShrunkCluster(FakeColocation):
        def __enter__(self):
            if self.wait_s and self.cfg.parallel.world_size > 1:  # the lost node never came back
                raise ResourceError("not enough resources for this run:\n  2 rank(s) need 2 CPUs but ... has 1")
            return self

    monkeypatch.setattr(service, "Colocation", ShrunkCluster)
    monkeypatch.setattr(stops, "cluster_resources", lambda: {"CPU": 1.0})

    def lose_a_node(run, it):
        if len(FakeColocation.made) == 1:  # the first attempt only
            raise ActorFailedError("policy_1", "generate", "the actor process died", died=True)

    fake_run[1] = lose_a_node
    base = ["parallel.world_size=2", "ppo.prompts_per_iteration=16", "checkpoint.max_restarts=1", "ray.node_wait_s=7"]
    lines = []
    log = run_ppo(_cfg(tmp_path, *base, "checkpoint.elastic=true"), progress=lines.append)
    made = FakeColocation.made
    assert [(c.wait_s, c.cfg.parallel.world_size) for c in made] == [(0.0, 2), (7.0, 2), (7.0, 1)]
    assert log["status"] == "completed" and log["config"]["parallel"]["world_size"] == 1
    assert log["restarts"][0]["world_size"] == 1
    assert any(
        line.startswith(
            "checkpoint.elastic: the cluster holds 1 of 2 rank(s) after waiting "
            "ray.node_wait_s=7 s; going on with data-parallel size 1 (was 2)"
        )
        and line.endswith("From here the results differ from those of the original layout")
        for line in lines
    )

    FakeColocation.made = []
    with pytest.raises(ResourceError):
        run_ppo(_cfg(tmp_path / "strict", *base), progress=lambda line: None)
    assert [c.cfg.parallel.world_size for c in FakeColocation.made] == [2, 2]
