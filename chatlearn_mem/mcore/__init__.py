"""megatron-core support: the one place that knows megatron's private attribute names."""

from chatlearn_mem.mcore import layout

__all__ = ["layout"]
