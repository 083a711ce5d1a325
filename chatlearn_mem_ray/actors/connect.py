"""Connecting a run's driver to Ray: which cluster (start a local one or join one), how to join it
fast and with a one-line error, and whether the cluster has room for the run.

Which cluster: :func:`resolve_address` turns ``ray.address`` and ``RAY_ADDRESS`` into a local
cluster to start or an address to join; :func:`init_kwargs` is what ``ray.init`` then gets
(resource counts only for a local cluster: Ray refuses them when joining). Before joining, the
address is probed with a plain TCP connection (bounded by ``ray.connect_timeout_s``; ``ray.init``
itself retries an unreachable address for many minutes) and Ray's own connection timeouts are
bounded by :func:`join_environment`, which also turns token authentication on for a head on this
machine when a token exists (as Ray does for ``ray.init()`` without an address).
:func:`start_or_join` does all of it for :class:`~chatlearn_mem_ray.service.colocation.Colocation`.

Room: :func:`check_resources` compares what the run's bundles need (``ray.cpus_per_rank`` CPUs per
trainer rank, one GPU each when :func:`wants_gpu`) with what a machine or cluster has.
"""

from __future__ import annotations

import contextlib
import ipaddress
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.errors import ClusterConnectionError, ResourceError

__all__ = [
    "ClusterTarget",
    "check_resources",
    "current_cluster_file",
    "import_ray",
    "init_kwargs",
    "join_environment",
    "probe_address",
    "resolve_address",
    "start_or_join",
    "wants_gpu",
]


def import_ray():
    """The ``ray`` module, or an ImportError that says which extra installs it."""
    try:
        import ray
    except ImportError as e:
        raise ImportError("Ray is required for the PPO run; install it with: pip install 'chatlearn-mem[ray]'") from e
    return ray


@dataclass(frozen=True)
class ClusterTarget:
    """The cluster a run uses.

    Attributes:
        address: ``host:port`` or ``ray://host:port`` to join; None to start a local cluster.
        source: What chose it, for messages (``ray.address``, ``RAY_ADDRESS``, ...).
    """

    address: Optional[str]
    source: str

    @property
    def local(self) -> bool:
        return self.address is None

    @property
    def host_port(self) -> tuple[str, int]:
        """``(host, port)`` of :attr:`address` (the Ray client's port for ``ray://``).

        Raises:
            ClusterConnectionError: The address is not ``host:port``.
        """
        assert self.address is not None
        rest = self.address.split("://", 1)[-1].rstrip("/")
        host, _, port = rest.rpartition(":")
        host = host.strip("[]")  # [::1]:6379
        if not host or not port.isdigit():
            raise ClusterConnectionError(
                f"the Ray address {self.address!r} (from {self.source}) is not host:port "
                "(e.g. 10.0.0.1:6379, or ray://10.0.0.1:10001 for the Ray client)"
            )
        return host, int(port)


def current_cluster_file() -> Path:
    """The file where ``ray start`` records the latest head on this machine
    (``/tmp/ray/ray_current_cluster`` unless ``RAY_TMPDIR`` / ``TMPDIR`` move it)."""
    try:
        from ray._common.utils import get_ray_address_file  # Ray >= 2.4x
    except ImportError:
        try:
            from ray._private.utils import get_ray_address_file
        except ImportError:  # Ray's rule, for versions that moved it again

            def get_ray_address_file(_):
                base = os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"
                return os.path.join(base, "ray", "ray_current_cluster")

    return Path(get_ray_address_file(None))


def resolve_address(
    address: Optional[str], environ: Mapping[str, str] = os.environ, recorded_file: Optional[Path] = None
) -> ClusterTarget:
    """Decide which cluster a run uses, from ``ray.address`` and the ``RAY_ADDRESS`` variable.

    ======================  ========================================================================
    ``ray.address``         cluster
    ======================  ========================================================================
    None                    ``RAY_ADDRESS`` if set (``ray job submit`` sets it), else a new local one
    ``local``               a new local one, whatever ``RAY_ADDRESS`` says
    ``auto``                ``RAY_ADDRESS``, else the head the latest ``ray start`` recorded
    ``host:port``           that one (``ray://host:port``: through the Ray client)
    ======================  ========================================================================

    Unlike ``ray.init()``, None never joins a head that ``ray start`` left running (or that has
    died since) on this machine, and ``auto`` never joins a cluster another program started with
    ``ray.init()``.

    Args:
        address: ``ray.address``.
        environ: The environment (``RAY_ADDRESS``).
        recorded_file: Where ``ray start`` records its head (default :func:`current_cluster_file`).

    Raises:
        ClusterConnectionError: ``auto`` and no cluster was found.
    """
    env = (environ.get("RAY_ADDRESS") or "").strip()
    if address == "local":
        return ClusterTarget(None, "ray.address=local")
    if address is None:
        if not env or env == "local":
            return ClusterTarget(None, "RAY_ADDRESS=local" if env else "default")
        if env != "auto":
            return ClusterTarget(env, "RAY_ADDRESS")
        address, via = "auto", "RAY_ADDRESS=auto"
    else:
        via = "ray.address=auto"
    if address == "auto":
        if env == "local":
            return ClusterTarget(None, "RAY_ADDRESS=local")
        if env and env != "auto":
            return ClusterTarget(env, "RAY_ADDRESS")
        path = Path(recorded_file) if recorded_file is not None else current_cluster_file()
        try:
            recorded = path.read_text().strip()
        except OSError:
            recorded = ""
        if not recorded:
            raise ClusterConnectionError(
                f"{via} but no Ray cluster was found: RAY_ADDRESS is not set and no head started with "
                f"`ray start` is recorded in {path}. Start one (`ray start --head`), set ray.address=HOST:PORT, "
                "or leave ray.address unset to start a local cluster for the run"
            )
        return ClusterTarget(recorded, f"the latest `ray start`, recorded in {path}")
    return ClusterTarget(address, "ray.address")


def init_kwargs(cfg: LoopConfig, target: ClusterTarget) -> dict:
    """The keyword arguments of ``ray.init`` for ``target``: resource counts only for a local
    cluster (Ray refuses them when joining one)."""
    if target.local:
        # "local": a new cluster even when RAY_ADDRESS or a `ray start` head would be picked up.
        return {
            "address": "local",
            "num_cpus": cfg.ray.num_cpus,
            "include_dashboard": False,
            # ERROR: Ray's notices about its own cluster (token authentication on, ...) are not the run's
            "logging_level": "ERROR",
            "log_to_driver": True,
        }
    return {"address": target.address, "logging_level": "WARNING"}


def probe_address(host: str, port: int, timeout_s: float) -> Optional[str]:
    """Open and close a TCP connection to ``host:port``; None when it answered, else why not."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except socket.timeout:
        return f"no answer within {timeout_s:g} s"
    except OSError as e:
        return e.strerror or str(e) or type(e).__name__


def _is_this_machine(host: str) -> bool:
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    if any(ipaddress.ip_address(ip.split("%")[0]).is_loopback for ip in ips):
        return True
    try:
        import psutil
    except ImportError:
        return False
    mine = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    return bool(ips & mine)


def _token_available(environ: Mapping[str, str]) -> bool:
    """Whether a Ray auth token exists where Ray looks for one."""
    if environ.get("RAY_AUTH_TOKEN"):
        return True
    path = (
        Path(environ["RAY_AUTH_TOKEN_PATH"])
        if environ.get("RAY_AUTH_TOKEN_PATH")
        else (Path.home() / ".ray" / "auth_token")
    )
    return path.is_file() and path.stat().st_size > 0


def join_environment(target: ClusterTarget, timeout_s: float, environ: Mapping[str, str] = os.environ) -> dict:
    """Environment variables to set (only those the user has not set) while joining ``target``.

    - Ray's connection timeouts, so that an address that accepts TCP but is no Ray head fails
      in about ``timeout_s`` instead of retrying for many minutes.
    - ``RAY_AUTH_MODE=token`` for a head on this machine when a token exists: ``ray start``
      turns token authentication on whenever ``~/.ray/auth_token`` exists (Ray 2.5x+), and a
      driver given an explicit address does not send the token unless told to. The token never
      goes to another machine unasked.
    """
    each = str(max(1, math.ceil(timeout_s / 3)))  # three waits in a row: GCS, pubsub, cluster id
    env = {
        k: v
        for k, v in (
            ("RAY_gcs_rpc_server_connect_timeout_s", each),
            ("RAY_py_gcs_connect_timeout_s", each),
            ("RAY_gcs_server_port_wait_time_s", "1"),
        )
        if k not in environ
    }
    if (
        not target.address.startswith("ray://")
        and "RAY_AUTH_MODE" not in environ
        and _token_available(environ)
        and _is_this_machine(target.host_port[0])
    ):
        env["RAY_AUTH_MODE"] = "token"
    return env


def _reload_ray_config() -> None:
    """Make Ray re-read its ``RAY_*`` settings (read once, at import), as Ray's own auth code does."""
    try:
        from ray._raylet import Config

        Config.initialize("")
    except (ImportError, AttributeError):  # a Ray without it: the TCP probe still bounds the wait
        pass


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in os.environ and Ray's config for the block, then restore os.environ.

    After a failure Ray's config is re-read from the restored environment; after a successful
    join it is left alone (the connected driver's config also holds the cluster's settings)."""
    saved = {k: os.environ.get(k) for k in env}

    def restore() -> None:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    os.environ.update(env)
    if env:
        _reload_ray_config()
    try:
        yield
    except BaseException:
        restore()
        if env:
            _reload_ray_config()
        raise
    restore()


def _join(ray, cfg: LoopConfig, target: ClusterTarget) -> None:
    """``ray.init`` to an existing cluster, fast and with a one-line error when it cannot."""
    where = f"the Ray cluster at {target.address} (from {target.source})"
    host, port = target.host_port
    timeout_s = cfg.ray.connect_timeout_s
    problem = probe_address(host, port, timeout_s)
    if problem is not None:
        stale = (
            " (that head has probably stopped; `ray start --head` starts a new one)"
            if ("ray start" in target.source)
            else ""
        )
        raise ClusterConnectionError(
            f"cannot reach {where}: {problem}{stale}. Check the address, or unset it to start a local "
            "cluster (ray.address unset and RAY_ADDRESS unset, or ray.address=local)"
        )
    env = join_environment(target, timeout_s)
    try:
        with _environment(env):
            ray.init(**init_kwargs(cfg, target))
    except Exception as e:  # Ray raises ConnectionError, RuntimeError, AuthenticationError, ValueError
        text = f"{e} {e.__cause__}"
        if any(k in text for k in ("AuthenticationError", "InvalidAuthToken", "Unauthenticated")):
            raise ClusterConnectionError(
                f"{where} requires token authentication and refused this driver: set RAY_AUTH_MODE=token and "
                "provide the cluster's token in RAY_AUTH_TOKEN (or in the file RAY_AUTH_TOKEN_PATH names, "
                "default ~/.ray/auth_token); `ray get-auth-token` on the head prints it"
            ) from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ClusterConnectionError(
            f"could not join {where} within about {timeout_s:g} s: {first}. Is it a Ray head's GCS port "
            "(6379 by default; ray://HOST:10001 for the Ray client)? Raise ray.connect_timeout_s if the "
            "cluster is just slow to answer"
        ) from None


def wants_gpu(cfg: LoopConfig, available_gpus: float) -> bool:
    """Whether the run puts a GPU in each bundle (``ray.use_gpu``; ``auto``: when there is one)."""
    if cfg.ray.use_gpu == "auto":
        return available_gpus >= 1
    return bool(cfg.ray.use_gpu)


def check_resources(cfg: LoopConfig, cpus: float, gpus: float, where: str) -> bool:
    """Check that the run's bundles fit; return whether GPUs are used.

    Raises:
        ResourceError: Saying what is asked, what exists and which setting to change.
    """
    ranks = cfg.parallel.world_size
    need_cpus = ranks * cfg.ray.cpus_per_rank
    problems = []
    if need_cpus > cpus:
        problems.append(
            f"{ranks} rank(s) x ray.cpus_per_rank={cfg.ray.cpus_per_rank:g} need {need_cpus:g} "
            f"CPUs but {where} has {cpus:g}: lower parallel.world_size or ray.cpus_per_rank"
        )
    use_gpu = wants_gpu(cfg, gpus)
    if use_gpu and ranks > gpus:
        problems.append(
            f"{ranks} rank(s) need {ranks} GPUs but {where} has {gpus:g}: lower "
            "parallel.world_size or set ray.use_gpu=false"
        )
    if problems:
        raise ResourceError("not enough resources for this run:\n  " + "\n  ".join(problems))
    return use_gpu


def start_or_join(cfg: LoopConfig, progress: Callable[[str], None]) -> tuple[str, bool]:
    """Connect this driver to the cluster ``ray.address`` names (:func:`resolve_address`): start a
    local one (after checking that this machine has room for the run) or join one. A driver that
    is connected already (a notebook, the tests) stays on its cluster.

    Args:
        cfg: The run config.
        progress: Receives a line before a local cluster starts and after a cluster was joined.

    Returns:
        Where the run is, for messages (``"the local Ray cluster"``, ...), and whether this call
        connected the driver (the caller then shuts Ray down when it is done).

    Raises:
        ClusterConnectionError: The cluster to join cannot be found, reached or joined.
        ResourceError: This machine has no room for a local cluster of the run.
    """
    ray = import_ray()
    if ray.is_initialized():
        return "the Ray cluster this process is connected to", False
    target = resolve_address(cfg.ray.address)
    if target.local:
        import torch

        cpus, gpus = cfg.ray.num_cpus or os.cpu_count() or 1, torch.cuda.device_count()
        check_resources(cfg, cpus, gpus, "this machine")  # before starting anything
        gpu_note = f", {gpus} GPU{'s' if gpus > 1 else ''}" if gpus else ""
        progress(f"starting a local Ray cluster ({cpus} CPUs{gpu_note}) ...")
        ray.init(**init_kwargs(cfg, target))
        return "the local Ray cluster", True
    _join(ray, cfg, target)
    where = f"the Ray cluster at {target.address}"
    ignored = (
        f"; ray.num_cpus={cfg.ray.num_cpus} ignored (it sizes a local cluster)" if cfg.ray.num_cpus is not None else ""
    )
    progress(f"joined {where} (from {target.source}){ignored}")
    return where, True
