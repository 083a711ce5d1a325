"""Running a loop on the colocation service as a job: :func:`run_loop` (:func:`run_ppo`,
:func:`run_grpo` for the two recipes shipped).

What a run needs around the loop, and what a reader copying a recipe need not read:

- Before Ray starts: the loop's declarations, the output directory (:func:`prepare_output_dir`:
  writable, another run's results kept), where to resume from (:func:`find_resume_point`), the
  device budget (:func:`chatlearn_mem_ray.service.check_budget`) and the checkpoint directory.
- The outer loop: the run's iterations, then the manager-off comparison iterations; a progress
  line per iteration; ``log.json`` rewritten after each; checkpoints every ``checkpoint.every``.
- Stops: Ctrl-C and SIGTERM (at the end of an iteration, a checkpoint saved) write the log first;
  a dead actor or a hung phase restarts every actor from the newest checkpoint
  (``checkpoint.max_restarts``), on fewer data-parallel ranks with ``checkpoint.elastic`` when
  the cluster lost a node for good.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence, Union

import torch

from chatlearn_mem_ray import weight_sync
from chatlearn_mem_ray.checkpoints import (
    RunCheckpointer,
    check_checkpoint_dir,
    check_room,
    config_differences,
    latest_run_checkpoint,
    list_run_checkpoints,
    newest_intact_run_checkpoint,
    remove_temporaries,
    write_json_atomic,
)
from chatlearn_mem_ray.colocation import engine_log
from chatlearn_mem_ray.config import GRPORunConfig, LoopConfig, RunConfig
from chatlearn_mem_ray.connect import wants_gpu
from chatlearn_mem_ray.declare import check_declarations
from chatlearn_mem_ray.errors import (
    ActorFailedError,
    CheckpointDirError,
    EngineMissingError,
    OutputDirError,
    PhaseTimeoutError,
    ResourceError,
    ResumeError,
    RunInterrupted,
    RunTerminated,
    iteration_label,
)
from chatlearn_mem_ray.nodes import software_versions
from chatlearn_mem_ray.service import Loop, Service, check_budget
from chatlearn_mem_ray.timeline import MemoryTimeline, plot_timeline

__all__ = ["find_resume_point", "prepare_output_dir", "run_grpo", "run_loop", "run_ppo"]


def run_loop(
    loop: Union[type[Loop], Callable[[LoopConfig], Loop]],
    cfg: LoopConfig,
    progress: Callable[[str], None] = print,
    on_iteration: Optional[Callable[[Service, int], None]] = None,
    on_phase: Optional[Callable[[Service, int, str], None]] = None,
    on_checkpoint: Optional[Callable[[Path], None]] = None,
) -> dict:
    """Run ``loop`` (a :class:`~chatlearn_mem_ray.service.Loop` subclass, or a factory taking
    ``cfg``) on the colocation service as ``cfg`` says; write ``log.json`` and
    ``memory_timeline.png`` to ``cfg.output_dir``.

    Its declarations, ``output_dir`` (and the checkpoint directory) and a device budget are checked
    before Ray starts. ``log.json`` is rewritten atomically after every iteration (``status``:
    ``running``), so a run that fails or is interrupted keeps every iteration it completed; at the
    end ``status`` is ``completed``, ``failed`` (with ``error``), ``interrupted`` (Ctrl-C) or
    ``terminated`` (SIGTERM).

    Checkpoints (the ``checkpoint`` section): every ``checkpoint.every`` iterations the saved models
    (the trainers) save their state from their host stores, with the loop's own
    (:meth:`~chatlearn_mem_ray.service.Loop.state_dict`; see :mod:`chatlearn_mem_ray.checkpoints`);
    ``checkpoint.resume`` continues from the newest complete one (iteration counter, every
    trainer's state and RNG, the loop's state, the log and memory timeline so far). When an actor
    process dies or a phase times out, every actor is torn down, started again and the run
    continues from the newest checkpoint, up to ``checkpoint.max_restarts`` times; ``log.json``
    lists each restart under ``restarts``.

    Args:
        progress: Receives one line per iteration, per checkpoint and per restart, and a summary.
        on_iteration: Called after each iteration with the service and the iteration's index
            (from 0: iteration 1 is index 0; tests use it to inspect or disturb the actors).
        on_phase: Called as each phase starts with the service, the iteration's index and the phase's name.
        on_checkpoint: Called with the temporary directory of each save before the trainers write.

    Returns:
        The log (also written as JSON): config, versions, iterations, memory timeline, summary,
        checkpoints, restarts and the final weights' SHA-256 per trainer rank. Iterations are
        numbered from 1 (``iteration``) in the log, the memory timeline and on the console alike,
        and the manager-off comparison iterations from 1 again (``manager_on`` false); the
        checkpoint ``iter_<K>`` holds iterations 1 to K. Each iteration's metrics are those the
        loop's :meth:`~chatlearn_mem_ray.service.Loop.step` returned, with the service's figures.

    Raises:
        DeclarationError: The loop's models and phases are inconsistent (nothing started).
        RunError: A subclass saying why the run stopped (the log is written first).
        RunInterrupted: Ctrl-C (a ``KeyboardInterrupt``), after the log was written and Ray shut down.
        RunTerminated: SIGTERM (a ``RunInterrupted``): the run stopped at the end of the iteration
            it was in, saved a checkpoint of it (``checkpoint.on_sigterm``), wrote the log
            (``status``: ``terminated``) and shut Ray down. Only when called from the main thread.
    """
    recipe = loop(cfg)
    models, phases = recipe.models(), recipe.phases()
    check_declarations(models, phases, cfg.parallel.world_size)
    check_engine_installed(cfg)
    resume = find_resume_point(cfg, progress, [m.name for m in models if m.is_saved])
    check_budget(cfg, models, phases)
    log_path = prepare_output_dir(cfg, resuming=resume is not None)
    _prepare_checkpoints(cfg, resume, progress)
    _prepare_hf_checkpoint(cfg, progress)
    recipe.prepare(progress)
    out_dir = log_path.parent
    t0 = time.perf_counter()
    versions = _versions()
    svc: Optional[Service] = None
    ck = cfg.checkpoint
    total = recipe.iterations
    extra_its = cfg.memory.compare_iterations if cfg.memory.enabled else 0
    record: dict = {"resumed_from": None, "restarts": [], "checkpoints": [], "final_weights": {}, "nodes": {}}
    if resume is not None:
        record["resumed_from"] = {"checkpoint": str(resume[0]), "iterations_done": resume[1]["iterations_done"]}
        record["restarts"] = list(resume[1].get("restarts", []))  # those of the run it continues
        record["checkpoints"] = list(resume[1].get("checkpoints", []))

    def write(status: str, error: Optional[str] = None) -> dict:
        log = _log(cfg, svc, versions, status, time.perf_counter() - t0, error, record)
        write_json_atomic(log_path, log)
        return log

    term = _SigtermWatch(progress)
    restarts_here = 0
    legend_said = False

    def attempt() -> None:
        nonlocal svc, recipe, legend_said
        t_start = time.perf_counter()
        if restarts_here:  # the loop's state as the checkpoint (or the start) has it
            recipe = loop(cfg)
            recipe.prepare(lambda line: None)
        wait_s = cfg.ray.node_wait_s if restarts_here else 0.0
        with Service(cfg, recipe.models(), recipe.phases(), progress, on_phase, wait_s) as svc_:
            svc = svc_
            term.install()  # after ray.init, whose core worker installed its own handler
            record["nodes"] = dict(svc.colo.nodes)
            if ck.every or resume is not None:
                svc.colo.check_shared_dir(cfg.checkpoint_dir)
            if resume is not None:
                svc.restore(*resume)
                recipe.load_state_dict(resume[1].get("loop", {}))
                progress(f"resumed from {resume[0]}: {svc.next_iteration} iteration(s) done")
            progress(
                f"{len(svc.colo.all_actors)} actors ready on {cfg.parallel.world_size} bundle(s) "
                f"({'GPU' if svc.colo.use_gpu else 'CPU'}) in {time.perf_counter() - t_start:.1f}s; "
                f"memory manager {'on' if cfg.memory.enabled else 'off'}"
            )
            for engine in sorted(a for a, _ in svc.runner.pinned):
                progress(
                    f"{engine}: vLLM's CPU build cannot sleep, so the engine stays resident in every phase "
                    f"(counted there); its own log: {engine_log(cfg.output_dir, engine)}"
                )
            if ck.every:
                svc.checkpointer = RunCheckpointer(
                    cfg, svc.colo, svc.saved_models, progress, saved=record["checkpoints"]
                )
                trainers = [a for m in svc.saved_models for a in svc.colo.actors_of[m]]
                nbytes = sum(
                    svc.colo.call("setup", {a: a.checkpoint_nbytes.remote(ck.resharding) for a in trainers}).values()
                )
                check_room(cfg.checkpoint_dir, nbytes, ck.keep_last)
            start = svc.next_iteration
            if cfg.memory.enabled:
                svc.sleep_all()
                schedule = svc.plan()
                if schedule is not None:
                    record["residency_plan"] = schedule.summary()
                    moved = {b: p["bytes_moved"] for b, p in record["residency_plan"].items()}
                    aon = {b: p["all_or_nothing_bytes"] for b, p in record["residency_plan"].items()}
                    progress(
                        f"device budget {', '.join(f'{v / 2**20:.1f} MiB' for v in schedule.budget.values())}: "
                        f"the plan copies {sum(moved.values()) / 2**20:.2f} MiB per iteration "
                        f"(all or nothing: {sum(aon.values()) / 2**20:.2f} MiB)"
                    )
            if start < total + extra_its and not legend_said and recipe.legend:
                progress(recipe.legend)
                legend_said = True
            for it in range(start, total + extra_its):
                if it == total:
                    if svc.checkpointer is not None:
                        svc.checkpointer.complete()
                        svc.checkpointer = None  # the comparison iterations are not saved
                    progress(f"comparison: {extra_its} more iteration(s) with the memory manager off")
                    svc.wake_all()
                svc.begin_iteration(it)
                try:
                    m = svc.end_iteration(recipe.step(svc, it))
                except Exception as e:
                    _keep_the_open_save(svc, e, progress)
                    raise
                if svc.checkpointer is not None and ((it + 1) % ck.every == 0 or it + 1 == total):
                    svc.where = (it, "checkpoint")
                    saved_so_far = {"restarts": list(record["restarts"]), "checkpoints": list(record["checkpoints"])}
                    state = dict(svc.state(), loop=recipe.state_dict(), **saved_so_far)
                    waited = svc.checkpointer.save(it + 1, state, before_calls=on_checkpoint)
                    m["checkpoint_seconds"] += waited
                    m["seconds"] += waited
                write("running")
                progress(_progress_line(recipe, m, extra_its if it >= total else total, comparison=it >= total))
                if on_iteration is not None:
                    on_iteration(svc, it)
                if term.at is not None and it + 1 < total + extra_its:  # the safe point after SIGTERM
                    term.note = _sigterm_checkpoint(cfg, svc, recipe, record, it + 1, term)
                    raise _Terminate()
            if svc.checkpointer is not None:
                svc.checkpointer.complete()
            record["final_weights"] = svc.final_weights()

    term.install()
    try:
        while True:
            try:
                attempt()
                break
            except BaseException as e:
                if isinstance(e, ResourceError) and restarts_here and ck.elastic:
                    smaller = _elastic_config(cfg, e, progress)
                    record["restarts"][-1]["world_size"] = smaller.parallel.world_size
                    cfg = smaller
                    continue
                if not _restartable(e):
                    raise
                if restarts_here >= ck.max_restarts:
                    if ck.max_restarts:
                        progress(f"no restarts left (checkpoint.max_restarts={ck.max_restarts}); the run stops")
                    raise
                restarts_here += 1
                resume = _restart(cfg, e, svc, record, restarts_here, progress)
    except _Terminate:
        done = len(svc.iterations) if svc is not None else 0
        _write_quietly(write, progress, "terminated", "stopped by SIGTERM")
        newest = latest_run_checkpoint(cfg.checkpoint_dir) if ck.every else None
        raise RunTerminated(
            done,
            log_path,
            newest.name if newest is not None else None,
            term.note or "stopped before the iteration ended",
        ) from None
    except KeyboardInterrupt:
        done = len(svc.iterations) if svc is not None else 0
        _write_quietly(write, progress, "interrupted", "stopped by Ctrl-C")
        raise RunInterrupted(done, log_path) from None
    except BaseException as e:
        done = len(svc.iterations) if svc is not None else 0
        if _write_quietly(write, progress, "failed", f"{type(e).__name__}: {e}") and done:
            progress(f"the run stopped; log of its {done} completed iteration(s): {log_path}")
        raise
    finally:
        term.restore()
    log = write("completed")
    nodes = sorted(set(record["nodes"].values()))
    main = min(len(svc.iterations), total)
    compared = f" (+{len(svc.iterations) - main} with the manager off)" if len(svc.iterations) > main else ""
    plot_timeline(
        svc.timeline,
        out_dir / "memory_timeline.png",
        f"colocated {recipe.title}, {cfg.parallel.world_size} rank(s), {main} iterations{compared}, "
        f"{len(nodes)} node(s): {', '.join(nodes[:4])}{' ...' if len(nodes) > 4 else ''}",
        mismatch={
            (m["iteration"], m["manager_on"]): m["logprob_mismatch"]["max"]
            for m in svc.iterations
            if m.get("logprob_mismatch")
        },
    )
    for key, s in log["summary"].items():
        if isinstance(s, dict) and "peak_colocated_bytes" in s:
            progress(
                f"{key.replace('_', ' ')}: peak colocated {s['peak_colocated_bytes'] / 2**20:.2f} MiB "
                f"({s['peak_phase']}) / largest phase {s['largest_phase_bytes'] / 2**20:.2f} MiB "
                f"({s['largest_phase']}) = {s['ratio']:.3f}"
            )
    if log["summary"].get("weight_sync"):
        progress(weight_sync.sync_summary_line(log["summary"]["weight_sync"]))
    progress(f"wrote {log_path} and {out_dir / 'memory_timeline.png'}")
    return log


def run_ppo(cfg: RunConfig, progress: Callable[[str], None] = print, **hooks) -> dict:
    """:func:`run_loop` of the PPO recipe (:class:`~chatlearn_mem_ray.ppo.PPO`); ``hooks`` as there."""
    from chatlearn_mem_ray.ppo import PPO

    return run_loop(PPO, cfg, progress, **hooks)


def run_grpo(cfg: GRPORunConfig, progress: Callable[[str], None] = print, **hooks) -> dict:
    """:func:`run_loop` of the GRPO recipe (:class:`~chatlearn_mem_ray.grpo.GRPO`); ``hooks`` as there."""
    from chatlearn_mem_ray.grpo import GRPO

    return run_loop(GRPO, cfg, progress, **hooks)


# -- before Ray starts ---------------------------------------------------------------------
def prepare_output_dir(cfg: LoopConfig, resuming: bool = False) -> Path:
    """Check ``cfg.output_dir`` before anything starts; return the path of its ``log.json``.

    Creates the directory and writes a first ``log.json`` (status ``starting``, no iterations):
    the write itself proves the directory writable. With ``output_dir_exists=error`` (the
    default) a ``log.json`` that holds iterations of another run, or that a live run on this
    machine is writing, stops the run instead; a log with no iterations (a run that failed
    to start) is replaced. With ``overwrite`` the old log and picture are replaced. With
    ``resuming`` the old log is the one the run continues (only a live writer stops it).

    Raises:
        OutputDirError: The directory cannot be created or written, or holds another run's results.
    """
    out = Path(cfg.output_dir)
    log_path = out / "log.json"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputDirError(f"cannot create output_dir {out}: {e.strerror or e}; choose another output_dir") from None
    if log_path.exists() and (cfg.output_dir_exists == "error" or resuming):
        try:
            old = json.loads(log_path.read_text())
            done, status = len(old["iterations"]), old.get("status", "completed")
            pid, node = old.get("pid"), old.get("versions", {}).get("node")
        except (OSError, ValueError, KeyError, TypeError) as e:
            if resuming:
                old, done, status, pid, node = {}, 0, "unreadable", None, None
            else:
                raise OutputDirError(
                    f"output_dir {out} holds a log.json that is not a run's log "
                    f"({type(e).__name__}); choose another output_dir or set "
                    "output_dir_exists=overwrite"
                ) from None
        if status in ("starting", "running") and pid and node == platform.node() and _pid_alive(pid):
            raise OutputDirError(f"another run (pid {pid}) is writing to output_dir {out}; choose another output_dir")
        if done and not resuming:
            resumable = ", resume it (--resume)" if latest_run_checkpoint(cfg.checkpoint_dir) else ""
            raise OutputDirError(
                f"output_dir {out} already holds the log of another run ({done} iteration(s), "
                f"{status}); choose another output_dir{resumable}, or set "
                "output_dir_exists=overwrite to replace it"
            )
    try:
        write_json_atomic(
            log_path,
            {
                "status": "starting",
                "pid": os.getpid(),
                "versions": {"node": platform.node()},
                "config": json.loads(cfg.model_dump_json()),
                "iterations": [],
            },
        )
    except OSError as e:
        raise OutputDirError(f"cannot write {log_path}: {e.strerror or e}; choose a writable output_dir") from None
    (out / "memory_timeline.png").unlink(missing_ok=True)  # another run's picture must not pass for this one's
    return log_path


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def find_resume_point(
    cfg: LoopConfig, progress: Callable[[str], None] = print, saved: Sequence[str] = ("policy", "critic")
) -> Optional[tuple[Path, dict]]:
    """Where ``cfg.checkpoint.resume`` says the run continues from: ``(checkpoint, its run.json)``,
    or None for a fresh start. Checked before anything starts.

    Raises:
        ResumeError: ``resume=true`` and no complete checkpoint; or the config's model differs from
            the checkpoint's (each difference named).
    """
    mode, root = cfg.checkpoint.resume, cfg.checkpoint_dir
    if mode is False:
        return None
    intact = newest_intact_run_checkpoint(root, progress)
    if intact is None:
        if mode == "auto":
            progress(f"checkpoint.resume=auto: no complete checkpoint in {root}; starting from the beginning")
            return None
        raise ResumeError(
            f"nothing to resume: no complete checkpoint in {root}. Run without --resume (or with "
            "checkpoint.resume=auto) to start from the beginning, or point checkpoint.directory "
            "at the run's checkpoints"
        )
    newest, state = intact
    blocking, changed = config_differences(state["config"], cfg, state.get("models", saved))
    if blocking:
        raise ResumeError(
            f"cannot resume from {newest}: the config's model differs from the checkpoint's: "
            + "; ".join(blocking)
            + ". Resume with the checkpoint's model settings, or start a new "
            "run in another output_dir / checkpoint.directory"
        )
    if changed:
        resharded = any(line.startswith("parallel.") for line in changed)
        progress(
            "resuming with settings that differ from the checkpoint's: "
            + "; ".join(changed)
            + (
                "; megatron reshards the trainers to the new split, whose RNG states start afresh (the "
                "result is not bit-identical to the run continued on its own split)"
                if resharded
                else ""
            )
        )
    return newest, state


def check_engine_installed(cfg: LoopConfig) -> None:
    """Before Ray starts: the rollout engine the config names can be imported here (the actors run
    in this Python's environment). Without it the run used to fail only once the actors had
    started, some 30 s later.

    Raises:
        EngineMissingError: ``rollout.engine`` is ``vllm`` and vLLM is not installed; the message
            gives the install commands.
    """
    if cfg.rollout.engine != "vllm" or importlib.util.find_spec("vllm") is not None:
        return
    from chatlearn_mem.engines.vllm_rollout import INSTALL_CPU, INSTALL_CUDA

    raise EngineMissingError(
        f"rollout.engine=vllm needs vLLM, which is not installed for {sys.executable}. On a CPU-only "
        f"machine (Python 3.11): {INSTALL_CPU}; with CUDA: {INSTALL_CUDA} (docs/vllm.md). Or generate "
        "with the policy's own loop: rollout.engine=megatron"
    )


def _prepare_hf_checkpoint(cfg: LoopConfig, progress: Callable[[str], None]) -> None:
    """Before Ray starts: write the policy's Hugging Face checkpoint when it asks for one
    (``policy.create_hf``) and none is there yet."""
    policy = cfg.policy
    if policy.from_hf is None or not policy.create_hf or Path(policy.from_hf).exists():
        return
    from chatlearn_mem.models import hf

    hf.save_random_hf(policy, policy.from_hf, seed=policy.seed)
    progress(f"wrote a randomly initialised {hf.hf_config_dict(policy)['architectures'][0]} to {policy.from_hf}")


def _prepare_checkpoints(cfg: LoopConfig, resume: Optional[tuple[Path, dict]], progress: Callable[[str], None]) -> None:
    """Before Ray starts: the checkpoint directory is writable, and holds no other run's checkpoints."""
    root = cfg.checkpoint_dir
    if cfg.checkpoint.every == 0 and resume is None:
        return
    check_checkpoint_dir(root)
    for name in remove_temporaries(root):
        progress(f"removed {root / name}: a checkpoint save that never completed")
    if resume is None:
        earlier = list_run_checkpoints(root)
        if earlier and cfg.output_dir_exists == "error":
            raise CheckpointDirError(
                f"checkpoint.directory {root} holds checkpoints of an earlier run (newest: "
                f"{earlier[-1][1].name}); resume it (--resume or checkpoint.resume=auto), "
                "choose another checkpoint.directory, or set output_dir_exists=overwrite to "
                "delete them"
            )
        for _, path in earlier:
            shutil.rmtree(path)
        if earlier:
            progress(
                f"deleted {len(earlier)} checkpoint(s) of an earlier run from {root} (output_dir_exists=overwrite)"
            )


# -- the log and the console ---------------------------------------------------------------
def _log(
    cfg: LoopConfig,
    run: Optional[Service],
    versions: dict,
    status: str,
    seconds: float,
    error: Optional[str] = None,
    extra: Optional[dict] = None,
) -> dict:
    timeline = run.timeline if run is not None else MemoryTimeline()
    return {
        "status": status,
        "error": error,
        "pid": os.getpid(),
        "config": json.loads(cfg.model_dump_json()),
        "versions": versions,
        "iterations": run.iterations if run is not None else [],
        "memory_timeline": timeline.to_json(),
        "sync_checks": run.sync_checks if run is not None else [],
        "audits": run.audits if run is not None else {"runs": 0, "checks_clean": 0},
        "over_budget": run.over_budget if run is not None else [],
        "summary": {
            "memory_manager_on": timeline.summary(True),
            "memory_manager_off": timeline.summary(False),
            "seconds": seconds,
            **({"weight_sync": sync} if (sync := weight_sync.sync_summary(run.iterations if run else [])) else {}),
        },
        **(extra or {}),
    }


def _write_quietly(write: Callable, progress: Callable[[str], None], status: str, error: str) -> bool:
    """Write the final log of a stopped run; a failure to write must not hide why it stopped."""
    try:
        write(status, error)
        return True
    except Exception as e:  # a full disk, an unserialisable metric
        progress(f"warning: could not write the log ({type(e).__name__}: {e})")
        return False


def _versions() -> dict:
    of = software_versions()  # read without importing (megatron takes seconds)
    return {
        "torch": torch.__version__,
        "megatron-core": of["megatron-core"],
        "ray": of["ray"],
        "python": platform.python_version(),
        "machine": platform.machine(),
        "node": platform.node(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def _progress_line(loop: Loop, m: dict, of: int, comparison: bool = False) -> str:
    """``iter   3/20 reward ... | generate 0.05s/0.2MiB ...``, or ``iter manager off 1/1 ...`` for a
    comparison iteration: the loop's figures (:meth:`Loop.progress_line`), then each phase's."""
    phases = " ".join(
        f"{name} {m['phase_seconds'][name]:.2f}s/{m['phase_colocated_bytes'][name] / 2**20:.1f}MiB"
        for name in m["phase_seconds"]
    )
    if comparison:
        head = f"iter manager off {m['iteration']}/{of}"
    else:
        head = f"iter {m['iteration']:>3}/{of}{'' if m['manager_on'] else ' [manager off]'}"
    first, newline, rest = loop.progress_line(m).partition("\n")  # more lines (a sample) go under the phases
    return f"{head} {first} | {phases}{newline}{rest}"


# -- SIGTERM -------------------------------------------------------------------------------
class _Terminate(BaseException):
    """Raised by the driver at a safe point once SIGTERM arrived (a BaseException: no ``except
    Exception`` on the way turns it into a failure)."""


class _SigtermWatch:
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
            raise _Terminate()
        self.at = time.monotonic()
        self._progress("SIGTERM received: the run stops once this iteration ends (a second SIGTERM stops it now)")


def _sigterm_checkpoint(cfg: LoopConfig, run: Service, loop: Loop, record: dict, done: int, term: _SigtermWatch) -> str:
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
        run.state(), loop=loop.state_dict(), restarts=list(record["restarts"]), checkpoints=list(record["checkpoints"])
    )
    run.checkpointer.save(done, state)
    run.checkpointer.complete()
    return f"saved on SIGTERM, it holds all {done} iterations"


def _keep_the_open_save(svc: Service, error: BaseException, progress: Callable[[str], None]) -> None:
    """An iteration failed in the loop's own code (a reward function, a NaN, a bad sync), not by a
    lost actor: commit the save still open in the background, the state after the last complete
    iteration, before the actors go, so the newest checkpoint holds every completed iteration. A
    failure of that commit is said, never raised over the first error."""
    if svc.checkpointer is None or _restartable(error):
        return
    try:
        svc.checkpointer.complete()
    except Exception as e:  # noqa: BLE001 - the run's own error is what stops it
        progress(f"warning: the checkpoint save still open could not be completed ({type(e).__name__}: {e})")


# -- restarts ------------------------------------------------------------------------------
def _restartable(e: BaseException) -> bool:
    """A lost actor process or a hung phase is worth a restart; an exception from code is not."""
    return isinstance(e, PhaseTimeoutError) or (isinstance(e, ActorFailedError) and e.died)


def _restart(
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


def _cluster_resources() -> dict:
    """CPUs and GPUs of the live nodes of the cluster this driver is connected to."""
    import ray

    return ray.cluster_resources()


def _elastic_config(cfg: LoopConfig, error: BaseException, progress: Callable[[str], None]) -> LoopConfig:
    """``cfg`` with the largest data-parallel size the live nodes hold (``checkpoint.elastic``), said
    in one line; re-raises ``error`` when no smaller layout fits or validates."""
    total = _cluster_resources()
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
