"""Before Ray starts: the output directory, where to resume from, the engine's install, the policy's
Hugging Face checkpoint and the checkpoint directory, each checked so that a bad run stops before
any actor does."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Callable, Optional, Sequence

from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.config.model import architecture_line
from chatlearn_mem_ray.errors import CheckpointDirError, EngineMissingError, OutputDirError, ResumeError
from chatlearn_mem_ray.job.checkpoints import (
    check_checkpoint_dir,
    config_differences,
    latest_run_checkpoint,
    list_run_checkpoints,
    newest_intact_run_checkpoint,
    remove_temporaries,
    write_json_atomic,
)

__all__ = [
    "check_builders_installed",
    "check_engine_installed",
    "find_resume_point",
    "prepare_checkpoints",
    "prepare_hf_checkpoint",
    "prepare_output_dir",
]


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


def check_builders_installed(models: Sequence) -> None:
    """Before Ray starts: a torch-native model (``backend: torch``: a Hugging Face Llama or Qwen2) can
    be built here, ``transformers`` importable (its actors run in this Python's environment).
    Without it the run failed only once the actors had started.

    Raises:
        EngineMissingError: Naming the first such model and the extra to install.
    """
    torch_native = [m.name for m in models if getattr(m.config, "backend", "megatron") == "torch"]
    if not torch_native or importlib.util.find_spec("transformers") is not None:
        return
    raise EngineMissingError(
        f"{torch_native[0]} is a torch-native model (backend: torch), built with transformers, which is not "
        f"installed for {sys.executable}: pip install 'chatlearn-mem[hf]' (or use backend: megatron)"
    )


def prepare_hf_checkpoint(cfg: LoopConfig, progress: Callable[[str], None]) -> None:
    """Before Ray starts: write the policy's Hugging Face checkpoint when it asks for one
    (``policy.create_hf``) and none is there yet; then say, for each model that starts from a
    checkpoint, which architecture it took from where (and which of the preset's fields gave way)."""
    policy = cfg.policy
    if policy.from_hf is not None and policy.create_hf and not Path(policy.from_hf).exists():
        from chatlearn_mem.models import hf

        hf.save_random_hf(policy, policy.from_hf, seed=policy.seed)
        progress(f"wrote a randomly initialised {hf.hf_config_dict(policy)['architectures'][0]} to {policy.from_hf}")
    for role in cfg.model_sections:
        if getattr(cfg, role).from_hf is not None:
            progress(architecture_line(role, getattr(cfg, role)))
    for line in cfg.architecture_notes:
        progress(line)


def prepare_checkpoints(cfg: LoopConfig, resume: Optional[tuple[Path, dict]], progress: Callable[[str], None]) -> None:
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
