#!/usr/bin/env python3
"""Time blocking transitions of two revisions of chatlearn-mem against each other, processes alternating.

Each revision is checked out once into a temporary git worktree (``.`` means the working tree as it is,
uncommitted changes included). Then ``--processes`` child processes per revision run in turn, A B A B ...,
each importing the library from its own tree and timing, on the bench's CPU trainer (by default the
135 M-parameter bf16 GPT of ``configs/bench/cpu.yaml``, distributed optimizer, ``bucket_size_mb=256``),
after ``--warmup-cycles`` full offload/onload cycles:

* ``--onloads`` blocking weights onloads (each after a blocking weights offload, also timed);
* ``--full`` blocking full onloads (each after a full offload, also timed);
* the same number of plain copies of the weights' bytes into a buffer allocated once (the ``ceiling``),
  measured in the same process.

It prints, per revision, the median and the 10th-90th percentiles of each call, the 90th percentile of the
weights onloads over their median (the slow tail) and the weights onload over the ceiling. Both revisions
run on the same machine in the same minutes, so their ratio is the comparison; absolute times vary with the
host. Example (the revision before the copy engine against the working tree)::

    python scripts/ab_transitions.py 3ab30be . --processes 2 --out ab.json

``--soak N`` runs N full offload/onload cycles instead, with a train step every ``--train-every`` cycles, and
prints each process's RSS (after ``gc.collect()``) every ``--sample-every`` cycles and its cycle time: the
memory-growth comparison (``--layers 4 --hidden 256 --heads 4 --vocab 4096 --bucket-size-mb 16`` shows it in a
minute).

Revisions as old as the first public API (``chatlearn_mem.testbed``) work: the child finds the GPT
builder and the CPU backend under either name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(args: argparse.Namespace) -> None:
    import importlib

    import torch

    def first(*names):
        for name in names:
            try:
                return importlib.import_module(name)
            except ImportError:
                continue
        raise ImportError(f"none of {names} in {args.child}")

    import chatlearn_mem
    from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager

    assert Path(chatlearn_mem.__file__).resolve().is_relative_to(Path(args.child).resolve()), chatlearn_mem.__file__
    cpu_backend = first("chatlearn_mem.cpu_backend", "chatlearn_mem.testbed.cpu_backend")
    gpt = first("chatlearn_mem.models.gpt", "chatlearn_mem.testbed.gpt")
    cpu_backend.install(**({"quiet": True} if "quiet" in cpu_backend.install.__code__.co_varnames else {}))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(args.port)
    gpt.init_distributed()
    cfg = gpt.GPTTrainerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        seq_length=128,
        precision="bf16",
        use_distributed_optimizer=True,
    )
    trainer = gpt.build_gpt_trainer(cfg)
    trainer.train_step(gpt.synthetic_batch(cfg, 0, batch_size=2))  # the optimizer states exist
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(bucket_size_mb=args.bucket_size_mb))
    for _ in range(args.warmup_cycles):
        mm.offload()
        mm.onload()
    weights_bytes = mm.residency().by_category["weights"]

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    out: dict = {"tree": args.child, "weights_bytes": weights_bytes}
    if args.soak:
        out.update(_soak(mm, trainer, gpt.synthetic_batch(cfg, 1, batch_size=2), args))
        mm.close()
        print("AB-RESULT " + json.dumps(out), flush=True)
        return
    w_off, w_on = [], []
    for _ in range(args.onloads):
        w_off.append(timed(lambda: mm.offload([Part.WEIGHTS])))
        w_on.append(timed(lambda: mm.onload([Part.WEIGHTS])))
    f_off, f_on = [], []
    for _ in range(args.full):
        f_off.append(timed(mm.offload))
        f_on.append(timed(mm.onload))
    assert mm.audit().ok
    host = torch.ones(weights_bytes, dtype=torch.uint8)
    dev = torch.zeros(weights_bytes, dtype=torch.uint8)
    ceiling = [timed(lambda: dev.copy_(host)) for _ in range(args.onloads)]
    out.update(weights_offload=w_off, weights_onload=w_on, full_offload=f_off, full_onload=f_on, ceiling=ceiling)
    mm.close()
    print("AB-RESULT " + json.dumps(out), flush=True)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _soak(mm, trainer, batch, args: argparse.Namespace) -> dict:
    """``args.soak`` full offload/onload cycles, a train step every ``args.train_every``; the RSS
    (after ``gc.collect()``) every ``args.sample_every`` cycles and the time of every cycle."""
    import gc

    rss, cycle_s = [], []
    gc.collect()
    rss.append((0, _rss_bytes()))
    for c in range(1, args.soak + 1):
        t0 = time.perf_counter()
        mm.offload()
        mm.onload()
        cycle_s.append(time.perf_counter() - t0)
        if args.train_every and c % args.train_every == 0:
            trainer.train_step(batch)
        if c % args.sample_every == 0:
            gc.collect()
            rss.append((c, _rss_bytes()))
    return {"soak_rss": rss, "cycle": cycle_s}


def _worktree(rev: str, tmp: Path) -> Path:
    if rev == ".":
        return ROOT
    path = tmp / f"tree-{rev.replace('/', '_')}"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(path), rev], check=True)
    return path


def _pct(xs: list[float], q: float) -> float:
    # imported here, in the parent only: a child must import nothing of this checkout before its own tree
    from chatlearn_mem_bench.measure import percentile

    return percentile(xs, q)


def _row(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:8.1f} ms ({_pct(xs, 0.1) * 1e3:.1f}-{_pct(xs, 0.9) * 1e3:.1f})"


def summarize(results: dict[str, list[dict]]) -> dict:
    """Pool each revision's processes; per call: median and 10th/90th percentiles (seconds)."""
    summary = {}
    for rev, runs in results.items():
        pooled = {k: [x for r in runs for x in r[k]] for k in runs[0] if isinstance(runs[0][k], list)}
        s = {k: {"median": statistics.median(v), "p10": _pct(v, 0.1), "p90": _pct(v, 0.9)} for k, v in pooled.items()}
        won = pooled["weights_onload"]
        s["weights_onload_p90_over_median"] = _pct(won, 0.9) / statistics.median(won)
        s["weights_onload_over_ceiling"] = statistics.median(won) / statistics.median(pooled["ceiling"])
        s["weights_bytes"] = runs[0]["weights_bytes"]
        summary[rev] = s
    return summary


def _print_soak(results: dict[str, list[dict]], args: argparse.Namespace) -> None:
    print(f"RSS after gc.collect() (MiB) at cycles {[c for c, _ in results[args.revs[0]][0]['soak_rss']]}")
    for rev, runs in results.items():
        for r in runs:
            rss = " / ".join(f"{b / 2**20:.0f}" for _, b in r["soak_rss"])
            print(f"{rev:>12}: {rss}   cycle {_row(r['cycle']).strip()}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("revs", nargs="*", default=["HEAD", "."], help="two revisions (default: HEAD and .)")
    p.add_argument("--processes", type=int, default=2, help="child processes per revision (default 2)")
    p.add_argument("--onloads", type=int, default=20, help="weights offload/onload pairs per process (default 20)")
    p.add_argument("--full", type=int, default=6, help="full offload/onload pairs per process (default 6)")
    p.add_argument("--warmup-cycles", type=int, default=3, help="full cycles before timing (default 3)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--bucket-size-mb", type=int, default=256)
    p.add_argument("--soak", type=int, default=0, help="instead: this many full cycles, RSS sampled (default off)")
    p.add_argument("--train-every", type=int, default=20, help="soak: a train step every N cycles (0: none)")
    p.add_argument("--sample-every", type=int, default=200, help="soak: RSS after gc.collect() every N cycles")
    p.add_argument("--port", type=int, default=29517, help=argparse.SUPPRESS)
    p.add_argument("--out", help="write every sample and the summary to this JSON file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        _child(args)
        return
    if len(args.revs) != 2:
        p.error(f"give two revisions, got {args.revs}")
    results: dict[str, list[dict]] = {rev: [] for rev in args.revs}
    with tempfile.TemporaryDirectory(prefix="ab-transitions-") as tmp:
        trees = {rev: _worktree(rev, Path(tmp)) for rev in args.revs}
        try:
            for k in range(args.processes):
                for rev in args.revs:
                    print(f"[{k + 1}/{args.processes}] {rev} ...", file=sys.stderr, flush=True)
                    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(trees[rev])]
                    cmd += [
                        f"--{n.replace('_', '-')}={getattr(args, n)}"
                        for n in (
                            "onloads",
                            "full",
                            "warmup_cycles",
                            "layers",
                            "hidden",
                            "heads",
                            "vocab",
                            "bucket_size_mb",
                            "soak",
                            "train_every",
                            "sample_every",
                        )
                    ]
                    env = dict(os.environ, PYTHONPATH=str(trees[rev]))
                    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("AB-RESULT ")), None)
                    if proc.returncode or line is None:
                        sys.exit(f"error: the child for {rev} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                    results[rev].append(json.loads(line[len("AB-RESULT ") :]))
        finally:
            for rev, tree in trees.items():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    if args.soak:
        _print_soak(results, args)
        if args.out:
            Path(args.out).write_text(json.dumps({"revs": args.revs, "argv": sys.argv, "samples": results}, indent=1))
        return
    summary = summarize(results)
    calls = ("weights_onload", "weights_offload", "full_onload", "full_offload", "ceiling")
    print(f"{'call':<18}" + "".join(f"{rev:>34}" for rev in args.revs))
    for call in calls:
        pooled = {rev: [x for r in results[rev] for x in r[call]] for rev in args.revs}
        print(f"{call:<18}" + "".join(f"{_row(pooled[rev]):>34}" for rev in args.revs))
    for key in ("weights_onload_p90_over_median", "weights_onload_over_ceiling"):
        print(f"{key:<34}" + "".join(f"{summary[rev][key]:>18.2f}" for rev in args.revs))
    if args.out:
        Path(args.out).write_text(
            json.dumps({"revs": args.revs, "argv": sys.argv, "summary": summary, "samples": results}, indent=1)
        )


if __name__ == "__main__":
    main()
