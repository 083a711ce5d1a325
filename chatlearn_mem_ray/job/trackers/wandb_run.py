"""Weights & Biases through ``wandb``: online with a key, else offline (synced later with ``wandb sync``)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Optional

__all__ = ["WandB"]


def _has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


class WandB:
    """A W&B run in ``<output_dir>/wandb``; ``run_id`` continues an earlier one (``resume="allow"``)."""

    def __init__(self, settings, output_dir: Path, name: str, run_id: Optional[str] = None):
        import wandb

        mode = settings.wandb_mode if settings.wandb_mode != "auto" else ("online" if _has_key() else "offline")
        self.run_id = run_id or secrets.token_hex(4)
        output_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=settings.project,
            entity=settings.wandb_entity,
            name=name,
            id=self.run_id,
            resume="allow",
            dir=str(output_dir),
            mode=mode,
            settings=wandb.Settings(console="off", quiet=True, silent=True, x_disable_stats=True),
            reinit="create_new",
        )
        self.where = f"{mode} run {self.run_id} in {Path(self.run.dir).parent}"

    def log_config(self, config: dict) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_image(self, tag: str, path: Path, step: int) -> None:
        import wandb

        self.run.log({tag: wandb.Image(str(path))}, step=step)

    def close(self, status: str) -> None:
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
