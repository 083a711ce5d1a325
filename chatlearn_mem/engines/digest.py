"""The weight digest that proves a sync took: the same SHA-256 digest computed from the trainer's
export stream and from the engine's parameters as it computes with them.

vLLM does not hold a Llama or Qwen2 the way a Hugging Face checkpoint does: it merges q, k and v
into one ``qkv_proj`` (and their biases), gate and up into one ``gate_up_proj``, pads the
vocabulary rows of the embedding and the head to a multiple of 64, and with tied embeddings its
head is the embedding. The digest is therefore defined per *engine* parameter over its *pieces*,
the Hugging Face tensors it is made of, in the engine's order::

    piece digest  = SHA-256(name | dtype | shape | canonical bytes)        (a Hugging Face tensor)
    param digest  = SHA-256(engine name | piece digest 1 | piece digest 2 | ...)
    model digest  = SHA-256 over the sorted "engine name:param digest;" pairs

Both sides compute it without a merged copy: the export side hashes each tensor of the stream as it
passes (:class:`StreamDigest`, 32 bytes kept per piece until its parameter is complete); the
engine side splits each merged parameter into row ranges (views) and hashes those
(``_vllm_worker.weights_digest``). A merged tensor is its pieces stacked along rows, so the rows
of piece ``i`` are bit for bit the ``i``-th Hugging Face tensor.

Canonical bytes: -0 is hashed as +0, and in 16-bit dtypes (bf16) so are subnormals. The CPU
build keeps no readable copy of its linear weights (it repacks them for its GEMM kernels and drops
the originals), so the engine side reads them back through the layer's own GEMM on an identity
matrix; that GEMM returns -0 as +0 and, in bf16, flushes subnormals to zero, while fp32
subnormals come back exact (measured on vLLM 0.32.0's CPU build, oneDNN). Neither changes a
product the engine computes; every other bit is compared exactly.

Pure Python and torch: imported by the engine's worker and by whoever streams the export.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Optional

import torch

from chatlearn_mem.models.gpt import GPTTrainerConfig

__all__ = ["EngineParam", "WeightsDigest", "StreamDigest", "engine_params", "piece_digest", "param_digest"]

MERGED: Mapping[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
"""Hugging Face module -> (the vLLM module it is merged into, its place there): vLLM's
``packed_modules_mapping`` for Llama and Qwen2 (checked against the running engine at start)."""

GEMM = "gemm"
"""Read mode: the weight of a layer whose forward is a matrix product (linear layers, the head):
on the CPU build read back through that product, elsewhere read as the parameter."""
TENSOR = "tensor"
"""Read mode: a parameter used as it is (embedding rows, norms, biases)."""


@dataclass(frozen=True)
class EngineParam:
    """One parameter of the engine and the Hugging Face tensors it is made of."""

    name: str
    """The engine's parameter name (``model.layers.0.self_attn.qkv_proj.weight``)."""
    read: str
    """:data:`GEMM` or :data:`TENSOR`."""
    pieces: tuple[tuple[str, tuple[int, ...]], ...]
    """``(Hugging Face name, shape)`` of each piece, in the engine's row order."""

    @property
    def rows(self) -> int:
        """Rows the pieces fill; the engine's tensor may have more (vocabulary padding)."""
        return sum(shape[0] for _, shape in self.pieces)


def engine_params(config: GPTTrainerConfig) -> list[EngineParam]:
    """The engine's parameters of ``config``'s Llama or Qwen2, in the checkpoint's order, each with
    its pieces: what both sides digest.

    Raises:
        ValueError: ``config`` is not a Llama or Qwen2 architecture.
    """
    from chatlearn_mem.models import hf

    groups: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {}
    for name, shape in hf.hf_shapes(config).items():
        engine, place = _engine_name(name)
        groups.setdefault(engine, []).append((place, name, shape))
    if config.share_embeddings_and_output_weights:  # the head is the embedding: no tensor of its own
        groups["lm_head.weight"] = list(groups["model.embed_tokens.weight"])
    out = []
    for engine, pieces in groups.items():
        module = engine.rpartition(".")[0].rpartition(".")[2]
        read = GEMM if engine.endswith(".weight") and (module.endswith("_proj") or module == "lm_head") else TENSOR
        out.append(EngineParam(engine, read, tuple((n, s) for _, n, s in sorted(pieces, key=lambda p: p[0]))))
    return out


def _engine_name(hf_name: str) -> tuple[str, int]:
    """A Hugging Face tensor's engine parameter and its place among that parameter's pieces."""
    module, _, leaf = hf_name.rpartition(".")
    parent, _, last = module.rpartition(".")
    if last in MERGED:
        merged, place = MERGED[last]
        return f"{parent}.{merged}.{leaf}", place
    return hf_name, 0


_EXPONENT_16 = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
"""The exponent bits of the 16-bit dtypes: all zero for exactly the zeros and subnormals."""


def canonical(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU and contiguous, with -0 as +0 and, in 16-bit dtypes, subnormals as +0; a
    copy only when ``t`` holds such a value (else one counting pass over its bits)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if not t.is_floating_point() or not t.numel():
        return t
    if t.dtype in _EXPONENT_16:  # bf16 comparisons are slow on CPU: test the exponent bits as int16
        exponent = torch.bitwise_and(t.view(torch.int16), _EXPONENT_16[t.dtype])
        if torch.count_nonzero(exponent) == t.numel():  # no zero, no subnormal: the common case
            return t
        return t.masked_fill(exponent == 0, 0.0)
    # fp32 and wider: the GEMM read keeps subnormals; only -0 changes
    if torch.count_nonzero(t) == t.numel() or not torch.signbit(t[t == 0]).any():
        return t
    return t + 0.0  # -0 + 0 = +0; every other value unchanged


def piece_digest(name: str, t: torch.Tensor) -> bytes:
    """SHA-256 (32 bytes) of one Hugging Face tensor: its name, dtype, shape and canonical bytes."""
    t = canonical(t)
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def param_digest(engine_name: str, pieces: Iterable[bytes]) -> str:
    """Hex SHA-256 of one engine parameter from its pieces' digests, in the engine's order."""
    h = hashlib.sha256(f"{engine_name}|".encode())
    for p in pieces:
        h.update(p)
    return h.hexdigest()


@dataclass(frozen=True)
class WeightsDigest:
    """Per engine parameter, its digest; equal digests mean bit-identical weights (up to the
    canonical zeros of the module docstring)."""

    params: dict[str, str]
    """Engine parameter name -> hex digest, in the checkpoint's order."""

    @property
    def hexdigest(self) -> str:
        """One digest of the whole model (64 hex characters)."""
        return hashlib.sha256("".join(f"{k}:{v};" for k, v in sorted(self.params.items())).encode()).hexdigest()

    def first_difference(self, other: "WeightsDigest") -> Optional[str]:
        """The first engine parameter (in ``self``'s order) whose digest differs from ``other``'s
        or that only one of them has; None when they are equal."""
        for name, value in self.params.items():
            if other.params.get(name) != value:
                return name
        extra = [n for n in other.params if n not in self.params]
        return extra[0] if extra else None


class StreamDigest:
    """The export side of the digest, fed one Hugging Face tensor at a time as it streams.

    Holds 32 bytes per piece of a parameter that is not complete yet, never a tensor::

        d = StreamDigest(config)
        for name, t in stream:
            d.update(name, t)
        d.result()  # a WeightsDigest, equal to the engine's after a sync that took

    Args:
        config: The policy's config (its family, tying and shapes).
    """

    def __init__(self, config: GPTTrainerConfig):
        self.params = engine_params(config)
        self._by_name = {p.name: p for p in self.params}
        self._uses: dict[str, list[tuple[str, int]]] = {}
        for p in self.params:
            for place, (name, _) in enumerate(p.pieces):
                self._uses.setdefault(name, []).append((p.name, place))
        self._pieces: dict[str, dict[int, bytes]] = {}
        self._done: dict[str, str] = {}
        self.seconds = 0.0
        """Time spent hashing, in seconds (what the digest adds to the stream)."""

    def update(self, name: str, t: torch.Tensor) -> None:
        """Hash one streamed tensor (a name the model does not have is ignored: the sync's own
        check of the names reports it)."""
        uses = self._uses.get(name)
        if not uses:
            return
        t0 = time.perf_counter()
        d = piece_digest(name, t)
        for engine, place in uses:
            got = self._pieces.setdefault(engine, {})
            got[place] = d
            param = self._by_name[engine]
            if len(got) == len(param.pieces):
                self._done[engine] = param_digest(engine, (got[i] for i in range(len(param.pieces))))
                del self._pieces[engine]
        self.seconds += time.perf_counter() - t0

    def result(self) -> WeightsDigest:
        """The digest of every engine parameter whose pieces all came, in the checkpoint's order."""
        return WeightsDigest({p.name: self._done[p.name] for p in self.params if p.name in self._done})
