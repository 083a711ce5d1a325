"""Tiny Hugging Face checkpoints for the adapter's tests, made with ``transformers`` (nothing is
downloaded). Importable as ``hf_checkpoints`` from every tier (the root conftest puts ``tests/`` on
sys.path) and in spawned workers."""

from __future__ import annotations

import os

import torch

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0}


def make_checkpoint(
    path: str,
    family: str = "llama",
    kv_heads: int = 2,
    tied: bool = False,
    dtype: torch.dtype = torch.float32,
    vocab: int = 128,
    seed: int = 0,
) -> str:
    """Save a random 2-layer, hidden-64, 4-head ``family`` model to ``path`` and return ``path``.

    Weights are drawn with std 0.1 (biases too), larger than Hugging Face's 0.02, so that a
    wrongly mapped tensor moves the logits far beyond the agreement tolerance."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    config = config_cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rope_theta=ROPE_THETA[family],
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(path)
    return path


def hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    """``transformers``' logits (B, T, V) of ``tokens`` (B, T) under the checkpoint at ``path``, in fp32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def tokens(batch: int = 2, length: int = 16, vocab: int = 128, seed: int = 7) -> torch.Tensor:
    """Deterministic token ids (B, T)."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """A megatron GPTModel's logits (B, T, V/TP on each tensor-parallel rank) of ``tokens``, in fp32."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None).float()


def files_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in ``path``."""
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def bit_equal_dicts(a: dict, b: dict) -> bool:
    """Same names, dtypes and bits."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
