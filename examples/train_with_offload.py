"""Train a tiny megatron-core GPT with the memory manager putting it to sleep between phases.

Each iteration runs the three phases of a colocated RLHF loop for one trainer:

    train     everything on the device, one optimizer step
    sleep     everything offloaded (another model would use the device now)
    score     weights only, a forward pass under no_grad (e.g. log-probs for PPO)

and prints the trainer's device and host bytes after each phase, the audit result and the loss.

    python examples/train_with_offload.py --steps 5
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

import torch

from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager
from chatlearn_mem.models import gpt


def mib(n: int) -> str:
    return f"{n / 2**20:7.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="training iterations (default 5)")
    parser.add_argument("--hidden-size", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--layers", type=int, default=4, help="transformer layers (default 4)")
    parser.add_argument("--bucket-size-mb", type=float, default=64, help="host bucket size (default 64)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log every transfer")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="  %(message)s")
    warnings.filterwarnings("ignore")  # megatron-core's own notices about apex, TE and deprecations

    gpt.init_distributed(cpu_backend=True)
    cfg = gpt.GPTTrainerConfig(
        num_layers=args.layers, hidden_size=args.hidden_size, num_attention_heads=8, vocab_size=512, seq_length=64
    )
    trainer = gpt.build_gpt_trainer(cfg)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(bucket_size_mb=args.bucket_size_mb))
    n_params = sum(p.numel() for p in trainer.model.parameters())
    print(
        f"GPT with {n_params / 1e6:.2f} M parameters ({cfg.precision}, distributed optimizer), "
        f"megatron-core on {mm.device}"
    )
    print(f"{'iter':>4} {'phase':<6} {'device':>12} {'host store':>12}  {'by category (MiB)'}")

    def show(step: int, phase: str) -> None:
        r = mm.residency()
        cats = " ".join(f"{k}={v / 2**20:.1f}" for k, v in r.by_category.items() if v)
        print(f"{step:>4} {phase:<6} {mib(r.device_bytes):>12} {mib(r.host_bytes):>12}  {cats or '-'}")

    for step in range(args.steps):
        t0 = time.perf_counter()
        mm.onload()
        loss = trainer.train_step(gpt.synthetic_batch(cfg, step))
        show(step, "train")
        mm.offload()
        show(step, "sleep")
        mm.onload(Part.WEIGHTS)  # a forward-only phase needs the weights alone
        with torch.no_grad():
            score_loss = trainer.loss(gpt.synthetic_batch(cfg, 10_000 + step)).item()
        show(step, "score")
        mm.offload()
        audit = mm.audit()
        print(f"{step:>4} loss {loss:.4f}  held-out loss {score_loss:.4f}  {audit}  ({time.perf_counter() - t0:.2f} s)")
        if not audit.ok:
            raise SystemExit(1)
    mm.onload()
    print("done: trainer awake, audit", "ok" if mm.audit().ok else "FAILED")
    gpt.shutdown_distributed()  # before the process exits: a process group left to the exit can hang or abort it


if __name__ == "__main__":
    main()
