"""What the PPO actors compute with a megatron-core GPT: log-probs, values, sampling, weight sync."""

from __future__ import annotations

import hashlib
from typing import Mapping, Optional, Sequence

import torch

__all__ = [
    "generate",
    "merge_tensor_parallel",
    "sequence_logprobs",
    "sequence_values",
    "split_tensor_parallel",
    "weights_digest",
]


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def sequence_logprobs(model: torch.nn.Module, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token under the sampling distribution at ``temperature``:
    ``out[b, t] = log softmax(logits / temperature)[tokens[b, t+1]]`` given ``tokens[b, :t+1]``.

    Uses megatron's (vocab-parallel) cross entropy, so it works on any tensor-parallel size. The
    rollout samples at the run's temperature, so the policy's and the reference's log-probs (the
    PPO ratio, the KL penalty) must be taken at the same one.

    Args:
        model: A ``GPTModel`` or a DDP wrapping one.
        tokens: (B, T) token ids.
        temperature: > 0; 1 is the model's own distribution.

    Returns:
        (B, T-1) float32.

    Raises:
        ValueError: ``temperature`` is not > 0 (greedy decoding has no log-probabilities to optimise).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probabilities, got {temperature}")
    pos = _positions(tokens)
    if temperature == 1.0:
        nll = model(tokens[:, :-1], pos[:, :-1], None, labels=tokens[:, 1:])  # (B, T-1)
        return -nll.float()
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = model(tokens[:, :-1], pos[:, :-1], None)  # (B, T-1, V / tensor-parallel size)
    return -vocab_parallel_cross_entropy(logits.float() / temperature, tokens[:, 1:])


def sequence_values(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Value of each prefix: ``out[b, t]`` scores ``tokens[b, :t+1]``. (B, T) float32."""
    return model(tokens, _positions(tokens), None).float()


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: torch.Tensor,
    response_length: int,
    temperature: float,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Sample ``response_length`` tokens after each prompt (no KV cache: one full forward per token).

    Args:
        model: A ``GPTModel`` with tensor-parallel size 1 (full-vocabulary logits).
        prompts: (B, P) token ids.
        temperature: Softmax temperature; 0 picks the most likely token.
        generator: CPU generator for sampling (reproducible runs).

    Returns:
        (B, P + response_length) token ids, prompts first.
    """
    tokens = prompts
    for _ in range(response_length):
        logits = model(tokens, _positions(tokens), None)[:, -1, :].float()  # (B, V)
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(logits / temperature, dim=-1).cpu()
            nxt = torch.multinomial(probs, 1, generator=generator).to(tokens.device)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


def merge_tensor_parallel(
    shards: Sequence[Mapping[str, torch.Tensor]], partition_dims: Mapping[str, int]
) -> dict[str, torch.Tensor]:
    """Join the state dicts of the tensor-parallel ranks of one model into a TP=1 state dict.

    Args:
        shards: One state dict per tensor-parallel rank, in rank order.
        partition_dims: For each name, the dimension megatron split it along, or -1 when it is
            replicated (then rank 0's copy is taken).
    """
    if len(shards) == 1:
        return dict(shards[0])
    out = {}
    for name, t in shards[0].items():
        dim = partition_dims.get(name, -1)
        out[name] = t if dim < 0 else torch.cat([s[name] for s in shards], dim=dim)
    return out


def split_tensor_parallel(
    state: Mapping[str, torch.Tensor], partition_dims: Mapping[str, int], size: int
) -> list[dict[str, torch.Tensor]]:
    """The inverse of :func:`merge_tensor_parallel`: the state dict of each of ``size`` ranks."""
    if size == 1:
        return [dict(state)]
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]
    for name, t in state.items():
        dim = partition_dims.get(name, -1)
        pieces = [t] * size if dim < 0 else list(torch.chunk(t, size, dim=dim))
        for rank in range(size):
            out[rank][name] = pieces[rank]
    return out


def weights_digest(state: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 of the names, dtypes, shapes and bytes of every tensor (sorted by name)."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
