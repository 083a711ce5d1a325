"""The megatron-specific audit checks: every alias megatron built must still be intact.

Each function adds one sentence per broken invariant to an :class:`~chatlearn_mem.audit.AuditReport`,
naming the tensor and what is wrong, and counts every check it runs. They read megatron's
structures only through :mod:`chatlearn_mem.mcore.layout`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from chatlearn_mem.audit import AuditReport
from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.mcore import layout

__all__ = ["check_buffers", "check_hooks", "check_optimizers", "check_view", "count_post_hooks"]


def check_view(
    report: AuditReport, label: str, t: Any, base: torch.Tensor, offset: int, numel: int, base_label: str
) -> None:
    """Record a problem unless ``t`` views ``base``'s storage at element ``offset`` with ``numel``."""
    report.checked += 1
    if not isinstance(t, torch.Tensor):
        report.add(f"{label} is missing (expected a view of {base_label})")
        return
    if storage_key(t) != storage_key(base):
        report.add(
            f"{label} is not a view of {base_label}: it has its own storage "
            "(rebound to a new tensor?), so it no longer shares memory with megatron's buffer"
        )
        return
    expected = base.storage_offset() + offset
    if t.storage_offset() != expected:
        report.add(f"{label} views {base_label} at element {t.storage_offset()}, expected {expected}")
    if t.numel() != numel:
        report.add(f"{label} has {t.numel()} elements, expected {numel}")


def count_post_hooks(node: Any) -> int:
    """Number of Python post-hooks registered on an autograd node.

    torch keeps every Python hook of a node in one dict and exposes it only through the handle
    ``register_hook`` returns; register a no-op hook, read the dict's size, remove the hook.
    """
    handle = node.register_hook(lambda *args: None)
    try:
        return len(handle.hooks_dict_ref()) - 1
    finally:
        handle.remove()


def check_buffers(
    report: AuditReport,
    buffers: Sequence[layout.BufferLayout],
    names: Mapping[torch.Tensor, str],
    chunks: Sequence[torch.nn.Module],
    optimizer: Any,
) -> None:
    """Each param ``.data`` and ``main_grad`` views its DDP buffer at megatron's ``param_index_map``
    offset; bucket views and the bucket groups' cached shards view their buffers."""
    for b in buffers:
        for p, (start, end) in b.param_offsets.items():
            name = names.get(p, "<a parameter not in the model>")
            if b.param_data is not None:
                check_view(report, f"param {name} .data", p, b.param_data, start, end - start, f"{b.label}.param_data")
            local = layout.local_main_grad(p)
            view_name = ".main_grad_copy_in_grad_buffer" if local is not None else ".main_grad"
            check_view(
                report,
                f"param {name} {view_name}",
                layout.grad_buffer_view(p),
                b.grad_data,
                start,
                end - start,
                f"{b.label}.grad_data",
            )
            if local is not None:
                report.checked += 1
                if not any(local is g for g in b.extra_main_grads) or local.shape != p.shape:
                    report.add(
                        f"param {name} .main_grad (fp32 local accumulation) is not the tensor "
                        f"{b.label}.extra_main_grads holds for it: megatron would scale and zero another one"
                    )
        for label, view, base, offset in layout.bucket_views(b):
            check_view(report, label, view, base, offset, view.numel(), b.label)
    for g in layout.bucket_groups(chunks, optimizer):
        for label, shard, bucket_tensor in layout.cached_shard_views(g):
            report.checked += 1
            lo = bucket_tensor.storage_offset()
            if storage_key(shard) != storage_key(bucket_tensor):
                report.add(
                    f"bucket group cache {label} does not view its bucket's storage "
                    "(a stale shard left pointing at other memory)"
                )
            elif not lo <= shard.storage_offset() <= lo + bucket_tensor.numel() - shard.numel():
                report.add(f"bucket group cache {label} lies outside its bucket")


def check_optimizers(report: AuditReport, leaves: Sequence[Any], names: Mapping[torch.Tensor, str]) -> None:
    """The distributed optimizers' shard groups view the params; each torch ``param_group`` holds
    exactly the live shard / main tensors; ``state`` is keyed by them."""
    model_params = {id(p) for p in names}
    for li, leaf in enumerate(leaves):
        prefix = f"optimizer[{li}]({type(leaf).__name__})"
        for sv in layout.shard_views(leaf):
            pname = names.get(sv.param, "?")
            check_view(
                report, f"{prefix}.{sv.label} (param {pname})", sv.shard, sv.param, sv.start, sv.numel, f"param {pname}"
            )
        opt = layout.torch_optimizer(leaf)
        expected = layout.expected_param_groups(leaf)
        live: set[int] = set()
        for gi, group in enumerate(opt.param_groups):
            ids = [id(t) for t in group["params"]]
            live.update(ids)
            report.checked += 1
            if expected is None:
                bad = [i for i, x in enumerate(ids) if x not in model_params]
                if bad:
                    report.add(f"{prefix}.param_groups[{gi}] entries {bad} are not parameters of the model")
            elif gi >= len(expected) or sorted(ids) != sorted(id(t) for t in expected[gi]):
                report.add(
                    f"{prefix}.param_groups[{gi}]['params'] is not the optimizer's live shard "
                    "tensors (a rebuilt shard was not put back into param_groups)"
                )
        for key in opt.state:
            report.checked += 1
            if id(key) not in live:
                report.add(
                    f"{prefix}.state is keyed by a tensor of shape {tuple(key.shape)} that is "
                    "not in param_groups (stale key; that state will never be used)"
                )


def check_hooks(
    report: AuditReport,
    chunks: Sequence[torch.nn.Module],
    chunk_buffers: Sequence[Sequence[layout.BufferLayout]],
    names: Mapping[torch.Tensor, str],
) -> None:
    """Each trainable parameter has exactly one grad-accumulator hook and one ``grad_accs`` entry."""
    for ci, (c, bufs) in enumerate(zip(chunks, chunk_buffers)):
        accs = layout.grad_accumulators(c)
        trainable = [p for b in bufs for p in b.param_offsets if p.requires_grad]
        owned = set()
        for p in trainable:
            name = names.get(p, "?")
            node = layout.grad_accumulator(p)
            owned.add(id(node))
            report.checked += 1
            n_entries = sum(a is node for a in accs)
            n_hooks = count_post_hooks(node)
            if n_entries != 1 or n_hooks != 1:
                report.add(
                    f"param {name} has {n_hooks} grad-accumulator hook(s) and {n_entries} "
                    "entries in DDP's grad_accs; expected exactly 1 of each "
                    "(0: its gradient is never reduced; 2: it is reduced twice)"
                )
        stale = sum(id(a) not in owned for a in accs)
        if stale:
            report.add(
                f"chunk{ci}: {stale} grad_accs entries hook accumulators no parameter uses "
                "any more (hooks registered on replaced tensors)"
            )
