"""Tensors across actors without a copy: a bucket of named tensors as numpy views of their bytes.

Ray serialises a torch tensor by pickling it, which copies its bytes into a private buffer of the
sending process before they reach the object store; a numpy array it writes straight into the
store, and the receiver reads it back as a view of the store's shared memory. A weight sync streams
every weight of the model, so the sender sends each tensor's bytes as a numpy ``uint8`` view (the
tensor itself is often a view of the trainer's host store: nothing is copied until the object
store) and the receiver views them as the tensor again (bf16 has no numpy dtype: bytes do).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

__all__ = ["from_wire", "to_wire"]


def to_wire(bucket: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple[int, ...], object]]:
    """``(name, dtype, shape, numpy uint8 view of the bytes)`` per tensor of ``bucket`` (host tensors;
    a non-contiguous one is copied first)."""
    out = []
    for name, t in bucket:
        t = t.detach().cpu().contiguous()
        out.append((name, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy()))
    return out


def from_wire(bucket: Sequence[tuple[str, str, tuple[int, ...], object]]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a :func:`to_wire` bucket, viewing the received bytes (read-only: the
    object store's memory; a consumer copies what it keeps)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the store's arrays are read-only, and are only read here
        return [
            (name, torch.from_numpy(arr).view(getattr(torch, dtype)).view(shape)) for name, dtype, shape, arr in bucket
        ]
