"""Models built from megatron-core's public API, for the PPO app, the benchmark and the examples.

- :mod:`~chatlearn_mem.models.gpt`: GPT trainers, Llama / Qwen2-shaped too (DDP, the distributed
  optimizer, TP / PP / virtual PP / MoE, a value-head critic) and ``init_distributed``.
- :mod:`~chatlearn_mem.models.hf`: Llama and Qwen2 trainers from Hugging Face checkpoints, and
  their weights back to Hugging Face files (the ``[hf]`` extra).

The memory managers do not import this package: they take any megatron-core model and optimizer.
"""
