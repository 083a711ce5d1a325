"""Serving engines beside a megatron trainer: :mod:`chatlearn_mem.engines.vllm_rollout`."""
