"""Running a loop on the colocation service as a job: :func:`run_loop`.

What a run needs around the loop, and what a reader copying a recipe need not read:

- Before Ray starts (:mod:`~chatlearn_mem_ray.job.prepare`): the loop's declarations, the output
  directory (writable, another run's results kept), where to resume from, the device budget
  (:func:`chatlearn_mem_ray.service.budget.check_budget`) and the checkpoint directory.
- The outer loop (here): the run's iterations, then the manager-off comparison iterations; a
  progress line per iteration; ``log.json`` rewritten after each (:mod:`~chatlearn_mem_ray.job.output`);
  checkpoints every ``checkpoint.every`` (:mod:`~chatlearn_mem_ray.job.checkpoints`).
- Stops (:mod:`~chatlearn_mem_ray.job.stops`): Ctrl-C and SIGTERM (at the end of an iteration, a
  checkpoint saved) write the log first; a dead actor or a hung phase restarts every actor from the
  newest checkpoint (``checkpoint.max_restarts``), on fewer data-parallel ranks with
  ``checkpoint.elastic`` when the cluster lost a node for good.

The job knows the service and the :class:`~chatlearn_mem_ray.service.loop.Loop` protocol, never a
recipe: PPO's and GRPO's ``run_ppo`` / ``run_grpo`` live with their loops.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional, Union

from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.errors import ResourceError, RunInterrupted, RunTerminated
from chatlearn_mem_ray.job.checkpoints import RunCheckpointer, check_room, latest_run_checkpoint, write_json_atomic
from chatlearn_mem_ray.job.export import RunExports
from chatlearn_mem_ray.job.output import progress_line, run_log, versions, write_quietly
from chatlearn_mem_ray.job.prepare import (
    check_builders_installed,
    check_engine_installed,
    find_resume_point,
    prepare_checkpoints,
    prepare_hf_checkpoint,
    prepare_output_dir,
)
from chatlearn_mem_ray.job.stops import (
    SigtermWatch,
    Terminate,
    elastic_config,
    keep_the_open_save,
    restart,
    restartable,
    sigterm_checkpoint,
)
from chatlearn_mem_ray.job.trackers import Trackers, check_trackers
from chatlearn_mem_ray.service import weight_sync
from chatlearn_mem_ray.service.budget import check_budget
from chatlearn_mem_ray.service.colocation import engine_log
from chatlearn_mem_ray.service.declare import check_declarations
from chatlearn_mem_ray.service.loop import Loop
from chatlearn_mem_ray.service.service import Service
from chatlearn_mem_ray.service.timeline_plot import plot_timeline

__all__ = ["run_loop"]


def run_loop(
    loop: Union[type[Loop], Callable[[LoopConfig], Loop]],
    cfg: LoopConfig,
    progress: Callable[[str], None] = print,
    on_iteration: Optional[Callable[[Service, int], None]] = None,
    on_phase: Optional[Callable[[Service, int, str], None]] = None,
    on_checkpoint: Optional[Callable[[Path], None]] = None,
) -> dict:
    """Run ``loop`` (a :class:`~chatlearn_mem_ray.service.service.Loop` subclass, or a factory taking
    ``cfg``) on the colocation service as ``cfg`` says; write ``log.json`` and
    ``memory_timeline.png`` to ``cfg.output_dir``.

    Its declarations, ``output_dir`` (and the checkpoint directory) and a device budget are checked
    before Ray starts. ``log.json`` is rewritten atomically after every iteration (``status``:
    ``running``), so a run that fails or is interrupted keeps every iteration it completed; at the
    end ``status`` is ``completed``, ``failed`` (with ``error``), ``interrupted`` (Ctrl-C) or
    ``terminated`` (SIGTERM).

    Checkpoints (the ``checkpoint`` section): every ``checkpoint.every`` iterations the saved models
    (the trainers) save their state from their host stores, with the loop's own
    (:meth:`~chatlearn_mem_ray.service.service.Loop.state_dict`; see :mod:`chatlearn_mem_ray.job.checkpoints`);
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
        loop's :meth:`~chatlearn_mem_ray.service.service.Loop.step` returned, with the service's figures.

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
    check_builders_installed(models)
    check_trackers(cfg)
    resume = find_resume_point(cfg, progress, [m.name for m in models if m.is_saved])
    check_budget(cfg, models, phases)
    log_path = prepare_output_dir(cfg, resuming=resume is not None)
    prepare_checkpoints(cfg, resume, progress)
    prepare_hf_checkpoint(cfg, progress)
    recipe.prepare(progress)
    out_dir = log_path.parent
    t0 = time.perf_counter()
    run_versions = versions()
    svc: Optional[Service] = None
    ck = cfg.checkpoint
    total = recipe.iterations
    extra_its = cfg.memory.compare_iterations if cfg.memory.enabled else 0
    record: dict = {
        "resumed_from": None,
        "restarts": [],
        "checkpoints": [],
        "exports": [],
        "final_weights": {},
        "nodes": {},
    }
    if resume is not None:
        record["resumed_from"] = {"checkpoint": str(resume[0]), "iterations_done": resume[1]["iterations_done"]}
        record["restarts"] = list(resume[1].get("restarts", []))  # those of the run it continues
        record["checkpoints"] = list(resume[1].get("checkpoints", []))
        record["exports"] = list(resume[1].get("exports", []))
    exports = RunExports(cfg, progress, record["exports"])
    resumed = (resume[1].get("trackers", {}), resume[1]["iterations_done"]) if resume is not None else None
    trackers = Trackers(cfg, resumed, progress)  # before Ray starts: a tracker that cannot start stops the run here
    record["trackers"] = trackers.run_ids
    console = "console" in cfg.logger

    def write(status: str, error: Optional[str] = None) -> dict:
        log = run_log(cfg, svc, run_versions, status, time.perf_counter() - t0, error, record)
        write_json_atomic(log_path, log)
        return log

    term = SigtermWatch(progress)
    restarts_here = 0
    legend_said = False

    def attempt() -> None:
        nonlocal svc, recipe, legend_said
        t_start = time.perf_counter()
        if restarts_here:  # the loop's state as the checkpoint (or the start) has it
            recipe = loop(cfg)
            recipe.prepare(lambda line: None)
            record["exports"][:] = list(resume[1].get("exports", [])) if resume is not None else []
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
            if resume is not None and start >= total and cfg.export.on_resume and exports.why_not is None:
                exports.export(svc, total)  # a finished run resumed to export it (export.on_resume)
            if start < total + extra_its and not legend_said and recipe.legend and console:
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
                    keep_the_open_save(svc, e, progress)
                    raise
                if it < total and exports.due(it + 1, total):
                    svc.where = (it, "export")
                    m["export_seconds"] = exports.export(svc, it + 1)["seconds"]
                    m["seconds"] += m["export_seconds"]
                if svc.checkpointer is not None and ((it + 1) % ck.every == 0 or it + 1 == total):
                    svc.where = (it, "checkpoint")
                    saved_so_far = {
                        "restarts": list(record["restarts"]),
                        "checkpoints": list(record["checkpoints"]),
                        "exports": list(record["exports"]),
                        "trackers": dict(record["trackers"]),
                    }
                    state = dict(svc.state(), loop=recipe.state_dict(), **saved_so_far)
                    waited = svc.checkpointer.save(it + 1, state, before_calls=on_checkpoint)
                    m["checkpoint_seconds"] += waited
                    m["seconds"] += waited
                write("running")
                if console:
                    progress(progress_line(recipe, m, extra_its if it >= total else total, comparison=it >= total))
                number = m["iteration"]
                trackers.log_iteration(
                    m, number if it < total else total + number, "manager_off/" if it >= total else ""
                )
                if on_iteration is not None:
                    on_iteration(svc, it)
                if term.at is not None and it + 1 < total + extra_its:  # the safe point after SIGTERM
                    term.note = sigterm_checkpoint(cfg, svc, recipe, record, it + 1, term)
                    raise Terminate()
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
                    smaller = elastic_config(cfg, e, progress)
                    record["restarts"][-1]["world_size"] = smaller.parallel.world_size
                    cfg = smaller
                    continue
                if not restartable(e):
                    raise
                if restarts_here >= ck.max_restarts:
                    if ck.max_restarts:
                        progress(f"no restarts left (checkpoint.max_restarts={ck.max_restarts}); the run stops")
                    raise
                restarts_here += 1
                resume = restart(cfg, e, svc, record, restarts_here, progress)
    except Terminate:
        done = len(svc.iterations) if svc is not None else 0
        write_quietly(write, progress, "terminated", "stopped by SIGTERM")
        trackers.close("KILLED")
        newest = latest_run_checkpoint(cfg.checkpoint_dir) if ck.every else None
        raise RunTerminated(
            done,
            log_path,
            newest.name if newest is not None else None,
            term.note or "stopped before the iteration ended",
        ) from None
    except KeyboardInterrupt:
        done = len(svc.iterations) if svc is not None else 0
        write_quietly(write, progress, "interrupted", "stopped by Ctrl-C")
        trackers.close("KILLED")
        raise RunInterrupted(done, log_path) from None
    except BaseException as e:
        done = len(svc.iterations) if svc is not None else 0
        if write_quietly(write, progress, "failed", f"{type(e).__name__}: {e}") and done:
            progress(f"the run stopped; log of its {done} completed iteration(s): {log_path}")
        trackers.close("FAILED")
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
    trackers.log_image("memory_timeline", out_dir / "memory_timeline.png", total + len(svc.iterations) - main)
    trackers.close("FINISHED")
    progress(f"wrote {log_path} and {out_dir / 'memory_timeline.png'}")
    return log
