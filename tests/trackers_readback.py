"""Read a run's trackers back with each one's own reader: TensorBoard's ``EventAccumulator``, MLflow's
``MlflowClient`` on the file store, and an offline W&B run's transaction log parsed into wandb's own
protobuf ``Record`` messages (wandb 0.31 reads its log in Go, wandb-core, and ships no Python reader
of it; the log is LevelDB's log format, framed below)."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path

__all__ = ["mlflow_run", "tensorboard_run", "wandb_offline_run"]


def tensorboard_run(directory: Path) -> dict:
    """``{"scalars": {tag: [(step, value)]}, "images": {tag: [step]}, "texts": [tag]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(directory), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    acc.Reload()
    tags = acc.Tags()
    return {
        "scalars": {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]},
        "images": {t: [e.step for e in acc.Images(t)] for t in tags["images"]},
        "texts": list(tags["tensors"]),
    }


def mlflow_run(output_dir: Path, run_id: str) -> dict:
    """``{"metrics": {key: [(step, value)]}, "params": {...}, "artifacts": [path], "status"}``."""
    import os

    from mlflow import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=(Path(output_dir).absolute() / "mlruns").as_uri())
    run = client.get_run(run_id)
    metrics = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in run.data.metrics}
    return {
        "metrics": metrics,
        "params": dict(run.data.params),
        "artifacts": [a.path for a in client.list_artifacts(run_id)],
        "status": run.info.status,
    }


_BLOCK, _HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(data: bytes):
    """The payloads of a LevelDB-format log that starts with W&B's 7-byte file header."""
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = 7, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        payload = data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind == _FULL:
            yield payload
        elif kind == _FIRST:
            pending = payload
        elif kind == _MIDDLE:
            pending += payload
        elif kind == _LAST:
            yield pending + payload
            pending = b""
        elif kind == 0 and length == 0:  # zero padding at the end
            break


def wandb_offline_run(output_dir: Path) -> dict:
    """Every offline run under ``<output_dir>/wandb`` merged in order: ``{"ids": [run id per
    directory], "history": [{key: value, "_step": step}], "config": {key: value}, "images": [file]}``."""
    from wandb.proto import wandb_internal_pb2 as pb

    runs = sorted(glob.glob(str(Path(output_dir) / "wandb" / "offline-run-*")))
    out: dict = {"ids": [], "history": [], "config": {}, "images": []}
    for run in runs:
        [log] = glob.glob(f"{run}/run-*.wandb")
        out["ids"].append(Path(log).stem.removeprefix("run-"))
        for payload in _records(Path(log).read_bytes()):
            record = pb.Record()
            record.ParseFromString(payload)
            kind = record.WhichOneof("record_type")
            if kind == "history":
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
                out["history"].append(row)
            elif kind == "config":
                for item in record.config.update:
                    out["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        out["images"] += sorted(glob.glob(f"{run}/files/media/images/*.png"))
    return out
