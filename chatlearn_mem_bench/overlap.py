"""The overlap rows: each transition the copy engine overlaps with something, timed against its serial
counterpart in the same run, interleaved repeat by repeat.

* ``onload_then_forward``: serial = ``onload(weights)`` then a no-grad forward pass; overlapped =
  ``onload(weights, blocking=False)`` and the forward at once (each module waits for its own
  weights only), then ``wait()``. The forward pass alone, the onload alone and a plain copy of the
  first module's bytes (the first user of the manager's use order: a GPT's embedding) are timed
  too: no schedule beats the longer of the onload alone (the last module waits for the last bytes)
  and the first module's copy followed by the whole forward (nothing of the forward runs before
  its first module's weights are there): ``best_possible_s``. On a CPU "device" the row also times
  that schedule with plain copies (the first module's copy, then the forward while a thread copies
  the rest): the forward beside a copy is slower than alone there, the two sharing one memory bus,
  and no schedule of the onload escapes that. ``contended_best_s``, the longer of it and
  ``best_possible_s``, is the bound the CPU target uses, as the swap's uses two copies at once.
* ``swap``: the benchmark trainer (policy-sized) goes to sleep while a critic-sized trainer (half the
  layers, a value head) wakes up. Serial = ``a.offload()`` then ``b.onload()``; overlapped =
  ``swap(out=a, into=b)`` (both copy directions at once, b's storages regrown as a's are released).
  Both managers copy every time (the benchmark's ``skip_unchanged_weights=False``), as after a
  training step.
* ``full_cycle``: offload and onload of every part. Serial = one blocking call per part (one wait per
  part, the way transitions ran before the copy engine); overlapped = one ``offload()`` and one
  ``onload()`` (every part in one job, storages released and regrown as their copies complete).

On a CPU "device" the copy engine's lanes are worker threads, so the copies and the compute share the
machine's cores and memory bus; ``BenchConfig.overlap_threads`` (default 1) gives the compute one
intra-op thread, leaving a core for the copy lane, the way a GPU's copy engines are hardware of
their own. A lane copies with the intra-op threads of the thread that submitted the transition, so
the lanes run with the same setting, and so do the plain copies the rows' bounds are made of (the
first module's copy, the swap's two copies at once). Ignored on CUDA.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Optional

import torch

from chatlearn_mem import Part, TrainerMemoryManager, swap
from chatlearn_mem_bench.measure import stats, timed
from chatlearn_mem_bench.plan import COPY_BOUND_BYTES, copy_bound_sizes

__all__ = ["OVERLAP_ROWS", "TARGETS", "critic_config", "measure_overlap", "plan_args"]

log = logging.getLogger("benchmarks")

OVERLAP_ROWS = ("onload_then_forward", "swap", "full_cycle")
TARGETS = {
    # (CPU, GPU): the largest overlapped/serial ratio that passes (None: reported, no target)
    "onload_then_forward": (0.85, None),  # on a GPU: overlapped <= 1.1x best_possible_s, checked apart
    "swap": (0.85, 0.65),
    "full_cycle": (None, None),
}


def _row(name: str, serial: list[float], overlapped: list[float], **extra) -> dict:
    s, o = stats(serial), stats(overlapped)
    pairs = sorted(b / a for a, b in zip(serial, overlapped) if a)
    return {
        "name": name,
        "serial_s": s["median"],
        "overlapped_s": o["median"],
        "ratio": o["median"] / s["median"] if s["median"] else None,
        "serial_spread_s": [s["q25"], s["q75"]],
        "overlapped_spread_s": [o["q25"], o["q75"]],
        "ratio_spread": [pairs[len(pairs) // 4], pairs[(3 * len(pairs)) // 4]] if pairs else None,
        "serial_samples_s": serial,
        "overlapped_samples_s": overlapped,
        **extra,
    }


def measure_overlap(
    cfg, trainer, mm: TrainerMemoryManager, device: torch.device, threads: Optional[int] = None, pin: bool = False
) -> list[dict]:
    """The three rows for ``trainer`` (whose manager is ``mm``); every part resident before and after.

    Args:
        cfg: The :class:`~chatlearn_mem_bench.config.BenchConfig` (trainer, batch size, repeats).
        threads: Intra-op threads while measuring (CPU only; restored afterwards).
        pin: The run's host buffers are pinned (the first module's plain copy pins its source too).
    """
    before = torch.get_num_threads()
    if threads and device.type == "cpu":
        torch.set_num_threads(threads)
    if cfg.overlap_repeats:
        cfg = cfg.model_copy(update={"repeats": cfg.overlap_repeats})
    try:
        batch = forward_batch(cfg, trainer, mm, device)
        rows = [
            _onload_then_forward(cfg, trainer, mm, device, batch, copy_threads=torch.get_num_threads(), pin=pin),
            _swap(cfg, trainer, mm, device),
            _full_cycle(cfg, mm, device),
        ]
    finally:
        torch.set_num_threads(before)
    for r in rows:
        r["threads"] = torch.get_num_threads() if not threads or device.type != "cpu" else threads
        log.info(
            "overlap %s: %.3f s serial, %.3f s overlapped (ratio %.2f)",
            r["name"],
            r["serial_s"],
            r["overlapped_s"],
            r["ratio"],
        )
    return rows


CALIBRATION_TOKENS = 16
"""Tokens of the short forward that ``overlap_forward: match_copy`` times to size the row's forward."""


def forward_batch(
    cfg, trainer=None, mm: Optional[TrainerMemoryManager] = None, device: Optional[torch.device] = None
) -> torch.Tensor:
    """The ``onload_then_forward`` row's token ids (B, T) for ``cfg.overlap_forward``: the bench
    batch, a given shape, or (``match_copy``, needs ``trainer``, ``mm`` and ``device``) one sequence
    whose forward lasts about as long as a blocking weights onload, assuming time linear in tokens."""
    from chatlearn_mem.models import gpt

    full = gpt.synthetic_batch(cfg.trainer, 1, batch_size=cfg.batch_size)
    if cfg.overlap_forward is None:
        return full
    if cfg.overlap_forward != "match_copy":
        sequences, tokens = cfg.overlap_forward
        return gpt.synthetic_batch(cfg.trainer, 1, batch_size=sequences)[:, :tokens]
    short = full[:1, :CALIBRATION_TOKENS]

    def forward():
        with torch.no_grad():
            trainer.loss(short)

    def onload():
        mm.offload(Part.WEIGHTS)
        return timed(lambda: mm.onload(Part.WEIGHTS), device)[0]

    forward()  # warm
    fwd = sorted(timed(forward, device)[0] for _ in range(3))[1]
    copy = sorted(onload() for _ in range(3))[1]
    tokens = min(cfg.trainer.seq_length, max(2, round(1 + (CALIBRATION_TOKENS - 1) * copy / fwd)))
    log.info(
        "overlap onload_then_forward: a forward of 1 x %d tokens (weights onload %.1f ms, %d-token forward %.1f ms)",
        tokens,
        copy * 1e3,
        CALIBRATION_TOKENS,
        fwd * 1e3,
    )
    return full[:1, :tokens]


def first_module_bytes(mm: TrainerMemoryManager) -> int:
    """Bytes of the first module in ``mm``'s use order of the weights (its own parameters and
    buffers): what a non-blocking weights onload must bring before the forward can start."""
    ranges = mm.state.weight_user_ranges() or [[]]
    return sum(b - a for _, a, b in ranges[0])


@contextlib.contextmanager
def _intra_op_threads(threads: int):
    """This thread's intra-op threads set to ``threads`` inside, as they were after."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _copy_with_threads(threads: int, dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` on a thread of its own with ``threads`` intra-op threads (that thread's
    own setting), as a lane's worker copies."""
    torch.set_num_threads(threads)
    dst.copy_(src)


def _first_module_copy(cfg, mm, device, threads: int, pin: bool) -> tuple[int, list[float]]:
    """A plain copy, host to device, of the first module's bytes (buffers allocated once), timed
    ``warmup + repeats`` times with ``threads`` intra-op threads (CPU: the copy lane's, which are
    the submitting thread's); returns the bytes and the timed samples."""
    nbytes = first_module_bytes(mm)
    src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    with _intra_op_threads(threads) if device.type == "cpu" else contextlib.nullcontext():
        samples = [timed(lambda: dst.copy_(src, non_blocking=pin), device)[0] for _ in range(cfg.warmup + cfg.repeats)]
    return nbytes, samples[cfg.warmup :]


def _plain_onload_beside_forward(weights_bytes: int, first_bytes: int, threads: int, forward):
    """CPU only: the schedule ``onload(blocking=False)`` aims at, with plain copies. A copy of the
    first module's bytes, then the forward while a thread copies the rest of the weights' bytes (with
    ``threads`` intra-op threads, as a lane copies); returns the function to time. On a CPU
    "device" the forward and the copy share the memory bus: this is the row's bound counting that
    contention, as ``copy_bound_ratio`` is the swap's."""
    src = torch.ones(weights_bytes, dtype=torch.uint8)
    dst = torch.zeros(weights_bytes, dtype=torch.uint8)

    def run():
        with _intra_op_threads(threads):
            dst[:first_bytes].copy_(src[:first_bytes])
        other = threading.Thread(target=_copy_with_threads, args=(threads, dst[first_bytes:], src[first_bytes:]))
        other.start()
        forward()
        other.join()

    return run


def _onload_then_forward(cfg, trainer, mm, device, batch, copy_threads: int, pin: bool) -> dict:
    first_bytes, first_samples = _first_module_copy(cfg, mm, device, copy_threads, pin)

    def forward():
        with torch.no_grad():
            trainer.loss(batch)

    def serial():
        mm.onload(Part.WEIGHTS)
        forward()

    def overlapped():
        handle = mm.onload(Part.WEIGHTS, blocking=False)
        forward()
        handle.wait()

    def onload():
        mm.onload(Part.WEIGHTS)

    forward()  # warm
    kinds = [("forward", forward), ("onload", onload), ("serial", serial), ("overlapped", overlapped)]
    if device.type == "cpu":
        weights_bytes = sum(s.nbytes() for s in mm.state.storages(Part.WEIGHTS))
        kinds.append(("plain", _plain_onload_beside_forward(weights_bytes, first_bytes, copy_threads, forward)))
    samples = {name: [] for name, _ in kinds}
    for r in range(cfg.warmup + cfg.repeats):
        for name, fn in kinds:
            if name in ("onload", "serial", "overlapped"):
                mm.offload(Part.WEIGHTS)
            t, _ = timed(fn, device)
            if r >= cfg.warmup:
                samples[name].append(t)
    fwd = stats(samples["forward"])["median"]
    copy = stats(samples["onload"])["median"]
    row = _row(
        "onload_then_forward",
        samples["serial"],
        samples["overlapped"],
        forward_alone_s=fwd,
        forward_samples_s=samples["forward"],
        onload_alone_s=copy,
        onload_samples_s=samples["onload"],
        first_module_bytes=first_bytes,
        first_module_copy_s=stats(first_samples)["median"],
        first_module_copy_samples_s=first_samples,
        forward_shape=list(batch.shape),
    )
    row["timeline"] = onload_timeline(trainer, mm, device, forward)
    # No schedule beats the onload alone (the forward's last module waits for the last bytes of
    # the onload), nor the first module's bytes copied and then the whole forward.
    row["best_possible_s"] = max(fwd + row["first_module_copy_s"], copy)
    row["best_possible_ratio"] = row["best_possible_s"] / row["serial_s"] if row["serial_s"] else None
    if samples.get("plain"):
        # CPU: the same schedule with plain copies, the forward beside the copy on one memory bus
        # (the bound above counts the forward as it runs alone); no schedule of the onload beats it
        row["plain_overlap_samples_s"] = samples["plain"]
        row["plain_overlap_s"] = stats(samples["plain"])["median"]
        row["contended_best_s"] = max(row["plain_overlap_s"], row["best_possible_s"])  # never below it
        row["contended_best_ratio"] = row["contended_best_s"] / row["serial_s"] if row["serial_s"] else None
    row["overlapped_vs_forward"] = row["overlapped_s"] / fwd if fwd else None
    row["overlapped_vs_best"] = row["overlapped_s"] / row["best_possible_s"] if row["best_possible_s"] else None
    return row


def onload_timeline(trainer, mm: TrainerMemoryManager, device: torch.device, forward) -> dict:
    """One more overlapped onload and ``forward()``, with each module's bytes' arrival (the end of
    its step in the copy lane) and its start (after its wait) timed from the call, in ms: where the
    overlapped time goes (waiting for copies, or a forward slower beside them). CUDA: from events
    (the lane's, timed for this run); CPU: from ``time.perf_counter()``. ``{}`` without per-module
    fences (every module then waits for the whole onload)."""
    from chatlearn_mem import copy_engine

    users = mm.state.weight_users
    if not users:
        return {}
    cuda = device.type == "cuda"
    names = {id(m): n for n, m in trainer.model.named_modules()}
    ranges = mm.state.weight_user_ranges()

    def now():
        if cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    starts: list = [None] * len(users)

    def stamp(u: int):
        def hook(module, args):  # registered after the manager's wait, so it runs after it
            if starts[u] is None:
                starts[u] = now()

        return hook

    handles = [m.register_forward_pre_hook(stamp(u)) for u, m in enumerate(users)]
    mm.offload(Part.WEIGHTS)
    try:
        if cuda:
            torch.cuda.synchronize(device)
        t0, host0 = now(), time.perf_counter()
        with copy_engine.timed_events():
            handle = mm.onload(Part.WEIGHTS, blocking=False)
        submit_ms = (time.perf_counter() - host0) * 1e3
        gt = mm.state.in_flight(Part.WEIGHTS)
        forward()
        end = now()
        fences = [gt.user_fence(u) if gt is not None else None for u in range(len(users))]
        last = gt.batch.fence() if gt is not None and gt.batch.steps else None
        handle.wait()
        if cuda:
            torch.cuda.synchronize(device)
    finally:
        for h in handles:
            h.remove()

    def ms(x) -> Optional[float]:
        if x is None:
            return None
        return t0.elapsed_time(x) if cuda else (x - t0) * 1e3

    def arrived(f) -> Optional[float]:
        return None if f is None else ms(f.cuda_event if cuda else f.finished_at)

    modules = [
        {
            "module": names.get(id(m), type(m).__name__),
            "bytes": sum(b - a for _, a, b in ranges[u]),
            "arrived_ms": arrived(fences[u]),
            "started_ms": ms(starts[u]),
        }
        for u, m in enumerate(users)
    ]
    ran = [x for x in modules if x["started_ms"] is not None]
    return {
        "submit_ms": submit_ms,
        "first_start_ms": ran[0]["started_ms"] if ran else None,
        "last_arrival_ms": arrived(last),
        "last_start_ms": ran[-1]["started_ms"] if ran else None,
        "end_ms": ms(end),
        "modules": modules,
    }


def critic_config(trainer_cfg):
    """The swap row's incoming trainer: the benchmark's with half the layers (a value head on top)."""
    return trainer_cfg.model_copy(
        update={"num_layers": max(1, trainer_cfg.num_layers // 2), "seed": trainer_cfg.seed + 1}
    )


def copy_bound_ratio(out_bytes: int, in_bytes: int, repeats: int, nbytes: int = COPY_BOUND_BYTES) -> float:
    """On a CPU "device": the time of two host copies run at once (two threads, as the two lanes,
    each with the caller's intra-op threads, as the lanes copy) over the time of the same copies one
    after the other, median of ``repeats`` interleaved pairs.
    The copies are ``out_bytes`` and ``in_bytes`` scaled so that the larger is at most ``nbytes``
    (:func:`~chatlearn_mem_bench.plan.copy_bound_sizes`): how much a
    swap can gain from running its two directions together on this machine's memory bus, before any
    release, regrow or pacing. A GPU's two copy engines are separate hardware; this is CPU only."""
    sizes = copy_bound_sizes(out_bytes, in_bytes, nbytes)
    src = [torch.ones(n, dtype=torch.uint8) for n in sizes]
    dst = [torch.zeros(n, dtype=torch.uint8) for n in sizes]

    def serial():
        for d, s in zip(dst, src):
            d.copy_(s)

    threads = torch.get_num_threads()  # the caller's, as a lane copies with

    def together():
        other = threading.Thread(target=_copy_with_threads, args=(threads, dst[0], src[0]))
        other.start()
        dst[1].copy_(src[1])
        other.join()

    serial()
    together()  # warm: pages touched, thread machinery loaded
    ratios = []
    for _ in range(repeats):
        t_serial, _ = timed(serial, torch.device("cpu"))
        t_together, _ = timed(together, torch.device("cpu"))
        ratios.append(t_together / t_serial)
    return stats(ratios)["median"]


def _swap(cfg, trainer, mm, device) -> dict:
    from chatlearn_mem.models import gpt

    assert not mm.config.skip_unchanged_weights, "the benchmark's manager copies every time"
    critic_cfg = critic_config(cfg.trainer)
    critic = gpt.build_gpt_trainer(critic_cfg, value_head=True)
    critic.train_step(gpt.synthetic_batch(critic_cfg, 0, batch_size=cfg.batch_size))
    b = TrainerMemoryManager(critic.model, critic.optimizer, mm.config)
    out_bytes, in_bytes = mm.residency().device_bytes, b.residency().device_bytes
    b.offload()
    samples = {"serial": [], "overlapped": []}
    try:
        for r in range(cfg.warmup + cfg.repeats):
            t_serial, _ = timed(lambda: (mm.offload(force=True), b.onload()), device)
            b.offload(force=True)
            mm.onload()
            t_swap, _ = timed(lambda: swap(out=mm, into=b, force=True), device)
            swap(out=b, into=mm, force=True)
            if r >= cfg.warmup:
                samples["serial"].append(t_serial)
                samples["overlapped"].append(t_swap)
    finally:
        for p in mm.parts:
            if mm.is_offloaded(p):
                mm.onload(p)
        b.onload()
        b.close()
    bound = copy_bound_ratio(out_bytes, in_bytes, cfg.repeats) if device.type == "cpu" else None
    return _row(
        "swap",
        samples["serial"],
        samples["overlapped"],
        out_bytes=out_bytes,
        in_bytes=in_bytes,
        critic_layers=critic_cfg.num_layers,
        copy_bound_ratio=bound,
    )


def _full_cycle(cfg, mm, device) -> dict:
    parts = list(mm.parts)

    def serial():
        for p in mm.state.offload_order:
            mm.offload(p, force=True)
        for p in mm.state.onload_order:
            mm.onload(p)

    def overlapped():
        mm.offload(force=True)
        mm.onload()

    samples = {"serial": [], "overlapped": []}
    for r in range(cfg.warmup + cfg.repeats):
        for name, fn in (("serial", serial), ("overlapped", overlapped)):
            t, _ = timed(fn, device)
            if r >= cfg.warmup:
                samples[name].append(t)
    return _row("full_cycle", samples["serial"], samples["overlapped"], parts=[str(p) for p in parts])


def _forward_tokens(cfg) -> Optional[int]:
    """Tokens of the row's forward; None for ``match_copy`` (it lasts about a weights onload)."""
    if cfg.overlap_forward == "match_copy":
        return None
    sequences, tokens = cfg.overlap_forward or (cfg.batch_size, cfg.trainer.seq_length)
    return sequences * (tokens - 1)


def plan_args(cfg) -> dict:
    """What the overlap rows of ``cfg`` (a ``BenchConfig``) add to the host memory plan and the time
    estimate (``overlap_bytes``; ``forward_tokens`` for the estimate); empty without them."""
    if not cfg.overlap:
        return {}
    from chatlearn_mem.models import gpt

    return {
        "overlap_bytes": gpt.estimate_part_bytes(critic_config(cfg.trainer), value_head=True),
        "forward_tokens": _forward_tokens(cfg),
        "overlap_repeats": cfg.overlap_repeats or cfg.repeats,
    }
