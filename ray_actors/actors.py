"""The actors that hold a loop's models. Plain classes: ``chatlearn_mem_ray.colocation`` turns them
into Ray actors; tests may also use them in-process.

- :class:`TrainerActor`: one rank of a megatron-core trainer (a policy with an LM head, or a critic
  with a value head) under a :class:`chatlearn_mem.TrainerMemoryManager`.
- :class:`InferenceActor`: a GPT with no optimizer (the megatron rollout, or a reference) under an
  :class:`chatlearn_mem.InferenceMemoryManager`.
- The vLLM engine's actor is :class:`chatlearn_mem_ray.vllm_actor.VLLMRolloutActor`.

Every method returns plain Python or CPU tensors, so results cross process boundaries cheaply.
"""

from __future__ import annotations

import logging
import os
import platform
import warnings
from typing import Any, Callable, Literal, Mapping, Optional

import torch

from chatlearn_mem import InferenceMemoryManager, MemoryConfig, OffloadedError, Part, TrainerMemoryManager
from chatlearn_mem.parts import PartsArg
from chatlearn_mem_ray import modeling
from chatlearn_mem_ray.config import TrainerModelConfig
from chatlearn_mem_ray.wire import register_tensor_serializer

__all__ = ["InferenceActor", "TrainerActor"]


def _stats(stats) -> list[dict]:
    return [
        {
            "part": s.group,
            "direction": s.direction,
            "bytes": s.nbytes,
            "copied_bytes": s.copied_bytes,
            "seconds": s.seconds,
            "steps": s.steps,
            "actions": s.actions,
            "host_seconds": s.host_seconds,
        }
        for s in stats
        if s is not None
    ]


def _rss_bytes() -> Optional[int]:
    """This process's resident set in bytes (Linux ``/proc``); None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _private_and_shared_bytes() -> Optional[tuple[int, int]]:
    """This process's resident private (anonymous) memory and shared memory (``RssAnon``,
    ``RssShmem`` of ``/proc/self/status``); None where it cannot be read."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("RssAnon", "RssShmem")))
        return int(fields["RssAnon"].split()[0]) * 1024, int(fields["RssShmem"].split()[0]) * 1024
    except (OSError, ValueError, KeyError):
        return None


class PeakRSS:
    """The peak growth of this process's resident memory over a ``with`` block, sampled every
    ``interval_s`` on a thread: ``.bytes`` of private memory (what the process itself allocated:
    copies, merged tensors) and ``.shared_bytes`` of shared memory (Ray's object store, which maps
    the same pages into every process that reads them); 0 where ``/proc`` cannot be read."""

    def __init__(self, interval_s: float = 0.002):
        import threading

        self.interval_s, self.bytes, self.shared_bytes = interval_s, 0, 0
        self._start: Optional[tuple[int, int]] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="chatlearn-peak-rss", daemon=True)

    def _take(self) -> None:
        now = _private_and_shared_bytes()
        if now is not None and self._start is not None:
            self.bytes = max(self.bytes, now[0] - self._start[0])
            self.shared_bytes = max(self.shared_bytes, now[1] - self._start[1])

    def _sample(self) -> None:
        while True:
            self._take()
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> "PeakRSS":
        self._start = _private_and_shared_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._take()


def process_memory() -> dict:
    """What this process holds beside a model's parts: on CUDA torch's allocated and reserved
    bytes, and the process's resident set (``rss_bytes``)."""
    out = {}
    if torch.cuda.is_available():
        out["cuda_allocated_bytes"] = torch.cuda.memory_allocated()
        out["cuda_reserved_bytes"] = torch.cuda.memory_reserved()
    out["rss_bytes"] = _rss_bytes()
    return out


class ManagedActor:
    """What both actor kinds share: process-group setup, residency, audit, weight digests."""

    manager: Any
    name: str

    def __init__(self, name: str, memory: Mapping[str, Any]):
        # The run's console is the run's: megatron's notices (its deprecations, "GPTModel IS DEPRECATED"
        # on 0.19) and torch's warning when megatron's zero_grad reads .grad of an fp32 shard view
        # say nothing a user of the run can act on; the actors' own problems come back as errors.
        logging.getLogger("megatron").setLevel(logging.ERROR)
        # torch's CUDA build on a host without a CUDA runtime, when megatron imports cpp_extension
        logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        warnings.filterwarnings("ignore", module="megatron")
        warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
        warnings.filterwarnings("ignore", message=".*is deprecated. Please use.*")  # torch.distributed renames
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        register_tensor_serializer()  # the driver reads what this actor returns without megatron-core
        self.name = name
        self.memory = MemoryConfig(**memory)
        self.manager = None
        self._in_flight: list = []  # Transfer handles of non-blocking offloads and onloads (see settle)

    def master_address(self) -> str:
        """A ``tcp://ip:port`` init method on this actor's node (call on rank 0, which then joins
        with :meth:`setup`). The rendezvous server starts here, listening on a port the OS picks:
        a port chosen free and bound later could be taken in between (seen as a DistNetworkError
        when many processes start at once)."""
        import datetime

        import torch.distributed as dist

        try:
            import ray

            ip = ray.util.get_node_ip_address()
        except Exception:  # not inside Ray
            ip = "127.0.0.1"
        self._master_store = dist.TCPStore(
            ip, 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(minutes=30)
        )
        return f"tcp://{ip}:{self._master_store.port}"

    def _init_distributed(self, rank: int, world_size: int, tp: int, init_method: str, seed: int) -> None:
        from chatlearn_mem import cpu_backend
        from chatlearn_mem.models import gpt

        cpu_backend.install(quiet=True)  # without CUDA; the driver's device line says which it is
        store = getattr(self, "_master_store", None) if rank == 0 else None
        gpt.init_distributed(rank, world_size, tp, init_method=init_method, seed=seed, store=store)

    def offload(self, parts: PartsArg = None, blocking: bool = True) -> list[dict]:
        """Offload the chosen parts (None: every part of the manager; offloaded ones are skipped).

        ``blocking=False``: return at once; the copies run behind this actor's next calls (each
        waits for what it needs) and :meth:`settle` reports them."""
        return self._transition(self.manager.offload, parts, blocking)

    def onload(self, parts: PartsArg = None, blocking: bool = True) -> list[dict]:
        """Onload the chosen parts (None: every part of the manager; resident ones are skipped);
        ``blocking`` as in :meth:`offload` (a forward pass then waits per module)."""
        return self._transition(self.manager.onload, parts, blocking)

    def _transition(self, call: Callable, parts: PartsArg, blocking: bool) -> list[dict]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = call(parts, blocking=blocking)
        if blocking:
            return _stats(out)
        self._in_flight.append(out)
        return []

    def settle(self) -> dict:
        """Wait for the non-blocking transitions this actor started.

        Returns:
            ``{"seconds": how long this call waited, "stats": one dict per part moved}``.
        """
        import time

        t0 = time.perf_counter()
        stats = []
        while self._in_flight:
            stats += _stats(self._in_flight.pop(0).wait())
        return {"seconds": time.perf_counter() - t0, "stats": stats}

    def part_sizes(self) -> dict[str, int]:
        """Device bytes of each part when resident, whether resident now or not (for a residency plan)."""
        return {p: int(b) for p, b in self.manager.residency().resident_by_category.items() if p in set(Part)}

    def device_free_bytes(self) -> Optional[int]:
        """Free bytes on this actor's GPU (``torch.cuda.mem_get_info``); None without CUDA."""
        if not torch.cuda.is_available():
            return None
        torch.cuda.empty_cache()
        return int(torch.cuda.mem_get_info()[0])

    def residency(self) -> dict:
        """Device and host bytes of the model, per part; on CUDA also what the allocator holds."""
        r = self.manager.residency()
        out = {
            "device_bytes": r.device_bytes,
            "host_bytes": r.host_bytes,
            "by_part": dict(r.by_category),
            "host_by_part": dict(r.host_by_category),
            "resident_by_part": self.part_sizes(),
        }
        return {**out, **process_memory()}

    def audit(self) -> list[str]:
        """The manager's audit problems (empty when clean)."""
        return list(self.manager.audit().problems)

    def ping(self) -> str:
        return self.name

    def pid(self) -> int:
        """This actor's process id (tests kill it to simulate a lost process)."""
        return os.getpid()

    def node_info(self) -> dict:
        """Where this actor runs and what: ``{"node_id", "ip", "hostname", "versions"}`` (see
        :func:`chatlearn_mem_ray.nodes.software_versions`)."""
        import ray

        from chatlearn_mem_ray.nodes import software_versions

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "hostname": platform.node(),
            "versions": software_versions(),
        }

    def check_shared(self, token_path: str, token: str) -> bool:
        """Whether this actor's node reads the driver's token file (and leaves a marker beside it)."""
        import ray

        from chatlearn_mem_ray.nodes import check_shared_from_node

        return check_shared_from_node(token_path, token, ray.get_runtime_context().get_node_id())


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
        from megatron.core import parallel_state

        from chatlearn_mem.models import gpt

        self._init_distributed(rank, world_size, tensor_model_parallel_size, init_method, self.config.seed)
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
        return self._outputs(_to_device(tokens), temperature).cpu()

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
        model, optimizer = self.trainer.model, self.trainer.optimizer
        batch = {k: _to_device(v) for k, v in batch.items()}
        n = batch["tokens"].shape[0]
        g = torch.Generator().manual_seed(seed)
        sums: dict[str, float] = {}
        steps = skipped = 0
        for _ in range(epochs):
            order = torch.randperm(n, generator=g)
            for start in range(0, n, minibatch_size):
                idx = order[start : start + minibatch_size].to(batch["tokens"].device)
                mb = {k: v[idx] for k, v in batch.items()}
                model.zero_grad_buffer()
                optimizer.zero_grad()
                loss, metrics = loss_fn(self._outputs(mb["tokens"], temperature, entropy), mb)
                loss.backward()
                model.finish_grad_sync()
                ok, grad_norm, _ = optimizer.step()
                skipped += not ok
                metrics = dict(metrics, loss=loss.item(), grad_norm=float(grad_norm or 0.0))
                for k, v in metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v)
                steps += 1
        return {**{k: v / steps for k, v in sums.items()}, "skipped_steps": float(skipped)}

    def megatron_weight_buckets(self, tp: int, bucket_bytes: int):
        """This rank's own megatron weights in buckets of at most ``bucket_bytes``, read from the
        host store when asleep (:func:`chatlearn_mem.models.hf.megatron_shard_buckets`: every
        tensor-parallel rank's buckets hold the same names): a generator, called with
        ``num_returns="streaming"`` by the vLLM rollout, which merges the ranks' buckets. The peak
        growth of this process's resident set while it streams is kept for
        :meth:`stream_peak_rss_bytes`."""
        from chatlearn_mem.models import hf
        from chatlearn_mem_ray.wire import to_wire

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
        SHA-256 (see :func:`chatlearn_mem_ray.modeling.weights_digest`), computed from the same read."""
        state = self.manager.weights_state_dict()
        params = dict(self.trainer.model.module.named_parameters())
        dims = {
            name: (
                getattr(params[name], "partition_dim", -1)
                if getattr(params.get(name), "tensor_model_parallel", False)
                else -1
            )
            for name in state
        }
        return state, dims, modeling.weights_digest(state) if with_digest else None

    def weights_digest(self) -> str:
        """SHA-256 of this rank's weights (see :func:`chatlearn_mem_ray.modeling.weights_digest`)."""
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
        tokens = modeling.generate(self.model, _to_device(prompts), response_length, temperature, g)
        return tokens.cpu(), self.logprobs(tokens, temperature)

    def generate_rows(
        self,
        rows: list[list[int]],
        response_length: int,
        temperature: float,
        seed: int,
        eos_ids: tuple[int, ...] = (),
        pad_id: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample a response after each prompt of ``rows`` (token ids, any lengths), stopping at a
        token of ``eos_ids`` (see :func:`chatlearn_mem_ray.modeling.generate_rows`).

        Returns:
            ``(tokens (B, L), logprobs (B, L-1), response_lengths (B,))``: right-padded sequences,
            the log-probability of each next token at ``temperature`` (meaningful on the response
            positions), and each response's length (its EOS included).
        """
        device = torch.device("cuda") if torch.cuda.is_available() else None
        tokens, lengths = modeling.generate_rows(
            self.model, rows, response_length, temperature, seed, eos_ids, pad_id, device
        )
        return tokens, self.logprobs(tokens, temperature), lengths

    @torch.no_grad()
    def logprobs(self, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """(B, T-1) log-probability of each next token of ``tokens`` (B, T) at ``temperature``."""
        return modeling.sequence_logprobs(self.model, _to_device(tokens), temperature).cpu()

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
        """SHA-256 of the weights (see :func:`chatlearn_mem_ray.modeling.weights_digest`), one per
        tensor-parallel shard when split as a trainer with ``tensor_parallel_size`` ranks holds them."""
        state = self.manager.weights_state_dict()
        return [
            modeling.weights_digest(s)
            for s in modeling.split_tensor_parallel(state, partition_dims or {}, tensor_parallel_size)
        ]


def _to_device(t: torch.Tensor) -> torch.Tensor:
    return t.cuda() if torch.cuda.is_available() else t
