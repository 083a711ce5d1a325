"""The torch-native model of a trainer config (``backend: torch``): a Hugging Face Llama or Qwen2
built with ``transformers`` from the config's fields (nothing downloaded), or loaded from its
``from_hf`` directory, and the process group its data-parallel ranks share. Imports no megatron."""

from __future__ import annotations

import datetime
from typing import Any, Optional

import torch

from chatlearn_mem_ray.config import TrainerModelConfig

__all__ = ["build_causal_lm", "init_torch_distributed"]


def build_causal_lm(config: TrainerModelConfig) -> torch.nn.Module:
    """A ``transformers`` causal LM of ``config``'s family and shape, seeded with ``config.seed``
    (every rank and every copy builds the same weights), in ``config.precision``, with eager
    attention (the same numbers in the trainer, the rollout and the reference).

    Raises:
        ImportError: ``transformers`` is not installed (the ``[hf]`` extra).
        ValueError: ``config`` is not a Llama or Qwen2 architecture.
    """
    from chatlearn_mem.models import hf

    try:
        import transformers
    except ImportError as e:
        raise ImportError("backend: torch builds its model with transformers: pip install 'chatlearn-mem[hf]'") from e
    dtype = torch.bfloat16 if config.precision == "bf16" else torch.float32
    if config.from_hf is not None:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(config.from_hf), dtype=dtype, attn_implementation="eager"
        )
    else:
        family = hf.family_of(config)
        fields = {k: v for k, v in hf.hf_config_dict(config).items() if k not in ("architectures", "model_type")}
        fields.pop("torch_dtype", None)
        fields.pop("dtype", None)
        hf_config = transformers.AutoConfig.for_model(family.model_type, **fields)
        hf_config._attn_implementation = "eager"
        torch.manual_seed(config.seed)
        model = getattr(transformers, family.architecture)(hf_config).to(dtype)
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def init_torch_distributed(
    rank: int, world_size: int, init_method: str, store: Optional[Any] = None, timeout_s: float = 1800
) -> None:
    """Join the trainer's process group (NCCL with CUDA, else gloo); nothing for one rank, whose
    model trains without DDP. ``store``: rank 0's own ``TCPStore``, already listening."""
    if world_size == 1:
        return
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is not None:  # the key prefix torch adds to a store it makes from tcp://
        dist.init_process_group(
            backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size, timeout=timeout
        )
    else:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
