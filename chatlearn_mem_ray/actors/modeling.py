"""What the actors compute with a model: log-probs (and entropies), values, sampling, weight sync.

A model is megatron-core's GPT (``model(tokens, positions, mask)``, its vocabulary split over the
tensor-parallel ranks) or a Hugging Face causal LM (``model(input_ids=...).logits``, the whole
vocabulary), either maybe in its DDP; :func:`logits` tells them apart, so that a torch-native
policy's actors never import megatron."""

from __future__ import annotations

import hashlib
from typing import Mapping, Optional, Sequence

import torch

__all__ = [
    "generate",
    "is_hugging_face",
    "logits",
    "generate_rows",
    "merge_tensor_parallel",
    "sequence_logprobs",
    "sequence_logprobs_entropy",
    "sequence_values",
    "split_tensor_parallel",
    "weights_digest",
]


def _positions(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)


def is_hugging_face(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the module its DDP wraps) is a ``transformers`` model."""
    inner = getattr(model, "module", model)
    return type(inner).__module__.startswith("transformers.")


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """(B, T, V) next-token logits of ``tokens`` (B, T): the whole vocabulary for a Hugging Face
    model, this rank's slice of it for megatron's GPT under tensor parallelism."""
    if is_hugging_face(model):
        return model(input_ids=tokens, use_cache=False).logits
    return model(tokens, _positions(tokens), None)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy over the last dimension (the whole vocabulary): (..., V) -> (...)."""
    return -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)


def sequence_logprobs(model: torch.nn.Module, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probability of each next token under the sampling distribution at ``temperature``:
    ``out[b, t] = log softmax(logits / temperature)[tokens[b, t+1]]`` given ``tokens[b, :t+1]``.

    Uses megatron's (vocab-parallel) cross entropy, so it works on any tensor-parallel size. The
    rollout samples at the run's temperature, so the policy's and the reference's log-probs (the
    PPO ratio, the KL penalty) must be taken at the same one.

    Args:
        model: A ``GPTModel`` or a Hugging Face causal LM, or a DDP wrapping one.
        tokens: (B, T) token ids.
        temperature: > 0; 1 is the model's own distribution.

    Returns:
        (B, T-1) float32.

    Raises:
        ValueError: ``temperature`` is not > 0 (greedy decoding has no log-probabilities to optimise).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probabilities, got {temperature}")
    if is_hugging_face(model):
        scaled = logits(model, tokens[:, :-1]).float() / temperature  # (B, T-1, V)
        return torch.log_softmax(scaled, -1).gather(-1, tokens[:, 1:, None])[..., 0]
    pos = _positions(tokens)
    if temperature == 1.0:
        nll = model(tokens[:, :-1], pos[:, :-1], None, labels=tokens[:, 1:])  # (B, T-1)
        return -nll.float()
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    vocab = model(tokens[:, :-1], pos[:, :-1], None)  # (B, T-1, V / tensor-parallel size)
    return -vocab_parallel_cross_entropy(vocab.float() / temperature, tokens[:, 1:])


def sequence_logprobs_entropy(
    model: torch.nn.Module, tokens: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequence_logprobs` and the entropy of each next-token distribution at ``temperature``.

    The entropy is for the log (no gradient flows through it); on a tensor-parallel model each rank
    holds a slice of the vocabulary, and its max, normaliser and expectation are all-reduced over
    the tensor-parallel group.

    Returns:
        ``(logprobs, entropy)``, each (B, T-1) float32.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 for log-probabilities, got {temperature}")
    if is_hugging_face(model):
        scaled = logits(model, tokens[:, :-1]).float() / temperature  # (B, T-1, V)
        with torch.no_grad():
            entropy = _entropy(scaled)
        return torch.log_softmax(scaled, -1).gather(-1, tokens[:, 1:, None])[..., 0], entropy
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    pos = _positions(tokens)
    scaled = model(tokens[:, :-1], pos[:, :-1], None).float() / temperature  # (B, T-1, V / tensor-parallel size)
    entropy = _vocab_parallel_entropy(scaled.detach())  # before the cross entropy, which works in place
    return -vocab_parallel_cross_entropy(scaled, tokens[:, 1:]), entropy


@torch.no_grad()
def _vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy over the last dimension, which tensor parallelism may split: (..., V/tp) -> (...)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size() if parallel_state.model_parallel_is_initialized() else 1
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    top = logits.max(dim=-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    e = torch.exp(logits - top)
    z = e.sum(dim=-1, keepdim=True)
    expected = (e * logits).sum(dim=-1, keepdim=True)
    if tp > 1:
        dist.all_reduce(z, group=group)
        dist.all_reduce(expected, group=group)
    return (torch.log(z) + top - expected / z).squeeze(-1)  # log Z - E[logit]


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
        last = logits(model, tokens)[:, -1, :].float()  # (B, V)
        if temperature == 0:
            nxt = last.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(last / temperature, dim=-1).cpu()
            nxt = torch.multinomial(probs, 1, generator=generator).to(tokens.device)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


@torch.no_grad()
def generate_rows(
    model: torch.nn.Module,
    rows: Sequence[Sequence[int]],
    response_length: int,
    temperature: float,
    seed: int,
    eos_ids: Sequence[int] = (),
    pad_id: int = 0,
    device: Optional[torch.device] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to ``response_length`` tokens after each prompt of ``rows`` (prompts of any length).

    Prompts of one length are sampled as one batch (no padding inside a forward pass, so no
    attention mask is needed), groups in order of length, each from its own generator
    (``seed`` + the length), so a row's sample does not depend on which other lengths the batch
    holds. A row stops after its first token in ``eos_ids`` (the EOS is kept); a group stops when
    every row of it has. ``temperature`` 0 decodes greedily.

    Returns:
        ``(tokens (B, L), response_lengths (B,))``: each row's prompt then its response, right-padded
        with ``pad_id`` to the longest (``L``), and each response's length (up to and including its
        EOS).
    """
    by_length: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_length.setdefault(len(r), []).append(i)
    out: list[list[int]] = [[] for _ in rows]
    lengths = [0] * len(rows)
    stop = torch.tensor(sorted(set(eos_ids)), dtype=torch.long)
    for length in sorted(by_length):
        idx = by_length[length]
        tokens = torch.tensor([list(rows[i]) for i in idx], dtype=torch.long, device=device)
        g = torch.Generator().manual_seed(seed * 1_000_003 + length)
        done = torch.zeros(len(idx), dtype=torch.bool)
        for _ in range(response_length):
            last = logits(model, tokens)[:, -1, :].float()  # (b, V)
            if temperature == 0:  # greedy (validation)
                nxt = last.argmax(dim=-1, keepdim=True).cpu()  # (b, 1)
            else:
                probs = torch.softmax(last / temperature, dim=-1).cpu()
                nxt = torch.multinomial(probs, 1, generator=g)  # (b, 1)
            nxt[done] = pad_id  # a stopped row pads
            tokens = torch.cat([tokens, nxt.to(tokens.device)], dim=1)
            if len(stop):
                done |= torch.isin(nxt[:, 0], stop)
                if bool(done.all()):
                    break
        for j, i in enumerate(idx):
            response = tokens[j, length:].tolist()
            n = next((k + 1 for k, t in enumerate(response) if t in set(eos_ids)), len(response))
            out[i] = list(rows[i]) + response[:n]
            lengths[i] = n
    width = max(len(r) for r in out)
    padded = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(out):
        padded[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return padded, torch.tensor(lengths, dtype=torch.long)


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
