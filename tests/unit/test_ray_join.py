"""Which Ray cluster a run uses and how it joins one, decided without starting Ray.

The real joins (a `ray start` head with token authentication, an unreachable address through the
command line) are in tests/ray/test_ray_join_real.py.
"""

import os
import socket
import sys
import types

import pytest

from chatlearn_mem_ray import load_config
from chatlearn_mem_ray.actors import connect
from chatlearn_mem_ray.actors.connect import (
    ClusterTarget,
    init_kwargs,
    join_environment,
    probe_address,
    resolve_address,
)
from chatlearn_mem_ray.errors import ClusterConnectionError
from chatlearn_mem_ray.loops.ppo import PPO
from chatlearn_mem_ray.service.colocation import Colocation

LIVE = "10.0.0.7:6379"


@pytest.fixture
def recorded(tmp_path):
    """A `ray_current_cluster` file as `ray start` leaves it (its head may be alive or long gone)."""
    path = tmp_path / "ray_current_cluster"
    path.write_text(LIVE + "\n")
    return path


@pytest.mark.parametrize(
    "address, env, expected, source",
    [
        (None, {}, None, "default"),
        (None, {"RAY_ADDRESS": "1.2.3.4:6379"}, "1.2.3.4:6379", "RAY_ADDRESS"),  # as `ray job submit` sets it
        (None, {"RAY_ADDRESS": "local"}, None, "RAY_ADDRESS=local"),
        (None, {"RAY_ADDRESS": "  "}, None, "default"),
        ("local", {"RAY_ADDRESS": "1.2.3.4:6379"}, None, "ray.address=local"),
        ("auto", {"RAY_ADDRESS": "1.2.3.4:6379"}, "1.2.3.4:6379", "RAY_ADDRESS"),
        ("auto", {}, LIVE, "the latest `ray start`"),
        (None, {"RAY_ADDRESS": "auto"}, LIVE, "the latest `ray start`"),
        ("5.6.7.8:6379", {"RAY_ADDRESS": "1.2.3.4:6379"}, "5.6.7.8:6379", "ray.address"),
        ("ray://5.6.7.8:10001", {}, "ray://5.6.7.8:10001", "ray.address"),
    ],
)
def test_address_resolution(recorded, address, env, expected, source):
    target = resolve_address(address, env, recorded)
    assert target.address == expected
    assert target.source.startswith(source), target


def test_default_never_joins_a_head_left_by_ray_start(recorded):
    """The README's promise: without ray.address (and RAY_ADDRESS) a local cluster is started,
    even when `ray start` recorded a head, live or stale (ray.init() would join it)."""
    assert resolve_address(None, {}, recorded).local


def test_auto_without_any_cluster_says_what_to_do(tmp_path):
    missing = tmp_path / "ray_current_cluster"
    with pytest.raises(ClusterConnectionError) as e:
        resolve_address("auto", {}, missing)
    msg = str(e.value)
    assert "ray.address=auto but no Ray cluster was found" in msg
    assert str(missing) in msg and "ray start --head" in msg and "leave ray.address unset" in msg


def test_joining_never_passes_resource_counts():
    """Ray refuses num_cpus/num_gpus/resources when joining ("must not be provided"); the
    shipped config sets ray.num_cpus, which sizes only a local cluster."""
    cfg = load_config("cpu_tiny")
    assert cfg.ray.num_cpus == 2
    local = init_kwargs(cfg, ClusterTarget(None, "default"))
    assert local["address"] == "local" and local["num_cpus"] == 2  # "local": not RAY_ADDRESS, not a `ray start` head
    for address in ("1.2.3.4:6379", "ray://1.2.3.4:10001"):
        kwargs = init_kwargs(cfg, ClusterTarget(address, "ray.address"))
        assert kwargs["address"] == address
        assert not {"num_cpus", "num_gpus", "resources", "object_store_memory"} & set(kwargs), kwargs


@pytest.mark.parametrize(
    "address, host_port",
    [
        ("10.0.0.1:6379", ("10.0.0.1", 6379)),
        ("ray://head:10001", ("head", 10001)),
        ("[::1]:6379", ("::1", 6379)),
    ],
)
def test_host_port(address, host_port):
    assert ClusterTarget(address, "ray.address").host_port == host_port


@pytest.mark.parametrize("address", ["head", "head:", "ray://head:port", ":6379"])
def test_malformed_address_is_one_clear_error(address):
    with pytest.raises(ClusterConnectionError, match=r"is not host:port \(e\.g\. 10\.0\.0\.1:6379"):
        ClusterTarget(address, "ray.address").host_port


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_probe_answers_for_a_listening_port_and_says_why_not_otherwise():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert probe_address("127.0.0.1", server.getsockname()[1], 5.0) is None
    assert probe_address("127.0.0.1", _closed_port(), 5.0) == "Connection refused"
    assert probe_address("no-such-host.invalid", 6379, 5.0)  # name resolution failed, said in words


def test_join_environment_bounds_ray_and_keeps_what_the_user_set():
    target = ClusterTarget("203.0.113.5:6379", "ray.address")  # TEST-NET-3: never this machine
    env = join_environment(target, 20.0, {"RAY_AUTH_TOKEN_PATH": "/nonexistent"})
    assert env == {
        "RAY_gcs_rpc_server_connect_timeout_s": "7",
        "RAY_py_gcs_connect_timeout_s": "7",
        "RAY_gcs_server_port_wait_time_s": "1",
    }
    env = join_environment(target, 20.0, {"RAY_py_gcs_connect_timeout_s": "60", "RAY_AUTH_TOKEN_PATH": "/nonexistent"})
    assert "RAY_py_gcs_connect_timeout_s" not in env


def test_token_auth_is_turned_on_for_a_head_on_this_machine_only():
    """`ray start` enables token authentication when ~/.ray/auth_token exists (Ray 2.5x+); a
    driver given an explicit address does not send the token unless RAY_AUTH_MODE=token."""
    local = ClusterTarget("127.0.0.1:6379", "ray.address")
    with_token = {"RAY_AUTH_TOKEN": "secret"}
    assert join_environment(local, 20.0, with_token)["RAY_AUTH_MODE"] == "token"
    remote = ClusterTarget("203.0.113.5:6379", "ray.address")
    assert "RAY_AUTH_MODE" not in join_environment(remote, 20.0, with_token)  # the token stays here
    assert "RAY_AUTH_MODE" not in join_environment(local, 20.0, {**with_token, "RAY_AUTH_MODE": "disabled"})
    assert "RAY_AUTH_MODE" not in join_environment(local, 20.0, {"RAY_AUTH_TOKEN_PATH": "/nonexistent"})


# -- Colocation._start with a stand-in for the ray module -----------------------------------
class FakeRay(types.SimpleNamespace):
    def __init__(self, fail=None):
        super().__init__(calls=[], env_during_init=None, fail=fail, connected=False)

    def is_initialized(self):
        return self.connected

    def init(self, **kwargs):
        self.calls.append(kwargs)
        self.env_during_init = {k: v for k, v in os.environ.items() if k.startswith("RAY_")}
        if self.fail is not None:
            raise self.fail
        self.connected = True

    def cluster_resources(self):
        return {"CPU": 4.0}

    def shutdown(self):
        self.connected = False


@pytest.fixture
def listening():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield f"127.0.0.1:{server.getsockname()[1]}"


def _start(monkeypatch, fake, overrides, env=None):
    monkeypatch.setattr(connect, "import_ray", lambda: fake)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)  # the lines name a local cluster's GPUs
    monkeypatch.setattr(connect, "_reload_ray_config", lambda: None)
    monkeypatch.setattr(Colocation, "_place", lambda self: None)
    for k in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_gcs_rpc_server_connect_timeout_s"):
        monkeypatch.delenv(k, raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    lines = []
    cfg = load_config("cpu_tiny", overrides)
    colo = Colocation(cfg, PPO(cfg).models(), progress=lines.append)
    colo._start()
    return colo, lines


def test_ray_address_from_the_environment_is_joined_without_resource_counts(monkeypatch, listening):
    fake = FakeRay()
    colo, lines = _start(monkeypatch, fake, [], {"RAY_ADDRESS": listening, "RAY_AUTH_TOKEN": "t"})
    assert fake.calls == [{"address": listening, "logging_level": "WARNING"}]
    assert lines == [
        f"joined the Ray cluster at {listening} (from RAY_ADDRESS); ray.num_cpus=2 ignored (it sizes a local cluster)"
    ]
    assert fake.env_during_init["RAY_AUTH_MODE"] == "token"  # a head on this machine, a token exists
    assert fake.env_during_init["RAY_gcs_server_port_wait_time_s"] == "1"
    assert "RAY_AUTH_MODE" not in os.environ and "RAY_gcs_server_port_wait_time_s" not in os.environ  # restored
    colo.close()
    assert not fake.connected


def test_an_unreachable_address_fails_before_ray_init(monkeypatch):
    fake = FakeRay()
    address = f"127.0.0.1:{_closed_port()}"
    with pytest.raises(ClusterConnectionError) as e:
        _start(monkeypatch, fake, [f"ray.address={address}"])
    assert fake.calls == []
    assert str(e.value).startswith(f"cannot reach the Ray cluster at {address} (from ray.address): Connection refused")


def test_a_stale_ray_start_head_is_named(monkeypatch, tmp_path):
    fake = FakeRay()
    (tmp_path / "ray").mkdir()
    address = f"127.0.0.1:{_closed_port()}"
    (tmp_path / "ray" / "ray_current_cluster").write_text(address)
    monkeypatch.setattr(connect, "current_cluster_file", lambda: tmp_path / "ray" / "ray_current_cluster")
    with pytest.raises(ClusterConnectionError) as e:
        _start(monkeypatch, fake, ["ray.address=auto"])
    assert f"cannot reach the Ray cluster at {address} (from the latest `ray start`" in str(e.value)
    assert "that head has probably stopped" in str(e.value)


def test_a_refused_token_says_what_to_set(monkeypatch, listening):
    cause = RuntimeError(
        "Failed to connect to GCS. Last connection error: ray.exceptions.AuthenticationError: "
        "RPC error: InvalidAuthToken: Authentication token is missing or incorrect."
    )
    fail = ConnectionError(f"Failed to connect to Ray cluster at {listening}")
    fail.__cause__ = cause
    with pytest.raises(ClusterConnectionError) as e:
        _start(monkeypatch, FakeRay(fail), [f"ray.address={listening}"], {"RAY_AUTH_TOKEN_PATH": "/nonexistent"})
    msg = str(e.value)
    assert msg.startswith(f"the Ray cluster at {listening} (from ray.address) requires token authentication")
    assert "set RAY_AUTH_MODE=token" in msg and "RAY_AUTH_TOKEN" in msg and "ray get-auth-token" in msg


def test_a_port_that_is_no_ray_head_fails_with_one_line(monkeypatch, listening):
    fail = ConnectionError(f"Failed to connect to Ray cluster at {listening}")
    with pytest.raises(ClusterConnectionError) as e:
        _start(monkeypatch, FakeRay(fail), [f"ray.address={listening}", "ray.connect_timeout_s=6"])
    msg = str(e.value)
    assert msg.startswith(f"could not join the Ray cluster at {listening} (from ray.address) within about 6 s")
    assert "\n" not in msg and "ray.connect_timeout_s" in msg


def test_a_local_cluster_is_started_even_with_a_ray_start_head_recorded(monkeypatch, recorded):
    monkeypatch.setattr(connect, "current_cluster_file", lambda: recorded)
    fake = FakeRay()
    _, lines = _start(monkeypatch, fake, [])
    assert fake.calls == [
        {
            "address": "local",
            "num_cpus": 2,
            "include_dashboard": False,
            "logging_level": "ERROR",
            "log_to_driver": True,
        }
    ]
    assert lines == ["starting a local Ray cluster (2 CPUs) ..."]


def test_a_start_says_what_it_starts_before_each_wait(monkeypatch):
    """Ray, the actors' processes and their models take half a minute to start: a line before each."""
    fake = FakeRay()
    for step in ("_make_placement_groups", "_start_actors", "_setup_actors"):  # each step says its name
        monkeypatch.setattr(Colocation, step, lambda self, step=step: self.progress(step))
    monkeypatch.setattr(connect, "import_ray", lambda: fake)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    lines = []
    cfg = load_config("cpu_tiny", ["parallel.world_size=2", "ppo.prompts_per_iteration=16"])
    Colocation(cfg, PPO(cfg).models(), progress=lines.append)._start()
    assert lines == [
        "starting a local Ray cluster (2 CPUs) ...",
        "starting 6 actors (policy x2, critic x2, rollout, reference) ...",
        "_make_placement_groups",
        "_start_actors",
        "building the models ...",
        "_setup_actors",
    ]


def test_unreachable_address_through_the_command_line_is_one_line_and_quick(tmp_path):
    """The whole command in a subprocess (no Ray cluster starts): exit 1, one error line, no traceback."""
    import subprocess

    address = f"127.0.0.1:{_closed_port()}"
    env = {**os.environ, "RAY_ADDRESS": address}
    out = subprocess.run(
        [sys.executable, "-m", "chatlearn_mem_cli", "ppo", f"output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 1, out
    assert (
        out.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: cannot reach the Ray cluster at {address} (from RAY_ADDRESS): Connection refused")
    ), out.stderr
    assert "Traceback" not in out.stderr + out.stdout
