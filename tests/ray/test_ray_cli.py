"""Ray as a user meets it, in subprocesses: joining a head started with `ray start` (token
authentication on, as Ray 2.5x+ does when a token exists), and Ctrl-C in the middle of a run. Each test starts its own Ray processes and ends them (by pid, never `ray stop`: other Ray
clusters on the machine are not ours)."""

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray
pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")
from chatlearn_mem_ray.job.checkpoints import list_run_checkpoints, read_run_state  # noqa: E402

RUN = [sys.executable, "-m", "chatlearn_mem_cli", "ppo", "memory.compare_iterations=0", "ray.phase_timeout_s=300"]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # no RAY_ADDRESS, no auth mode
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_processes_naming(text: str) -> None:
    """End every process whose command line names ``text`` (this test's own Ray temp dir)."""
    procs = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(text in arg for arg in p.info["cmdline"] or []):
                procs.append(p)
                p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=3)
    for p in alive:
        p.kill()


@pytest.fixture
def ray_start_head():
    """`ray start --head` with token authentication, its own temp dir, port and token file."""
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    token = Path(temp) / "auth_token"
    token.write_text(uuid.uuid4().hex + uuid.uuid4().hex)
    port = _free_port()
    try:
        ray_cli = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
        out = subprocess.run(
            [
                ray_cli,
                "start",
                "--head",
                f"--port={port}",
                f"--temp-dir={temp}",
                "--num-cpus=2",
                "--include-dashboard=false",
                "--disable-usage-stats",
            ],
            env=_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token)),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        yield f"127.0.0.1:{port}", token
    finally:
        _kill_processes_naming(temp)
        shutil.rmtree(temp, ignore_errors=True)


JOIN = """
import sys
import ray
from chatlearn_mem_ray.service.colocation import Colocation
from chatlearn_mem_ray import load_config
from chatlearn_mem_ray.loops.ppo import PPO

cfg = load_config("cpu_tiny", sys.argv[1:])
colo = Colocation(cfg, PPO(cfg).models(), progress=print)
colo._place = lambda: None  # the actors are placed as on any cluster (tests/ray/test_ppo_ray.py)
with colo:
    print("cpus", ray.cluster_resources()["CPU"])
    print("task", ray.get(ray.remote(lambda: 6 * 7).remote()))  # a worker of the head runs it
print("connected after", ray.is_initialized())
"""


def test_joining_a_ray_start_head_with_token_auth(ray_start_head):
    """The shipped config (it sets ray.num_cpus) joins by RAY_ADDRESS (as `ray job submit` sets it)
    and by ray.address. Before: "num_cpus and num_gpus must not be provided", and without
    RAY_AUTH_MODE=token a bare traceback after retrying for minutes. The whole PPO run on a
    joined cluster is the same as on the local one (tests/ray/test_ppo_ray.py)."""
    address, token = ray_start_head
    for args, env, source in (
        ([], {"RAY_ADDRESS": address}, "RAY_ADDRESS"),
        ([f"ray.address={address}"], {}, "ray.address"),
    ):
        out = subprocess.run(
            [sys.executable, "-c", JOIN, *args],
            env=_env(RAY_AUTH_TOKEN_PATH=str(token), **env),
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert out.stdout.splitlines() == [
            f"joined the Ray cluster at {address} (from {source}); ray.num_cpus=2 ignored (it sizes a local cluster)",
            "cpus 2.0",
            "task 42",
            "connected after False",
        ], out.stdout + out.stderr


def _popen_with_ctrl_c(*args, **kwargs) -> subprocess.Popen:
    """``subprocess.Popen`` whose child takes Ctrl-C as a terminal's foreground job does. A process
    started in the background of a non-interactive shell (``cmd &``) has SIGINT ignored, its children
    inherit that through exec, and Python then leaves it ignored: a CI stream started that way ran
    the whole PPO run through the test's Ctrl-C (exit 0). A handler set here is reset to the default
    in the child by exec, where Python turns it into KeyboardInterrupt."""
    ignored = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(*args, **kwargs)
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def _signal_after_first_iteration(args: list, send) -> tuple[int, list, str, list]:
    """Run ``chatlearn-mem ppo`` in a new session; once iteration 1 is printed, call ``send(pid)``.
    Returns the exit code, the Ray processes the run had started, its stderr and its stdout lines."""
    proc = _popen_with_ctrl_c(
        [*RUN, *args], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    lines: queue.Queue = queue.Queue()
    out: list[str] = []
    threading.Thread(target=lambda: [(lines.put(line), out.append(line)) for line in proc.stdout], daemon=True).start()
    try:
        deadline = time.monotonic() + 240
        while True:
            line = lines.get(timeout=max(1.0, deadline - time.monotonic()))
            if line.startswith("iter   1/50"):
                break
        ray_processes = psutil.Process(proc.pid).children(recursive=True)
        assert ray_processes  # the local cluster: GCS, raylet, workers
        send(proc.pid)
        proc.wait(timeout=180)
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, ray_processes, err, out


def test_ctrl_c_stops_the_run_keeps_the_log_and_shuts_ray_down(tmp_path):
    # A new session, signalled as a whole: what a terminal's Ctrl-C does to the foreground group.
    # Checkpoints every iteration: the Ctrl-C comes while one is being written in the background.
    returncode, ray_processes, err, _ = _signal_after_first_iteration(
        ["ppo.iterations=50", f"output_dir={tmp_path}", "checkpoint.every=1"], lambda pid: os.killpg(pid, signal.SIGINT)
    )
    assert returncode == 130, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("stopped by Ctrl-C after ") and last.endswith(f"; log: {tmp_path / 'log.json'}"), err
    assert "Traceback" not in err, err
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["status"] == "interrupted" and len(log["iterations"]) >= 1
    done = len(log["iterations"])
    assert last.startswith(f"stopped by Ctrl-C after {done} iteration")
    _, alive = psutil.wait_procs(ray_processes, timeout=30)
    assert not alive, [p.info if hasattr(p, "info") else p.pid for p in alive]  # Ray was shut down
    # Whatever the Ctrl-C cut short is not a checkpoint; every complete one can be resumed.
    complete = list_run_checkpoints(tmp_path / "checkpoints")
    assert len(complete) <= 2 and all(n <= done for n, _ in complete), (complete, done)  # keep_last=2
    for n, path in complete:
        assert read_run_state(path)["iterations_done"] == n


def test_sigterm_stops_at_the_end_of_the_iteration_saves_and_exits_143(tmp_path):
    """What a scheduler does before preempting: SIGTERM to the driver. No crash dump from Ray's own
    handler, the iteration ends, a checkpoint of every completed iteration is saved (checkpoints
    every 3, so the one taken on SIGTERM is its own), Ray is shut down, exit 143 with one line
    saying how far the run got and how to go on."""
    returncode, ray_processes, err, out = _signal_after_first_iteration(
        ["ppo.iterations=50", f"output_dir={tmp_path}", "checkpoint.every=3"], lambda pid: os.kill(pid, signal.SIGTERM)
    )  # the driver only, as Kubernetes signals a container's first process
    assert returncode == 143, err
    assert "SIGTERM received at time" not in err and "PC: @" not in err and "Traceback" not in err, err
    assert any(line.startswith("SIGTERM received: the run stops once this iteration ends") for line in out), out
    log = json.loads((tmp_path / "log.json").read_text())
    done = len(log["iterations"])
    assert log["status"] == "terminated" and 1 <= done < 50
    newest = list_run_checkpoints(tmp_path / "checkpoints")[-1]
    assert newest[0] == done and read_run_state(newest[1])["iterations_done"] == done
    last = err.strip().splitlines()[-1]
    assert (
        last.startswith(f"stopped by SIGTERM after {done} iteration")
        and f"newest checkpoint iter_{done:08d} (" in last
        and "continue with --resume" in last
    ), err
    if done % 3:  # not a save point of checkpoint.every: the checkpoint was taken on SIGTERM
        assert f"(saved on SIGTERM, it holds all {done} iterations)" in last, err
    # the console is the run's: no notice of Ray's own (token authentication), none of megatron's
    # (0.19's "GPTModel IS DEPRECATED"), no library warning from an actor
    console = "".join(out) + err
    for noise in ("Token authentication", "IS DEPRECATED", "UserWarning", "(TrainerActor", "(InferenceActor"):
        assert noise not in console, console
    _, alive = psutil.wait_procs(ray_processes, timeout=30)
    assert not alive, [p.pid for p in alive]  # no Ray process of the run is left
