"""Training runs shared by the megatron and multirank tiers, and the spawned workers' code.

Single-rank tests call :func:`train` in the test process (after the ``dist1`` fixture). Multi-rank
tests describe each run as a spec (:func:`layout_spec`) and run a list of specs of one world size
in one spawned process group (:func:`spawn_layouts`): the process start and the megatron import,
which dominate on CPU, are paid once per group, not once per run. Each rank re-initialises
megatron's model-parallel state between specs and writes one JSON result per spec.

Importable as ``trainer_runs`` from every tier and from the spawned workers: the root conftest
puts ``tests/`` on sys.path, and spawn hands sys.path to the children.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
import traceback
import warnings
from typing import Callable, Optional

import torch

from chatlearn_mem import MemoryConfig, TrainerMemoryManager, cpu_backend
from chatlearn_mem.mcore import layout
from chatlearn_mem.models import gpt

_T0 = time.perf_counter()  # module import in the spawned process, before megatron's

NON_BLOCKING = MemoryConfig(copy_chunk_mb=16 / 1024)
"""The config of the non-blocking runs: 16 KiB pieces, so that even the test GPT's weights arrive in
many steps and each module really waits for its own (R4)."""
NON_BLOCKING_GPU = MemoryConfig(copy_chunk_mb=4)
"""The same for the GPU tier's larger model (1.5 GB of state): 4 MiB pieces, a few hundred steps per
transition. 16 KiB pieces there mean some 100 000 copies per transition, each slowed by
:func:`slow_lanes`: minutes per test instead of seconds."""
SLOWED = (NON_BLOCKING, NON_BLOCKING_GPU)
"""The configs :func:`train` runs under :func:`slow_lanes`."""

STEPS = 8  # train() default: the single-rank runs and the multi-rank exactness specs
LAYOUT_STEPS = 4  # layout_spec() default: the multi-rank layouts (each step costs more there)
BATCH = 4


def layout_spec(
    name: str,
    world: int,
    tp: int = 1,
    pp: int = 1,
    vpp: Optional[int] = None,
    ep: int = 1,
    steps: int = LAYOUT_STEPS,
    inject_bugs: bool = False,
    **cfg,
) -> dict:
    """A multi-rank run for :func:`spawn`: process-group sizes, steps, the GPTTrainerConfig
    fields, and whether to break aliases on purpose after the exactness run (:func:`inject_bugs`)."""
    return dict(name=name, world=world, tp=tp, pp=pp, vpp=vpp, ep=ep, steps=steps, cfg=cfg, inject_bugs=inject_bugs)


def setup_parallel(spec: dict) -> None:
    """(Re)initialise megatron's model-parallel groups for ``spec`` in this process."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        spec["tp"], spec["pp"], virtual_pipeline_model_parallel_size=spec["vpp"], expert_model_parallel_size=spec["ep"]
    )
    model_parallel_cuda_manual_seed(1234)


def chunks_of(trainer) -> list:
    """The trainer's model chunks: ``[model]`` for the single-model trainer."""
    return trainer.model if isinstance(trainer.model, list) else [trainer.model]


def sync_params(trainer) -> None:
    """Finish a lazy (overlapped) param all-gather so the model params hold the stepped weights."""
    if trainer.config.overlap_param_gather:
        for c in chunks_of(trainer):
            c.start_param_sync(force_sync=True)


def snapshot(trainer) -> list[torch.Tensor]:
    """Weights (of every chunk), fp32 main weights and optimizer states, cloned.

    Works for both trainers (one model or a list of chunks); with overlapped param gather it
    first finishes the lazy all-gather so the params hold the stepped weights."""
    sync_params(trainer)
    out = [p.detach().clone() for c in chunks_of(trainer) for p in c.parameters()]
    for leaf in layout.leaf_optimizers(trainer.optimizer):
        out += [t.detach().clone() for t in layout.main_weights(leaf)]
        for state in layout.torch_optimizer(leaf).state.values():
            out += [v.clone() for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Same length, and every pair has the same dtype and the same bits."""
    return len(a) == len(b) and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


def data_parallel_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def train(
    cfg: gpt.GPTTrainerConfig | dict,
    steps: int = STEPS,
    between: Optional[Callable] = None,
    rank: int = 0,
    pipeline: bool = False,
    config: Optional[MemoryConfig] = None,
):
    """Build a trainer, train ``steps`` steps calling ``between(mm, trainer, step)`` after each.

    ``pipeline=False`` builds the single-model ``GPTTrainer`` (``gpt.build_gpt_trainer``),
    ``pipeline=True`` the ``GPTPipelineTrainer`` (a list of chunks stepped by megatron's
    schedule). ``rank`` is the data-parallel rank the synthetic batches are drawn for; ``config``
    the manager's (:data:`NON_BLOCKING` when ``between`` is non-blocking, see :func:`slow_lanes`).
    Returns ``(losses, snapshot(trainer), mm, trainer)``.
    """
    if isinstance(cfg, dict):
        cfg = gpt.GPTTrainerConfig(**cfg)
    trainer = (gpt.build_gpt_pipeline_trainer if pipeline else gpt.build_gpt_trainer)(cfg)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, config)
    losses = []
    with slow_lanes() if any(config is c for c in SLOWED) else contextlib.nullcontext():
        for step in range(steps):
            losses.append(trainer.train_step(gpt.synthetic_batch(cfg, step, batch_size=BATCH, rank=rank)))
            if between is not None:
                between(mm, trainer, step)
    mm.residency()  # waits for what is in flight: snapshot() reads the tensors directly, unguarded
    return losses, snapshot(trainer), mm, trainer


@contextlib.contextmanager
def slow_lanes(seconds: float = 2e-4):
    """Make every copy of the copy engine take ``seconds`` longer, so that the training step after a
    non-blocking onload really runs while the bytes are still arriving: every guard's wait (R4) is
    exercised, not only the path where the copies have long finished.

    A CPU lane's worker thread sleeps before each copy. A CUDA lane's copies are queued by the
    caller's thread, so sleeping there would only slow the caller: the lane's stream (current
    while the copy is queued) spins instead (``torch.cuda._sleep``), and the host goes on."""
    from chatlearn_mem import copy_engine

    real = copy_engine._before_step
    cycles = int(seconds * 2e9)  # about ``seconds`` at a GPU's 2 GHz clock

    def slow(lane: str, label: str) -> None:
        if label.startswith(("copy", "zero")):
            if lane.startswith("cpu"):
                time.sleep(seconds)
            else:
                torch.cuda._sleep(cycles)

    copy_engine._before_step = slow
    try:
        yield
    finally:
        copy_engine._before_step = real


def full_cycle_non_blocking(mm, trainer, step):
    """:func:`full_cycle` without waiting: offload, check the device is empty (residency waits),
    onload and leave it in flight: the next train step's guards wait for what each needs. The audit
    runs every other step (it waits for the onload; the other steps overlap)."""
    mm.offload(blocking=False)
    res = mm.residency()
    assert res.device_bytes == 0, str(res)
    handle = mm.onload(blocking=False)
    if step % 2:
        handle.wait()
        report = mm.audit()
        assert report.ok, str(report)


def train_spec(spec: dict, between: Optional[Callable] = None, config: Optional[MemoryConfig] = None):
    """:func:`train` for a multi-rank layout spec: the pipeline trainer, this rank's data."""
    return train(
        spec["cfg"], steps=spec["steps"], between=between, rank=data_parallel_rank(), pipeline=True, config=config
    )


def full_cycle(mm, trainer, step):
    """Offload everything, check the device is empty, onload everything, audit."""
    mm.offload()
    res = mm.residency()
    assert res.device_bytes == 0, str(res)
    mm.onload()
    report = mm.audit()
    assert report.ok, str(report)


def assert_exact(cfg, steps: int, between: Callable, base=None, rank: int = 0, config: Optional[MemoryConfig] = None):
    """Train ``cfg`` with ``between`` after every step and require the same losses and bits as a run
    without it (``base``: a :func:`train` result, made here when None). On a mismatch the baseline
    is run again: if it does not reproduce itself, the device is not deterministic and the
    failure says so instead of blaming the manager. Returns the run's :func:`train` result."""
    base = base or train(cfg, steps=steps, rank=rank)
    got = train(cfg, steps=steps, between=between, rank=rank, config=config)
    if got[0] != base[0] or not bit_equal(got[1], base[1]):
        again = train(cfg, steps=steps, rank=rank)
        assert again[0] == base[0] and bit_equal(again[1], base[1]), (
            "two runs without offload differ: this device is not deterministic for this model, so "
            f"exactness cannot be judged (losses {base[0]} vs {again[0]})"
        )
    assert got[0] == base[0], f"losses differ: {got[0]} vs {base[0]}"
    assert bit_equal(got[1], base[1]), "weights, main weights or optimizer states differ"
    return got


TRANSITIONS = {"blocking": (full_cycle, None), "non_blocking": (full_cycle_non_blocking, NON_BLOCKING)}
"""``{name: (between, memory config)}``: the exactness tests run each way (parametrize over the keys)."""


def reachable_storages(*roots) -> dict[int, tuple[str, torch.UntypedStorage]]:
    """Every tensor storage reachable from ``roots`` through attributes, containers and modules.

    An independent view of what a trainer holds (the manager's residency() counts only the
    tensors it knows about): ``{storage id: (first path found, storage)}``. The walk is the
    library's (``chatlearn_mem.device_report.reachable_tensors``, which the device report uses).
    """
    from chatlearn_mem.device_report import reachable_tensors

    out: dict[int, tuple[str, torch.UntypedStorage]] = {}
    for path, t, _ in reachable_tensors(*roots):
        if t.device.type != "meta":
            s = t.untyped_storage()
            out.setdefault(s._cdata, (path, s))
    return out


def reachable_bytes(trainer) -> tuple[int, list[str]]:
    """Bytes of every storage reachable from the trainer's chunks and optimizer, and the paths
    of the ones larger than 0 bytes (for error messages)."""
    found = reachable_storages(chunks_of(trainer), trainer.optimizer)
    live = [(s.nbytes(), p) for p, s in found.values() if s.nbytes()]
    return sum(n for n, _ in live), [f"{p} ({n} bytes)" for n, p in sorted(live, reverse=True)]


def describe(trainer, mm) -> dict:
    """Facts about the layout, so the tests can check it really is what it claims."""
    from megatron.core.optimizer import ChainedOptimizer

    leaves = layout.leaf_optimizers(trainer.optimizer)
    chunks = chunks_of(trainer)
    return dict(
        n_chunks=len(chunks),
        n_expert_buffers=sum(len(getattr(c, "expert_parallel_buffers", None) or []) for c in chunks),
        n_buffers=sum(len(c.buffers) for c in chunks),
        leaf_types=[type(leaf).__name__ for leaf in leaves],
        chained=isinstance(trainer.optimizer, ChainedOptimizer),
        n_frozen=sum(not p.requires_grad for c in chunks for p in c.parameters()),
        n_bucket_groups=len(layout.bucket_groups(chunks)),
        n_cached_shards=sum(len(layout.cached_shard_views(g)) for g in layout.bucket_groups(chunks)),
        audit_checks=mm.audit().checked,
    )


def _audit_text(mm) -> str:
    return "\n".join(mm.audit().problems)


def inject_bugs(mm, trainer) -> dict:
    """Break one alias at a time the way a buggy offloader would, record what audit() says, undo.

    Targets the last chunk and the last optimizer (the expert-parallel ones in a MoE model, the
    second virtual stage with virtual pipeline). Returns ``{bug: audit problems}`` plus
    ``{bug + "/undone": audit problems after undoing}`` (empty when clean again).
    """
    out = {}
    chunk = chunks_of(trainer)[-1]
    bufs = layout.ddp_buffers(chunk, len(chunks_of(trainer)) - 1)
    target_buf = bufs[-1]  # expert_parallel_buffers come last
    param = next(p for p in reversed(list(target_buf.param_offsets)) if p.requires_grad)
    name = next(n for n, p in chunk.named_parameters() if p is param)
    out["target_param"] = name

    # 1. A bucket-group shard cache left pointing at released memory (0.16 keeps these caches).
    groups = [g for g in layout.bucket_groups([chunk]) if layout.cached_shard_views(g)]
    if groups:
        group = groups[-1]
        attr = next(
            a
            for a in ("cached_param_buffer_shard_list", "cached_grad_buffer_shard_list")
            if any(x is not None for x in getattr(group, a))
        )
        idx = next(i for i, x in enumerate(getattr(group, attr)) if x is not None)
        saved = getattr(group, attr)[idx]
        old = torch.empty(sum(t.numel() for t in saved), dtype=saved[0].dtype)  # the "old" bucket
        n = saved[0].numel()
        getattr(group, attr)[idx] = [old[r * n : (r + 1) * n] for r in range(len(saved))]
        old.untyped_storage().resize_(0)  # ... released
        out["stale_cached_shard"] = _audit_text(mm)
        getattr(group, attr)[idx] = saved
        out["stale_cached_shard/undone"] = _audit_text(mm)

    # 2. A param_groups entry that is no longer the live shard (or main) tensor.
    leaf = layout.leaf_optimizers(trainer.optimizer)[-1]
    opt = layout.torch_optimizer(leaf)
    params = [g["params"] for g in opt.param_groups if g["params"]][-1]
    live = params[-1]
    params[-1] = live.detach().clone()
    out["stale_param_group_entry"] = _audit_text(mm)
    params[-1] = live
    out["stale_param_group_entry/undone"] = _audit_text(mm)

    # 3. A missing grad-accumulator hook (what a param recreated behind DDP's back ends up with:
    #    an accumulator without DDP's hook, so its gradient is never reduced).
    node = layout.grad_accumulator(param)
    probe = node.register_hook(lambda *a: None)
    hooks = probe.hooks_dict_ref()
    probe.remove()
    saved_hooks = dict(hooks)
    hooks.clear()
    out["missing_hook"] = _audit_text(mm)
    hooks.update(saved_hooks)
    out["missing_hook/undone"] = _audit_text(mm)

    # 4. A doubled hook (registered again, e.g. by rewrapping): its grad would be reduced twice.
    handle = node.register_hook(chunk._make_backward_post_hook(param))
    chunk.grad_accs.append(node)
    out["doubled_hook"] = _audit_text(mm)
    handle.remove()
    chunk.grad_accs.pop()
    out["doubled_hook/undone"] = _audit_text(mm)
    return out


def run_layout(spec: dict) -> dict:
    """Baseline run vs the same run with a full offload/onload after every step, on this rank."""
    setup_parallel(spec)
    base_losses, base_state, _, _ = train_spec(spec)
    ratios, problems = [], []

    reach_ratios, leftovers = [], []

    def cycle(mm, trainer, step):
        before = mm.residency().device_bytes
        reach_before, _ = reachable_bytes(trainer)
        mm.offload()
        after = mm.residency().device_bytes
        ratios.append(after / before)
        reach_after, paths = reachable_bytes(trainer)
        reach_ratios.append(reach_after / reach_before)
        if step == 0:
            leftovers.extend(paths[:10])
        report = mm.audit()  # clean while offloaded too
        problems.extend(f"step {step} offloaded: {p}" for p in report.problems)
        mm.onload()
        report = mm.audit()
        problems.extend(f"step {step} onloaded: {p}" for p in report.problems)

    setup_parallel(spec)
    losses, state, mm, trainer = train_spec(spec, between=cycle)
    bugs = inject_bugs(mm, trainer) if spec.get("inject_bugs") else {}

    nb_ratios, nb_problems = [], []

    def cycle_non_blocking(mm, trainer, step):
        before = mm.residency().device_bytes  # waits for the previous step's onload
        mm.offload(blocking=False)
        nb_ratios.append(mm.residency().device_bytes / before)
        nb_problems.extend(f"step {step} offloaded: {p}" for p in mm.audit().problems)
        mm.onload(blocking=False)  # still in flight when the next step starts

    setup_parallel(spec)
    nb_losses, nb_state, nb_mm, _ = train_spec(spec, between=cycle_non_blocking, config=NON_BLOCKING)
    nb_problems.extend(f"end: {p}" for p in nb_mm.audit().problems)
    return dict(
        losses_equal=losses == base_losses,
        weights_equal=bit_equal(state, base_state),
        bugs=bugs,
        n_tensors=len(state),
        losses=losses,
        ratios=ratios,
        audit_problems=problems,
        reach_ratios=reach_ratios,
        leftovers=leftovers,
        nb_losses_equal=nb_losses == base_losses,
        nb_weights_equal=bit_equal(nb_state, base_state),
        nb_ratios=nb_ratios,
        nb_audit_problems=nb_problems,
        **describe(trainer, mm),
    )


def exactness(spec: dict) -> dict:
    """The single-model trainer on this rank: baseline vs a full offload/onload after every step."""
    setup_parallel(spec)
    rank = data_parallel_rank()
    base_losses, base_weights, _, _ = train(spec["cfg"], steps=spec["steps"], rank=rank)
    losses, weights, mm, _ = train(spec["cfg"], steps=spec["steps"], between=full_cycle, rank=rank)
    nb_losses, nb_weights, nb_mm, _ = train(
        spec["cfg"], steps=spec["steps"], between=full_cycle_non_blocking, rank=rank, config=NON_BLOCKING
    )
    return dict(
        losses_equal=base_losses == losses,
        weights_equal=bit_equal(base_weights, weights),
        audit_ok=mm.audit().ok,
        losses=losses,
        n_tensors=len(weights),
        nb_losses_equal=base_losses == nb_losses,
        nb_weights_equal=bit_equal(base_weights, nb_weights),
        nb_audit_ok=nb_mm.audit().ok,
    )


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(spec: dict) -> dict:
    """``spec['steps']`` train steps with a full offload/onload after each, against the same run
    without offload; records device, host and process memory along the way."""
    import gc

    setup_parallel(spec)
    base_losses, base_state, _, _ = train_spec(spec)
    samples = []

    def cycle(mm, trainer, step):
        mm.offload()
        off = mm.residency()
        reach_off, _ = reachable_bytes(trainer)
        mm.onload()
        report = mm.audit()
        if step % 10 == 0 or step == spec["steps"] - 1:
            gc.collect()
            on = mm.residency()
            samples.append(
                dict(
                    step=step,
                    device_off=off.device_bytes,
                    host_off=off.host_bytes,
                    reach_off=reach_off,
                    device_on=on.device_bytes,
                    host_on=on.host_bytes,
                    reach_on=reachable_bytes(trainer)[0],
                    rss=_rss_bytes(),
                    audit_ok=report.ok,
                )
            )
        elif not report.ok:
            samples.append(dict(step=step, audit_ok=False, problems=report.problems))

    setup_parallel(spec)
    losses, state, mm, trainer = train_spec(spec, between=cycle)
    return dict(
        losses_equal=losses == base_losses,
        weights_equal=bit_equal(state, base_state),
        samples=samples,
        steps=len(losses),
    )


def worker(rank: int, world: int, init_file: str, out_dir: str, specs_json: str, fn_name: str) -> None:
    """Spawned process: join the process group, run ``fn_name(spec)`` for every spec in
    ``specs_json``; write ``<name>.rank<N>.json`` to ``out_dir``.

    After the first failing layout the remaining ones are not run (the ranks may be out of step
    in their collectives); their results say so.
    """
    import faulthandler

    faulthandler.enable()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # several processes share few cores
    import torch.distributed as dist

    cpu_backend.install(quiet=True)
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # a short timeout: when one rank fails a layout the others give up instead of hanging
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    if ":" in fn_name:  # "module:function" of another helper module on sys.path
        import importlib

        module, _, name = fn_name.partition(":")
        fn = getattr(importlib.import_module(module), name)
    else:
        fn = globals()[fn_name]
    failed = None
    for spec in json.loads(specs_json):
        start = time.perf_counter()
        result: dict = {"rank": rank, "name": spec["name"], "started_s": start - _T0}
        if failed is not None:
            result["error"] = f"not run: layout {failed} failed before it in the same process group"
        else:
            try:
                result.update(fn(spec))
            except Exception:
                result["error"] = traceback.format_exc()
                failed = spec["name"]
        result["seconds"] = time.perf_counter() - start
        with open(os.path.join(out_dir, f"{spec['name']}.rank{rank}.json"), "w") as f:
            json.dump(result, f)
    if failed is None:
        try:
            dist.barrier()  # no rank closes its connections while another still talks to it
        except RuntimeError:
            pass  # a peer failed a layout and left; its result file says why


def spawn(specs: list[dict], fn_name: str = "run_layout") -> dict[str, list[dict]]:
    """Run ``fn_name(spec)`` (``run_layout``, ``exactness``, ``soak``, or ``"module:function"`` of
    another helper module) for every spec of ``specs``
    (all of one world size) in one spawned process group; return ``{spec name: [result per rank]}``.

    A rank that wrote no result (it crashed, or the group failed) gets ``{"rank": r, "error": ...}``.
    """
    import tempfile

    import torch.multiprocessing as mp

    world = specs[0]["world"]
    assert all(s["world"] == world for s in specs)
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        try:
            mp.spawn(worker, args=(world, init_file, tmp, json.dumps(specs), fn_name), nprocs=world, join=True)
        except Exception as e:  # the per-rank files (read below) usually say more
            crash = f"process group failed: {e}"
        else:
            crash = "no result written"
        out = {}
        for s in specs:
            out[s["name"]] = []
            for r in range(world):
                path = os.path.join(tmp, f"{s['name']}.rank{r}.json")
                if os.path.exists(path):
                    with open(path) as f:
                        out[s["name"]].append(json.load(f))
                else:
                    out[s["name"]].append({"rank": r, "error": crash})
    return out


def _named_state(trainer) -> dict[str, torch.Tensor]:
    """Weights, main weights, optimizer states (keys sorted: a loaded optimizer orders them otherwise)."""
    sync_params(trainer)
    out = {
        f"param {i}.{n}": p.detach().clone() for i, c in enumerate(chunks_of(trainer)) for n, p in c.named_parameters()
    }
    for i, leaf in enumerate(layout.leaf_optimizers(trainer.optimizer)):
        out.update({f"main {i}.{j}": t.detach().clone() for j, t in enumerate(layout.main_weights(leaf))})
        for j, state in enumerate(layout.torch_optimizer(leaf).state.values()):
            out.update({f"state {i}.{j}.{k}": state[k].clone() for k in sorted(state)})
    return out


def checkpoint_reshard(spec: dict) -> dict:
    """One leg of a checkpoint round trip through another parallel split (``spec["role"]``):

    ``save``: train, keep this rank's state in ``<dir>/state.rank<N>.pt``, save (asleep) to ``<dir>/a``;
    ``reshard``: a fresh trainer of this split loads ``<dir>/a`` and saves it to ``<dir>/b``;
    ``check``: a fresh trainer (the first split) loads ``<dir>/b``: returns the names that differ
    from what ``save`` kept, bit for bit.
    """
    import torch.distributed as dist

    from chatlearn_mem.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    setup_parallel(spec)
    d, role = spec["dir"], spec["role"]
    if role == "save":
        _, _, mm, trainer = train_spec(spec)
        torch.save(_named_state(trainer), os.path.join(d, f"state.rank{dist.get_rank()}.pt"))
        mm.offload()
        save_checkpoint(mm, os.path.join(d, "a"), step=spec["steps"])
        mm.onload()
        return {"saved": True}
    trainer = gpt.build_gpt_pipeline_trainer(gpt.GPTTrainerConfig(**spec["cfg"]))
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    if role == "reshard":
        load_checkpoint(mm, latest_checkpoint(os.path.join(d, "a")))
        save_checkpoint(mm, os.path.join(d, "b"), step=spec["steps"])
        return {"resaved": True}
    meta = load_checkpoint(mm, latest_checkpoint(os.path.join(d, "b")))
    expected = torch.load(os.path.join(d, f"state.rank{dist.get_rank()}.pt"))
    got = _named_state(trainer)
    differ = sorted(
        k
        for k in expected.keys() | got.keys()
        if k not in got
        or k not in expected
        or expected[k].dtype != got[k].dtype
        or not torch.equal(expected[k], got[k])
    )
    return {"differ": differ, "compared": len(expected), "saved_split": meta["parallel"]}


def vocab_parallel_entropy(spec: dict) -> dict:
    """The entropy of next-token distributions whose vocabulary tensor parallelism split over the
    ranks (``chatlearn_mem_ray.actors.modeling``, all-reduced), against the entropy of the whole
    vocabulary on one rank: ``max_abs_diff``, and the log-probs of the same split (megatron's
    vocab-parallel cross entropy) against the whole vocabulary's."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from chatlearn_mem_ray.actors import modeling

    setup_parallel(spec)
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 64, generator=g) * 3  # (B, T, V): far from uniform
    labels = torch.randint(0, 64, (3, 5), generator=g)
    shard = logits.chunk(tp, dim=-1)[rank].clone()  # this rank's slice of the vocabulary
    whole = torch.distributions.Categorical(logits=logits).entropy()
    got = modeling._vocab_parallel_entropy(shard)
    lp = -vocab_parallel_cross_entropy(shard.clone(), labels)
    want_lp = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    return dict(
        tp=tp,
        max_abs_diff=(got - whole).abs().max().item(),
        logprob_max_abs_diff=(lp - want_lp).abs().max().item(),
        entropy_mean=whole.mean().item(),
    )
