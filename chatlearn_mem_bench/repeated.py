"""Rows that repeat one transition many times: the weights onload's tail, and the soak.

* ``onload_tail``: ``tail_onloads`` blocking weights onloads of the manager (each after a blocking
  weights offload), each followed by a plain copy of the same bytes between two buffers allocated
  once (pinned on GPU, like the ceiling): the onload's median against the copy's, and the onload's
  90th percentile against its own median (a slow tail shows there, not in a median).
* ``soak``: ``soak_cycles`` full offload/onload cycles with a train step every
  ``soak_train_every`` cycles, the process RSS (and on CUDA ``memory_reserved``) after a
  ``gc.collect()`` every ``soak_sample_every`` cycles: memory must stop growing after a warm-up
  of half the cycles, training between the cycles included. A train step comes before its
  cycle's offload, as in a PPO loop (train, sleep, wake), and a sample is taken after the onload:
  where the trainer wakes, after the offload has trimmed the C heap of what training freed
  (sampled right after a train step, the heap's untrimmed residue swung the RSS by 100-200 MiB
  from sample to sample). The train steps change the weights, so the benchmark runs this row
  last, after its integrity check.
"""

from __future__ import annotations

import gc
import statistics

import torch

from chatlearn_mem import Part
from chatlearn_mem_bench.measure import memory_snapshot, percentile, stats, timed

__all__ = ["TAIL_TARGETS", "measure_onload_tail", "measure_soak", "repeated_targets"]

TAIL_TARGETS = {
    # (CPU, GPU): a blocking weights onload at most this many times a plain copy of its bytes
    "onload_over_copy": (1.3, 1.15),
    # the 90th percentile of the onloads at most this many times their median
    "p90_over_median": (1.5, 1.5),
}


def measure_onload_tail(mm, ceiling, device: torch.device, n: int) -> dict:
    """``n`` blocking weights onloads, each beside a plain copy of the same bytes through the
    benchmark's ``ceiling`` method (its buffers allocated here and freed after; see the module)."""
    nbytes = mm.residency().by_category[str(Part.WEIGHTS)]
    ceiling.prepare(device_bytes=nbytes, host_bytes=nbytes)
    ceiling.use(nbytes)
    onload, copy = [], []
    try:
        for _ in range(n):
            mm.offload([Part.WEIGHTS])
            onload.append(timed(lambda: mm.onload([Part.WEIGHTS]), device)[0])
            copy.append(timed(lambda: ceiling.onload(Part.WEIGHTS), device)[0])
    finally:
        ceiling.release()
    ratios = [a / b for a, b in zip(onload, copy)]
    med = statistics.median(onload)
    p90 = percentile(onload, 0.9)
    return {
        "bytes": nbytes,
        "onload_s": stats(onload),
        "copy_s": stats(copy),
        "samples_onload_s": onload,
        "samples_copy_s": copy,
        "p90_onload_s": p90,
        "p90_over_median": p90 / med,
        "onload_over_copy": med / statistics.median(copy),
        "ratio_spread": [percentile(ratios, 0.25), percentile(ratios, 0.75)],
    }


def measure_soak(mm, trainer, batch: torch.Tensor, device: torch.device, cycles: int, train_every: int, every: int):
    """Full cycles with training between them; memory sampled after ``gc.collect()`` (see the module)."""

    def sample(cycle: int) -> dict:
        gc.collect()
        snap = memory_snapshot(device)
        return {"cycle": cycle, **{k: v for k, v in snap.items() if k in ("rss_bytes", "cuda_reserved_bytes")}}

    samples = [sample(0)]
    cycle_s = []
    for c in range(1, cycles + 1):
        if train_every and c % train_every == 0:
            trainer.train_step(batch)  # train, then sleep and wake (the offload trims what it freed)
        cycle_s.append(timed(lambda: (mm.offload(force=True), mm.onload()), device)[0])
        if c % every == 0 or c == cycles:
            samples.append(sample(c))
    return {
        "cycles": cycles,
        "train_every": train_every,
        "samples": samples,
        "cycle_s": stats(cycle_s),
        "audit_ok": mm.audit().ok,
    }


def repeated_targets(res: dict, gpu: bool, tolerance_bytes: float) -> list[dict]:
    """Targets of the two rows, each ``{"name", "passed", "detail"}`` (what was measured only)."""
    out = []
    tail = res.get("onload_tail")
    if tail:
        limit = TAIL_TARGETS["onload_over_copy"][gpu]
        out.append(
            {
                "name": f"weights onload (blocking) <= {limit}x a plain copy of its bytes",
                "passed": tail["onload_over_copy"] <= limit,
                "detail": f"{tail['onload_over_copy']:.2f}x (per-pair IQR {tail['ratio_spread'][0]:.2f}-"
                f"{tail['ratio_spread'][1]:.2f}; {tail['onload_s']['median'] * 1e3:.1f} ms vs "
                f"{tail['copy_s']['median'] * 1e3:.1f} ms, {tail['onload_s']['n']} onloads)",
            }
        )
        limit = TAIL_TARGETS["p90_over_median"][gpu]
        out.append(
            {
                "name": f"weights onload tail: 90th percentile <= {limit}x the median",
                "passed": tail["p90_over_median"] <= limit,
                "detail": f"{tail['p90_over_median']:.2f}x ({tail['p90_onload_s'] * 1e3:.1f} ms vs "
                f"{tail['onload_s']['median'] * 1e3:.1f} ms; max {tail['onload_s']['max'] * 1e3:.1f} ms)",
            }
        )
    soak = res.get("soak")
    if soak:
        samples = soak["samples"]
        warm = next(s for s in samples if s["cycle"] >= soak["cycles"] // 2)
        last = samples[-1]
        for key in ("rss_bytes", "cuda_reserved_bytes"):
            if key not in last:
                continue
            grew = last[key] - warm[key]
            out.append(
                {
                    "name": f"soak: {key.replace('_bytes', '').replace('_', ' ')} flat with training between cycles",
                    "passed": grew <= tolerance_bytes,
                    "detail": f"{grew / 2**20:+.1f} MiB from cycle {warm['cycle']} to {last['cycle']} "
                    f"(tolerance {tolerance_bytes / 2**20:.0f} MiB; a train step every {soak['train_every']} "
                    f"cycles; {samples[0][key] / 2**20:.0f} MiB at the start)",
                }
            )
        out.append(
            {
                "name": "soak: audit ok after the last cycle",
                "passed": soak["audit_ok"],
                "detail": f"audit() after cycle {soak['cycles']}: {'ok' if soak['audit_ok'] else 'problems'}",
            }
        )
    return out
