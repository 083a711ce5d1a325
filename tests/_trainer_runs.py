"""Training runs shared by the trainer tests and the multi-rank workers."""

from __future__ import annotations

import json
import os
import tempfile
import traceback
import warnings
from typing import Callable, Optional

import torch

from chatlearn_mem import TrainerMemoryManager

from chatlearn_mem.testbed import gpt
from chatlearn_mem.mcore import layout

STEPS = 8


def snapshot(trainer) -> list[torch.Tensor]:
    """Weights, fp32 main weights and optimizer states, cloned."""
    out = [p.detach().clone() for p in trainer.model.parameters()]
    for leaf in layout.leaf_optimizers(trainer.optimizer):
        out += [t.detach().clone() for t in layout.main_weights(leaf)]
        for state in layout.torch_optimizer(leaf).state.values():
            out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def train(cfg: gpt.GPTTrainerConfig, steps: int = STEPS,
          between: Optional[Callable] = None, rank: int = 0):
    """Train ``steps`` steps, calling ``between(mm, step)`` after each; return losses, snapshot, mm."""
    trainer = gpt.build_gpt_trainer(cfg)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    losses = []
    for step in range(steps):
        losses.append(trainer.train_step(gpt.synthetic_batch(cfg, step, rank=rank)))
        if between is not None:
            between(mm, step)
    return losses, snapshot(trainer), mm, trainer


def full_cycle(mm, step):
    """Offload everything, check the device is empty, onload everything, audit."""
    mm.offload()
    res = mm.residency()
    assert res.device_bytes == 0, str(res)
    mm.onload()
    report = mm.audit()
    assert report.ok, str(report)


def bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def multirank_exactness(rank: int, world: int, init_file: str, out_dir: str, cfg_json: str, tp: int) -> None:
    """Worker: baseline vs full offload cycles on every rank; writes rank<N>.json."""
    result = {"rank": rank}
    try:
        warnings.simplefilter("ignore")
        gpt.init_distributed(rank, world, tensor_model_parallel_size=tp, init_method=f"file://{init_file}")
        cfg = gpt.GPTTrainerConfig.model_validate_json(cfg_json)
        dp_rank = torch.distributed.get_rank() // tp
        base_losses, base_weights, _, _ = train(cfg, rank=dp_rank)
        losses, weights, mm, _ = train(cfg, between=full_cycle, rank=dp_rank)
        result.update(losses_equal=base_losses == losses, weights_equal=bit_equal(base_weights, weights),
                      audit_ok=mm.audit().ok, losses=losses, n_tensors=len(weights))
    except Exception:
        result["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def spawn(fn, world: int, *args) -> list[dict]:
    """Run ``fn(rank, world, init_file, out_dir, *args)`` on ``world`` fresh processes."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(fn, args=(world, init_file, tmp) + args, nprocs=world, join=True)
        results = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as f:
                results.append(json.load(f))
    return results
