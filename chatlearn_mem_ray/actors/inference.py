"""A model with no optimizer as an actor (the policy's own rollout, or a frozen reference) under an
:class:`chatlearn_mem.InferenceMemoryManager`: megatron-core's GPT (:class:`InferenceActor`) or the
Hugging Face causal LM of a torch-native policy (:class:`TorchInferenceActor`). The vLLM engine's
actor is :class:`chatlearn_mem_ray.actors.vllm.VLLMRolloutActor`."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from chatlearn_mem import InferenceMemoryManager, OffloadedError, Part
from chatlearn_mem_ray.actors import modeling
from chatlearn_mem_ray.actors.managed import ManagedActor, to_device
from chatlearn_mem_ray.config import TrainerModelConfig

__all__ = ["InferenceActor", "TorchInferenceActor"]


class InferenceActor(ManagedActor):
    """A GPT with no optimizer: the rollout engine or the frozen reference.

    Args:
        name: For messages and logs ("rollout").
        model: The :class:`chatlearn_mem_ray.config.TrainerModelConfig` of the policy it copies.
        memory: A :class:`chatlearn_mem.MemoryConfig` as a dict.
    """

    def __init__(self, name: str, model: Mapping[str, Any], memory: Mapping[str, Any]):
        super().__init__(name, memory)
        self.config = TrainerModelConfig(**model)
        self.model = None

    def setup(self, init_method: str) -> dict:
        """Create a one-rank process group and build the model (same init as the policy's)."""
        from chatlearn_mem.models import gpt

        self._init_distributed(0, 1, 1, init_method, self.config.seed)
        self.model = gpt.build_gpt_model(self.config)
        if self.config.from_hf is not None:
            from chatlearn_mem.models import hf

            hf.load_hf_weights(self.model, self.config.from_hf)
        self.model.eval()
        self.manager = InferenceMemoryManager(self.model, self.memory)
        return {"rank": 0}

    def generate(
        self, prompts: torch.Tensor, response_length: int, temperature: float, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample responses at ``temperature`` (> 0) and score them.

        Returns:
            ``(tokens (B, P+R), logprobs (B, P+R-1))``: the sequences and the log-probability of
            each next token under the distribution they were sampled from.
        """
        g = torch.Generator().manual_seed(seed)
        tokens = modeling.generate(self.model, to_device(prompts), response_length, temperature, g)
        return tokens.cpu(), self.logprobs(tokens, temperature)

    def generate_rows(
        self,
        rows: list[list[int]],
        response_length: int,
        temperature: float,
        seed: int,
        eos_ids: tuple[int, ...] = (),
        pad_id: int = 0,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
        """Sample a response after each prompt of ``rows`` (token ids, any lengths), stopping at a
        token of ``eos_ids`` (see :func:`chatlearn_mem_ray.actors.modeling.generate_rows`);
        ``temperature`` 0 decodes greedily.

        Returns:
            ``(tokens (B, L), logprobs (B, L-1), response_lengths (B,))``: right-padded sequences,
            the log-probability of each next token at ``temperature`` (meaningful on the response
            positions; None when greedy), and each response's length (its EOS included).
        """
        device = torch.device("cuda") if torch.cuda.is_available() else None
        tokens, lengths = modeling.generate_rows(
            self.model, rows, response_length, temperature, seed, eos_ids, pad_id, device
        )
        return tokens, self.logprobs(tokens, temperature) if temperature > 0 else None, lengths

    @torch.no_grad()
    def logprobs(self, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """(B, T-1) log-probability of each next token of ``tokens`` (B, T) at ``temperature``."""
        return modeling.sequence_logprobs(self.model, to_device(tokens), temperature).cpu()

    @torch.no_grad()
    def load_weights(self, partition_dims: Mapping[str, int], *shards: Mapping[str, torch.Tensor]) -> list[str]:
        """Copy a policy's weights in (the weights must be onloaded).

        Args:
            partition_dims: As returned by :meth:`TrainerActor.weights_for_sync`.
            shards: The policy's state dict from each tensor-parallel rank, in rank order (top-level
                arguments, so Ray resolves object refs to them without a trip through the driver).

        Returns:
            The digests of the weights now held, split as the shards were
            (see :meth:`weights_digest`).

        Raises:
            ValueError: Names or shapes do not match this model; nothing is copied then.
            OffloadedError: The weights are offloaded.
        """
        if self.manager.is_offloaded(Part.WEIGHTS):
            raise OffloadedError(f"{self.name}: load_weights() needs the weights on the device; call onload() first")
        state = modeling.merge_tensor_parallel(shards, partition_dims or {})
        own = {n: t for n, t in self.model.state_dict(keep_vars=True).items() if isinstance(t, torch.Tensor)}
        missing, unexpected = own.keys() - state.keys(), state.keys() - own.keys()
        wrong = [
            f"{n}: {tuple(state[n].shape)} vs {tuple(own[n].shape)}"
            for n in own.keys() & state.keys()
            if state[n].shape != own[n].shape
        ]
        if missing or unexpected or wrong:
            raise ValueError(
                f"{self.name}: weights do not match the model (missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}, shape mismatches {wrong})"
            )
        for n, t in own.items():
            t.copy_(state[n])
        return self.weights_digest(len(shards), partition_dims)

    def weights_digest(
        self, tensor_parallel_size: int = 1, partition_dims: Optional[Mapping[str, int]] = None
    ) -> list[str]:
        """SHA-256 of the weights (see :func:`chatlearn_mem_ray.actors.modeling.weights_digest`), one per
        tensor-parallel shard when split as a trainer with ``tensor_parallel_size`` ranks holds them."""
        state = self.manager.weights_state_dict()
        return [
            modeling.weights_digest(s)
            for s in modeling.split_tensor_parallel(state, partition_dims or {}, tensor_parallel_size)
        ]


class TorchInferenceActor(InferenceActor):
    """The rollout or reference copy of a torch-native policy (``backend: torch``): the same Hugging
    Face causal LM, built from the same config and seed; never imports megatron. Arguments as
    :class:`InferenceActor`'s."""

    def setup(self, init_method: str) -> dict:
        """Build the model (no process group: one rank)."""
        from chatlearn_mem_ray.actors.causal_lm import build_causal_lm

        self.model = build_causal_lm(self.config)
        self.model.eval()
        self.manager = InferenceMemoryManager(self.model, self.memory)
        return {"rank": 0}
