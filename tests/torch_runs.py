"""Plain PyTorch trainers for the torch-native tests: a small model of our own and Hugging Face
Llama / Qwen2 built from a config, plain, in DDP, with ZeroRedundancyOptimizer, sharded by FSDP2;
the runs that compare a managed trainer with its twin, and the spawned ranks' code.

Nothing here imports megatron. Unit tests call :func:`exactness` for the plain model in the test
process; multi-rank tests describe each run as a spec (:func:`spec`) and run every spec of one
world size in one spawned gloo process group (:func:`spawn`): the process start and torch's
import are paid once per group, not once per run. Importable as ``torch_runs`` from every tier
(the root conftest puts ``tests/`` on sys.path; spawn hands sys.path to the children).
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager

VOCAB, SEQ, BATCH = 64, 8, 4
NON_BLOCKING = MemoryConfig(copy_chunk_mb=1 / 1024)
"""1 KiB pieces: even the small model's weights arrive in many steps, so each module really waits."""
OVERLAP_BACKEND = "gloo_for_zero_overlap"
"""gloo registered under another name for ZeroRedundancyOptimizer(overlap_with_ddp=True): torch's
``hook_with_zero_step`` refuses a process group whose backend is named gloo (it may hang,
pytorch #62300); the same gloo under this name lets the tests run it on CPU (it did not hang here)."""


# -- the models --------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TinyLM(nn.Module):
    """A small language model of our own: embedding, residual MLP blocks, a head tied to the
    embedding, a persistent buffer and a non-persistent one (what Hugging Face models have)."""

    def __init__(self, vocab: int = VOCAB, hidden: int = 32, layers: int = 2, tied: bool = True):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, hidden))
        self.register_buffer("positions", torch.arange(SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, T) -> (B, T, V)
        x = self.embed(tokens) * self.scale
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def hf_model(family: str = "llama", tied: bool = False) -> nn.Module:
    """A 2-layer Llama or Qwen2 from ``transformers``, built from a config (nothing downloaded)."""
    import transformers

    config_cls, model_cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[family]
    config = config_cls(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    config._attn_implementation = "eager"
    return model_cls(config)


def batch(step: int, rank: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def logits_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(tokens)
    return out.logits if hasattr(out, "logits") else out


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = logits_of(model, tokens).float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


# -- the trainers --------------------------------------------------------------------------------------
class Trainer:
    """A model, its wrapper and optimizer, and one training step as a user writes it."""

    def __init__(self, model: nn.Module, optimizer: Any, wrapped: nn.Module, inner: nn.Module, spec: dict):
        self.model, self.optimizer, self.wrapped, self.inner, self.spec = model, optimizer, wrapped, inner, spec

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device if self.spec.get("wrapper") != "fsdp2" else torch.device("cpu")

    def step(self, step: int) -> float:
        loss = loss_of(self.wrapped, batch(step, _rank()).to(self.device))
        loss.backward()
        if not self.spec.get("overlap"):  # overlapped ZeRO steps inside the backward
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def forward(self, step: int) -> torch.Tensor:
        with torch.no_grad():
            return logits_of(self.wrapped, batch(step, _rank()).to(self.device))

    def state(self) -> dict[str, torch.Tensor]:
        """Weights (this rank's memory of each) and this rank's optimizer state, cloned, by name."""
        from chatlearn_mem.torchnative import layout

        layout.reshard(layout.fsdp_modules(self.inner))  # FSDP2: the sharded parameters registered
        names = {}
        for n, p in self.inner.named_parameters():
            names.setdefault(p, n)
        out = {f"param {n}": layout.local_tensor(p).detach().cpu().clone() for p, n in names.items()}
        for n, b in self.inner.named_buffers():
            out[f"buffer {n}"] = b.cpu().clone()
        opt = layout.state_optimizer(self.optimizer)
        if opt is not None:
            for p, k, v in layout.state_entries(opt):
                out[f"state {names.get(p, '?')} {k}"] = layout.local_tensor(v).detach().cpu().clone()
        return out


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def build(spec: dict) -> Trainer:
    """The trainer ``spec`` describes, seeded: the same spec gives the same trainer, bit for bit.

    Spec keys: ``model`` ("tiny", "llama", "qwen2"), ``tied``, ``wrapper`` ("plain", "ddp",
    "fsdp2"), ``bucket_view`` (DDP's gradient_as_bucket_view), ``zero`` (ZeroRedundancyOptimizer),
    ``zero_bucket_view`` (its parameters_as_bucket_view), ``overlap`` (overlap_with_ddp),
    ``mixed`` (FSDP2 with bf16 compute over fp32 shards), ``device`` (a plain trainer's: "cuda" in
    the GPU tier).
    """
    torch.manual_seed(spec.get("seed", 0))
    kind = spec.get("model", "tiny")
    model = TinyLM(tied=spec.get("tied", True)) if kind == "tiny" else hf_model(kind, spec.get("tied", False))
    model.to(spec.get("device", "cpu"))  # the GPU tier's plain trainers: "cuda"
    wrapper = spec.get("wrapper", "plain")
    lr = 1e-2
    if wrapper == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (spec["world"],))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if spec.get("mixed") else None
        kwargs = {"mesh": mesh, **({"mp_policy": mp} if mp else {})}
        for m in model.blocks if kind == "tiny" else model.model.layers:
            fully_shard(m, **kwargs)
        fully_shard(model, **kwargs)
        return Trainer(model, torch.optim.AdamW(model.parameters(), lr=lr), model, model, spec)
    if wrapper == "plain":
        return Trainer(model, torch.optim.AdamW(model.parameters(), lr=lr), model, model, spec)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    group = _overlap_group() if spec.get("overlap") else None
    ddp = DDP(model, gradient_as_bucket_view=spec.get("bucket_view", False), process_group=group, bucket_cap_mb=0.01)
    if spec.get("zero"):
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            process_group=group,
            parameters_as_bucket_view=spec.get("zero_bucket_view", False),
            overlap_with_ddp=spec.get("overlap", False),
            lr=lr,
        )
        if spec.get("overlap"):
            from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, opt))
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
    return Trainer(model, opt, ddp, model, spec)


_GROUPS: dict = {}


def _overlap_group():
    """A process group of every rank on gloo registered as :data:`OVERLAP_BACKEND` (made once)."""
    import torch.distributed as dist

    if "overlap" not in _GROUPS:
        _GROUPS["overlap"] = dist.new_group(backend=OVERLAP_BACKEND)
    return _GROUPS["overlap"]


# -- transitions between steps ---------------------------------------------------------------------------
def _assert_ok(mm: TrainerMemoryManager, where: str) -> None:
    report = mm.audit()
    assert report.ok and report.checked > 0, f"{where}: {report}"


def full(mm, trainer, step, log) -> None:
    """Everything out (the device empty, the audit clean while asleep), everything back."""
    awake = mm.residency().device_bytes
    mm.offload()
    res = mm.residency()
    assert res.device_bytes == 0 < awake, f"step {step}: {res}"
    log.setdefault("released", []).append(awake)
    _assert_ok(mm, f"step {step} asleep")
    mm.onload()
    _assert_ok(mm, f"step {step} awake")


def weights_only(mm, trainer, step, log) -> None:
    """Asleep, then a forward-only phase on the weights alone, then the rest."""
    mm.offload()
    mm.onload(Part.WEIGHTS)
    log.setdefault("forwards", []).append(trainer.forward(step).sum().item())
    mm.offload()  # the weights are unchanged: released without a copy
    mm.onload()
    _assert_ok(mm, f"step {step} awake")


def non_blocking(mm, trainer, step, log) -> None:
    """Offload and onload without waiting: the next step's guards wait for what each needs."""
    mm.offload(blocking=False)
    assert mm.residency().device_bytes == 0
    mm.onload(blocking=False)


def optimizer_only(mm, trainer, step, log) -> None:
    """The grads and optimizer states alone, out and back without waiting."""
    mm.offload([Part.GRADS, Part.OPTIMIZER_STATES], blocking=False)
    mm.onload([Part.GRADS, Part.OPTIMIZER_STATES])
    _assert_ok(mm, f"step {step} awake")


def weights_non_blocking(mm, trainer, step, log) -> None:
    mm.offload_weights(blocking=False)
    mm.onload_weights(blocking=False)


SCHEDULE: list[Callable] = [full, weights_only, non_blocking, optimizer_only, weights_non_blocking, full]
"""The transitions after each step of :func:`exactness` (the sequence the issue asks for: all
parts, weights only, non-blocking, with a train step between)."""


def exactness(spec: dict) -> dict:
    """Train ``spec``'s trainer with :data:`SCHEDULE` between the steps and its twin without;
    compare losses, forward outputs, weights and optimizer state bit for bit."""
    twin, managed = build(spec), build(spec)
    config = NON_BLOCKING if spec.get("slow_lanes", True) else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DDP(gradient_as_bucket_view=False)'s warning, checked elsewhere
        mm = TrainerMemoryManager(managed.wrapped, managed.optimizer, config)
    log: dict = {}
    losses, twin_losses, twin_forwards = [], [], []
    steps = spec.get("steps", len(SCHEDULE) + 2)
    for step in range(steps):
        twin_losses.append(twin.step(step))
        losses.append(managed.step(step))
        between = SCHEDULE[step % len(SCHEDULE)]
        if between is weights_only:
            twin_forwards.append(twin.forward(step).sum().item())
        between(mm, managed, step, log)
    mm.residency()  # waits for what is in flight
    _assert_ok(mm, "end")
    a, b = managed.state(), twin.state()
    differ = sorted(k for k in a.keys() | b.keys() if k not in a or k not in b or not torch.equal(a[k], b[k]))
    mm.close()
    return dict(
        losses=losses,
        losses_equal=losses == twin_losses,
        forwards_equal=log.get("forwards") == twin_forwards,
        differ=differ,
        compared=len(a),
        released=log.get("released", []),
    )


# -- what stays, who owns what, misuse, checkpoints (one function per spec kind) -------------------------
def reachable_leftovers(*roots: Any) -> list[tuple[str, int]]:
    """``(path, bytes)`` of every storage holding bytes reachable from ``roots`` (an independent walk
    of what a trainer holds, not the manager's own accounting)."""
    from chatlearn_mem.device_report import reachable_tensors

    seen, out = set(), []
    for path, t, _ in reachable_tensors(*roots):
        s = t.untyped_storage()
        if s.nbytes() and s._cdata not in seen:
            seen.add(s._cdata)
            out.append((path, s.nbytes()))
    return out


def what_stays(spec: dict) -> dict:
    """After a full offload: the manager's residency, an independent walk of everything reachable
    from the model and optimizer, DDP's gradient buckets (bucket views) and FSDP2's unsharded
    parameters (left all-gathered by a forward-only pass)."""
    from chatlearn_mem.torchnative import layout

    t = build(spec)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mm = TrainerMemoryManager(t.wrapped, t.optimizer)
    for s in range(3):  # overlapped ZeRO builds its optimizer after DDP's first iterations
        t.step(s)
    loss_of(t.wrapped, batch(1)).backward()  # .grads left: the bucket views DDP's buckets have
    buckets = [g.untyped_storage() for g in (p.grad for p in t.inner.parameters()) if g is not None]
    t.optimizer.step() if not spec.get("overlap") else None
    t.optimizer.zero_grad()
    t.forward(2)
    for m in layout.fsdp_modules(t.inner):
        m.unshard()  # FSDP2's unsharded parameters, all-gathered (as reshard_after_forward=False leaves them)
    unsharded = [x.untyped_storage() for fp in layout.fsdp_params(t.inner) for x in layout.fsdp_unsharded_buffers(fp)]
    unsharded_awake = sum(s.nbytes() for s in unsharded)
    awake = mm.residency()
    mm.offload()
    asleep = mm.residency()
    left = reachable_leftovers(t.wrapped, t.optimizer)
    out = dict(
        awake=awake.by_category,
        asleep_device_bytes=asleep.device_bytes,
        leftovers=[p for p, _ in left],
        leftover_bytes=sum(n for _, n in left),
        bucket_bytes_asleep=sum(s.nbytes() for s in buckets),
        unsharded_awake=unsharded_awake,
        unsharded_asleep=sum(s.nbytes() for s in unsharded),
        warnings=[str(w.message) for w in caught if "gradient_as_bucket_view" in str(w.message)],
    )
    mm.onload()
    out["bucket_bytes_awake"] = sum(s.nbytes() for s in buckets)
    out["audit_ok"] = mm.audit().ok
    out["step_after"] = t.step(3)
    return out


def _refusal(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        return f"{type(e).__name__}: {e}"
    return "not refused"


def misuse(spec: dict) -> dict:
    """Bad input and changes behind the manager's back, each on a fresh trainer (world size 1)."""

    out: dict = {}
    # an offload while DDP waits for the backward of a forward run with gradients enabled
    t = build(dict(spec, wrapper="ddp", bucket_view=True))
    mm = TrainerMemoryManager(t.wrapped, t.optimizer)
    t.step(0)
    loss = loss_of(t.wrapped, batch(1))
    out["pending"] = _refusal(mm.offload)
    out["pending_nothing_moved"] = not any(mm.is_offloaded(p) for p in mm.parts)
    loss.backward()
    t.optimizer.step()
    t.optimizer.zero_grad()
    mm.offload()
    mm.onload()
    loss_of(t.wrapped, batch(2))  # a forward whose output is dropped: nothing waits for its backward
    out["dropped_output_offload"] = _refusal(mm.offload)
    mm.onload()
    # DDP: .data replaced by another dtype (the accumulator DDP hooked is dropped)
    t = build(dict(spec, wrapper="ddp"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mm = TrainerMemoryManager(t.wrapped, t.optimizer)
    t.step(0)
    w = t.inner.blocks[0].fc1.weight
    w.data = w.data.double()
    out["ddp_dtype_audit"] = mm.audit().problems
    out["ddp_dtype_offload"] = _refusal(mm.offload)
    # ZeroRedundancyOptimizer's bucket view broken by param.data = ...
    t = build(dict(spec, wrapper="ddp", zero=True, zero_bucket_view=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mm = TrainerMemoryManager(t.wrapped, t.optimizer)
    t.step(0)
    w = t.inner.blocks[1].fc2.bias
    w.data = w.data.clone()
    out["zero_view_audit"] = mm.audit().problems
    out["zero_view_offload"] = _refusal(mm.offload)
    # an optimizer created before fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyLM()
    early = torch.optim.AdamW(model.parameters())
    fully_shard(model, mesh=init_device_mesh("cpu", (spec["world"],)))
    out["fsdp_early_optimizer"] = _refusal(lambda: TrainerMemoryManager(model, early))
    later = torch.optim.AdamW(model.parameters())
    mm = TrainerMemoryManager(model, later)
    out["fsdp_then_ok"] = mm.audit().ok
    mm.close()
    # DDP around an FSDP2 model (where DDP accepts one)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    except Exception as e:  # noqa: BLE001 - DDP refusing it itself is fine too
        out["ddp_over_fsdp"] = f"DDP refused it: {type(e).__name__}"
    else:
        out["ddp_over_fsdp"] = _refusal(lambda: TrainerMemoryManager(ddp, later))
    return out


def _full_state(t: Trainer) -> dict[str, torch.Tensor]:
    """Every weight and optimizer state as whole tensors by name, on every rank (FSDP2's shards
    gathered, ZeroRedundancyOptimizer's partitions from their owners)."""
    import torch.distributed as dist

    from chatlearn_mem.torchnative import layout

    layout.reshard(layout.fsdp_modules(t.inner))
    names = {}
    for n, p in t.inner.named_parameters():
        names.setdefault(p, n)
    full = lambda x: x.full_tensor() if layout.is_dtensor(x) else x  # noqa: E731
    out = {f"param {n}": full(p).detach().clone() for p, n in names.items()}
    mine = {}
    for p, k, v in layout.state_entries(layout.state_optimizer(t.optimizer)):
        mine[f"state {names[p]} {k}"] = full(v).detach().clone()
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for d in gathered:
        out.update(d)
    return out


def ckpt_save(spec: dict) -> dict:
    """Train, save asleep (asynchronously, the next phase running meanwhile), keep the whole state."""
    import torch.distributed as dist

    from chatlearn_mem import save_checkpoint

    t = build(spec)
    mm = TrainerMemoryManager(t.wrapped, t.optimizer)
    for s in range(3):
        t.step(s)
    mm.offload()
    handle = save_checkpoint(mm, spec["dir"], step=3, async_=True)
    mm.onload()
    handle.wait()
    state = _full_state(t)
    if dist.get_rank() == 0:
        torch.save(state, os.path.join(spec["dir"], "expected.pt"))
    return {"files": sorted(os.listdir(handle.path)), "nbytes": handle.nbytes}


def ckpt_load(spec: dict) -> dict:
    """Load a checkpoint saved at another world size into a fresh trainer; compare with what the
    save kept, then train on."""
    from chatlearn_mem import latest_checkpoint, load_checkpoint

    t = build(dict(spec, seed=7))  # another initialisation: the load must overwrite all of it
    mm = TrainerMemoryManager(t.wrapped, t.optimizer)
    meta = load_checkpoint(mm, latest_checkpoint(spec["dir"]))
    expected = torch.load(os.path.join(spec["dir"], "expected.pt"))
    got = _full_state(t)
    differ = sorted(
        k
        for k in expected.keys() | got.keys()
        if k not in got or k not in expected or not torch.equal(expected[k], got[k])
    )
    out = dict(saved_split=meta["parallel"], differ=differ, compared=len(expected), audit_ok=mm.audit().ok)
    out["loss_after"] = t.step(3)
    out["audit_after"] = mm.audit().ok
    return out


# -- the spawned ranks ----------------------------------------------------------------------------------------
def spec(name: str, world: int, fn: str = "exactness", **kw) -> dict:
    """A run for :func:`spawn`: the function to run on every rank and what :func:`build` reads."""
    return dict(name=name, world=world, fn=fn, **kw)


def worker(rank: int, world: int, init_file: str, out_dir: str, specs_json: str) -> None:
    """Spawned process: join the gloo group, run each spec's function, write ``<name>.rank<N>.json``.
    After a spec fails the others are not run (the ranks may be out of step in their collectives)."""
    import faulthandler

    import torch.distributed as dist
    from torch.distributed import ProcessGroupGloo

    faulthandler.enable()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)  # several processes share few cores; one thread: deterministic sums
    dist.Backend.register_backend(
        OVERLAP_BACKEND, lambda store, r, size, timeout: ProcessGroupGloo(store, r, size, timeout), devices=["cpu"]
    )
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    failed = None
    for s in json.loads(specs_json):
        start = time.perf_counter()
        result: dict = {"rank": rank, "name": s["name"]}
        if failed is not None:
            result["error"] = f"not run: {failed} failed before it in the same process group"
        else:
            try:
                result.update(globals()[s["fn"]](s))
            except Exception:
                result["error"] = traceback.format_exc()
                failed = s["name"]
        result["seconds"] = time.perf_counter() - start
        with open(os.path.join(out_dir, f"{s['name']}.rank{rank}.json"), "w") as f:
            json.dump(result, f)
    if failed is None:
        try:
            dist.barrier()
        except RuntimeError:
            pass
    dist.destroy_process_group()


def spawn(specs: list[dict]) -> dict[str, list[dict]]:
    """Run every spec (all of one world size) in one spawned gloo group; ``{name: [result per rank]}``."""
    import tempfile

    import torch.multiprocessing as mp

    world = specs[0]["world"]
    assert all(s["world"] == world for s in specs)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(worker, args=(world, os.path.join(tmp, "init"), tmp, json.dumps(specs)), nprocs=world, join=True)
            crash = "no result written"
        except Exception as e:
            crash = f"process group failed: {e}"
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


def check(results: list[dict]) -> None:
    """Assert a spec's result on every rank is error-free (the traceback otherwise)."""
    for r in results:
        assert "error" not in r, f"rank {r['rank']}:\n{r['error']}"
