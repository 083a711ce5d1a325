"""The parts of a model's state that a memory manager moves, named once for the whole project."""

from __future__ import annotations

import enum
from typing import Iterable, Optional, Union

__all__ = ["OTHER", "Part", "PartsArg", "parse_parts"]


class Part(str, enum.Enum):
    """One part of a trainer's device state. A ``str`` enum: ``Part.WEIGHTS == "weights"``, so the
    plain names work wherever a part is expected (configs, Ray calls, JSON logs)."""

    WEIGHTS = "weights"
    """Model parameters (DDP param buffers, frozen params) and module buffers; copied to the host."""
    GRADS = "grads"
    """DDP grad buffers; dropped, never copied, rebuilt zeroed."""
    MAIN_WEIGHTS = "main_weights"
    """The optimizer's fp32 main weights beside 16-bit params; copied to the host."""
    OPTIMIZER_STATES = "optimizer_states"
    """The torch optimizer's state tensors (Adam's ``exp_avg``, ``exp_avg_sq``); copied to the host."""

    def __str__(self) -> str:
        return self.value


OTHER = "other"
"""Residency category of device bytes a manager frees but does not own as a part (``.grad``
tensors derived from ``main_grad``, the pipeline schedule's last received activation)."""

PartsArg = Optional[Union[Part, str, Iterable[Union[Part, str]]]]
"""What ``offload()`` / ``onload()`` accept: None (every part), one part, or several."""


def parse_parts(parts: PartsArg, available: Iterable[Part]) -> list[Part]:
    """``parts`` as a list of :class:`Part`, in the order of ``available``; None means all of them.

    Raises:
        ValueError: A name is not a part, or not one of ``available`` (the message lists them).
        TypeError: ``parts`` is neither None, a part nor an iterable of parts.
    """
    available = list(available)
    if parts is None:
        return available
    if isinstance(parts, (str, Part)):
        parts = [parts]
    try:
        items = list(parts)
    except TypeError:
        raise TypeError(f"parts must be a Part, a part name or a list of them, got {type(parts).__name__}") from None
    chosen = set()
    for p in items:
        try:
            part = Part(p)
        except ValueError:
            raise ValueError(f"unknown part {p!r}; parts are {[a.value for a in available]}") from None
        if part not in available:
            raise ValueError(
                f"{part.value!r} is not a part of this manager; its parts are {[a.value for a in available]}"
            )
        chosen.add(part)
    return [p for p in available if p in chosen]
