"""A small megatron-core testbed: not the memory manager, what it is exercised with.

- :mod:`~chatlearn_mem.testbed.gpt`: GPT trainers (DDP, the distributed optimizer, TP / PP /
  virtual PP / MoE, a value-head critic) built from megatron-core's public API, for the examples,
  the tests, the benchmarks and the PPO recipe.
- :mod:`~chatlearn_mem.testbed.cpu_backend`: runs megatron-core's CUDA-only code paths on a
  CPU-only torch build. It patches ``torch.cuda`` and threading process-wide, so it is never
  installed by the manager itself; ``gpt.init_distributed`` installs it when CUDA is missing.

Nothing in the manager imports this package.
"""

from chatlearn_mem.testbed import cpu_backend, gpt

__all__ = ["cpu_backend", "gpt"]
