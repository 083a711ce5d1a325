"""Functions the vLLM rollout runs inside the engine's worker (``collective_rpc``). A worker may
import this module anew, so it has no side effects on import and imports nothing heavy."""

from __future__ import annotations

from typing import Any, Optional

import torch

_PROBE_ROWS = 2048
"""Rows of the identity fed to a layer's GEMM at once when reading its weight back: bounds the
transient input to ``_PROBE_ROWS`` x in-features."""


def refresh_tied_head(worker) -> str:
    """Rebuild a tied language-model head's kernel weights from the updated embedding.

    With tied embeddings the head shares the embedding's parameter, so an update writes both; but
    on the CPU build the head's matrix product runs on a packed copy made when the layer was
    processed (``process_weights_after_loading``). vLLM's in-place reload (``reload_weights``,
    checkpoint format, 0.32) processes a layer once all its weights arrived, and a tied head
    receives none, so it kept sampling from the previous weights' head (found by the PPO run's
    check: 0.19 off the policy after the first update). Returns ``"refreshed"`` or ``"no head"``.
    """
    model = worker.model_runner.model
    head = getattr(model, "lm_head", None)
    method = getattr(head, "quant_method", None)
    if head is None or method is None:
        return "no head"
    method.process_weights_after_loading(head)
    return "refreshed"


def packed_modules(worker) -> dict[str, list[str]]:
    """The model's ``packed_modules_mapping``: which checkpoint modules vLLM merges into which."""
    return {k: list(v) for k, v in getattr(worker.model_runner.model, "packed_modules_mapping", {}).items()}


def weights_digest(worker, params: list) -> dict[str, str]:
    """The digest of each parameter in ``params`` (:class:`~chatlearn_mem.engines.digest.EngineParam`)
    as the engine computes with it: engine name -> hex digest; a parameter the model lacks is left
    out. See :mod:`chatlearn_mem.engines.digest` for the definition.

    A GEMM layer's weight is read through the layer's own matrix product on an identity when the
    engine keeps no plain copy of it: the CPU build repacks every linear weight for its kernels
    and frees the original (``weight`` becomes an empty tensor), and its head computes on a packed
    copy of ``lm_head.weight`` (the copy a tied head's reload left stale, see
    :func:`refresh_tied_head`). Reading through the kernel checks the values it multiplies with.
    """
    from chatlearn_mem.engines.digest import GEMM, param_digest, piece_digest

    model = worker.model_runner.model
    out = {}
    with torch.inference_mode():
        for p in params:
            module_name, _, leaf = p.name.rpartition(".")
            try:
                module = model.get_submodule(module_name)
            except AttributeError:
                continue
            tensor = getattr(module, leaf, None)
            if not torch.is_tensor(tensor):
                continue
            in_features = p.pieces[0][1][1] if len(p.pieces[0][1]) > 1 else None
            if p.read == GEMM and in_features is not None and _packed(module, p.rows * in_features):
                tensor = _through_gemm(module, in_features)
            digests, row = [], 0
            for name, shape in p.pieces:
                digests.append(piece_digest(name, tensor[row : row + shape[0]]))
                row += shape[0]
            out[p.name] = param_digest(p.name, digests)
    return out


def _packed(module: torch.nn.Module, numel: int) -> bool:
    """Whether ``module`` computes on a copy of its weight that its ``weight`` does not show: the
    CPU build's dispatch (``cpu_linear``), or a weight freed after packing."""
    return hasattr(module, "cpu_linear") or module.weight.numel() < numel


def _through_gemm(module: torch.nn.Module, in_features: int) -> torch.Tensor:
    """``module``'s weight (out, in) as its forward multiplies with it: its GEMM applied to the
    identity, ``_PROBE_ROWS`` input rows at a time (one weight-sized result, no bias)."""
    weight = module.weight
    method = module.quant_method
    out: Optional[torch.Tensor] = None
    for k0 in range(0, in_features, _PROBE_ROWS):
        k1 = min(in_features, k0 + _PROBE_ROWS)
        eye = torch.zeros(k1 - k0, in_features, dtype=weight.dtype, device=weight.device)
        eye[:, k0:k1].fill_diagonal_(1)
        cols = method.apply(module, eye)  # (k1 - k0, out) = W[:, k0:k1]^T
        if out is None:
            out = torch.empty(cols.shape[1], in_features, dtype=cols.dtype, device=cols.device)
        out[:, k0:k1] = cols.t()
    assert out is not None
    return out


def memory_report(worker) -> dict[str, Any]:
    """What the engine allocated, in bytes: ``weights`` (its parameters, plus on the CPU build the
    kernels' packed copy of each GEMM weight, counted at the weight's size), ``kv_cache`` (the
    storage behind the model runner's KV cache tensors), and ``device`` (their device type)."""
    model = worker.model_runner.model
    storages: dict[int, int] = {}
    for p in model.parameters():
        if p.numel():
            storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    packed = 0
    for module in model.modules():
        if hasattr(module, "cpu_linear") and getattr(module, "quant_method", None) is not None:
            packed += _gemm_bytes(module)
    kv: dict[int, int] = {}
    for t in _tensors(getattr(worker.model_runner, "kv_caches", [])):
        kv[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    device = next((p.device.type for p in model.parameters()), "cpu")
    return {"weights": sum(storages.values()) + packed, "kv_cache": sum(kv.values()), "device": device}


def _gemm_bytes(module: torch.nn.Module) -> int:
    """Bytes of a GEMM layer's weight at its logical shape (its packed copy holds as many)."""
    weight = module.weight
    if weight.numel():
        return weight.numel() * weight.element_size()
    out = getattr(module, "output_size_per_partition", 0)
    inp = getattr(module, "input_size_per_partition", 0)
    return out * inp * weight.element_size()


def _tensors(x) -> list[torch.Tensor]:
    """The tensors in a (nested) list, tuple or dict."""
    if torch.is_tensor(x):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []
