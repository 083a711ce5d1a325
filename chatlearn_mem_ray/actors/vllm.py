"""A vLLM engine as a loop's rollout (``rollout.engine: vllm``): :class:`VLLMRolloutActor`.

It speaks the same protocol as the other actors of a run (residency, transitions, audit, node
information), so the service, the timeline and the supervisor treat it like the megatron rollout.
Its weights come from the trainer it follows: each tensor-parallel rank of the trainer streams its
host store's shards in buckets (:meth:`TrainerActor.megatron_weight_buckets`), this actor merges
one bucket of every rank at a time into Hugging Face tensors and the engine loads them one tensor
at a time and verifies them bit for bit
(:meth:`chatlearn_mem.engines.vllm_rollout.VLLMRollout.sync_weights`). A sync that does not
verify comes back as a record the driver turns into a ``WeightSyncError`` before the engine samples.

The engine's own log goes to ``<output_dir>/<name>_vllm.log``; what matters in it is said in one
line. Host memory during a sync is measured on both sides (:class:`PeakRSS`): each record holds the
peak growth of this actor's and of every trainer rank's private resident memory over the sync, and
apart from it the shared memory (Ray's object store) they mapped.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any, Mapping, Optional

import torch

from chatlearn_mem.parts import PartsArg
from chatlearn_mem_ray.actors.managed import ManagedActor, PeakRSS, process_memory
from chatlearn_mem_ray.config import RolloutConfig, TrainerModelConfig

__all__ = ["VLLMRolloutActor", "engine_bytes"]

_BACKPRESSURE = 2
"""Buckets each trainer rank may have produced ahead of the engine (Ray's streaming generator)."""


class VLLMRolloutActor(ManagedActor):
    """A :class:`~chatlearn_mem.engines.vllm_rollout.VLLMRollout` of the policy.

    Args:
        name: For messages and logs ("rollout").
        model: The policy's :class:`chatlearn_mem_ray.config.TrainerModelConfig` as a dict (its
            ``from_hf`` checkpoint starts the engine).
        memory: A :class:`chatlearn_mem.MemoryConfig` as a dict (unused: the engine manages its own).
        rollout: The run's :class:`chatlearn_mem_ray.config.RolloutConfig` as a dict.
        log_file: Where the engine's own log goes (None: the console, as vLLM does).
        verify: Verify every sync bit for bit (``memory.verify_sync``).
    """

    def __init__(
        self,
        name: str,
        model: Mapping[str, Any],
        memory: Mapping[str, Any],
        rollout: Mapping[str, Any],
        log_file: Optional[str] = None,
        verify: bool = True,
    ):
        super().__init__(name, memory)
        # said once by the driver in its own words (run_loop): not a warning with a file path per run
        warnings.filterwarnings("ignore", message="vLLM's CPU build cannot sleep")
        self.config = TrainerModelConfig(**model)
        self.rollout = RolloutConfig(**rollout)
        self.log_file, self.verify = log_file, verify
        self.engine = None

    def setup(self, init_method: str = "") -> dict:
        """Start the engine from the policy's checkpoint (no process group: the engine has its own)."""
        from chatlearn_mem.engines.vllm_rollout import VLLMRollout

        r = self.rollout
        self.engine = VLLMRollout(
            self.config.from_hf,
            self.config,
            seed=self.config.seed,
            kv_cache_gib=r.kv_cache_gib,
            gpu_memory_utilization=r.gpu_memory_utilization,
            max_model_len=r.max_model_len,
            enforce_eager=r.enforce_eager,
            log_file=self.log_file,
            verify=self.verify,
        )
        return {"rank": 0, "start_seconds": self.engine.start_seconds}

    def master_address(self) -> str:
        return ""  # no process group to join

    # -- the work -------------------------------------------------------------------------
    def sync_from(self, policies: list, bucket_bytes: int) -> dict:
        """Load the trainer's current weights into the engine, streamed from its actors (one per
        tensor-parallel rank, in rank order, each sending its own shards in buckets of at most
        ``bucket_bytes``; a bucket of every rank merged into Hugging Face tensors at a time; a
        torch-native policy's one rank sends Hugging Face tensors as they are), and verify them.

        Returns:
            ``{"tensors", "bytes", "seconds", "gb_per_s", "verified", "digest", "hash_seconds",
            "verify_seconds", "engine_peak_rss_bytes", "policy_peak_rss_bytes"}``; when the update
            failed or did not verify, ``verified`` is False and ``error`` (and ``param``, the first
            parameter that differs) say why: the engine then refuses to sample until a sync verifies.
        """
        import ray

        from chatlearn_mem.engines.vllm_rollout import EngineError, SyncVerificationError
        from chatlearn_mem_ray.actors.weight_stream import hf_weight_stream

        t0 = time.perf_counter()
        with PeakRSS() as peak:
            try:
                stats = self.engine.sync_weights(hf_weight_stream(policies, self.config, bucket_bytes, _BACKPRESSURE))
            except (SyncVerificationError, EngineError) as e:
                failed = {"verified": False, "error": str(e), "param": getattr(e, "param", None)}
            else:
                failed = None
        policy_peaks = ray.get([p.stream_peak_rss_bytes.remote() for p in policies])
        memory = {
            "engine_peak_rss_bytes": peak.bytes,  # private memory: what the process itself holds
            "policy_peak_rss_bytes": max(p for p, _ in policy_peaks),
            "engine_peak_shared_bytes": peak.shared_bytes,  # Ray's object store, mapped
            "policy_peak_shared_bytes": max(s for _, s in policy_peaks),
        }
        if failed is not None:
            return {**failed, **memory, "seconds": time.perf_counter() - t0}
        return {
            "tensors": stats.tensors,
            "bytes": stats.nbytes,
            "seconds": stats.seconds,
            "gb_per_s": stats.gb_per_s,
            "verified": stats.digest is not None,
            "digest": stats.digest,
            "hash_seconds": stats.hash_seconds,
            "verify_seconds": stats.verify_seconds,
            **memory,
        }

    def generate(
        self, prompts: torch.Tensor, response_length: int, temperature: float, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the megatron rollout's: ``(tokens (B, P+R), logprobs (B, P+R-1))``; the log-probs of
        the prompt's positions, which the engine does not compute, are NaN (PPO reads the last R).
        CUDA: the KV cache wakes here, after the weight update (:meth:`onload` woke the weights)."""
        self._wake_kv_cache()
        tokens, logprobs = self.engine.generate(prompts, response_length, temperature, seed=seed)
        pad = torch.full((tokens.shape[0], prompts.shape[1] - 1), float("nan"))
        return tokens, torch.cat([pad, logprobs], dim=1)

    def generate_rows(
        self,
        rows: list[list[int]],
        response_length: int,
        temperature: float,
        seed: int,
        eos_ids: tuple[int, ...] = (),
        pad_id: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """As the megatron rollout's :meth:`~chatlearn_mem_ray.actors.inference.InferenceActor.generate_rows`
        (prompts of any length, a stop at ``eos_ids``): ``(tokens, logprobs, response_lengths)``,
        the log-probs NaN off the response."""
        self._wake_kv_cache()
        return self.engine.generate_rows(rows, response_length, temperature, seed, eos_ids, pad_id)

    def _wake_kv_cache(self) -> None:
        if "kv_cache" in self.engine.sleeping:
            self.engine.wake_up(tags=["kv_cache"])

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
        """The engine's weights and KV cache as it allocated them (a running engine), else the estimate."""
        if self.engine is not None:
            m = self.engine.memory()
            return int(m.weights_bytes + m.kv_cache_bytes)
        return engine_bytes(self.config, self.rollout, cuda=torch.cuda.is_available())

    def part_sizes(self) -> dict[str, int]:
        """The engine as one item of a residency plan, its ``weights`` part: weights and KV cache
        (what a generate phase needs), the sizes the engine reports."""
        return {"weights": self._engine_bytes()}

    def residency(self) -> dict:
        """What the engine holds, weights and KV cache, counted as its ``weights`` part: on the CPU
        build always (vLLM cannot sleep there), on CUDA while awake."""
        awake = self.engine is not None and not self.engine.asleep
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
    """Before the engine starts: its weights, and on the CPU build its KV cache
    (``rollout.kv_cache_gib``). On CUDA the KV cache is what vLLM makes of
    ``rollout.gpu_memory_utilization`` once it sees the device, known only then (the plan made
    after the start uses the engine's own report)."""
    return _weights_bytes(config) + (0 if cuda else rollout.kv_cache_gib * 2**30)


def _weights_bytes(config) -> int:
    from chatlearn_mem.models import hf

    element = 2 if config.precision == "bf16" else 4
    return element * sum(math.prod(shape) for shape in hf.hf_shapes(config).values())
