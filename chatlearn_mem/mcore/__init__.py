"""megatron-core support: the one place that knows megatron's private attribute names.

- :mod:`~chatlearn_mem.mcore.layout`: discovery, one function per question ("which buffers hold
  the params?", "which tensors are the fp32 main weights?") and the supported-version gate.
- :mod:`~chatlearn_mem.mcore.checks`: the audit checks of every alias megatron built.
- :mod:`~chatlearn_mem.mcore.cpu`: the megatron patches the CPU backend needs.
"""

from chatlearn_mem.mcore import checks, layout

__all__ = ["checks", "layout"]
