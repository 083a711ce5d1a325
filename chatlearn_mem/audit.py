"""Audit reports: checks that every alias a manager must preserve is intact."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["AuditReport", "check_view", "count_post_hooks"]


@dataclass
class AuditReport:
    """Result of ``audit()``.

    Attributes:
        problems: One sentence per broken invariant, naming the tensor and what is wrong.
        checked: How many individual checks ran (a clean report of 0 checks proves nothing).
    """

    problems: list[str] = field(default_factory=list)
    checked: int = 0

    @property
    def ok(self) -> bool:
        """True when no problem was found."""
        return not self.problems

    def add(self, problem: str) -> None:
        self.problems.append(problem)

    def __str__(self) -> str:
        if self.ok:
            return f"audit ok ({self.checked} checks)"
        lines = "\n".join(f"  - {p}" for p in self.problems)
        return f"audit found {len(self.problems)} problem(s) in {self.checked} checks:\n{lines}"


def check_view(report: AuditReport, label: str, t: Any, base: torch.Tensor, offset: int,
               numel: int, base_label: str) -> None:
    """Record a problem unless ``t`` views ``base``'s storage at element ``offset`` with ``numel``."""
    report.checked += 1
    if not isinstance(t, torch.Tensor):
        report.add(f"{label} is missing (expected a view of {base_label})")
        return
    if t.untyped_storage()._cdata != base.untyped_storage()._cdata:
        report.add(f"{label} is not a view of {base_label}: it has its own storage "
                   "(rebound to a new tensor?), so it no longer shares memory with megatron's buffer")
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
