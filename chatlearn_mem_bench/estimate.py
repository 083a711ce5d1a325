"""How long a benchmark run will take, estimated from its config before the minutes of measuring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from chatlearn_mem import Part
from chatlearn_mem_bench.config import FULL, PARTS
from chatlearn_mem_bench.plan import (
    CALL_OVERHEAD_S,
    DEVICE_FILL_GBPS,
    FORWARD_FLOPS,
    FRESH_PAGE_GBPS,
    METHOD_PAGES,
    PAGEABLE_GBPS,
    PAGEABLE_METHODS,
    PINNED_GBPS,
    TMS_IN_GBPS,
    TMS_OUT_GBPS,
    method_parts,
    part_bytes,
    tms_part_bytes,
)

__all__ = ["TimeEstimate", "estimate_seconds"]


@dataclass(frozen=True)
class TimeEstimate:
    """Expected seconds of a run: building the trainer, each part's repeats, the full cycles."""

    setup_s: float
    parts_s: dict
    cycles_s: float
    bandwidths_gbps: dict
    overlap_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.setup_s + sum(self.parts_s.values()) + self.cycles_s + self.overlap_s

    def summary(self) -> str:
        per = ", ".join(f"{p} {s:.0f} s" for p, s in self.parts_s.items())
        bw = ", ".join(f"{k} {v:.0f} GB/s" for k, v in self.bandwidths_gbps.items())
        overlap = f" + overlap rows {self.overlap_s:.0f} s" if self.overlap_s else ""
        return (
            f"time estimate: {self.total_s:.0f} s = setup {self.setup_s:.0f} s + parts ({per}) + cycles "
            f"{self.cycles_s:.0f} s{overlap} ({bw})"
        )

    def to_dict(self) -> dict:
        return {
            "total_s": self.total_s,
            "setup_s": self.setup_s,
            "parts_s": dict(self.parts_s),
            "cycles_s": self.cycles_s,
            "overlap_s": self.overlap_s,
            "bandwidths_gbps": dict(self.bandwidths_gbps),
        }


def estimate_seconds(
    sizes: Mapping[str, Sequence[int]],
    *,
    methods: Sequence[str],
    repeats: int,
    warmup: int,
    cycles: int,
    cuda: bool,
    pin: bool,
    builtin_available: bool = True,
    copy_gbps: Optional[float] = None,
    fresh_gbps: Optional[float] = None,
    overlap_bytes: Optional[Mapping[str, int]] = None,
    forward_tokens: Optional[int] = 0,
    overlap_repeats: Optional[int] = None,
    release_bound: bool = True,
) -> TimeEstimate:
    """Seconds a run with these parts and settings should take (sizes in, seconds out).

    Args:
        sizes: Byte size of every storage per part name.
        methods: The alternatives the run times.
        copy_gbps: On CPU, the measured bandwidth of one copy between touched buffers (GB/s); every
            copy and fill runs at it. Ignored on CUDA (:data:`PINNED_GBPS`, :data:`PAGEABLE_GBPS`).
        fresh_gbps: Fresh host pages per second (GB/s), measured; default :data:`FRESH_PAGE_GBPS`.
        overlap_bytes: With the overlap rows, the second trainer's bytes per part (see
            :func:`plan_host_memory`); ``forward_tokens``: tokens of their forward pass (None: it
            lasts one weights onload, as ``overlap_forward: match_copy`` sizes it);
            ``overlap_repeats``: their timed repeats (default ``repeats``).
        release_bound: The release bound is timed.
    """
    if cuda:
        bw = {"pinned": PINNED_GBPS if pin else PAGEABLE_GBPS, "pageable": PAGEABLE_GBPS, "fill": DEVICE_FILL_GBPS}
    else:
        if not copy_gbps or copy_gbps <= 0:
            raise ValueError(f"copy_gbps must be > 0 on CPU, got {copy_gbps}")
        bw = {"pinned": copy_gbps, "pageable": copy_gbps, "fill": copy_gbps}
    bw["fresh pages"] = fresh_gbps or FRESH_PAGE_GBPS
    b = part_bytes(sizes)

    def call(name: str, part: str, direction: int) -> float:
        if name == "torch_memory_saver":
            return CALL_OVERHEAD_S + tms_part_bytes(b, part) / (TMS_IN_GBPS if direction else TMS_OUT_GBPS) / 1e9
        fresh, regrow = METHOD_PAGES[name][direction]
        n = b[part]
        pinned_fresh = name == "fresh_host_alloc" and pin  # pinning fresh pages: faulted in, then locked
        seconds = (fresh * n * (2 if pinned_fresh else 1) + (0 if cuda else regrow * n)) / bw["fresh pages"]
        if part == Part.GRADS.value:  # nothing copied: a drop, then a zero-fill on the rebuild
            seconds += n / bw["fill"] if direction else 0.0
        elif name == "megatron_builtin" and part == FULL:  # pinned weights; the optimizer per tensor, pageable, new
            rest = n - b[Part.WEIGHTS.value]
            seconds += b[Part.WEIGHTS.value] / bw["pinned"] + rest / bw["pageable"]
            seconds += rest / bw["fresh pages"] if not direction else 0.0
        else:
            seconds += n / bw["pageable" if name in PAGEABLE_METHODS else "pinned"]
        return CALL_OVERHEAD_S + seconds / 1e9

    every = ["manager", "ceiling", *(["release_bound"] if release_bound else []), *methods]
    parts_s = {}
    for part in PARTS:
        timed = [m for m in every if part in method_parts(m, cuda, builtin_available)]
        per_round = sum(call("manager", part, d) for d in (0, 1))  # the untimed manager cycle first
        per_round += sum(call(m, part, d) for m in timed for d in (0, 1))
        parts_s[part] = (warmup + repeats) * per_round
    cycles_s = cycles * sum(call("manager", FULL, d) for d in (0, 1))
    n_params = b[Part.OPTIMIZER_STATES.value] / 8  # two fp32 moments per parameter
    # Building and one train step: megatron's import and NCCL start, then CPU initialisation
    # (use_cpu_initialization) of every parameter; plus the two integrity checksums.
    setup_s = 30.0 + 20.0 * n_params / 1e9 if cuda else 5.0 + 60.0 * n_params / 1e9
    setup_s += 2 * b[FULL] / 1e9 / bw["fill"]
    if cuda and "torch_memory_saver" in methods:  # its worker builds beside, then checks every part once
        setup_s += 10.0 + 2 * tms_part_bytes(b, FULL) / 1e9 / bw["fill"]
    overlap_s = 0.0
    if overlap_bytes:
        rounds = warmup + (overlap_repeats or repeats)
        full = sum(call("manager", FULL, d) for d in (0, 1))
        weights = sum(call("manager", Part.WEIGHTS.value, d) for d in (0, 1))
        forward = 2 * n_params * forward_tokens / FORWARD_FLOPS[cuda] if forward_tokens is not None else weights / 2
        critic = sum(n for p, n in overlap_bytes.items() if p != Part.GRADS.value) / 1e9 / bw["pinned"]
        critic_params = overlap_bytes.get(Part.OPTIMIZER_STATES.value, 0) / 8
        overlap_s = (
            # onload_then_forward: forward, onload, serial, overlapped (and on CPU the plain-copy bound)
            rounds * ((3 if cuda else 4) * forward + 3 * weights)
            + rounds * 4 * (full + 2 * critic)  # swap: serial and overlapped, there and back
            + rounds * 2 * full  # full_cycle: serial and overlapped
            + 2.0
            + (20.0 if cuda else 60.0) * critic_params / 1e9
        )  # building the second trainer, as setup
    return TimeEstimate(setup_s, parts_s, cycles_s, bw, overlap_s)
