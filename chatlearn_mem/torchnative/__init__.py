"""Plain PyTorch support: the one place that knows torch's private attribute names.

- :mod:`~chatlearn_mem.torchnative.layout`: discovery, one function per question (DDP's gradient
  buckets and hooks, ZeroRedundancyOptimizer's partition and buckets, FSDP2's sharded parameters,
  which optimizer state stays on the host).
- :mod:`~chatlearn_mem.torchnative.backend`: the trainer manager's backend for a torch model.
- :mod:`~chatlearn_mem.torchnative.checks`: the audit checks of every alias torch's wrappers built.
- :mod:`~chatlearn_mem.torchnative.checkpointing`: checkpoints in ``torch.distributed.checkpoint``'s
  format, written from the host store.
"""

from chatlearn_mem.torchnative import checks, layout

__all__ = ["checks", "layout"]
