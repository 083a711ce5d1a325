"""Checkpoints of a plain PyTorch trainer in ``torch.distributed.checkpoint``'s format.

What a checkpoint holds, one flat state dict:

* ``model.<name>``: every weight in the module's ``state_dict()`` naming (FSDP2's shards as
  DTensors, so they reshard to another number of ranks; DDP's replicas written once);
* ``optim.state.<param name>.<key>``: every optimizer state tensor by its parameter's name
  (``step`` included), written by the rank that holds it (ZeroRedundancyOptimizer: its
  partition's owner), so that another number of ranks reads back what it owns then;
* ``optim.param_groups``: each group's settings (learning rate, betas, ...) and its parameters' names;
* ``rng.rank<N>``: each rank's torch generators, restored when the world size is the one saved.

Saved in :mod:`chatlearn_mem.checkpoint`'s three steps, as megatron's: :meth:`TorchCheckpointIO.start_save`
plans (the ranks exchange their plans: a collective, in the caller's thread),
:meth:`~TorchCheckpointIO.write_save` writes this rank's file (no collective: it may run in a
background thread), :meth:`~TorchCheckpointIO.finalize_save` gathers what every rank wrote and
rank 0 writes DCP's ``.metadata``. The file names are DCP's (``__<rank>_0.distcp``), which the
manifest reads. Loading copies into the trainer's own tensors in place (DCP's load), so every
alias survives it as it survives an onload.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from chatlearn_mem.torchnative import layout

__all__ = ["TorchCheckpointIO"]


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def _world() -> int:
    dist = _dist()
    return dist.get_world_size() if dist is not None else 1


def _all_gather(obj: Any) -> list:
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _from_rank0(obj: Any) -> Any:
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@dataclass
class _Request:
    """A planned save: the writer, the planner, this rank's final plan, rank 0's metadata."""

    writer: Any
    planner: Any
    plan: Any
    metadata: Any
    results: Any = None


def _rng_state() -> dict:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    return out


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def _adam_like(opt: Any) -> bool:
    return isinstance(opt, (torch.optim.Adam, torch.optim.AdamW)) or type(opt).__name__ in (
        "_FunctionalAdam",
        "_FunctionalAdamW",
    )


class TorchCheckpointIO:
    """``torch.distributed.checkpoint`` for one torch trainer (see the module's docstring).

    Args:
        trainer: The :class:`~chatlearn_mem.torchnative.backend.TorchTrainer`.
    """

    name = "torch"

    def __init__(self, trainer: Any):
        self.trainer = trainer

    # -- what a checkpoint records ---------------------------------------------------------------
    def versions(self) -> dict:
        return {"torch": torch.__version__.split("+")[0]}

    def split_sizes(self) -> dict[str, int]:
        return {"dp": _world()}

    def sharding(self, resharding: bool) -> Optional[str]:
        return None  # DCP's format reshards over data parallel either way

    def estimate_nbytes(self, resharding: bool) -> int:
        """This rank's bytes: its weights (a shard under FSDP2) and two fp32 moments per
        parameter it steps (ZeRO: its partition)."""
        t = self.trainer
        weights = sum(layout.local_tensor(p).numel() * p.element_size() for p in t.params)
        stepped = [p for p in t.params if p.requires_grad]
        if t.zero is not None:
            mine = {id(p) for p in layout.zero_partition(t.zero)[layout.zero_rank(t.zero)]}
            stepped = [p for p in stepped if id(p) in mine]
        return weights + sum(layout.local_tensor(p).numel() for p in stepped) * 4 * 2

    def swapped_tensors(self) -> list[torch.Tensor]:
        return []  # the state is built from host views directly (HostCopies.view)

    # -- the state ---------------------------------------------------------------------------------
    def _optimizer_groups(self) -> list[dict]:
        """Each global param group's settings, with its parameters' names."""
        names = self.trainer.params
        out = []
        for g in self.trainer.optimizer.param_groups:
            settings = {k: v for k, v in g.items() if k != "params"}
            settings["params"] = [names[p] for p in g["params"]]
            out.append(settings)
        return out

    def _entries(self) -> list[tuple[str, torch.Tensor, Optional[torch.Tensor]]]:
        """``(key, the trainer's tensor, its plain memory)`` of every tensor a checkpoint holds."""
        t = self.trainer
        out = [(f"model.{name}", w, layout.local_tensor(w)) for name, w in t.state_tensors()]
        opt = layout.state_optimizer(t.optimizer)
        for p, k, v in layout.state_entries(opt):
            out.append((f"optim.state.{t.params[p]}.{k}", v, layout.local_tensor(v)))
        return out

    @staticmethod
    def _like(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        """``local`` (host memory) as ``t`` is: a DTensor with ``t``'s mesh and placements, or plain."""
        if not layout.is_dtensor(t):
            return local
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())

    def snapshot(self, sharding: Optional[str], host: Any) -> dict:
        """The state to save: host views of what is offloaded, host copies of what is resident."""
        state: dict[str, Any] = {}
        for key, t, local in self._entries():
            view = host.view(local)
            if view is None:
                view = local.detach().to("cpu", copy=True)
            state[key] = self._like(t, view)
        state["optim.param_groups"] = self._optimizer_groups()
        state[f"rng.rank{_rank()}"] = _rng_state()
        return state

    @staticmethod
    def tensor_shapes(state: dict) -> dict[str, tuple[list[int], str]]:
        """``key -> (global shape, dtype)`` of the model's tensors in a state."""
        return {
            k: (list(v.shape), str(v.dtype).replace("torch.", ""))
            for k, v in state.items()
            if k.startswith("model.") and isinstance(v, torch.Tensor)
        }

    @staticmethod
    def tensor_nbytes(state: dict) -> int:
        return sum(
            layout.local_tensor(v).numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor)
        )

    # -- the save, in three calls --------------------------------------------------------------------
    @staticmethod
    def start_save(state: dict, directory: str) -> _Request:
        """Plan the save of ``state`` into ``directory``: every rank's plan to rank 0, the global plan
        back (a collective, in the caller's thread)."""
        from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter

        rank = _rank()
        coordinator = rank == 0
        writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True, thread_count=1)
        planner = DefaultSavePlanner(flatten_state_dict=False)  # settings and RNG: one object each
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=coordinator)
        writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
        local = writer.prepare_local_plan(planner.create_local_plan())
        plans = _all_gather(local)
        metadata = None
        if coordinator:
            plans, metadata = planner.create_global_plan(plans)
            plans = writer.prepare_global_plan(plans)
        plans = _from_rank0(plans if coordinator else None)
        return _Request(writer, planner, planner.finish_plan(plans[rank]), metadata)

    @staticmethod
    def write_save(request: _Request) -> None:
        """Write this rank's file (no collective)."""
        futures = request.writer.write_data(request.plan, request.planner)
        futures.wait()
        request.results = futures.value()

    @staticmethod
    def finalize_save(request: _Request) -> None:
        """Every rank's results to rank 0, which writes DCP's metadata (a collective)."""
        results = _all_gather(request.results)
        if _rank() == 0:
            request.writer.finish(metadata=request.metadata, results=results)

    # -- loading -------------------------------------------------------------------------------------
    def prepare_load(self) -> None:
        """Create the optimizer's state where it has none yet, so that the load copies into it:
        Adam and AdamW directly (zeros, ``step`` 0 on the host, as their first step would); other
        optimizers by one step of zero gradients at learning rate 0."""
        t = self.trainer
        opt = layout.state_optimizer(t.optimizer)
        if opt is None:
            raise ValueError(
                "ZeroRedundancyOptimizer(overlap_with_ddp=True) builds its local optimizer only after "
                "DistributedDataParallel's first iterations; load a checkpoint once it has stepped"
            )
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        missing = [p for p in params if not opt.state.get(p)]
        if not missing:
            return
        if _adam_like(opt):
            amsgrad = any(g.get("amsgrad") for g in opt.param_groups) or getattr(opt, "defaults", {}).get("amsgrad")
            for p in missing:
                s = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
                if amsgrad:
                    s["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                opt.state[p] = s
            return
        saved = [(g, g.get("lr")) for g in opt.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for g, _ in saved:
            if "lr" in g:
                g["lr"] = 0.0
        opt.step()
        for g, lr in saved:
            if lr is not None:
                g["lr"] = lr
        for p in params:
            p.grad = None

    def loading_state(self, meta: dict) -> dict:
        """The trainer's own tensors under the checkpoint's keys (a load copies into them)."""
        state: dict[str, Any] = {k: t for k, t, _ in self._entries()}
        state["optim.param_groups"] = None
        if meta["parallel"] == self.split_sizes():
            state[f"rng.rank{_rank()}"] = None
        return state

    def load(self, state: dict, path: str, same_split: bool) -> None:
        """Copy the checkpoint into the trainer's tensors in place, then its settings and RNG.
        Optimizer states the checkpoint lacks (saved before the first step) stay as
        :meth:`prepare_load` made them: as a first step makes them."""
        import torch.distributed.checkpoint as dcp

        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        for key in [k for k in state if k.startswith("optim.state.") and k not in saved]:
            del state[key]
        with torch.no_grad(), warnings.catch_warnings():
            # without a process group DCP warns that it assumes one process: that is the case here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state,
                checkpoint_id=path,
                planner=dcp.DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                no_dist=_dist() is None,
            )
        groups = state["optim.param_groups"]
        mine = self.trainer.optimizer.param_groups
        names = self.trainer.params
        if len(groups) != len(mine) or any(
            saved["params"] != [names[p] for p in g["params"]] for saved, g in zip(groups, mine)
        ):
            raise ValueError(
                "the checkpoint's optimizer groups hold other parameters than this optimizer's "
                f"({[len(g['params']) for g in groups]} vs {[len(g['params']) for g in mine]} per group); "
                "build the optimizer with the parameter groups it was saved with"
            )
        for saved, g in zip(groups, mine):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        rng = state.get(f"rng.rank{_rank()}")
        if same_split and rng is not None:
            _set_rng_state(rng)
