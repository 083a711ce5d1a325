"""The run's experiment trackers as one: :func:`check_trackers` before anything starts,
:class:`Trackers` (opened before Ray starts) to which the job hands every iteration, validation,
the config and the memory picture, and :func:`flat_metrics`, what an iteration's log entry becomes
in a tracker.

Each tracker is an adapter of its own module (:mod:`.tb`, :mod:`.wandb_run`, :mod:`.mlflow_run`)
with four calls: ``log_config``, ``log_metrics``, ``log_image`` and ``close``; and ``run_id`` (the
run a resumed job continues, kept in ``log.json`` and in every run checkpoint).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.errors import TrackerError

__all__ = ["INSTALL", "Trackers", "check_trackers", "flat_config", "flat_metrics"]

INSTALL = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
}
"""Tracker -> (the module it needs, chatlearn-mem's extra that installs it)."""
_SKIPPED = ("iteration", "manager_on", "samples", "validations")


def check_trackers(cfg: LoopConfig) -> None:
    """Every tracker of ``logger`` can be imported here.

    Raises:
        TrackerError: Naming the tracker and the extra to install.
    """
    for name in cfg.logger:
        if name in INSTALL and importlib.util.find_spec(INSTALL[name][0]) is None:
            module, extra = INSTALL[name]
            raise TrackerError(
                f"logger: {name} needs the {module} package, which is not installed for {sys.executable}: "
                f"pip install 'chatlearn-mem[{extra}]' (or leave {name} out of logger)"
            )


def flat_metrics(m: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """An iteration's log entry as ``{name: number}``: nested figures joined with ``/``
    (``phase_seconds/train``, ``phase_colocated_bytes/generate``, ``weight_sync/seconds``); texts,
    samples and the validations (logged apart) left out."""
    out: dict[str, float] = {}
    for k, v in m.items():
        if not prefix and k in _SKIPPED:
            continue
        if isinstance(v, bool):
            out[f"{prefix}{k}"] = float(v)
        elif isinstance(v, (int, float)):
            out[f"{prefix}{k}"] = float(v)
        elif isinstance(v, Mapping):
            out.update(flat_metrics(v, f"{prefix}{k}/"))
    return out


def flat_config(cfg: LoopConfig) -> dict[str, Any]:
    """The config as hyper-parameters: dotted keys, values a number, a bool or a string."""

    def walk(d: Any, prefix: str) -> dict[str, Any]:
        if isinstance(d, dict):
            return {k: v for key, value in d.items() for k, v in walk(value, f"{prefix}{key}.").items()}
        key = prefix.rstrip(".")
        return {key: d if isinstance(d, (int, float, bool, str)) else json.dumps(d)}

    return walk(json.loads(cfg.model_dump_json()), "")


class Trackers:
    """The trackers of ``cfg.logger`` (``console`` is the job's own line), opened at once.

    Args:
        cfg: The run's config (``logger``, ``trackers``, ``output_dir``).
        resumed: The tracker run ids a checkpoint kept (``{"wandb": id, "mlflow": run id}``) and
            the iterations it holds, when the run resumes: each tracker continues that run.
        progress: Receives a line per tracker opened and a warning when one fails later (that
            tracker is then closed; the run goes on).

    Raises:
        TrackerError: A tracker is not installed or cannot start (naming it and why).
    """

    def __init__(
        self,
        cfg: LoopConfig,
        resumed: Optional[tuple[dict, int]] = None,
        progress: Callable[[str], None] = print,
    ):
        check_trackers(cfg)
        self.progress = progress
        self.open: dict[str, Any] = {}
        ids, done = resumed if resumed is not None else ({}, 0)
        out = Path(cfg.output_dir)
        name = cfg.trackers.run_name or out.absolute().name
        for kind in (k for k in cfg.logger if k != "console"):
            try:
                if kind == "tensorboard":
                    from chatlearn_mem_ray.job.trackers.tb import TensorBoard

                    tracker = TensorBoard(cfg.trackers.tensorboard_dir or out / "tensorboard", done)
                elif kind == "wandb":
                    from chatlearn_mem_ray.job.trackers.wandb_run import WandB

                    tracker = WandB(cfg.trackers, out, name, ids.get("wandb"))
                else:
                    from chatlearn_mem_ray.job.trackers.mlflow_run import MLflow

                    tracker = MLflow(cfg.trackers, out, name, ids.get("mlflow"))
            except TrackerError:
                self.close("FAILED")
                raise
            except Exception as e:  # noqa: BLE001 - any library's own reason for not starting
                self.close("FAILED")
                raise TrackerError(
                    f"logger: {kind} could not start ({type(e).__name__}: {str(e).splitlines()[0][:200]}); fix "
                    f"its settings (the trackers section) or leave {kind} out of logger"
                ) from None
            self.open[kind] = tracker
            progress(f"logger: {kind} -> {tracker.where}" + (" (continued)" if ids.get(kind) else ""))
        try:
            self.log_config(flat_config(cfg))
        except Exception:
            self.close("FAILED")
            raise

    @property
    def run_ids(self) -> dict[str, str]:
        """The runs a resumed job continues (the trackers that have one)."""
        return {k: t.run_id for k, t in self.open.items() if getattr(t, "run_id", None)}

    def _each(self, call: str, *args) -> None:
        for kind, tracker in list(self.open.items()):
            try:
                getattr(tracker, call)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker failing mid-run does not stop the run
                self.progress(f"warning: logger {kind} failed ({type(e).__name__}: {e}); it is closed, the run goes on")
                self.open.pop(kind)
                try:
                    tracker.close("FAILED")
                except Exception:  # noqa: BLE001
                    pass

    def log_config(self, config: dict) -> None:
        self._each("log_config", config)

    def log_iteration(self, m: dict, step: int, prefix: str = "") -> None:
        """An iteration's entry at ``step`` (its number; ``prefix`` ``manager_off/`` for a comparison
        iteration), with the validations it ran each at its own iteration (0: before training)."""
        for v in m.get("validations", ()):
            if v["iteration"] != m["iteration"] or prefix:
                self._each(
                    "log_metrics", flat_metrics({k: x for k, x in v.items() if k != "iteration"}), v["iteration"]
                )
        metrics = {f"{prefix}{k}": x for k, x in flat_metrics(m).items()}
        for v in m.get("validations", ()):
            if v["iteration"] == m["iteration"] and not prefix:
                metrics.update(flat_metrics({k: x for k, x in v.items() if k != "iteration"}))
        self._each("log_metrics", metrics, step)

    def log_image(self, tag: str, path: Path, step: int) -> None:
        self._each("log_image", tag, Path(path), step)

    def close(self, status: str = "FINISHED") -> None:
        """Close every tracker (``FINISHED``, ``FAILED`` or ``KILLED``)."""
        for kind, tracker in list(self.open.items()):
            self.open.pop(kind)
            try:
                tracker.close(status)
            except Exception as e:  # noqa: BLE001
                self.progress(f"warning: logger {kind} did not close cleanly ({type(e).__name__}: {e})")
