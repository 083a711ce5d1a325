"""How a run stops and goes on: SIGTERM at the end of an iteration (a checkpoint saved), the open save
kept when the loop's own code fails, and restarts after a lost actor or a hung phase (on fewer
data-parallel ranks with ``checkpoint.elastic``)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from chatlearn_mem_ray.actors.connect import wants_gpu
from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.errors import ActorFailedError, PhaseTimeoutError, ResourceError, iteration_label
from chatlearn_mem_ray.job.checkpoints import newest_intact_run_checkpoint
from chatlearn_mem_ray.service.loop import Loop
from chatlearn_mem_ray.service.service import Service

__all__ = [
    "SigtermWatch",
    "Terminate",
    "cluster_resources",
    "elastic_config",
    "keep_the_open_save",
    "restart",
    "restartable",
    "sigterm_checkpoint",
]


# -- SIGTERM -----------------------------------------------------------------------------
class Terminate(BaseException):
    """Raised by the driver at a safe point once SIGTERM arrived (a BaseException: no ``except
    Exception`` on the way turns it into a failure)."""


class SigtermWatch:
    """The driver's own SIGTERM handler for the length of a run, in place of Ray's (whose core
    worker installs one that prints a crash dump). The first SIGTERM only notes the time: the run
    stops at the end of the iteration. A second one stops it at once, as Ctrl-C does."""

    _UNSET = object()

    def __init__(self, progress: Callable[[str], None]):
        self.at: Optional[float] = None
        self.note = ""
        self._progress, self._previous = progress, self._UNSET

    def install(self) -> None:
        """Take SIGTERM (again after ``ray.init``); only the main thread can."""
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.signal(signal.SIGTERM, self._handle)
        if self._previous is self._UNSET:
            self._previous = previous

    def restore(self) -> None:
        if self._previous is not self._UNSET:
            signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
            self._previous = self._UNSET

    def _handle(self, signum, frame) -> None:
        if self.at is not None:
            raise Terminate()
        self.at = time.monotonic()
        self._progress("SIGTERM received: the run stops once this iteration ends (a second SIGTERM stops it now)")


def sigterm_checkpoint(cfg: LoopConfig, run: Service, loop: Loop, record: dict, done: int, term: SigtermWatch) -> str:
    """At the safe point after SIGTERM: make the newest checkpoint hold the ``done`` iterations
    when ``checkpoint.on_sigterm`` and the time left allow it; returns what was done, for the line."""
    ck = cfg.checkpoint
    if not ck.every or run.checkpointer is None:
        return "checkpoints are off (checkpoint.every=0)" if not ck.every else "the comparison iterations are not saved"
    run.checkpointer.complete()
    if record["checkpoints"] and record["checkpoints"][-1]["iterations_done"] == done:
        return f"it holds all {done} iterations"
    if not ck.on_sigterm:
        return "checkpoint.on_sigterm=false: no checkpoint saved on SIGTERM"
    last = record["checkpoints"][-1]["seconds"] if record["checkpoints"] else None
    left = ck.sigterm_grace_s - (time.monotonic() - term.at)
    if last is not None and last > left:
        return (
            f"no time to save the last iterations: the previous save took {last:.1f}s and "
            f"{max(0.0, left):.1f}s of checkpoint.sigterm_grace_s={ck.sigterm_grace_s:g} are left"
        )
    run.where = (done - 1, "checkpoint")
    state = dict(
        run.state(),
        loop=loop.state_dict(),
        restarts=list(record["restarts"]),
        checkpoints=list(record["checkpoints"]),
        exports=list(record.get("exports", [])),
        trackers=dict(record.get("trackers", {})),
    )
    run.checkpointer.save(done, state)
    run.checkpointer.complete()
    return f"saved on SIGTERM, it holds all {done} iterations"


def keep_the_open_save(svc: Service, error: BaseException, progress: Callable[[str], None]) -> None:
    """An iteration failed in the loop's own code (a reward function, a NaN, a bad sync), not by a
    lost actor: commit the save still open in the background, the state after the last complete
    iteration, before the actors go, so the newest checkpoint holds every completed iteration. A
    failure of that commit is said, never raised over the first error."""
    if svc.checkpointer is None or restartable(error):
        return
    try:
        svc.checkpointer.complete()
    except Exception as e:  # noqa: BLE001 - the run's own error is what stops it
        progress(f"warning: the checkpoint save still open could not be completed ({type(e).__name__}: {e})")


# -- restarts ------------------------------------------------------------------------------
def restartable(e: BaseException) -> bool:
    """A lost actor process or a hung phase is worth a restart; an exception from code is not."""
    return isinstance(e, PhaseTimeoutError) or (isinstance(e, ActorFailedError) and e.died)


def restart(
    cfg: LoopConfig,
    error: BaseException,
    run: Optional[Service],
    record: dict,
    number: int,
    progress: Callable[[str], None],
) -> Optional[tuple[Path, dict]]:
    """After an actor's death (or a hung phase): say what happened, record it, and return the
    checkpoint the run continues from (None: from the start)."""
    index, phase = run.where if run is not None else (None, "setup")
    iteration, comparison = run.number(index) if index is not None else (None, False)
    done = len(run.iterations) if run is not None else 0
    intact = (
        newest_intact_run_checkpoint(cfg.checkpoint_dir, progress)
        if cfg.checkpoint.every or record["resumed_from"]
        else None
    )
    newest, state = intact if intact is not None else (None, None)
    back_to = state["iterations_done"] if state is not None else 0
    where = f" (in {iteration_label(iteration, comparison)})" if iteration is not None else ""
    entry = {
        "number": number,
        "actor": getattr(error, "actor", None),
        "phase": phase,
        "iteration": iteration,
        "error": f"{type(error).__name__}: {error}",
        "iterations_done": done,
        "resumed_from": str(newest) if newest is not None else None,
        "iterations_redone": done - back_to,
        "at": time.time(),
    }
    record["restarts"].append(entry)
    source = f"the checkpoint after iteration {back_to} ({newest})" if newest is not None else "the beginning"
    progress(
        f"restart {number} of {cfg.checkpoint.max_restarts}: {error}{where}; tearing every actor "
        f"down, starting them again and continuing from {source}: {done - back_to} completed "
        "iteration(s) lost and redone"
    )
    return (newest, state) if newest is not None else None


def cluster_resources() -> dict:
    """CPUs and GPUs of the live nodes of the cluster this driver is connected to."""
    import ray

    return ray.cluster_resources()


def elastic_config(cfg: LoopConfig, error: BaseException, progress: Callable[[str], None]) -> LoopConfig:
    """``cfg`` with the largest data-parallel size the live nodes hold (``checkpoint.elastic``), said
    in one line; re-raises ``error`` when no smaller layout fits or validates."""
    total = cluster_resources()
    p, per = cfg.parallel, cfg.ray.cpus_per_rank
    fit = int(total.get("CPU", 0) // per)
    if wants_gpu(cfg, total.get("GPU", 0)):
        fit = min(fit, int(total.get("GPU", 0)))
    ranks = fit // p.tensor_model_parallel_size * p.tensor_model_parallel_size
    if ranks < p.tensor_model_parallel_size or ranks >= p.world_size:
        raise error
    data = json.loads(cfg.model_dump_json())
    data["parallel"]["world_size"] = ranks
    try:
        smaller = type(cfg).model_validate(data)
    except ValueError as e:
        raise ResourceError(f"{error}; checkpoint.elastic cannot go on with {ranks} rank(s): {e}") from None
    progress(
        f"checkpoint.elastic: the cluster holds {ranks} of {p.world_size} rank(s) after waiting "
        f"ray.node_wait_s={cfg.ray.node_wait_s:g} s; going on with data-parallel size "
        f"{ranks // p.tensor_model_parallel_size} (was {p.data_parallel_size}), the checkpoint resharded to it. "
        "From here the results differ from those of the original layout"
    )
    return smaller
