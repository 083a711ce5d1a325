"""megatron-core support: the one place that knows megatron's private attribute names.

- :mod:`~chatlearn_mem.mcore.layout`: discovery, one function per question ("which buffers hold
  the params?", "which tensors are the fp32 main weights?"), the methods megatron offers no hook
  for, and the supported-version gate.
- :mod:`~chatlearn_mem.mcore.transient`: what else megatron keeps on the device between steps
  (pipeline activations, the global memory buffer, MoE routing, Transformer Engine state).
- :mod:`~chatlearn_mem.mcore.checkpointing`: megatron's ``dist_checkpointing`` as
  :mod:`chatlearn_mem.checkpoint` uses it, with each release's compatibility shims.
- :mod:`~chatlearn_mem.mcore.checks`: the audit checks of every alias megatron built.
- :mod:`~chatlearn_mem.mcore.cpu`: the megatron patches the CPU backend needs.
"""

from chatlearn_mem.mcore import checks, layout

__all__ = ["checks", "layout"]
