"""The audit report type. The megatron-specific checks that fill it live in :mod:`chatlearn_mem.mcore.checks`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["AuditReport"]


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
