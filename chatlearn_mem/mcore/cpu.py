"""megatron-core private names the CPU backend must patch so megatron trains on a CPU-only torch.

:mod:`chatlearn_mem.cpu_backend` patches torch itself; the two megatron-specific patches
live here, beside the rest of megatron's private names.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import torch

__all__ = ["patch_for_cpu"]


@contextlib.contextmanager
def _torch_compile_as_identity() -> Iterator[None]:
    """While megatron-core is first imported, ``torch.compile`` returns what it is given.

    megatron binds ``megatron.core.jit.jit_fuser`` to ``torch.compile`` and decorates its fused
    kernels with it at import (38 of them on 0.16: bias-GeLU, bias-SwiGLU, bias-dropout-add, ...).
    Each decoration imports torch._dynamo and inductor: about 2 of the 4 seconds megatron's import
    takes in every process on a CPU host (each Ray actor and each rank starts with it). On the CPU
    backend none of them runs compiled: the fusions are off (TransformerConfig's defaults, which
    chatlearn-mem's models keep), and a fused function that did run would run eagerly, as megatron's
    own ``disable_jit_fuser`` makes it (which cannot be called before megatron's package imports).
    ``torch.compile`` is itself again once the import returns.
    """
    compile_ = torch.compile

    def identity(model=None, **kwargs):
        return model if model is not None else (lambda fn: fn)

    torch.compile = identity
    try:
        yield
    finally:
        torch.compile = compile_


def patch_for_cpu(get_rng_state: Callable[..., torch.Tensor], set_rng_state: Callable[..., None]) -> None:
    """Point megatron's CUDA RNG hooks at the given CPU stand-ins and fill a name TE would define.

    * ``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``: the RNG tracker's
      ``fork()`` then really switches the stream CPU kernels draw from.
    * ``transformer.moe.moe_utils.te_general_gemm``: megatron-core 0.13-0.16 bind it only when
      Transformer Engine imports, but the MoE router's gating GEMM tests ``te_general_gemm is not
      None`` unconditionally, so without TE every MoE forward dies with a NameError. ``None``
      makes it take its plain ``torch.mm`` path.
    * ``models.hybrid.hybrid_block.TENorm`` (0.18+): ``HybridStack`` builds its final norm with
      Transformer Engine's ``TENorm`` whatever the layer spec says; without TE that raises, so
      it becomes megatron's ``WrappedTorchNorm``, the norm of the local spec.

    When megatron-core is not imported yet, it is imported here without ``torch.compile``'s
    decorations (:func:`_torch_compile_as_identity`), 2 s less in every process. Does nothing when
    megatron-core is not installed (the library's CPU-only users need not have it).
    """
    try:
        if "megatron.core" not in sys.modules:
            with _torch_compile_as_identity():
                import megatron.core  # noqa: F401
        from megatron.core.tensor_parallel import random as mcore_random
    except ImportError:
        return
    mcore_random._get_cuda_rng_state = get_rng_state
    mcore_random._set_cuda_rng_state = set_rng_state
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    try:
        from megatron.core.models.hybrid import hybrid_block  # 0.18+
    except ImportError:
        return
    from megatron.core.extensions.transformer_engine import HAVE_TE

    if not HAVE_TE:
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        hybrid_block.TENorm = WrappedTorchNorm
