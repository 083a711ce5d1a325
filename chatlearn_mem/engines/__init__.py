"""Serving engines beside a megatron trainer. :mod:`chatlearn_mem.engines.vllm_rollout` is the public
surface (the vLLM wrapper, its errors, the canary and the mismatch bounds); beside it
:mod:`~chatlearn_mem.engines.digest` (the weight digest both sides of a sync compute),
:mod:`~chatlearn_mem.engines.vllm_install` (the pre-flight check of a vLLM install) and
:mod:`~chatlearn_mem.engines.vllm_log` (where the engine's log goes). Nothing here imports vLLM
until an engine starts."""
