"""The ``torch_native`` report (``torch_native: true``, off by default): a plain PyTorch trainer put
to sleep and woken by the manager against what its users do today, in one run.

The trainer: a Hugging Face ``LlamaForCausalLM`` (``transformers``) of the benchmark trainer's
shape (layers, hidden size, heads, vocabulary, sequence length), fp32 (the precision of FSDP2's
sharded parameters under mixed precision), with torch's AdamW after one training step (its states
exist; its ``.grad`` s dropped by ``zero_grad()``, so there are no gradients to move). Each way is
timed on a fresh, identical trainer of its own (one alive at a time), ``warmup`` untimed cycles
then ``repeats`` timed ones, offload and onload apart, for two parts: ``full`` (the weights and
AdamW's states) and ``weights`` alone:

* ``manager``: :class:`chatlearn_mem.TrainerMemoryManager` on the torch-native backend (the host
  store reused, storages released and regrown in place; ``skip_unchanged_weights=False``: it copies
  every time, as the others do).
* ``per_tensor_to_cpu``: verl's FSDP offload: every parameter's ``.data`` and every optimizer state
  tensor replaced by ``t.to("cpu", non_blocking=True)``, one tensor at a time, and back with
  ``t.to(device)``: new host tensors on every sleep, new device tensors on every wake (AdamW's
  ``step`` goes to the device and back with the rest, as verl moves every state tensor).
* ``model_to``: ``model.cpu()`` and ``model.to(device)`` for the weights (what verl's FSDP2 path
  does), the optimizer's states per tensor as above.
* ``ceiling``: not a way to sleep: one copy of the same bytes between a device buffer and a host
  buffer (pinned on CUDA, as the manager's store), both allocated once.

On a CPU "device" ``t.to("cpu")`` and ``model.cpu()`` copy nothing and free nothing; there the two
alternatives copy explicitly (``t.to("cpu", copy=True)``, the old tensor dropped), which is what
they do on a GPU: a new host tensor per tensor, the device memory freed, a new device tensor per
tensor on wake. After each sleep the report records what stays on the device: the bytes of every
storage reachable from the model and the optimizer that are still on it (an independent walk), and
on CUDA the allocator's allocated bytes. Every way must leave the trainer bit-identical (a
checksum of its weights and states before and after its cycles).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable, Optional

import torch

__all__ = ["METHODS", "measure_torch_native", "torch_native_lines", "torch_native_targets"]

METHODS = ("manager", "per_tensor_to_cpu", "model_to", "ceiling")
PARTS = ("full", "weights")
LABELS = {
    "manager": "chatlearn-mem manager (torch-native backend)",
    "per_tensor_to_cpu": "verl FSDP: every tensor .to('cpu') and back",
    "model_to": "model.cpu() / model.to(device), states per tensor",
    "ceiling": "ceiling: one copy between preallocated buffers",
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_torch_trainer(trainer_cfg: Any, device: torch.device, batch_size: int, seed: int = 0):
    """A Llama of ``trainer_cfg``'s shape in fp32 with AdamW, after one step (gradients dropped)."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=trainer_cfg.hidden_size,
        intermediate_size=trainer_cfg.ffn_hidden_size or 4 * trainer_cfg.hidden_size,
        num_hidden_layers=trainer_cfg.num_layers,
        num_attention_heads=trainer_cfg.num_attention_heads,
        num_key_value_heads=trainer_cfg.num_query_groups or trainer_cfg.num_attention_heads,
        vocab_size=trainer_cfg.vocab_size,
        max_position_embeddings=trainer_cfg.seq_length,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, trainer_cfg.vocab_size, (batch_size, trainer_cfg.seq_length), generator=g).to(device)
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    _sync(device)
    return model, optimizer


def _tensors(model, optimizer, part: str) -> list[torch.Tensor]:
    out = list(model.parameters()) + list(model.buffers())
    if part == "full":
        out += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return out


def _checksum(model, optimizer) -> list[int]:
    out = []
    for t in _tensors(model, optimizer, "full"):
        flat = t.detach().reshape(-1)
        iview = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        out.append(int(flat.view(iview).sum(dtype=torch.int64)))
    return out


def _part_bytes(model, optimizer, part: str, device: torch.device) -> int:
    seen, n = set(), 0
    for t in _tensors(model, optimizer, part):
        s = t.untyped_storage()
        if t.device == device and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            n += s.nbytes()
    return n


def _left_on_device(model, optimizer, device: torch.device) -> tuple[int, list[str]]:
    """Bytes of every storage reachable from the trainer still on ``device``, and the largest paths."""
    from chatlearn_mem.device_report import reachable_tensors

    seen, found = set(), []
    for path, t, _ in reachable_tensors(model, optimizer):
        s = t.untyped_storage()
        if t.device == device and s.nbytes() and s._cdata not in seen:
            seen.add(s._cdata)
            found.append((s.nbytes(), path))
    found.sort(reverse=True)
    return sum(n for n, _ in found), [f"{p} ({n} B)" for n, p in found[:3]]


class _Way:
    """One way of putting the trainer to sleep: ``offload(part)`` then ``onload(part)``."""

    def __init__(self, model, optimizer, device: torch.device, pin: bool, bucket_size_mb: float):
        self.model, self.optimizer, self.device, self.pin = model, optimizer, device, pin

    def close(self) -> None:
        pass


class _Manager(_Way):
    def __init__(self, model, optimizer, device, pin, bucket_size_mb):
        from chatlearn_mem import MemoryConfig, TrainerMemoryManager

        super().__init__(model, optimizer, device, pin, bucket_size_mb)
        config = MemoryConfig(bucket_size_mb=bucket_size_mb, skip_unchanged_weights=False)
        self.mm = TrainerMemoryManager(model, optimizer, config)

    def offload(self, part: str) -> None:
        self.mm.offload(None if part == "full" else "weights")

    def onload(self, part: str) -> None:
        self.mm.onload(None if part == "full" else "weights")

    def close(self) -> None:
        self.mm.close()


def _moved(t: torch.Tensor, to: torch.device) -> torch.Tensor:
    """``t.to(to)``; on a CPU "device" a forced copy (``.to("cpu")`` would return ``t`` itself)."""
    return t.to(to, non_blocking=True, copy=t.device == to)


class _PerTensor(_Way):
    """verl's FSDP offload: ``.data`` of every parameter and every optimizer state tensor replaced by
    its copy on the other side, one tensor at a time."""

    weights_whole = False

    def _weights(self, to: torch.device) -> None:
        if self.weights_whole and to.type != self.device.type:
            self.model.cpu() if to.type == "cpu" else self.model.to(to)
            return
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            t.data = _moved(t.data, to)

    def _states(self, to: torch.device) -> None:
        for state in self.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = _moved(v, to)

    def offload(self, part: str) -> None:
        host = torch.device("cpu")
        self._weights(host)
        if part == "full":
            self._states(host)
        _sync(self.device)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # like with like: the manager returns freed memory to the driver

    def onload(self, part: str) -> None:
        self._weights(self.device)
        if part == "full":
            self._states(self.device)
        _sync(self.device)


class _ModelTo(_PerTensor):
    """``model.cpu()`` / ``model.to(device)`` for the weights (on a GPU; on a CPU device the same
    per-tensor copies it would make), the optimizer's states per tensor."""

    weights_whole = True


class _Ceiling(_Way):
    def __init__(self, model, optimizer, device, pin, bucket_size_mb):
        from chatlearn_mem.host_store import HostStore

        super().__init__(model, optimizer, device, pin, bucket_size_mb)
        self.nbytes = {p: _part_bytes(model, optimizer, p, device) for p in PARTS}
        most = max(self.nbytes.values())
        self.dev = torch.ones(most, dtype=torch.uint8, device=device)
        self.store = HostStore([most], most, pin)
        self.store.buckets[0].fill_(1)

    def offload(self, part: str) -> None:
        n = self.nbytes[part]
        self.store.buckets[0][:n].copy_(self.dev[:n], non_blocking=True)
        _sync(self.device)

    def onload(self, part: str) -> None:
        n = self.nbytes[part]
        self.dev[:n].copy_(self.store.buckets[0][:n], non_blocking=True)
        _sync(self.device)

    def close(self) -> None:
        self.store.close()
        self.dev = None


WAYS: dict[str, type] = {
    "manager": _Manager,
    "per_tensor_to_cpu": _PerTensor,
    "model_to": _ModelTo,
    "ceiling": _Ceiling,
}


def _quartiles(values: list[float]) -> dict:
    s = sorted(values)
    return {"median": statistics.median(s), "min": s[0], "max": s[-1]}


def measure_torch_native(
    trainer_cfg: Any,
    device: torch.device,
    repeats: int,
    warmup: int,
    batch_size: int,
    bucket_size_mb: float,
    pin: bool,
    echo: Callable[[str], None] = print,
) -> dict:
    """Time every way of :data:`METHODS` on both parts, each on a fresh trainer; see the module.

    Returns:
        ``{"model", "bytes": {part: n}, "rows": [{method, part, direction, seconds: {median, min,
        max}, gb_per_s}], "stays": {method: {"device_bytes", "largest", "cuda_allocated_bytes"}},
        "bit_identical": {method: bool}}``.
    """
    out: dict = {"rows": [], "stays": {}, "bit_identical": {}, "repeats": repeats, "warmup": warmup}
    for name in METHODS:
        model, optimizer = build_torch_trainer(trainer_cfg, device, batch_size)
        if "bytes" not in out:
            out["bytes"] = {p: _part_bytes(model, optimizer, p, device) for p in PARTS}
            params = sum(p.numel() for p in model.parameters())
            out["model"] = f"LlamaForCausalLM, {params / 1e6:.1f} M parameters, fp32, AdamW"
            echo(f"torch-native report: {out['model']}, {out['bytes']['full'] / 2**20:.0f} MiB full")
        before = _checksum(model, optimizer)
        way = WAYS[name](model, optimizer, device, pin, bucket_size_mb)
        for part in PARTS:
            times: dict[str, list[float]] = {"offload": [], "onload": []}
            for i in range(warmup + repeats):
                for direction in ("offload", "onload"):
                    _sync(device)
                    t0 = time.perf_counter()
                    getattr(way, direction)(part)
                    seconds = time.perf_counter() - t0
                    if i >= warmup:
                        times[direction].append(seconds)
                    if direction == "offload" and part == "full" and i == warmup and name != "ceiling":
                        # on a CPU "device" an alternative's host copies are CPU tensors too: what
                        # stays cannot be told from what moved (the manager's released storages can)
                        measurable = device.type == "cuda" or name == "manager"
                        left, largest = _left_on_device(model, optimizer, device) if measurable else (None, [])
                        out["stays"][name] = {
                            "device_bytes": left,
                            "largest": largest,
                            "cuda_allocated_bytes": torch.cuda.memory_allocated(device)
                            if device.type == "cuda"
                            else None,
                        }
            for direction, values in times.items():
                q = _quartiles(values)
                out["rows"].append(
                    dict(
                        method=name,
                        part=part,
                        direction=direction,
                        seconds=q,
                        gb_per_s=out["bytes"][part] / q["median"] / 1e9,
                    )
                )
        way.close()
        out["bit_identical"][name] = _checksum(model, optimizer) == before
        del way, model, optimizer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _row(tn: dict, method: str, part: str, direction: str) -> Optional[dict]:
    return next((r for r in tn["rows"] if (r["method"], r["part"], r["direction"]) == (method, part, direction)), None)


def torch_native_lines(tn: Optional[dict]) -> list[str]:
    """The report's section of the markdown: seconds (median, min-max) and GB/s per way, part and
    direction, each against the manager; what stays on the device after a full sleep."""
    if not tn:
        return []
    lines = [
        "",
        f"## Plain PyTorch trainer: the manager against what users do ({tn['model']}; "
        f"{tn['repeats']} repeats after {tn['warmup']} warm-up, medians)",
        "",
        "| way | part | offload s (min-max) | GB/s | onload s (min-max) | GB/s | offload+onload vs manager |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for part in PARTS:
        base = sum(_row(tn, "manager", part, d)["seconds"]["median"] for d in ("offload", "onload"))
        for m in METHODS:
            off, on = _row(tn, m, part, "offload"), _row(tn, m, part, "onload")
            both = off["seconds"]["median"] + on["seconds"]["median"]
            cell = lambda r: f"{r['seconds']['median']:.3f} ({r['seconds']['min']:.3f}-{r['seconds']['max']:.3f})"  # noqa: E731
            lines.append(
                f"| {LABELS[m]} | {part} ({tn['bytes'][part] / 2**20:.0f} MiB) | {cell(off)} | {off['gb_per_s']:.2f} | "
                f"{cell(on)} | {on['gb_per_s']:.2f} | {both / base:.2f}x |"
            )
    lines += ["", "What stays on the device after a full sleep (bytes reachable from the model and optimizer):", ""]
    for m, s in tn["stays"].items():
        cuda = f", CUDA allocated {s['cuda_allocated_bytes']} B" if s["cuda_allocated_bytes"] is not None else ""
        largest = f" ({'; '.join(s['largest'])})" if s["largest"] else ""
        held = (
            "not told apart on a CPU device (its host copies are CPU tensors too)"
            if s["device_bytes"] is None
            else f"{s['device_bytes']} B"
        )
        lines.append(f"- {LABELS[m]}: {held}{largest}{cuda}")
    return lines


def torch_native_targets(tn: Optional[dict]) -> list[dict]:
    """Every way leaves the trainer bit-identical; the manager's sleep leaves nothing of the model
    on the device but what torch keeps there by design."""
    if not tn:
        return []
    ok = all(tn["bit_identical"].values())
    stays = tn["stays"].get("manager", {})
    leftover = [p for p in stays.get("largest", []) if "['step']" not in p]
    return [
        {
            "name": "torch-native: every way leaves the trainer bit-identical",
            "passed": ok,
            "detail": ", ".join(f"{m}: {'yes' if v else 'NO'}" for m, v in tn["bit_identical"].items()),
        },
        {
            "name": "torch-native: the manager's sleep leaves only AdamW's step counters (host tensors by design)",
            "passed": not leftover,
            "detail": f"{stays.get('device_bytes')} B reachable on the device; largest: {stays.get('largest')}",
        },
    ]
