"""The benchmark's trainer: built and trained one step, its process group, and a checksum of its
parts' bytes (bit-exactness after every method)."""

from __future__ import annotations

import tempfile
import warnings

import torch

from chatlearn_mem_bench.config import COPY_PARTS
from chatlearn_mem_bench.methods import logical_tensors

__all__ = ["build_trainer", "checksum", "init_distributed"]


def checksum(mm, trainer, parts=COPY_PARTS) -> list[int]:
    """Integer checksum of every tensor ``parts`` hold (bit-exactness after all methods)."""
    out = []
    with torch.no_grad():
        for part in parts:
            for t in logical_tensors(mm, trainer, part):
                flat = t.detach().reshape(-1)
                iview = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
                out.append(int(flat.view(iview).sum(dtype=torch.int64)))
    return out


def build_trainer(cfg):
    """The benchmark's trainer for ``cfg`` (a :class:`~chatlearn_mem_bench.config.BenchConfig`),
    after one training step, so that its optimizer states exist; the process group is initialised
    first when there is none."""
    from chatlearn_mem.models import gpt

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's notices about apex / TE / deprecations
        init_distributed(tmp)
        trainer = gpt.build_gpt_trainer(cfg.trainer)
        trainer.train_step(gpt.synthetic_batch(cfg.trainer, 0, batch_size=cfg.batch_size))
    return trainer


def init_distributed(tmp: str) -> None:
    from chatlearn_mem.models import gpt

    if not torch.distributed.is_initialized():
        # A file init method: no TCP port to collide with other jobs on the machine.
        gpt.init_distributed(init_method=f"file://{tmp}/dist_init", cpu_backend=True)
    else:
        gpt.init_distributed(cpu_backend=True)
