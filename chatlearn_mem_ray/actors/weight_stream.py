"""A trainer's weights as Hugging Face tensors, streamed from its actors' host stores: what a weight
sync (:class:`~chatlearn_mem_ray.actors.vllm.VLLMRolloutActor`) and an export
(:func:`chatlearn_mem_ray.service.export.export_hf`) both read.

A megatron trainer's tensor-parallel ranks each stream their own shards in megatron naming
(``megatron_weight_buckets``), one bucket of every rank merged into Hugging Face tensors at a time
(:func:`chatlearn_mem.models.hf.merge_shard_buckets`); a torch-native trainer (data parallel only)
streams its one rank's whole model already in Hugging Face naming (``hf_weight_buckets``). Either
way no process holds a second copy of the model: each rank sends views of its host store bucket
by bucket, with at most ``backpressure`` buckets in flight.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from chatlearn_mem_ray.actors.wire import from_wire
from chatlearn_mem_ray.config.model import TrainerModelConfig

__all__ = ["hf_weight_stream"]


def hf_weight_stream(
    senders: Sequence, config: TrainerModelConfig, bucket_bytes: int, backpressure: int = 2
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(Hugging Face name, tensor)`` of every tensor of the trainer ``config`` describes, in the
    checkpoint's order, streamed from ``senders`` (its actors: a megatron trainer's tensor-parallel
    ranks in rank order; a torch-native trainer's one rank). The tensors are views of the received
    buckets (read-only: copy what is kept).

    Raises:
        ValueError: A torch-native trainer given more than one sender; an incomplete stream (as
            :func:`~chatlearn_mem.models.hf.merge_shard_buckets` says).
        ray.exceptions.RayActorError, ray.exceptions.RayTaskError: A sender died or raised.
    """
    import ray

    from chatlearn_mem.models import hf

    stream = dict(num_returns="streaming", _generator_backpressure_num_objects=backpressure)
    if config.backend == "torch":
        if len(senders) != 1:
            raise ValueError(f"a torch-native trainer streams from one rank, got {len(senders)}")
        for ref in senders[0].hf_weight_buckets.options(**stream).remote(int(bucket_bytes)):
            yield from from_wire(ray.get(ref))
        return
    streams = [a.megatron_weight_buckets.options(**stream).remote(len(senders), int(bucket_bytes)) for a in senders]

    def steps():
        for refs in zip(*streams):
            yield [from_wire(b) for b in ray.get(list(refs))]

    yield from hf.merge_shard_buckets(steps(), config)
