"""Tensors across actors without a copy: a bucket of named tensors as numpy views of their bytes.

Ray serialises a torch tensor by pickling it, which copies its bytes into a private buffer of the
sending process before they reach the object store; a numpy array it writes straight into the
store, and the receiver reads it back as a view of the store's shared memory. A weight sync streams
every weight of the model, so the sender sends each tensor's bytes as a numpy ``uint8`` view (the
tensor itself is often a view of the trainer's host store: nothing is copied until the object
store) and the receiver views them as the tensor again (bf16 has no numpy dtype: bytes do).

Every other tensor an actor returns or receives crosses the same way, copied once on arrival
(:func:`register_tensor_serializer`): Ray's default pickles each storage through
``torch.storage._load_from_bytes``, which megatron-core 0.19 replaces with its own
``megatron.core.safe_globals.safe_load_from_bytes``, so a tensor from an actor that imported
megatron made the driver import megatron-core to read it (seconds, and its notices on the console).
"""

from __future__ import annotations

import warnings
from typing import Sequence

import torch

__all__ = ["from_wire", "register_tensor_serializer", "to_wire"]


def to_wire(bucket: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, str, tuple[int, ...], object]]:
    """``(name, dtype, shape, numpy uint8 view of the bytes)`` per tensor of ``bucket`` (host tensors;
    a non-contiguous one is copied first)."""
    return [(name, *_as_bytes(t.cpu())) for name, t in bucket]


def _as_bytes(t: torch.Tensor) -> tuple[str, tuple[int, ...], object]:
    """``(dtype, shape, numpy uint8 view of the elements)`` of a host tensor (a non-contiguous one
    is copied first; a contiguous one is viewed, not copied)."""
    t = t.detach().contiguous()
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy()


def from_wire(bucket: Sequence[tuple[str, str, tuple[int, ...], object]]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a :func:`to_wire` bucket, viewing the received bytes (read-only: the
    object store's memory; a consumer copies what it keeps)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the store's arrays are read-only, and are only read here
        return [
            (name, torch.from_numpy(arr).view(getattr(torch, dtype)).view(shape)) for name, dtype, shape, arr in bucket
        ]


def _tensor_to_payload(t: torch.Tensor) -> tuple:
    """What crosses for a tensor: a plain host tensor as ``("bytes", dtype, shape, numpy uint8 view)``
    (pickle 5 sends the view out of band: no copy in the sender; a non-contiguous tensor sends only
    its own elements), any other (on a device, requiring grad, conjugated, sparse, with attributes)
    as torch pickles it."""
    plain = (
        t.device.type == "cpu"
        and t.layout == torch.strided
        and not t.requires_grad
        and not t.is_quantized
        and not t.is_conj()
        and not t.is_neg()
        and not t.__dict__
    )
    if not plain:
        return ("torch", t.__reduce_ex__(2))
    return ("bytes", *_as_bytes(t))


def _tensor_from_payload(payload: tuple) -> torch.Tensor:
    """The tensor of :func:`_tensor_to_payload`'s payload, owning its memory (writable; the received
    buffer, often the object store's read-only memory, is released once read)."""
    if payload[0] == "torch":
        rebuild, args = payload[1][:2]
        return rebuild(*args)
    _, dtype, shape, arr = payload
    out = torch.empty(shape, dtype=getattr(torch, dtype))
    if out.numel():
        out.reshape(-1).view(torch.uint8).numpy()[:] = arr  # the one copy, numpy's (read-only source)
    return out


def register_tensor_serializer() -> None:
    """Send this process's torch tensors through Ray as their bytes (:func:`_tensor_to_payload`),
    received as owned tensors. Call once per process connected to Ray (each actor, the driver);
    the receiver needs only this module. Tensors of another type (``nn.Parameter``) keep Ray's
    default."""
    import ray

    ray.util.register_serializer(torch.Tensor, serializer=_tensor_to_payload, deserializer=_tensor_from_payload)
