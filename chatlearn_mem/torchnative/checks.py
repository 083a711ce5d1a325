"""The torch-specific audit checks: every alias torch's wrappers built must still be intact.

Each function adds one sentence per broken invariant to an :class:`~chatlearn_mem.audit.AuditReport`,
naming the tensor and what is wrong, and counts every check it runs. They read torch's structures
only through :mod:`chatlearn_mem.torchnative.layout`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from chatlearn_mem.audit import AuditReport
from chatlearn_mem.device_memory import storage_key
from chatlearn_mem.torchnative import layout

__all__ = [
    "check_ddp",
    "check_devices",
    "check_fsdp",
    "check_optimizer",
    "check_parameters",
    "check_view",
    "check_zero",
]


def check_view(
    report: AuditReport, label: str, t: torch.Tensor, base: torch.Tensor, offset: int, base_label: str
) -> None:
    """Record a problem unless ``t`` views ``base``'s storage at element ``offset`` of ``base``."""
    report.checked += 1
    if storage_key(t) != storage_key(base):
        report.add(
            f"{label} is not a view of {base_label}: it has its own storage (its .data was replaced), so "
            f"{base_label} no longer holds what the model computes with"
        )
        return
    expected = base.storage_offset() + offset
    if t.storage_offset() != expected:
        report.add(f"{label} views {base_label} at element {t.storage_offset()}, expected {expected}")


def check_parameters(
    report: AuditReport, module: torch.nn.Module, tracked: Mapping[torch.Tensor, str], now: Mapping[torch.Tensor, str]
) -> None:
    """The module's parameters are the objects the manager took (none replaced, added or removed)."""
    by_name = {name: p for p, name in now.items()}
    for p, name in tracked.items():
        report.checked += 1
        current = by_name.get(name)
        if current is None:
            report.add(f"param {name} is no longer a parameter of the model")
        elif current is not p:
            report.add(
                f"param {name} was replaced by a new Parameter object (module.{name.rpartition('.')[2]} = "
                "nn.Parameter(...)): the optimizer still updates the old one and the manager moves the old one"
            )
    names = set(tracked.values())
    for name in sorted(set(by_name) - names):
        report.checked += 1
        report.add(f"param {name} was added after the manager was created and is not managed")


def check_devices(report: AuditReport, params: Mapping[torch.Tensor, str], device: torch.device) -> None:
    """Every parameter's memory is on the manager's device (``model.cpu()`` moves it off)."""
    for p, name in params.items():
        report.checked += 1
        local = layout.local_tensor(p)
        if local.device != device:
            report.add(
                f"param {name} lives on {local.device} but the trainer on {device}: model.cpu(), model.to() or "
                "param.data = t.to(...) moved it behind the manager"
            )


def check_optimizer(report: AuditReport, optimizer: Any, params: Mapping[torch.Tensor, str]) -> None:
    """``param_groups`` hold the model's live parameters; ``state`` is keyed by them; eager
    optimizers' ``step`` stays on the host."""
    tracked = {id(p) for p in params}
    for gi, group in enumerate(optimizer.param_groups):
        report.checked += 1
        bad = [i for i, p in enumerate(group["params"]) if id(p) not in tracked]
        if bad:
            report.add(
                f"optimizer.param_groups[{gi}] entries {bad[:5]} are not parameters of the model (stale "
                "Parameter objects: their steps change nothing the model uses)"
            )
    local = layout.state_optimizer(optimizer)
    if local is None:
        return
    live = {id(p) for g in local.param_groups for p in g["params"]}
    for p, state in local.state.items():
        name = params.get(p, f"of shape {tuple(p.shape)}")
        report.checked += 1
        if id(p) not in live:
            report.add(f"optimizer state is keyed by param {name}, which is not in its param_groups (stale key)")
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):
                continue
            if layout.host_scalar_state(local, k):
                report.checked += 1
                if v.device.type != "cpu":
                    report.add(
                        f"optimizer state {k!r} of param {name} is on {v.device}: an eager optimizer keeps it on "
                        "the host and reads it with .item() every step (a device-to-host sync per parameter)"
                    )
            elif p in params:
                report.checked += 1
                if tuple(layout.local_tensor(v).shape) != tuple(layout.local_tensor(p).shape) and v.dim():
                    report.add(
                        f"optimizer state {k!r} of param {name} has shape {tuple(layout.local_tensor(v).shape)}, "
                        f"its parameter's memory {tuple(layout.local_tensor(p).shape)}"
                    )


def check_ddp(
    report: AuditReport,
    ddp: torch.nn.Module,
    hooked: Mapping[torch.Tensor, Any],
    params: Mapping[torch.Tensor, str],
    buckets: Mapping[int, Any],
) -> None:
    """Each trainable parameter's grad accumulator is the node DDP's reducer hooked; with bucket
    views each ``.grad`` views one of DDP's gradient buckets."""
    for p, node in hooked.items():
        report.checked += 1
        if layout.grad_accumulator(p) is not node:
            report.add(
                f"param {params.get(p, '?')} has a new grad accumulator, not the one DistributedDataParallel "
                "hooked (its .data was replaced by a tensor of another dtype or device): DDP would never reduce "
                "its gradient"
            )
    if not layout.ddp_uses_bucket_views(ddp) or not buckets:
        return
    for p, name in params.items():
        if p.grad is None:
            continue
        report.checked += 1
        if storage_key(p.grad) not in buckets:
            report.add(
                f"param {name} .grad is not a view of DistributedDataParallel's gradient buckets "
                "(gradient_as_bucket_view=True): it was replaced, and DDP reduces the bucket, not it"
            )


def check_zero(report: AuditReport, zero: Any, params: Mapping[torch.Tensor, str]) -> None:
    """ZeroRedundancyOptimizer: its local optimizer holds exactly this rank's partition, and every
    parameter it made a bucket view still views its bucket at its offset."""
    local = layout.zero_local_params(zero)
    if local is not None:
        report.checked += 1
        want = layout.zero_partition(zero)[layout.zero_rank(zero)]
        if [id(p) for p in local] != [id(p) for p in want]:
            report.add(
                "ZeroRedundancyOptimizer's local optimizer does not hold this rank's partition of the parameters "
                f"({len(local)} held, {len(want)} in the partition): its steps update the wrong parameters"
            )
    for v in layout.zero_bucket_views(zero):
        check_view(
            report,
            f"param {params.get(v.param, '?')} .data",
            v.param,
            v.bucket,
            v.offset,
            f"ZeroRedundancyOptimizer.{v.label}",
        )


def check_fsdp(
    report: AuditReport, fsdp_params: list[Any], params: Mapping[torch.Tensor, str], device: torch.device
) -> None:
    """FSDP2: each sharded parameter's local tensor narrows its padded shard from element 0, on the
    manager's device, and the optimizer's parameter is that sharded parameter."""
    for fp in fsdp_params:
        p = layout.fsdp_param_of(fp)
        name = params.get(p)
        report.checked += 1
        if name is None:
            report.add(
                "an FSDP2 parameter's sharded DTensor is not the parameter the manager took (fully_shard or "
                "reset_sharded_param() replaced it): the optimizer updates the old one"
            )
            continue
        shard = layout.fsdp_sharded_data(fp)
        check_view(
            report, f"param {name} local shard", layout.local_tensor(p), shard, 0, f"param {name}'s padded shard"
        )
        report.checked += 1
        if shard.device != device:
            report.add(f"param {name}'s padded shard lives on {shard.device}, the trainer on {device}")
