"""The rollout as a vLLM engine (``rollout.engine: vllm``): :class:`VLLMRolloutActor`.

It speaks the same protocol as the other actors of a run (residency, transitions, audit, node
information), so the PPO loop, the timeline and the supervisor treat it like the megatron rollout.
Its weights come from the policy before every generate phase: each tensor-parallel rank of the
policy streams its host store's shards in buckets (:meth:`TrainerActor.megatron_weight_buckets`),
this actor merges one bucket of every rank at a time into Hugging Face tensors and the engine loads
them one tensor at a time (:meth:`chatlearn_mem.engines.vllm_rollout.VLLMRollout.sync_weights`).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from chatlearn_mem.parts import PartsArg
from chatlearn_mem_ray.actors import ManagedActor, process_memory
from chatlearn_mem_ray.config import RolloutConfig, TrainerModelConfig

__all__ = ["VLLMRolloutActor", "engine_bytes"]

_BACKPRESSURE = 2
"""Buckets each policy rank may have produced ahead of the engine: the host holds at most this
many buckets per rank beside the host stores."""


class VLLMRolloutActor(ManagedActor):
    """A :class:`~chatlearn_mem.engines.vllm_rollout.VLLMRollout` of the policy.

    Args:
        name: For messages and logs ("rollout").
        model: The policy's :class:`chatlearn_mem_ray.config.TrainerModelConfig` as a dict (its
            ``from_hf`` checkpoint starts the engine).
        memory: A :class:`chatlearn_mem.MemoryConfig` as a dict (unused: the engine manages its own).
        rollout: The run's :class:`chatlearn_mem_ray.config.RolloutConfig` as a dict.
    """

    def __init__(self, name: str, model: Mapping[str, Any], memory: Mapping[str, Any], rollout: Mapping[str, Any]):
        super().__init__(name, memory)
        self.config = TrainerModelConfig(**model)
        self.rollout = RolloutConfig(**rollout)
        self.engine = None

    def setup(self, init_method: str = "") -> dict:
        """Start the engine from the policy's checkpoint (no process group: the engine has its own)."""
        from chatlearn_mem.engines.vllm_rollout import VLLMRollout

        self.engine = VLLMRollout(
            self.config.from_hf, self.config, seed=self.config.seed, kv_cache_gib=self.rollout.kv_cache_gib
        )
        return {"rank": 0, "start_seconds": self.engine.start_seconds}

    def master_address(self) -> str:
        return ""  # no process group to join

    # -- the work -------------------------------------------------------------------------
    def sync_from(self, policies: list, bucket_bytes: int) -> dict:
        """Load the policy's current weights into the engine, streamed from its actors: one per
        tensor-parallel rank, in rank order, each sending its own shards in buckets of at most
        ``bucket_bytes``; a bucket of every rank is merged into Hugging Face tensors at a time.

        Returns:
            ``{"tensors", "bytes", "seconds", "gb_per_s"}`` of the update.

        Raises:
            EngineError: The streams were incomplete or disagreed, or the engine failed while
                loading (the engine then refuses to generate until a complete update).
        """
        import ray

        from chatlearn_mem.models import hf

        streams = [
            p.megatron_weight_buckets.options(
                num_returns="streaming", _generator_backpressure_num_objects=_BACKPRESSURE
            ).remote(len(policies), int(bucket_bytes))
            for p in policies
        ]

        def steps():
            for refs in zip(*streams):
                yield ray.get(list(refs))

        stats = self.engine.sync_weights(hf.merge_shard_buckets(steps(), self.config))
        return {"tensors": stats.tensors, "bytes": stats.nbytes, "seconds": stats.seconds, "gb_per_s": stats.gb_per_s}

    def generate(
        self, prompts: torch.Tensor, response_length: int, temperature: float, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the megatron rollout's: ``(tokens (B, P+R), logprobs (B, P+R-1))``; the log-probs of
        the prompt's positions, which the engine does not compute, are NaN (PPO reads the last R).
        CUDA: the KV cache wakes here, after the weight update (:meth:`onload` woke the weights)."""
        if "kv_cache" in self.engine.sleeping:
            self.engine.wake_up(tags=["kv_cache"])
        tokens, logprobs = self.engine.generate(prompts, response_length, temperature, seed=seed)
        pad = torch.full((tokens.shape[0], prompts.shape[1] - 1), float("nan"))
        return tokens, torch.cat([pad, logprobs], dim=1)

    # -- the actors' protocol ------------------------------------------------------------
    def offload(self, parts: PartsArg = None, blocking: bool = True) -> list[dict]:
        """CUDA: the engine sleeps (level 2: weights and KV cache released). On the CPU build it
        cannot: said once, and its memory stays resident (and is reported so)."""
        self.engine.sleep(level=2)
        return []

    def onload(self, parts: PartsArg = None, blocking: bool = True) -> list[dict]:
        """CUDA: the engine's weights wake up, for the update that comes next; its KV cache waits
        for :meth:`generate`. The generate phase is then: weights wake, update, KV cache wakes,
        generate, and at the phase's end (:meth:`offload`) sleep level 2."""
        self.engine.wake_up(tags=["weights"])
        return []

    def settle(self) -> dict:
        return {"seconds": 0.0, "stats": []}

    def _engine_bytes(self) -> int:
        return engine_bytes(self.config, self.rollout, cuda=self.engine is None or self.engine.cuda)

    def part_sizes(self) -> dict[str, int]:
        return {"weights": self._engine_bytes()}

    def residency(self) -> dict:
        """What the engine holds, counted as its ``weights`` part (what a generate phase needs:
        weights and KV cache): on the CPU build always (vLLM cannot sleep there), on CUDA while awake."""
        awake = self.engine is not None and "weights" not in self.engine.sleeping
        held = self._engine_bytes() if awake else 0
        out = {
            "device_bytes": held,
            "host_bytes": 0,
            "by_part": {"weights": held},
            "host_by_part": {},
            "resident_by_part": self.part_sizes(),
        }
        return {**out, **process_memory()}

    def audit(self) -> list[str]:
        return []  # no memory manager: the engine's memory is its own


def engine_bytes(config, rollout: RolloutConfig, cuda: bool) -> int:
    """The engine's weights, and on the CPU build its KV cache (``rollout.kv_cache_gib``); on CUDA
    the KV cache is the share of the GPU vLLM takes, which torch's counters show."""
    return _weights_bytes(config) + (0 if cuda else rollout.kv_cache_gib * 2**30)


def _weights_bytes(config) -> int:
    from chatlearn_mem.models import hf

    element = 2 if config.precision == "bf16" else 4
    return element * sum(math.prod(shape) for shape in hf.hf_shapes(config).values())
