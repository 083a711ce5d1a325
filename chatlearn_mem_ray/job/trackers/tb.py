"""TensorBoard through ``torch.utils.tensorboard`` (the ``tensorboard`` package writes the event files)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["TensorBoard"]


class TensorBoard:
    """Event files under ``directory``; a resumed run hides what its lost iterations had logged
    (``purge_step``: every event after the checkpoint's iterations)."""

    run_id = None

    def __init__(self, directory: Path, done: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.where = str(directory)
        self.writer = SummaryWriter(log_dir=str(directory), purge_step=done + 1 if done else None)

    def log_config(self, config: dict) -> None:
        from torch.utils.tensorboard.summary import hparams

        text = json.dumps(config, indent=1, sort_keys=True)
        self.writer.add_text("config", f"```\n{text}\n```", 0)
        for summary in hparams({k: v for k, v in config.items()}, {}):  # the HParams tab
            self.writer.file_writer.add_summary(summary)
        self.writer.flush()

    def log_metrics(self, metrics: dict, step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_image(self, tag: str, path: Path, step: int) -> None:
        import matplotlib.image

        image = matplotlib.image.imread(str(path))  # (H, W, 4) floats in [0, 1]
        self.writer.add_image(tag, image[..., :3], step, dataformats="HWC")
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()
