"""Models built from megatron-core's public API, for the PPO app, the benchmark and the examples.

- :mod:`~chatlearn_mem.models.gpt`: GPT trainers (DDP, the distributed optimizer, TP / PP /
  virtual PP / MoE, a value-head critic) and ``init_distributed``.

The memory managers do not import this package: they take any megatron-core model and optimizer.
"""
