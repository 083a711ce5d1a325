"""Measure what MemoryConfig(debug_guard=True) costs, against the same trainer without it.

Two identical megatron-core GPT trainers (same seed), one managed with the debug guard and one
without, timed interleaved in one process (median of ``--repeats``):

* ``forward_partial``: a no-grad forward with the weights onloaded and the optimizer parts
  offloaded (a scoring phase): the guard is active and checks every torch call;
* ``train_step``: a full train step with everything resident: the guard is off the mode stack;
* ``cycle``: a full offload + onload;
* ``op``: one small torch op (``a.add_(b)`` on 64 floats) while a part is offloaded.

Run: ``python scripts/measure_debug_guard.py [--hidden 64] [--layers 2] [--repeats 30]``
(megatron-core on the CPU backend when there is no GPU). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import atexit
import json
import statistics
import tempfile
import time
import warnings

import torch


def _median_ms(fn, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager
    from chatlearn_mem.models import gpt

    gpt.init_distributed(init_method=f"file://{tempfile.mktemp()}", cpu_backend=True)
    atexit.register(gpt.shutdown_distributed)  # a NCCL group left to the exit holds it up
    cfg = gpt.GPTTrainerConfig(hidden_size=args.hidden, num_layers=args.layers)
    batch = gpt.synthetic_batch(cfg, 0, batch_size=4)
    runs = {}
    for guard in (False, True):
        trainer = gpt.build_gpt_trainer(cfg)
        mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(debug_guard=guard))
        trainer.train_step(batch)
        runs[guard] = (trainer, mm)

    def forward_partial(trainer, mm):
        mm.offload([Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES])
        with torch.no_grad():
            t0 = time.perf_counter()
            trainer.loss(batch)
            dt = time.perf_counter() - t0
        mm.onload()
        return dt

    a, b = torch.zeros(64), torch.ones(64)

    def op_loop(trainer, mm, n=2000):
        mm.offload([Part.OPTIMIZER_STATES])
        t0 = time.perf_counter()
        for _ in range(n):
            a.add_(b)
        dt = (time.perf_counter() - t0) / n
        mm.onload()
        return dt

    results = {g: {"forward_partial": [], "train_step": [], "cycle": [], "op": []} for g in runs}
    for _ in range(args.repeats):
        for g, (trainer, mm) in runs.items():  # interleaved: load drift hits both alike
            results[g]["forward_partial"].append(forward_partial(trainer, mm) * 1e3)
            results[g]["train_step"].append(_median_ms(lambda: trainer.train_step(batch), 1))
            results[g]["cycle"].append(_median_ms(lambda: (mm.offload(), mm.onload()), 1))
            results[g]["op"].append(op_loop(trainer, mm) * 1e6)
    out = {
        "config": vars(args),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "params": sum(p.numel() for p in runs[False][0].model.parameters()),
    }
    for key, unit in (("forward_partial", "ms"), ("train_step", "ms"), ("cycle", "ms"), ("op", "us")):
        off, on = statistics.median(results[False][key]), statistics.median(results[True][key])
        out[key] = {f"off_{unit}": round(off, 3), f"on_{unit}": round(on, 3), "ratio": round(on / off, 2)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
