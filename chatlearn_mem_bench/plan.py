"""What a benchmark run will hold and how long it will take, known before the first timing.

Both are pure functions of the bytes the trainer's parts occupy (sizes in, bytes or seconds out),
so they can be checked anywhere: on the trainer just built (:func:`measured_part_sizes`) before
the first timing, or from a config alone (:func:`estimate_part_sizes`) where the trainer cannot
be built, as the GPU validation's dry run does on a CPU machine.

**Host memory** (:func:`plan_host_memory`). What the run holds for all of it: the manager's host
store (pinned on CUDA, registered at its exact size), one ceiling host buffer sized for the
largest copy and shared by ``ceiling`` and ``release_bound`` (no host buffer for grads, which are
never copied), and megatron-core's own ``param_data_cpu`` when ``megatron_builtin`` runs on CUDA
(torch's pinned allocator rounds each block up to a power of two and megatron keeps it for the
life of the buffer). On top, what one method holds at a time: every alternative releases its
host copies (and on CPU its new "device" buffers, which are host memory there) before the next
method starts. The peak pinned and peak pageable figures add the largest of those to what is
held throughout; their sum is what the run is checked against.

**Time** (:func:`estimate_seconds`). Every (part, method, direction) is timed ``warmup +
repeats`` times after one untimed manager cycle per round. Each call costs its copy, over the
bandwidth of its kind of host memory (on CUDA 55 GB/s pinned and 16 GB/s pageable, the H100
figures in the design notes; on CPU a copy measured at start), plus the fresh pages it touches
(:data:`METHOD_PAGES`: host memory allocated anew, and on CPU released storages regrown) over the
host's page-fault bandwidth, measured at start (:func:`chatlearn_mem_bench.measure.host_bandwidths`;
pinning fresh pages counts twice), plus a fixed cost per call. Checked on a shared 2-core CPU:
with the bandwidths measured there (copies 21 GB/s, fresh pages 5.6 GB/s) it gives 93 s for the
``cpu`` preset, which took 92 s and 98 s in two runs (single parts off by up to 40%: weights
under, grads over). Fresh pages are what make the alternatives slow, and they do not get faster
with the copies: a model of each method's time as a multiple of the ceiling's does not carry
over (2-10x the ceiling on that CPU, 2-4x on a slower-copying one). ``torch_memory_saver`` is
estimated at the rates its users measured (:data:`chatlearn_mem_bench.tms.TMS_OUT_GBPS`, ``TMS_IN_GBPS``)
on the bytes its tags hold (:func:`tms_part_bytes`).

**Device memory** (:func:`plan_device_memory`, CUDA only). The trainer's state, the ceiling's device
buffer (the largest part, the full copy included), the release bound's (the largest part, while
the part runs), activations of the training step (a rough model, :func:`activation_bytes`) and,
with ``torch_memory_saver``, its worker's trainer (the same state, allocator segments whole):
what the GPU validation checks a preset against before it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from chatlearn_mem import ChatlearnMemError, Part
from chatlearn_mem.host_memory import HostMemory, gib
from chatlearn_mem.host_store import HostStore
from chatlearn_mem_bench.config import COPY_PARTS, FULL, PARTS

__all__ = [
    "HostMemoryPlan",
    "HostMemoryPlanError",
    "METHOD_PAGES",
    "PAGEABLE_GBPS",
    "PINNED_GBPS",
    "activation_bytes",
    "estimate_part_sizes",
    "format_bytes",
    "measured_part_sizes",
    "method_parts",
    "part_bytes",
    "plan_device_memory",
    "plan_host_memory",
    "refuse_unless_fits",
    "tms_part_bytes",
]

PINNED_GBPS = 55.0
"""Pinned host <-> device copy bandwidth of an H100 host, GB/s (DESIGN.md, "Lessons")."""
PAGEABLE_GBPS = 16.0
"""Pageable host <-> device copy bandwidth of an H100 host, GB/s (the same source)."""
DEVICE_FILL_GBPS = 1000.0
"""A device zero-fill (the grads rebuild) on a GPU, GB/s; an H100 writes about 3 TB/s."""
CALL_OVERHEAD_S = 0.005
"""Fixed cost of one offload or onload call (Python, module walks, ``empty_cache``), seconds."""
FORWARD_FLOPS = {True: 200e12, False: 200e9}
"""Sustained FLOP/s of a bf16 forward pass, for the overlap rows' estimate: a GPU (an H100 reaches
about 790 TFLOP/s on dense bf16 matrices; small-batch forwards far less) and a CPU (a 2-core AVX-512
machine ran the 135 M-parameter bench trainer's forward at about 400 GFLOP/s)."""
FRESH_PAGE_GBPS = 4.0
"""Fresh host pages (page faults and zeroing), GB/s, where it cannot be measured (an estimate made
for another machine): the low end of the 4.3-7.7 GB/s measured on a shared 2-core EPYC."""

METHOD_PAGES = {
    "manager": ((0, 0), (0, 1)),
    "ceiling": ((0, 0), (0, 0)),
    "release_bound": ((0, 0), (0, 1)),
    "per_tensor_new_host": ((1, 0), (0, 1)),
    "fresh_host_alloc": ((1, 0), (0, 1)),
    "replace_rebuild": ((1, 0), (0, 1)),
    "megatron_builtin": ((0, 0), (0, 1)),
    "torch_memory_saver": ((0, 0), (0, 0)),  # estimated at its measured rates (estimate_seconds)
}
"""Per method, ``(offload, onload)`` pairs of (fresh host bytes, regrown device bytes) per byte of
the part: the alternatives allocate their host copies anew on every offload; everything that
releases regrows on onload, which on CPU touches fresh pages (on CUDA a ``cudaMalloc``)."""
PAGEABLE_METHODS = ("per_tensor_new_host", "replace_rebuild")
"""Methods that copy through pageable host memory (the rest: pinned when pinning is on)."""


class HostMemoryPlanError(ChatlearnMemError, MemoryError):
    """The benchmark would need more host memory than the process can use; nothing was measured.
    The message (one line) gives the planned and available bytes and a smaller preset."""


def method_parts(name: str, cuda: bool, builtin_available: bool = True) -> tuple[str, ...]:
    """The parts method ``name`` is timed on: the manager and the two copy baselines on every part,
    the alternatives on the copied parts, megatron-core's own calls on weights and grads (and on
    CUDA the full trainer: its optimizer offload moves CUDA tensors only), where it has them."""
    if name in ("manager", "ceiling", "release_bound"):
        return PARTS
    if name == "megatron_builtin":
        return ((Part.WEIGHTS, Part.GRADS) + ((FULL,) if cuda else ())) if builtin_available else ()
    if name == "torch_memory_saver":  # its tags: the model (weights with grads), main weights, states, all
        return (Part.WEIGHTS, Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES, FULL) if cuda else ()
    return COPY_PARTS


def tms_part_bytes(b: Mapping[str, int], part: str) -> int:
    """Bytes ``torch_memory_saver`` pauses to free ``part`` (from :func:`part_bytes`): its ``model``
    tag holds the weights and the grads together, ``full`` is every tag (grads included); free
    blocks in its segments come on top and are not counted here."""
    if part == Part.WEIGHTS.value:
        return b[Part.WEIGHTS.value] + b[Part.GRADS.value]
    if part == FULL:
        return b[FULL] + b[Part.GRADS.value]
    return b[part]


# -- sizes --------------------------------------------------------------------------------------
def measured_part_sizes(storages: Mapping[str, Sequence]) -> dict[str, list[int]]:
    """Byte size of every storage per part, from ``{part: [UntypedStorage, ...]}``."""
    return {str(p): [int(s.nbytes()) for s in ss] for p, ss in storages.items()}


def format_bytes(n: int) -> str:
    """``n`` bytes as GiB from 1 GiB up, else MiB."""
    return gib(n) if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def estimate_part_sizes(trainer) -> dict[str, list[int]]:
    """Bytes per part of the trainer ``trainer`` (a ``GPTTrainerConfig``) would build, one rank, from
    the config alone (``gpt.estimate_part_bytes``, within megatron's padding of the measured bytes),
    as one size per part."""
    from chatlearn_mem.models.gpt import estimate_part_bytes

    return {part: [nbytes] if nbytes else [] for part, nbytes in estimate_part_bytes(trainer).items()}


def part_bytes(sizes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """Bytes per part, and for ``full`` the bytes copied (the three copied parts; grads are dropped)."""
    out = {str(p): sum(sizes.get(str(p), ())) for p in Part}
    out[FULL] = sum(out[str(p)] for p in COPY_PARTS)
    return out


# -- host memory --------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanItem:
    """One host allocation of the plan: what holds it, bytes, pinned or pageable, and whether it
    is held for the whole run (``held_by`` None) or only while method ``held_by`` runs."""

    what: str
    nbytes: int
    pinned: bool
    held_by: Optional[str] = None


@dataclass(frozen=True)
class HostMemoryPlan:
    """Host memory a benchmark run will hold at its peak (see the module docstring)."""

    items: tuple[PlanItem, ...]

    def _peak(self, pinned: bool) -> int:
        run = sum(i.nbytes for i in self.items if i.held_by is None and i.pinned == pinned)
        per_method: dict[str, int] = {}
        for i in self.items:
            if i.held_by is not None and i.pinned == pinned:
                per_method[i.held_by] = per_method.get(i.held_by, 0) + i.nbytes
        return run + max(per_method.values(), default=0)

    @property
    def pinned_bytes(self) -> int:
        """Peak page-locked bytes: held throughout plus the method that pins the most."""
        return self._peak(True)

    @property
    def pageable_bytes(self) -> int:
        """Peak pageable bytes: held throughout plus the method that allocates the most."""
        return self._peak(False)

    @property
    def peak_bytes(self) -> int:
        """``pinned_bytes + pageable_bytes``: what must fit in the host memory the process can use."""
        return self.pinned_bytes + self.pageable_bytes

    def summary(self) -> str:
        """One line: the peaks, then every allocation."""
        parts = "; ".join(
            f"{i.what} {format_bytes(i.nbytes)}{' pinned' if i.pinned else ''}"
            f"{f' (while {i.held_by} runs)' if i.held_by else ''}"
            for i in self.items
            if i.nbytes
        )
        return (
            f"host memory plan: peak {format_bytes(self.peak_bytes)} = {format_bytes(self.pinned_bytes)} pinned + "
            f"{format_bytes(self.pageable_bytes)} pageable ({parts})"
        )

    def to_dict(self) -> dict:
        return {
            "pinned_bytes": self.pinned_bytes,
            "pageable_bytes": self.pageable_bytes,
            "peak_bytes": self.peak_bytes,
            "items": [
                {"what": i.what, "bytes": i.nbytes, "pinned": i.pinned, "held_by": i.held_by} for i in self.items
            ],
        }


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def plan_host_memory(
    sizes: Mapping[str, Sequence[int]],
    *,
    methods: Sequence[str],
    cuda: bool,
    pin: bool,
    bucket_size: int,
    builtin_available: bool = True,
    overlap_bytes: Optional[Mapping[str, int]] = None,
    release_bound: bool = True,
    tms_retain_cpu_backup: bool = False,
    checkpoint: bool = False,
) -> HostMemoryPlan:
    """The host memory a run with these parts and methods holds (sizes in, bytes out).

    Args:
        sizes: Byte size of every storage per part name (:func:`measured_part_sizes`,
            :func:`estimate_part_sizes`).
        methods: The alternatives the run times (``BenchConfig.methods``).
        cuda: The trainer lives on a GPU; otherwise its "device" memory is host memory too, and the
            ceiling's and the alternatives' device buffers count.
        pin: Host buffers are pinned (the manager's store, the ceiling, ``fresh_host_alloc``).
        bucket_size: The manager's host store bucket, bytes (``MemoryConfig.bucket_size_bytes``).
        builtin_available: The installed megatron-core has its own offload calls (0.16+).
        overlap_bytes: With the overlap rows, the second (critic-sized) trainer's bytes per part
            (:func:`chatlearn_mem.models.gpt.estimate_part_bytes`): its host store, and on CPU its
            "device" state too, held while those rows run.
        release_bound: The release bound is timed (``BenchConfig.release_bound``).
        tms_retain_cpu_backup: ``torch_memory_saver`` keeps its pinned backups between pauses
            (held for the run, not only while it runs).
        checkpoint: The ``checkpoint`` report runs: while it does, its plain write's buffer (the
            checkpoint's bytes) and the default format's copy of the optimizer state.
    """
    b = part_bytes(sizes)
    copy_max = max(b[str(p)] for p in COPY_PARTS)
    items = [
        PlanItem(
            "manager host store",
            sum(HostStore.planned_nbytes(list(sizes.get(str(p), ())), bucket_size) for p in COPY_PARTS),
            pin,
        ),
        PlanItem("ceiling host buffer (shared with release_bound)", b[FULL], pin),
    ]
    if not cuda:  # the "device" buffers are host memory
        # release_bound's buffer is the part's size and held through the part's rounds (released
        # only inside its own timed calls): count the largest part's for the whole run
        items += [
            PlanItem("ceiling device buffer", max(b[FULL], b[Part.GRADS.value]), False),
        ]
        if release_bound:
            items.append(PlanItem("release_bound device buffer", max(b[FULL], b[Part.GRADS.value]), False))
    for name in methods:
        if name == "per_tensor_new_host":
            items.append(PlanItem("per_tensor_new_host host copies", copy_max, False, name))
        elif name == "fresh_host_alloc":
            items.append(PlanItem("fresh_host_alloc host buffers", copy_max, pin, name))
        elif name == "replace_rebuild":
            items.append(PlanItem("replace_rebuild host copies", copy_max, False, name))
            if not cuda:
                items.append(PlanItem("replace_rebuild new device buffers", copy_max, False, name))
        elif name == "megatron_builtin" and builtin_available:
            weights = list(sizes.get(Part.WEIGHTS.value, ()))
            if cuda:  # .cpu().pin_memory(): torch's pinned allocator, power-of-two blocks, kept
                items.append(PlanItem("megatron-core param_data_cpu", sum(_pow2(n) for n in weights), True))
                moved = b[Part.MAIN_WEIGHTS.value] + b[Part.OPTIMIZER_STATES.value]
                items.append(PlanItem("megatron-core .cpu() copies", max(sum(weights), moved), False, name))
            else:
                items.append(PlanItem("megatron-core param_data_cpu", sum(weights), False))
        elif name == "torch_memory_saver" and cuda:  # pinned backups of every tag, in its worker
            held_by = None if tms_retain_cpu_backup else name
            items.append(PlanItem("torch_memory_saver backups (its worker)", tms_part_bytes(b, FULL), True, held_by))
    if overlap_bytes:
        copied = sum(n for p, n in overlap_bytes.items() if p != Part.GRADS.value)
        items.append(PlanItem("overlap rows: second trainer's host store", copied, pin, "overlap"))
        if not cuda:
            items.append(PlanItem("overlap rows: second trainer", sum(overlap_bytes.values()), False, "overlap"))
            # the swap row's copy bound: its two copies scaled down, sources and destinations
            n_out, n_in = copy_bound_sizes(sum(b[str(p)] for p in Part), sum(overlap_bytes.values()))
            items.append(PlanItem("overlap rows: swap copy-bound buffers", 2 * (n_out + n_in), False, "overlap"))
            # onload_then_forward's bound with contention: a source and a destination of the weights,
            # freed before the swap row builds its second trainer (a phase of its own)
            n_weights = b[Part.WEIGHTS.value]
            items.append(
                PlanItem("overlap rows: plain-copy bound buffers", 2 * n_weights, False, "overlap onload_then_forward")
            )
    if checkpoint:
        optimizer = b[Part.MAIN_WEIGHTS.value] + b[Part.OPTIMIZER_STATES.value]
        items += [
            PlanItem("checkpoint report: plain-write buffer", b[FULL], False, "checkpoint"),
            PlanItem("checkpoint report: fully_reshardable optimizer copy", optimizer, False, "checkpoint"),
        ]
    return HostMemoryPlan(tuple(items))


COPY_BOUND_BYTES = 64 * 2**20
"""The larger copy of the CPU swap row's copy bound at most (``chatlearn_mem_bench.overlap.copy_bound_ratio``)."""


def copy_bound_sizes(out_bytes: int, in_bytes: int, nbytes: int = COPY_BOUND_BYTES) -> tuple[int, int]:
    """The two copies of the swap row's copy bound: the row's outgoing and incoming bytes scaled so
    that the larger is ``nbytes``, or the row's own sizes when both are smaller."""
    scale = min(1.0, nbytes / max(out_bytes, in_bytes, 1))
    return max(1, int(out_bytes * scale)), max(1, int(in_bytes * scale))


def refuse_unless_fits(
    plan: HostMemoryPlan, usable: HostMemory, margin_bytes: int, instead: Callable[[int], str]
) -> None:
    """Raise :class:`HostMemoryPlanError` when ``plan`` does not fit in ``usable`` minus ``margin_bytes``.

    Args:
        instead: Given the bytes that are left, what to run instead (e.g. ``--config tiny``), for
            the message.
    """
    if usable.nbytes is None:
        return
    room = max(0, usable.nbytes - margin_bytes)
    if plan.peak_bytes > room:
        raise HostMemoryPlanError(
            f"the benchmark would hold up to {format_bytes(plan.pinned_bytes)} pinned + {format_bytes(plan.pageable_bytes)} pageable "
            f"= {format_bytes(plan.peak_bytes)} of host memory, but the process can use {format_bytes(room)} ({usable.describe()}; "
            f"minus a {format_bytes(margin_bytes)} margin); nothing was measured. {instead(room)}"
        )


# -- time ---------------------------------------------------------------------------------------


# -- device memory (CUDA) -----------------------------------------------------------------------
def activation_bytes(trainer, batch_size: int) -> int:
    """About the device bytes one training step of ``trainer`` (a ``GPTTrainerConfig``) adds on top
    of its state: the layers' saved activations without recomputation (34 s b h + 5 a s^2 b bytes
    per layer in bf16, Korthikanti et al. 2022), the fp32 logits with their softmax and gradient
    (3 x 4 b s V bytes), and Adam's foreach temporaries (one fp32 copy of the states' smaller half,
    4 bytes per parameter). A rough model, for sizing presets, not an exact figure."""
    from chatlearn_mem.models.gpt import estimate_part_bytes

    s, b, h = trainer.seq_length, batch_size, trainer.hidden_size
    layers = trainer.num_layers * (34 * s * b * h + 5 * trainer.num_attention_heads * s * s * b)
    logits = 3 * 4 * b * s * trainer.vocab_size
    adam = estimate_part_bytes(trainer)["optimizer_states"] // 2
    return layers + logits + adam


def plan_device_memory(
    sizes: Mapping[str, Sequence[int]],
    *,
    methods: Sequence[str],
    release_bound: bool = True,
    activations: int = 0,
) -> dict:
    """The device memory (CUDA) a run holds at its peak: ``{"items": [(what, bytes)], "setup_bytes",
    "timing_bytes", "peak_bytes"}``.

    While the trainers are built and trained one step (setup): the trainer's state and the step's
    ``activations`` (:func:`activation_bytes`), and ``torch_memory_saver``'s worker doing the same
    beside it. While the parts are timed: the state, the ceiling's device buffer (the largest part,
    the full copy's bytes), the release bound's (up to the full copy's) and the worker's state.
    The overlap rows and the soak come after the ceiling's buffers are freed.
    """
    b = part_bytes(sizes)
    state = sum(b[str(p)] for p in Part)
    tms = "torch_memory_saver" in methods
    items = [
        ("trainer state", state),
        ("activations and optimizer temporaries of a training step (setup)", activations),
        ("ceiling device buffer", max(b.values())),
    ]
    if release_bound:
        items.append(("release_bound device buffer (the largest part)", max(b.values())))
    if tms:
        items.append(("torch_memory_saver worker's trainer state", state))
        items.append(("torch_memory_saver worker's training step (setup)", activations))
    setup = state + activations + (state + activations if tms else 0)
    timing = state + max(b.values()) * (2 if release_bound else 1) + (state if tms else 0)
    return {"items": items, "setup_bytes": setup, "timing_bytes": timing, "peak_bytes": max(setup, timing)}


TMS_OUT_GBPS = 2.41 * 2**30 / 1e9
"""TMS's CPU-backup pause, GB/s, as measured by its users (2.41 GiB/s where a pinned copy did
24.4 GiB/s on the same card, torch_memory_saver issue #111): the time estimate's figure."""


TMS_IN_GBPS = 5.32 * 2**30 / 1e9
"""TMS's resume from the CPU backup, GB/s (5.32 GiB/s, the same issue)."""
