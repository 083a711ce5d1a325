"""One rank of a trainer as an actor, under a :class:`chatlearn_mem.TrainerMemoryManager`: a
megatron-core policy with an LM head or critic with a value head (:class:`TrainerActor`), or a
torch-native policy, a Hugging Face causal LM in torch's DDP (:class:`TorchTrainerActor`, which
never imports megatron). Plain classes: :mod:`chatlearn_mem_ray.service.colocation` turns them into
Ray actors; tests may use them in-process."""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable, Literal, Mapping, Optional

import torch

from chatlearn_mem import Part, TrainerMemoryManager
from chatlearn_mem_ray.actors import modeling
from chatlearn_mem_ray.actors.managed import ManagedActor, PeakRSS, to_device
from chatlearn_mem_ray.config import TrainerModelConfig

__all__ = ["TorchTrainerActor", "TrainerActor"]


class TrainerActor(ManagedActor):
    """One rank of a trainer.

    Args:
        name: For messages and logs ("policy_0").
        head: ``lm`` (a language model, a policy: outputs are next-token log-probs) or ``value``
            (a critic's scalar head: outputs are values).
        model: A :class:`chatlearn_mem_ray.config.TrainerModelConfig` as a dict.
        memory: A :class:`chatlearn_mem.MemoryConfig` as a dict.
    """

    def __init__(self, name: str, head: Literal["lm", "value"], model: Mapping[str, Any], memory: Mapping[str, Any]):
        super().__init__(name, memory)
        if head not in ("lm", "value"):
            raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
        self.head = head
        self.config = TrainerModelConfig(**model)
        self.trainer = None
        self._save = None  # the checkpoint save in progress (chatlearn_mem.checkpoint.SaveHandle)

    def setup(self, rank: int, world_size: int, tensor_model_parallel_size: int, init_method: str) -> dict:
        """Join the trainer's process group, build the model, optimizer and memory manager.

        Returns:
            ``{"rank", "dp_rank", "dp_size", "tp_rank"}``.
        """
        from chatlearn_mem.models import gpt

        # first: on a CPU host the backend imports megatron-core the faster way (mcore.cpu.patch_for_cpu)
        self._init_distributed(rank, world_size, tensor_model_parallel_size, init_method, self.config.seed)
        from megatron.core import parallel_state

        self.trainer = gpt.build_gpt_trainer(self.config, value_head=self.head == "value")
        if self.config.from_hf is not None:  # before the manager: the optimizer restarts from these weights
            from chatlearn_mem.models import hf

            hf.load_hf_weights(self.trainer.model, self.config.from_hf, optimizer=self.trainer.optimizer)
        self.manager = TrainerMemoryManager(self.trainer.model, self.trainer.optimizer, self.memory)
        return {
            "rank": rank,
            "dp_rank": parallel_state.get_data_parallel_rank(),
            "dp_size": parallel_state.get_data_parallel_world_size(),
            "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        }

    def part_sizes(self) -> dict[str, int]:
        """As :meth:`ManagedActor.part_sizes`; before the optimizer's first step, which creates
        Adam's states, their size is what that step will allocate: ``exp_avg`` and ``exp_avg_sq`` like
        each main weight, and torch's 4-byte ``step`` counter, which lives on the CPU (so on the
        device only when the device is the CPU)."""
        sizes = super().part_sizes()
        if not sizes.get(Part.OPTIMIZER_STATES.value):
            from chatlearn_mem.mcore import layout

            params = [
                p
                for leaf in layout.leaf_optimizers(self.trainer.optimizer)
                for g in layout.torch_optimizer(leaf).param_groups
                for p in g["params"]
            ]
            sizes[Part.OPTIMIZER_STATES.value] = sum(
                2 * p.numel() * p.element_size() + 4 * (p.device.type == "cpu") for p in params
            )
        return sizes

    def _outputs(self, tokens: torch.Tensor, temperature: float = 1.0, entropy: bool = False):
        model = self.trainer.model
        if self.head == "value":
            return modeling.sequence_values(model, tokens)  # (B, T)
        if entropy:
            return modeling.sequence_logprobs_entropy(model, tokens, temperature)  # (B, T-1) twice
        return modeling.sequence_logprobs(model, tokens, temperature)  # (B, T-1)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """Forward only: log-probs at ``temperature`` (lm head, (B, T-1)) or values (value head, (B, T))."""
        return self._outputs(to_device(tokens), temperature).cpu()

    def train(
        self,
        batch: Mapping[str, torch.Tensor],
        loss_fn: Callable,
        epochs: int,
        minibatch_size: int,
        seed: int,
        temperature: float = 1.0,
        entropy: bool = False,
    ) -> dict[str, float]:
        """Optimizer steps on this rank's share of a batch.

        Args:
            batch: Tensors with the batch as first dimension; must include ``tokens``.
            loss_fn: ``loss_fn(outputs, minibatch) -> (loss, {metric: float})`` where outputs are
                what :meth:`forward` returns, with gradients.
            epochs: Passes over the batch.
            minibatch_size: Rows per optimizer step.
            seed: Shuffles the rows, identically on every rank.
            temperature: Of the policy's log-probs (the rollout's sampling temperature).
            entropy: An lm head's outputs are ``(logprobs, entropy)``: the entropy (B, T-1) of each
                next-token distribution at ``temperature``, without gradients (for the log).

        Returns:
            Mean of each metric over the steps, plus ``grad_norm`` and ``skipped_steps``.
        """
        batch = {k: to_device(v) for k, v in batch.items()}
        n = batch["tokens"].shape[0]
        g = torch.Generator().manual_seed(seed)
        sums: dict[str, float] = {}
        steps = skipped = 0
        for _ in range(epochs):
            order = torch.randperm(n, generator=g)
            for start in range(0, n, minibatch_size):
                idx = order[start : start + minibatch_size].to(batch["tokens"].device)
                mb = {k: v[idx] for k, v in batch.items()}
                self._zero_grads()
                loss, metrics = loss_fn(self._outputs(mb["tokens"], temperature, entropy), mb)
                loss.backward()
                ok, grad_norm = self._step()
                skipped += not ok
                metrics = dict(metrics, loss=loss.item(), grad_norm=float(grad_norm or 0.0))
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                steps += 1
        return {**{k: v / steps for k, v in sums.items()}, "skipped_steps": float(skipped)}

    def _zero_grads(self) -> None:
        self.trainer.model.zero_grad_buffer()
        self.trainer.optimizer.zero_grad()

    def _step(self) -> tuple[bool, Optional[float]]:
        """Finish the gradients' reduction and step: ``(stepped, grad norm)``."""
        self.trainer.model.finish_grad_sync()
        ok, grad_norm, _ = self.trainer.optimizer.step()
        return bool(ok), grad_norm

    def megatron_weight_buckets(self, tp: int, bucket_bytes: int):
        """This rank's own megatron weights in buckets of at most ``bucket_bytes``, read from the
        host store when asleep (:func:`chatlearn_mem.models.hf.megatron_shard_buckets`: every
        tensor-parallel rank's buckets hold the same names): a generator, called with
        ``num_returns="streaming"`` by the vLLM rollout, which merges the ranks' buckets. The peak
        growth of this process's resident set while it streams is kept for
        :meth:`stream_peak_rss_bytes`."""
        from chatlearn_mem.models import hf
        from chatlearn_mem_ray.actors.wire import to_wire

        with PeakRSS() as peak:
            try:  # views of the host store, sent as numpy views: the object store holds the only copy
                for bucket in hf.megatron_shard_buckets(
                    dict(self.manager.iter_weights()), self.config, int(tp), int(bucket_bytes)
                ):
                    yield to_wire(bucket)
            finally:
                self._stream_peak = peak
        self._stream_peak = peak

    def stream_peak_rss_bytes(self) -> tuple[int, int]:
        """How far this process's private and shared resident memory grew over its last
        :meth:`megatron_weight_buckets` (see :class:`PeakRSS`)."""
        peak = getattr(self, "_stream_peak", None)
        return (int(peak.bytes), int(peak.shared_bytes)) if peak is not None else (0, 0)

    def host_weights_copy_seconds(self, bucket_bytes: int) -> dict:
        """A plain copy of this rank's weights, read where :meth:`megatron_weight_buckets` reads them
        (the host store when asleep), through one preallocated host buffer of ``bucket_bytes`` (or
        of the largest tensor, when larger): ``{"seconds", "bytes"}`` of the second of two passes
        (the first touches the buffer's pages). The vLLM weight sync's baseline; it holds no second
        copy of the weights."""
        import time

        tensors = [t for _, t in self.manager.iter_weights() if torch.is_tensor(t)]
        size = max([int(bucket_bytes)] + [t.numel() * t.element_size() for t in tensors])
        buffer = torch.empty(size, dtype=torch.uint8)
        for _ in range(2):
            t0 = time.perf_counter()
            at = 0
            for src in tensors:
                n = src.numel() * src.element_size()
                if at + n > size:  # the buffer is full: the next bucket starts over it
                    at = 0
                buffer[at : at + n].view(src.dtype).view(src.shape).copy_(src)
                at += n
            seconds = time.perf_counter() - t0
        return {"seconds": seconds, "bytes": sum(t.numel() * t.element_size() for t in tensors)}

    def weights_for_sync(
        self, with_digest: bool = False
    ) -> tuple[dict[str, torch.Tensor], dict[str, int], Optional[str]]:
        """This rank's weights (from the host store when offloaded); per name, the dimension
        tensor parallelism split it along (-1: replicated); and, with ``with_digest``, their
        SHA-256 (see :func:`chatlearn_mem_ray.actors.modeling.weights_digest`), computed from the same read."""
        state = self.manager.weights_state_dict()
        return state, self._partition_dims(state), modeling.weights_digest(state) if with_digest else None

    def _partition_dims(self, state: Mapping[str, torch.Tensor]) -> dict[str, int]:
        params = dict(self.trainer.model.module.named_parameters())
        return {
            name: (
                getattr(params[name], "partition_dim", -1)
                if getattr(params.get(name), "tensor_model_parallel", False)
                else -1
            )
            for name in state
        }

    def weights_digest(self) -> str:
        """SHA-256 of this rank's weights (see :func:`chatlearn_mem_ray.actors.modeling.weights_digest`)."""
        return modeling.weights_digest(self.manager.weights_state_dict())

    # -- checkpoints ----------------------------------------------------------------------
    def checkpoint_nbytes(self, resharding: bool = True) -> int:
        """About how many bytes one checkpoint of this rank takes (see
        :func:`chatlearn_mem.checkpoint.estimate_checkpoint_nbytes`, which also refuses a
        ``resharding`` this megatron-core cannot save, before the first save)."""
        from chatlearn_mem.checkpoint import estimate_checkpoint_nbytes

        return estimate_checkpoint_nbytes(self.manager, resharding)

    def save_checkpoint(
        self, root: str, step: int, async_: bool, metadata: Optional[dict] = None, resharding: bool = True
    ) -> dict:
        """Start saving this rank's whole state to ``<root>/step_<step>`` (every rank of the trainer
        calls it; a collective); while offloaded it is read from the host store. With ``async_`` a
        background thread writes it: :meth:`finish_checkpoint` completes it. ``resharding``: see
        :func:`chatlearn_mem.checkpoint.save_checkpoint`.

        Returns:
            ``{"nbytes": tensor bytes this rank writes, "seconds": time in this call}``.
        """
        import time

        from chatlearn_mem.checkpoint import save_checkpoint

        if self._save is not None:
            raise RuntimeError(
                f"{self.name}: a checkpoint save ({self._save.path}) is still open; call finish_checkpoint() first"
            )
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._save = save_checkpoint(
                self.manager, root, step, async_=async_, metadata=metadata, resharding=resharding
            )
        return {"nbytes": self._save.nbytes, "seconds": time.perf_counter() - t0}

    def finish_checkpoint(self) -> dict:
        """Wait for the open save's write and commit it (every rank; a collective).

        Returns:
            ``{"path", "nbytes", "seconds": from the save's start to its commit}``; ``{}`` when no
            save is open.
        """
        handle, self._save = self._save, None
        if handle is None:
            return {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            path = handle.wait()
        return {"path": path, "nbytes": handle.nbytes, "seconds": handle.seconds}

    def load_checkpoint(self, path: str, verify: bool = True) -> dict:
        """Load a checkpoint saved by :meth:`save_checkpoint` (every rank; the trainer onloaded first
        when asleep). Returns the checkpoint's metadata (see :func:`chatlearn_mem.checkpoint.load_checkpoint`;
        ``verify``: read the files back against the manifest first, the ranks sharing them)."""
        from chatlearn_mem.checkpoint import load_checkpoint

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.manager.onload()
            return load_checkpoint(self.manager, path, verify=verify)


class TorchTrainerActor(TrainerActor):
    """One data-parallel rank of a torch-native policy (``backend: torch``): a Hugging Face causal LM
    (:func:`~chatlearn_mem_ray.actors.causal_lm.build_causal_lm`), in torch's
    ``DistributedDataParallel`` with gradient bucket views on several ranks, stepped by AdamW with
    its gradients clipped at ``clip_grad``, under the torch-native
    :class:`~chatlearn_mem.TrainerMemoryManager`. It never imports megatron. Arguments as
    :class:`TrainerActor`'s; the head is ``lm``.
    """

    def __init__(self, name: str, head: Literal["lm", "value"], model: Mapping[str, Any], memory: Mapping[str, Any]):
        if head != "lm":
            raise ValueError(f"{name}: a torch-native trainer has an LM head only, got head={head!r}")
        super().__init__(name, head, model, memory)

    def setup(self, rank: int, world_size: int, tensor_model_parallel_size: int, init_method: str) -> dict:
        """Join the data-parallel group (more than one rank), build the model, optimizer and manager.

        Returns:
            ``{"rank", "dp_rank", "dp_size", "tp_rank"}`` (``tp_rank`` 0: data parallel only).
        """
        import types

        from chatlearn_mem_ray.actors.causal_lm import build_causal_lm, init_torch_distributed

        if tensor_model_parallel_size != 1:
            raise ValueError(
                f"{self.name}: a torch-native trainer is data parallel only, got TP={tensor_model_parallel_size}"
            )
        store = getattr(self, "_master_store", None) if rank == 0 else None
        init_torch_distributed(rank, world_size, init_method, store)
        lm = build_causal_lm(self.config)
        model = lm
        if world_size > 1:
            model = torch.nn.parallel.DistributedDataParallel(lm, gradient_as_bucket_view=True)
        optimizer = torch.optim.AdamW(lm.parameters(), lr=self.config.lr)
        self.trainer = types.SimpleNamespace(model=model, optimizer=optimizer, lm=lm)
        self.manager = TrainerMemoryManager(model, optimizer, self.memory)
        return {"rank": rank, "dp_rank": rank, "dp_size": world_size, "tp_rank": 0}

    def part_sizes(self) -> dict[str, int]:
        """As :meth:`TrainerActor.part_sizes`: before the first step, AdamW's ``exp_avg`` and
        ``exp_avg_sq`` like each parameter (its ``step`` stays on the host)."""
        sizes = ManagedActor.part_sizes(self)
        if not sizes.get(Part.OPTIMIZER_STATES.value):
            params = [p for g in self.trainer.optimizer.param_groups for p in g["params"]]
            sizes[Part.OPTIMIZER_STATES.value] = sum(2 * p.numel() * p.element_size() for p in params)
        return sizes

    def _zero_grads(self) -> None:
        self.trainer.optimizer.zero_grad(set_to_none=True)

    def _step(self) -> tuple[bool, Optional[float]]:
        params = [p for p in self.trainer.lm.parameters() if p.grad is not None]
        clip = self.config.clip_grad if self.config.clip_grad > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        if not math.isfinite(grad_norm):  # as megatron's optimizer: a step on inf or nan is skipped
            self.trainer.optimizer.zero_grad(set_to_none=True)
            return False, grad_norm
        self.trainer.optimizer.step()
        # consumed: dropped now, as a torch loop does, so that nothing but the parts outlives the step
        # (with DDP's bucket views the buckets stay: they are the grads part)
        self.trainer.optimizer.zero_grad(set_to_none=True)
        return True, grad_norm

    def _partition_dims(self, state: Mapping[str, torch.Tensor]) -> dict[str, int]:
        return {name: -1 for name in state}  # data parallel: every rank holds every tensor whole

    def megatron_weight_buckets(self, tp: int, bucket_bytes: int):
        raise TypeError(
            f"{self.name}: a torch-native policy streams its weights in Hugging Face naming already: "
            "hf_weight_buckets(bucket_bytes), not megatron_weight_buckets"
        )

    def hf_weight_buckets(self, bucket_bytes: int):
        """This rank's weights (the whole model: data parallel only) in Hugging Face naming, in
        buckets of at most ``bucket_bytes`` (:func:`chatlearn_mem.models.hf.hf_named_buckets`), read
        from the host store when asleep: a generator, called with ``num_returns="streaming"`` by the
        vLLM rollout, which loads the buckets as they come. The peak growth of this process's
        resident set while it streams is kept for :meth:`stream_peak_rss_bytes`."""
        from chatlearn_mem.models import hf
        from chatlearn_mem_ray.actors.wire import to_wire

        with PeakRSS() as peak:
            try:  # views of the host store, sent as numpy views: the object store holds the only copy
                for bucket in hf.hf_named_buckets(dict(self.manager.iter_weights()), self.config, int(bucket_bytes)):
                    yield to_wire(bucket)
            finally:
                self._stream_peak = peak
        self._stream_peak = peak
