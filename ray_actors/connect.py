"""Ray plumbing of a colocated run: start or join a cluster, place every actor on the same
resources, and wait for actor calls phase by phase with errors that name the actor and phase.

Which cluster: :func:`resolve_address` turns ``ray.address`` and ``RAY_ADDRESS`` into a local
cluster to start or an address to join; :func:`init_kwargs` is what ``ray.init`` then gets
(resource counts only for a local cluster: Ray refuses them when joining). Before joining, the
address is probed with a plain TCP connection (bounded by ``ray.connect_timeout_s``; ``ray.init``
itself retries an unreachable address for many minutes) and Ray's own connection timeouts are
bounded by :func:`join_environment`, which also turns token authentication on for a head on this
machine when a token exists (as Ray does for ``ray.init()`` without an address).

Placement: one placement-group bundle per trainer rank (``ray.cpus_per_rank`` CPUs, plus one GPU
when GPUs are used), one placement group per tensor-parallel group on one node, the groups packed
or spread over the nodes (``ray.placement``; see :mod:`chatlearn_mem_ray.nodes`). Bundle ``i``
holds rank ``i`` of the policy and of the critic; bundle 0 also holds the rollout and the
reference model. Each actor asks for a quarter of its bundle, so the four models of bundle 0 share
one GPU (or its CPUs) and only the memory manager keeps them from needing four times the memory.
Every actor reports its node and the versions it runs; a version that differs from the driver's
stops the run before any work.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from chatlearn_mem_ray.config import RunConfig
from chatlearn_mem_ray.errors import (ActorFailedError, CheckpointDirError, ClusterConnectionError, PhaseTimeoutError,
                                      ResourceError, VersionSkewError)
from chatlearn_mem_ray.nodes import (group_targets, node_label, remove_check_files, shared_dir_check,
                                     software_versions, unseen_nodes, version_skew)

__all__ = ["ClusterTarget", "Colocation", "check_resources", "current_cluster_file", "init_kwargs", "join_environment",
           "probe_address", "resolve_address"]

logger = logging.getLogger("chatlearn_mem_ray")

ACTOR_SHARE = 0.25  # of a bundle: up to four colocated models per bundle


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("Ray is required for the PPO run; install it with: pip install 'chatlearn-mem[ray]'") from e
    return ray


# -- which cluster -------------------------------------------------------------------------
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
            raise ClusterConnectionError(f"the Ray address {self.address!r} (from {self.source}) is not host:port "
                                         "(e.g. 10.0.0.1:6379, or ray://10.0.0.1:10001 for the Ray client)")
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


def resolve_address(address: Optional[str], environ: Mapping[str, str] = os.environ,
                    recorded_file: Optional[Path] = None) -> ClusterTarget:
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
                "or leave ray.address unset to start a local cluster for the run")
        return ClusterTarget(recorded, f"the latest `ray start`, recorded in {path}")
    return ClusterTarget(address, "ray.address")


def init_kwargs(cfg: RunConfig, target: ClusterTarget) -> dict:
    """The keyword arguments of ``ray.init`` for ``target``: resource counts only for a local
    cluster (Ray refuses them when joining one)."""
    if target.local:
        # "local": a new cluster even when RAY_ADDRESS or a `ray start` head would be picked up.
        return {"address": "local", "num_cpus": cfg.ray.num_cpus, "include_dashboard": False,
                "logging_level": "WARNING", "log_to_driver": True}
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
    path = Path(environ["RAY_AUTH_TOKEN_PATH"]) if environ.get("RAY_AUTH_TOKEN_PATH") else (
        Path.home() / ".ray" / "auth_token")
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
    env = {k: v for k, v in (("RAY_gcs_rpc_server_connect_timeout_s", each), ("RAY_py_gcs_connect_timeout_s", each),
                             ("RAY_gcs_server_port_wait_time_s", "1")) if k not in environ}
    if (not target.address.startswith("ray://") and "RAY_AUTH_MODE" not in environ and _token_available(environ)
            and _is_this_machine(target.host_port[0])):
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


def _join(ray, cfg: RunConfig, target: ClusterTarget) -> None:
    """``ray.init`` to an existing cluster, fast and with a one-line error when it cannot."""
    where = f"the Ray cluster at {target.address} (from {target.source})"
    host, port = target.host_port
    timeout_s = cfg.ray.connect_timeout_s
    problem = probe_address(host, port, timeout_s)
    if problem is not None:
        stale = " (that head has probably stopped; `ray start --head` starts a new one)" if (
            "ray start" in target.source) else ""
        raise ClusterConnectionError(
            f"cannot reach {where}: {problem}{stale}. Check the address, or unset it to start a local "
            "cluster (ray.address unset and RAY_ADDRESS unset, or ray.address=local)")
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
                "default ~/.ray/auth_token); `ray get-auth-token` on the head prints it") from None
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ClusterConnectionError(
            f"could not join {where} within about {timeout_s:g} s: {first}. Is it a Ray head's GCS port "
            "(6379 by default; ray://HOST:10001 for the Ray client)? Raise ray.connect_timeout_s if the "
            "cluster is just slow to answer") from None


def _wants_gpu(cfg: RunConfig, available_gpus: float) -> bool:
    if cfg.ray.use_gpu == "auto":
        return available_gpus >= 1
    return bool(cfg.ray.use_gpu)


def check_resources(cfg: RunConfig, cpus: float, gpus: float, where: str) -> bool:
    """Check that the run's bundles fit; return whether GPUs are used.

    Raises:
        ResourceError: Saying what is asked, what exists and which setting to change.
    """
    ranks = cfg.parallel.world_size
    need_cpus = ranks * cfg.ray.cpus_per_rank
    problems = []
    if need_cpus > cpus:
        problems.append(f"{ranks} rank(s) x ray.cpus_per_rank={cfg.ray.cpus_per_rank:g} need {need_cpus:g} "
                        f"CPUs but {where} has {cpus:g}: lower parallel.world_size or ray.cpus_per_rank")
    use_gpu = _wants_gpu(cfg, gpus)
    if use_gpu and ranks > gpus:
        problems.append(f"{ranks} rank(s) need {ranks} GPUs but {where} has {gpus:g}: lower "
                        "parallel.world_size or set ray.use_gpu=false")
    if problems:
        raise ResourceError("not enough resources for this run:\n  " + "\n  ".join(problems))
    return use_gpu


class Colocation:
    """Every actor of a PPO run on one set of placement-group bundles.

    Use as a context manager: entering starts (or joins, see :func:`resolve_address`) Ray, checks
    resources, creates the placement group and the actors and sets them up; leaving kills the
    actors and, when this object started or joined Ray, shuts this driver's Ray down.

    Args:
        cfg: The run config.
        progress: Receives the line saying which cluster was joined (default: the logger).
        wait_s: Wait up to this long for the cluster to have room for every rank (a restart after a
            lost node: a replacement may be joining) before :class:`ResourceError`.

    Attributes:
        policy, critic: The trainer actors, one per rank.
        rollout, reference: The inference actors.
        names: Actor handle -> name (for error messages).
        ranks: Per trainer actor name, its ``setup()`` result (dp_rank, tp_rank, ...).
        nodes: Per actor name, its node's label (``ip/node-id prefix``).
    """

    def __init__(self, cfg: RunConfig, progress: Optional[Callable[[str], None]] = None, wait_s: float = 0.0):
        self.cfg = cfg
        self.wait_s = wait_s  # how long to wait for the cluster to have room (after a lost node)
        self._deadline = 0.0
        self.progress = progress or logger.info
        self._started_ray = False
        self._pgs: list = []
        self.names: dict[Any, str] = {}
        self.ranks: dict[str, dict] = {}
        self.nodes: dict[str, str] = {}
        self._node_ids: dict[str, str] = {}  # actor name -> Ray node id
        self.policy: list = []
        self.critic: list = []
        self.rollout = self.reference = None
        self.use_gpu = False

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> "Colocation":
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        ray = _ray()
        cfg = self.cfg
        if ray.is_initialized():  # this process joined a cluster already (a notebook, the tests)
            where = "the Ray cluster this process is connected to"
        else:
            target = resolve_address(cfg.ray.address)
            if target.local:
                import torch

                cpus = cfg.ray.num_cpus or os.cpu_count() or 1
                check_resources(cfg, cpus, torch.cuda.device_count(), "this machine")  # before starting anything
                ray.init(**init_kwargs(cfg, target))
                where = "the local Ray cluster"
            else:
                _join(ray, cfg, target)
                where = f"the Ray cluster at {target.address}"
                ignored = (f"; ray.num_cpus={cfg.ray.num_cpus} ignored (it sizes a local cluster)"
                           if cfg.ray.num_cpus is not None else "")
                self.progress(f"joined {where} (from {target.source}){ignored}")
            self._started_ray = True
        self.use_gpu = self._wait_for_room(ray, where)
        self._place()

    def _wait_for_room(self, ray, where: str) -> bool:
        """:func:`check_resources` on the live nodes, retried for up to :attr:`wait_s` (the placement
        groups then wait for what is left of it: Ray may count a lost node's resources until its
        health checks declare it dead)."""
        self._deadline = time.monotonic() + self.wait_s
        deadline, said = self._deadline, False
        while True:
            total = ray.cluster_resources()  # the nodes alive now
            try:
                return check_resources(self.cfg, total.get("CPU", 0), total.get("GPU", 0), where)
            except ResourceError as e:
                if time.monotonic() >= deadline:
                    raise
                if not said:
                    self.progress(f"waiting up to {self.wait_s:g} s (ray.node_wait_s) for the cluster to have room "
                                  f"for every rank again: {str(e).splitlines()[-1].strip()}")
                    said = True
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _place(self) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from chatlearn_mem_ray.actors import InferenceActor, TrainerActor

        cfg = self.cfg
        tp = cfg.parallel.tensor_model_parallel_size
        groups = cfg.parallel.world_size // tp
        bundle = {"CPU": cfg.ray.cpus_per_rank} | ({"GPU": 1} if self.use_gpu else {})
        targets = group_targets(groups, cfg.ray.cpus_per_rank * tp, tp if self.use_gpu else 0,
                                ray.nodes(), cfg.ray.placement)
        self._pgs = [placement_group([dict(bundle) for _ in range(tp)], strategy="STRICT_PACK",
                                     _soft_target_node_id=target) for target in targets]
        timeout, why = cfg.ray.phase_timeout_s, "ray.phase_timeout_s"
        if self.wait_s:  # a restart: what is left of ray.node_wait_s
            timeout, why = max(1.0, self._deadline - time.monotonic()), "ray.node_wait_s"
        ready, _ = ray.wait([pg.ready() for pg in self._pgs], num_returns=len(self._pgs), timeout=timeout)
        if len(ready) < len(self._pgs):
            raise ResourceError(f"the placement groups ({groups} tensor-parallel group(s) of {tp} x {bundle}, each "
                                f"on one node) could not be scheduled within {timeout:.0f} s ({why}); the "
                                f"cluster has {ray.available_resources()} available")

        def options(index: int) -> dict:
            share = {"num_cpus": cfg.ray.cpus_per_rank * ACTOR_SHARE}
            if self.use_gpu:
                share["num_gpus"] = ACTOR_SHARE
            return dict(share, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self._pgs[index // tp], placement_group_bundle_index=index % tp))

        memory = cfg.memory.manager.model_dump()
        Trainer, Inference = ray.remote(TrainerActor), ray.remote(InferenceActor)
        for role, group, model in (("policy", self.policy, cfg.policy), ("critic", self.critic, cfg.critic)):
            for rank in range(cfg.parallel.world_size):
                name = f"{role}_{rank}"
                handle = Trainer.options(**options(rank)).remote(name, role, model.model_dump(), memory)
                group.append(handle)
                self.names[handle] = name
        self.rollout = Inference.options(**options(0)).remote("rollout", cfg.policy.model_dump(), memory)
        self.reference = Inference.options(**options(0)).remote("reference", cfg.policy.model_dump(), memory)
        self.names[self.rollout], self.names[self.reference] = "rollout", "reference"
        self._check_nodes()

        p = cfg.parallel
        for group in (self.policy, self.critic):
            init = self.call("setup", {group[0]: group[0].master_address.remote()})[group[0]]
            results = self.call("setup", {a: a.setup.remote(r, p.world_size, p.tensor_model_parallel_size, init)
                                          for r, a in enumerate(group)})
            self.ranks.update({self.names[a]: v for a, v in results.items()})
        for a in (self.rollout, self.reference):
            init = self.call("setup", {a: a.master_address.remote()})[a]
            self.call("setup", {a: a.setup.remote(init)})

    def _check_nodes(self) -> None:
        """Learn every actor's node; stop before any work when one runs other versions than the driver."""
        info = {self.names[a]: r for a, r in self.call("setup", {a: a.node_info.remote() for a in self.all_actors}).items()}
        self._node_ids = {name: r["node_id"] for name, r in info.items()}
        self.nodes = {name: node_label(r["node_id"], r["ip"]) for name, r in info.items()}
        skew = version_skew(software_versions(), {n: {"versions": r["versions"], "node": self.nodes[n]}
                                                  for n, r in info.items()})
        if skew:
            raise VersionSkewError("the actors must run the driver's versions: " + "; ".join(skew)
                                   + ". Install the same versions on every node (one image or one environment)")
        by_node: dict[str, list[str]] = {}
        for name in (self.names[a] for a in self.all_actors):
            by_node.setdefault(self.nodes[name], []).append(name)
        self.progress(f"actors on {len(by_node)} node(s): "
                      + "; ".join(f"{node}: {', '.join(names)}" for node, names in by_node.items()))

    def check_shared_dir(self, directory: Path) -> None:
        """With actors on several nodes (or the driver on a node without actors): check that every
        node reads and writes ``directory``.

        Raises:
            CheckpointDirError: Naming the nodes that cannot see it.
        """
        ray = _ray()
        nodes = sorted(set(self._node_ids.values()))
        if len(nodes) < 2 and ray.get_runtime_context().get_node_id() in nodes:
            return
        one = {}
        for a in self.all_actors:
            one.setdefault(self._node_ids[self.names[a]], a)
        token_path, token = shared_dir_check(Path(directory))
        try:
            seen = self.call("setup", {a: a.check_shared.remote(str(token_path), token) for a in one.values()})
            missing = unseen_nodes(token_path, {n: seen[a] for n, a in one.items()})
        finally:
            remove_check_files(token_path)
        if missing:
            labels = {self._node_ids[n]: self.nodes[n] for n in self.nodes}
            raise CheckpointDirError(
                f"checkpoint.directory {directory} is not shared by every node of the run: node(s) "
                f"{', '.join(labels.get(n, n) for n in missing)} cannot read or write what the driver wrote there. "
                "Put it on a filesystem every node mounts at the same path (NFS, a parallel filesystem)")

    def close(self) -> None:
        """Kill the actors and the placement groups; stop Ray if this object started it."""
        ray = _ray()
        if not ray.is_initialized():
            return
        for handle in list(self.names):
            try:
                ray.kill(handle)
            except Exception:  # already dead
                pass
        self.names.clear()
        for pg in self._pgs:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(pg)
            except Exception:
                pass
        self._pgs = []
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    # -- calls ----------------------------------------------------------------------------
    @property
    def all_actors(self) -> list:
        return [*self.policy, *self.critic, self.rollout, self.reference]

    def call(self, phase: str, refs: Mapping[Any, Any], timeout_s: Optional[float] = None) -> dict:
        """Wait for one call per actor; return ``{actor: result}``.

        Fails fast: the first actor that dies or raises stops the wait, even while others are
        still running (a peer blocked in a collective on a dead rank would otherwise hang).

        Raises:
            ActorFailedError: Naming the actor, the phase and the cause.
            PhaseTimeoutError: After ``timeout_s`` (default ``ray.phase_timeout_s``).
        """
        ray = _ray()
        from ray.exceptions import RayActorError, RayTaskError

        timeout_s = self.cfg.ray.phase_timeout_s if timeout_s is None else timeout_s
        pending = {ref: actor for actor, ref in refs.items()}
        results: dict = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                waiting = sorted(self.names.get(a, "?") for a in pending.values())
                raise PhaseTimeoutError(f"phase {phase!r} did not finish within {timeout_s:g} s; still "
                                        f"waiting for {', '.join(waiting)} (raise ray.phase_timeout_s "
                                        "if the phase is just slow)")
            for ref in ready:
                actor = pending.pop(ref)
                name = self.names.get(actor, "?")
                try:
                    results[actor] = ray.get(ref)
                except RayActorError as e:
                    raise ActorFailedError(name, phase, f"the actor process died ({type(e).__name__})",
                                           died=True) from None
                except RayTaskError as e:
                    cause = e.cause if getattr(e, "cause", None) is not None else e
                    dead = self._dead_peer(actor)
                    if dead is not None:  # a collective broke because a peer's process (or node) is gone
                        raise ActorFailedError(dead, phase, f"the actor process died; {name} then failed in a "
                                               f"collective ({type(cause).__name__})", died=True) from e
                    raise ActorFailedError(name, phase, f"{type(cause).__name__}: {cause}") from e
        return results

    def _dead_peer(self, failed: Any) -> Optional[str]:
        """After ``failed`` raised: the name of another actor whose process is gone, if any. A rank
        whose peer died (a killed process, a lost node) fails in its next collective with an error
        of its own (gloo: "Connection closed by peer"); what the run must see is the death, which
        a restart can mend. Waits up to a minute for Ray to notice a lost node (its health checks),
        less when every other actor answers."""
        ray = _ray()
        from ray.exceptions import RayActorError

        refs = {a.ping.remote(): a for a in self.all_actors if a is not failed and a is not None}
        pending = list(refs)
        deadline = time.monotonic() + min(60.0, self.cfg.ray.phase_timeout_s)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            try:
                ray.get(ready[0])
            except RayActorError:
                return self.names.get(refs[ready[0]], "?")
            except Exception:  # noqa: BLE001 - an answer that is no death
                pass
        return None
