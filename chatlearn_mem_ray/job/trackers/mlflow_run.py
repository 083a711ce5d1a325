"""MLflow through ``mlflow``'s client: a local file store under the output directory by default
(MLflow 3 keeps the file store in maintenance mode: it is opened with ``MLFLOW_ALLOW_FILE_STORE``;
a ``sqlite:///...`` or server URI in ``trackers.mlflow_tracking_uri`` uses MLflow's database store)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path
from typing import Optional

__all__ = ["MLflow", "metric_name"]

_BATCH = 100  # params per log_batch call (MLflow's limit)


def metric_name(name: str) -> str:
    """``name`` as MLflow takes it: ``@`` spelled ``_at_`` (``val/pass_at_4``), any other character
    outside its set (letters, digits, ``_-. :/``) ``_``."""
    return re.sub(r"[^\w\-. :/]", "_", name.replace("@", "_at_"))


class MLflow:
    """An MLflow run in experiment ``trackers.project``; ``run_id`` continues an earlier one."""

    def __init__(self, settings, output_dir: Path, name: str, run_id: Optional[str] = None):
        from mlflow import MlflowClient

        uri = settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        uri = uri or (Path(output_dir).absolute() / "mlruns").as_uri()
        if uri.startswith("file:"):  # MLflow 3 keeps its file store in maintenance mode, behind this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.project)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self.client.create_experiment(settings.project)
        )
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        self.where = f"run {self.run_id} at {uri}"

    def log_config(self, config: dict) -> None:
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params  # a resumed run's: MLflow never changes a param
        params = [Param(k, str(v)[:6000]) for k, v in sorted(config.items()) if k not in logged]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _BATCH])

    def log_metrics(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(metric_name(k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_image(self, tag: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str) -> None:
        self.client.set_terminated(self.run_id, status=status)
