"""Build small megatron-core GPT trainers (examples, tests, benchmarks, the Ray actors).

Everything here uses megatron-core's public API: ``parallel_state``, ``GPTModel`` with the local
layer spec, ``DistributedDataParallel`` and ``get_megatron_optimizer``. On a machine without
CUDA call :func:`chatlearn_mem.cpu_backend.install` first (``init_distributed`` does).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from chatlearn_mem import cpu_backend

__all__ = ["GPTTrainerConfig", "GPTTrainer", "GPTValueModel", "build_gpt_model", "build_gpt_trainer", "init_distributed", "synthetic_batch"]

_INSTALL_HINT = "pip install 'megatron-core>=0.13,<0.17'"


class GPTTrainerConfig(BaseModel):
    """A megatron-core GPT trainer: model shape, precision, optimizer and data parallel layout."""

    model_config = ConfigDict(extra="forbid")

    num_layers: int = Field(2, ge=1)
    """Transformer layers."""
    hidden_size: int = Field(64, ge=8)
    """Hidden width."""
    num_attention_heads: int = Field(4, ge=1)
    """Attention heads; must divide hidden_size."""
    vocab_size: int = Field(128, ge=2)
    """Vocabulary size (padded by nothing; keep it divisible by the tensor parallel size)."""
    seq_length: int = Field(32, ge=2)
    """Maximum sequence length (learned absolute position embeddings)."""
    precision: Literal["bf16", "fp32"] = "bf16"
    """Parameter dtype; bf16 keeps fp32 main weights in the optimizer."""
    use_distributed_optimizer: bool = True
    """Shard the optimizer across data-parallel ranks (megatron's DistributedOptimizer)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients in fp32."""
    lr: float = Field(1e-3, gt=0)
    """Adam learning rate."""
    clip_grad: float = Field(1.0, ge=0)
    """Gradient clipping norm (0 disables)."""
    seed: int = 1234
    """Seed for weight initialisation."""

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> "GPTTrainerConfig":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must divide "
                             f"hidden_size ({self.hidden_size})")
        return self


@dataclass
class GPTTrainer:
    """A DDP-wrapped GPT model chunk, its megatron optimizer and the config it came from."""

    model: Any
    optimizer: Any
    config: GPTTrainerConfig

    def train_step(self, tokens: torch.Tensor) -> float:
        """One optimizer step of next-token prediction on ``tokens`` (B, T); returns the loss."""
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss = self.loss(tokens)
        loss.backward()
        self.model.finish_grad_sync()
        self.optimizer.step()
        return loss.item()

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of ``tokens`` (B, T) under the current weights."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        per_token = self.model(inputs, positions[:, :-1], None, labels=labels)  # (B, T-1)
        return per_token.float().mean()


def _megatron():
    try:
        import megatron.core  # noqa: F401
    except ImportError as e:
        raise ImportError(f"megatron-core is required for GPT trainers; install it with: {_INSTALL_HINT}") from e


def init_distributed(rank: int = 0, world_size: int = 1, tensor_model_parallel_size: int = 1,
                     pipeline_model_parallel_size: int = 1, init_method: Optional[str] = None,
                     seed: int = 1234) -> None:
    """Join (or create) the default process group and megatron's model-parallel groups.

    Uses gloo on CPU (installing the CPU backend) and NCCL with CUDA. Safe to call again in the
    same process with the same sizes.

    Args:
        init_method: torch.distributed init method; default ``env://`` with MASTER_ADDR/PORT
            defaulting to 127.0.0.1:29500.
    """
    _megatron()
    cpu_backend.install()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        if init_method is None:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29500")
            init_method = "env://"
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)
    model_parallel_cuda_manual_seed(seed)


class GPTValueModel(torch.nn.Module):
    """A GPT trunk with a scalar value head (a PPO critic): tokens (B, T) -> values (B, T).

    The trunk is a megatron-core ``GPTModel`` built without its output layer
    (``post_process=False``), so it returns hidden states; the head is a LayerNorm and a
    ``hidden -> 1`` linear layer, replicated on every tensor-parallel rank.
    """

    def __init__(self, trunk: torch.nn.Module, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.trunk = trunk
        self.config = trunk.config  # megatron's DDP reads the wrapped module's config
        self.norm = torch.nn.LayerNorm(hidden_size, dtype=dtype)
        self.head = torch.nn.Linear(hidden_size, 1, dtype=dtype)

    def forward(self, input_ids, position_ids, attention_mask=None, labels=None):
        hidden = self.trunk(input_ids, position_ids, attention_mask)  # (T, B, H)
        return self.head(self.norm(hidden)).squeeze(-1).transpose(0, 1).float()  # (B, T)

    def set_input_tensor(self, input_tensor) -> None:
        self.trunk.set_input_tensor(input_tensor)


def _transformer_config(config: GPTTrainerConfig):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    bf16 = config.precision == "bf16"
    return TransformerConfig(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, use_cpu_initialization=True,
        bf16=bf16, params_dtype=torch.bfloat16 if bf16 else torch.float32,
        hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size())


def build_gpt_model(config: GPTTrainerConfig, value_head: bool = False) -> torch.nn.Module:
    """Build the bare model of a trainer: a ``GPTModel`` (local layer spec), on the device, in
    ``config.precision``. With ``value_head`` it is a :class:`GPTValueModel` instead.

    Requires :func:`init_distributed` first. The weights depend only on ``config.seed`` and the
    model-parallel rank, so models built with the same config start identical; an inference copy
    of a trainer's model (no DDP, no optimizer) is built by this same function.
    """
    _megatron()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    tcfg = _transformer_config(config)
    torch.manual_seed(config.seed)
    model_parallel_cuda_manual_seed(config.seed)
    model = GPTModel(config=tcfg, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=config.vocab_size, max_sequence_length=config.seq_length,
                     position_embedding_type="learned_absolute", post_process=not value_head)
    if value_head:
        model = GPTValueModel(model, config.hidden_size, tcfg.params_dtype)
    if torch.cuda.is_available():
        model = model.cuda()
    if config.precision == "bf16":
        model = model.bfloat16()
    return model


def build_gpt_trainer(config: GPTTrainerConfig, value_head: bool = False) -> GPTTrainer:
    """Build a GPTModel (local layer spec), wrap it in DDP and create its megatron optimizer.

    Requires :func:`init_distributed` first. The weights depend only on ``config.seed`` and the
    model-parallel rank, so two trainers built with the same config start identical.

    Args:
        value_head: Build a critic (:class:`GPTValueModel`) instead of a language model.
    """
    _megatron()
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    model = build_gpt_model(config, value_head)
    tcfg = model.config
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=config.use_distributed_optimizer,
                                               grad_reduce_in_fp32=config.grad_reduce_in_fp32)
    model = DistributedDataParallel(tcfg, ddp_config, model)
    opt_config = OptimizerConfig(optimizer="adam", lr=config.lr, bf16=tcfg.bf16, params_dtype=tcfg.params_dtype,
                                 use_distributed_optimizer=config.use_distributed_optimizer,
                                 clip_grad=config.clip_grad)
    optimizer = get_megatron_optimizer(opt_config, [model])
    return GPTTrainer(model, optimizer, config)


def synthetic_batch(config: GPTTrainerConfig, step: int, batch_size: int = 4, rank: int = 0) -> torch.Tensor:
    """A deterministic batch of token ids (B, T) for ``step`` on data-parallel ``rank``."""
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 101 + rank)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.seq_length), generator=g)
    return tokens.cuda() if torch.cuda.is_available() else tokens

