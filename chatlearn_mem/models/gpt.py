"""GPT models and trainers built from megatron-core's public API: the PPO recipe's policy and critic,
the benchmark's trainer, the examples' and the tests'.

Everything here uses ``parallel_state``, ``GPTModel`` with the local layer spec,
``DistributedDataParallel`` and ``get_megatron_optimizer``. On a machine without CUDA, megatron-core
needs :func:`chatlearn_mem.cpu_backend.install` first: call it yourself, or pass
``init_distributed(cpu_backend=True)``. Nothing here installs it unasked.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Literal, Optional

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from chatlearn_mem import cpu_backend as _cpu_backend
from chatlearn_mem.mcore.layout import INSTALL_HINT

__all__ = [
    "GPTTrainerConfig",
    "GPTTrainer",
    "GPTPipelineTrainer",
    "GPTValueModel",
    "build_gpt_model",
    "build_gpt_trainer",
    "build_gpt_pipeline_trainer",
    "exit_process",
    "init_distributed",
    "owned_process_group",
    "shutdown_distributed",
    "synthetic_batch",
]


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
    num_moe_experts: Optional[int] = Field(None, ge=2)
    """Mixture-of-experts MLP with this many experts in every layer (None: dense MLP). Uses the
    all-gather token dispatcher; the experts' params live in DDP's ``expert_parallel_buffers``
    and get their own (distributed) optimizer inside a ChainedOptimizer."""
    moe_router_topk: int = Field(2, ge=1)
    """Experts each token is routed to (MoE only)."""
    overlap_grad_reduce: bool = False
    """Overlap DDP's grad reduction with backward (bucket-by-bucket async collectives)."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's param all-gather with the next forward (needs
    ``use_distributed_optimizer``); parameters are gathered lazily by DDP's forward pre-hooks."""
    ddp_bucket_size: Optional[int] = Field(None, ge=1)
    """Elements per DDP bucket (None: megatron's default, one bucket for these tiny models)."""
    frozen_params: tuple[str, ...] = ()
    """Parameters whose name contains one of these substrings get ``requires_grad=False`` before
    DDP wraps the model (they stay outside the DDP buffers and the optimizer)."""
    num_microbatches: int = Field(1, ge=1)
    """Micro batches per step in :class:`GPTPipelineTrainer` (the batch is split evenly)."""
    model_class: Literal["gpt", "hybrid"] = "gpt"
    """``gpt``: megatron's ``GPTModel``. ``hybrid``: ``HybridModel`` (megatron-core 0.18+, which
    recommends it over GPTModel), attention and MLP layers alternating (pattern ``*-*-``... of
    ``num_layers`` symbols). Both use megatron's local (non Transformer Engine) modules."""
    fp32_accumulation_params: tuple[str, ...] = ()
    """DDP's ``param_name_patterns_for_fp32_local_accumulation`` (megatron-core 0.17+): matching
    params accumulate into a separate fp32 ``main_grad`` (needs ``grad_reduce_in_fp32=False``)."""
    layer_spec: Literal["local", "transformer_engine"] = "local"
    """megatron-core's layer spec: ``local`` (megatron's own modules, runs on the CPU backend) or
    ``transformer_engine`` (``get_gpt_layer_with_transformer_engine_spec``: TE's fused modules;
    needs CUDA and ``transformer_engine``)."""
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Every norm of the model: ``LayerNorm`` (weight and bias) or ``RMSNorm`` (weight only; Llama, Qwen2)."""
    norm_epsilon: float = Field(1e-5, gt=0)
    """Epsilon of every norm (megatron's ``layernorm_epsilon``, Hugging Face's ``rms_norm_eps``)."""
    activation: Literal["gelu", "swiglu"] = "gelu"
    """MLP: ``gelu`` (fc1, GELU, fc2) or ``swiglu`` (a gated fc1 of twice the width, SiLU(gate) x up, fc2)."""
    ffn_hidden_size: Optional[int] = Field(None, ge=1)
    """MLP width (per half of the gated fc1 with ``swiglu``); None: 4 x hidden_size."""
    position_embedding: Literal["learned_absolute", "rope"] = "learned_absolute"
    """``learned_absolute`` (a learned table of seq_length rows) or ``rope`` (rotary embeddings on
    queries and keys, no parameters)."""
    rotary_base: Optional[float] = Field(None, gt=0)
    """RoPE base (Hugging Face's ``rope_theta``); None: 10000. Only with ``position_embedding="rope"``."""
    num_query_groups: Optional[int] = Field(None, ge=1)
    """Key/value heads of grouped-query attention (must divide num_attention_heads); None: one per
    attention head (multi-head attention)."""
    add_bias_linear: bool = True
    """Biases on every linear layer (the GPT); False for Llama and Qwen2."""
    add_qkv_bias: Optional[bool] = None
    """Biases on the fused query/key/value projection alone (Qwen2); None: as ``add_bias_linear``."""
    share_embeddings_and_output_weights: bool = False
    """Tie the output layer to the input embedding (one vocab x hidden matrix, Hugging Face's
    ``tie_word_embeddings``)."""

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> "GPTTrainerConfig":
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must divide hidden_size ({self.hidden_size})"
            )
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise ValueError("overlap_param_gather needs use_distributed_optimizer=True")
        if self.model_class == "hybrid" and self.num_moe_experts is not None:
            raise ValueError("the hybrid GPT model has dense MLP layers only: drop num_moe_experts")
        if self.model_class == "hybrid" and self.layer_spec != "local":
            raise ValueError("the hybrid GPT model is built from the local layer spec only: drop layer_spec")
        if self.fp32_accumulation_params and self.grad_reduce_in_fp32:
            raise ValueError("fp32_accumulation_params needs grad_reduce_in_fp32=False (megatron's rule)")
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_query_groups ({self.num_query_groups}) must divide num_attention_heads "
                f"({self.num_attention_heads}): each key/value head serves a whole group of query heads"
            )
        if self.rotary_base is not None and self.position_embedding != "rope":
            raise ValueError(
                f"rotary_base ({self.rotary_base}) is set but position_embedding is "
                f"{self.position_embedding!r}: set position_embedding='rope' or drop rotary_base"
            )
        if self.model_class == "hybrid" and not self.is_gpt_architecture:
            raise ValueError(
                "the hybrid model is built with the GPT architecture only (LayerNorm, GELU, learned "
                "positions, biases, one key/value head per query head, untied embeddings): drop the "
                "architecture fields or use model_class='gpt'"
            )
        return self

    @property
    def is_gpt_architecture(self) -> bool:
        """Whether every architecture field has its GPT default (the model this module has always built)."""
        arch = (
            "normalization",
            "norm_epsilon",
            "activation",
            "ffn_hidden_size",
            "position_embedding",
            "rotary_base",
            "num_query_groups",
            "add_bias_linear",
            "add_qkv_bias",
            "share_embeddings_and_output_weights",
        )
        defaults = type(self).model_fields
        return all(getattr(self, f) == defaults[f].default for f in arch)


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
        raise ImportError(f"megatron-core is required for GPT trainers; install it with: {INSTALL_HINT}") from e


def init_distributed(
    rank: int = 0,
    world_size: int = 1,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    init_method: Optional[str] = None,
    seed: int = 1234,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    expert_model_parallel_size: int = 1,
    store: Optional[Any] = None,
    cpu_backend: bool = False,
) -> None:
    """Join (or create) the default process group and megatron's model-parallel groups.

    Uses NCCL with CUDA and gloo without. Safe to call again in the same process with the same sizes.

    Args:
        init_method: torch.distributed init method; default ``env://`` with MASTER_ADDR/PORT
            defaulting to 127.0.0.1:29500.
        virtual_pipeline_model_parallel_size: Model chunks per pipeline rank (interleaved
            schedule); None for one chunk.
        expert_model_parallel_size: Ranks the MoE experts are split across.
        store: A ``torch.distributed.Store`` to rendezvous through instead of ``init_method`` (rank
            0's own ``TCPStore`` server, already listening: the other ranks join it with
            ``tcp://host:port``).
        cpu_backend: Install :mod:`chatlearn_mem.cpu_backend` when CUDA is not available (it
            patches ``torch.cuda`` process-wide and says so once). Does nothing with CUDA.

    Raises:
        RuntimeError: CUDA is not available, the CPU backend is not installed and ``cpu_backend``
            is False.
    """
    if cpu_backend and not torch.cuda.is_available():
        _cpu_backend.install()  # before megatron's first import: the backend imports it the faster way
    _megatron()
    if not torch.cuda.is_available() and not _cpu_backend.is_installed():
        raise RuntimeError(
            "CUDA is not available, and megatron-core needs CUDA or the CPU backend: call "
            "chatlearn_mem.cpu_backend.install() first, or pass init_distributed(cpu_backend=True)"
        )
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
        if store is not None:  # the key prefix torch adds to a store it makes from tcp://
            dist.init_process_group(
                backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=world_size
            )
        else:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
        )
    model_parallel_cuda_manual_seed(seed)


DESTROY_TIMEOUT_S = 30.0
"""How long :func:`shutdown_distributed` waits for ``destroy_process_group()`` by default. A healthy
teardown takes well under a second; on a one-GPU H100 machine (torch 2.11, megatron-core 0.19.2)
the NCCL teardown after a bench run did not return in 70 s."""

_teardown_hung = False  # a shutdown_distributed() in this process gave up waiting (exit_process)


def shutdown_distributed(timeout_s: Optional[float] = DESTROY_TIMEOUT_S) -> bool:
    """Destroy megatron's model-parallel groups and the default process group (what
    :func:`init_distributed` set up); nothing when none is initialised.

    Call it when the process is done with collectives, before it exits: torch asks for it, and a
    NCCL process group left to the interpreter's exit is torn down by destructors, which can hold
    the exit up long after the work is done. Every rank of the group calls it.

    The destroy runs on a helper thread, and this call waits ``timeout_s`` for it (None: without a
    limit): a NCCL teardown can hang (seen on a one-GPU H100 machine after a bench run). When it
    does not return in time, this warns and returns False, and the process's own exit would hang
    in the same teardown: end the process with :func:`exit_process`, which then skips it.

    Returns:
        True when nothing was left to destroy or the destroy returned; False when it is still
        running after ``timeout_s``.

    Raises:
        Whatever ``destroy_process_group()`` raised, when it raised in time.
    """
    global _teardown_hung
    import threading

    import torch.distributed as dist

    def teardown() -> None:
        if "megatron.core" in sys.modules:  # nothing to leave when megatron was never imported
            from megatron.core import parallel_state

            # unconditionally: it resets every group global, also those of an initialisation that
            # failed half way (which model_parallel_is_initialized() does not see), and does
            # nothing twice; it destroys megatron's own process groups (each a NCCL teardown)
            parallel_state.destroy_model_parallel()
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    if timeout_s is None:
        teardown()
        return True
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else "model-parallel"
    failed: list[BaseException] = []

    def run() -> None:
        try:
            teardown()
        except BaseException as e:  # noqa: BLE001 - raised again on the calling thread
            failed.append(e)

    helper = threading.Thread(target=run, name="chatlearn-mem-destroy-process-group", daemon=True)
    helper.start()
    helper.join(timeout_s)
    if helper.is_alive():
        _teardown_hung = True
        warnings.warn(
            f"destroying the {backend} process group did not return within {timeout_s:g} s; the "
            "process's own exit would hang in the same teardown: end it with "
            "chatlearn_mem.models.gpt.exit_process(code), which skips it (the chatlearn-mem "
            "commands do)",
            stacklevel=2,
        )
        return False
    if failed:
        raise failed[0]
    return True


def exit_process(code: Any = 0) -> None:
    """End the process with ``code`` (as ``sys.exit``). When a :func:`shutdown_distributed` of this
    process gave up waiting for the process group's teardown, the interpreter's own exit would
    hang in that teardown: then stdout and stderr are flushed and the process ends at once
    (``os._exit``), without atexit handlers. Call it last, once every result is written."""
    if not _teardown_hung:
        sys.exit(code)
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit's convention: anything else is printed, and the status is 1
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


@contextlib.contextmanager
def owned_process_group(timeout_s: Optional[float] = DESTROY_TIMEOUT_S) -> Iterator[None]:
    """A block that may create the process group (:func:`init_distributed`) and then owns it:
    leaving the block, however it ends, calls :func:`shutdown_distributed` (with ``timeout_s``)
    when the group was created inside it. A group that existed before the block (a test
    session's, a caller's) is left as it is. For the main function of a script or command, which
    ends the process with :func:`exit_process`::

        with gpt.owned_process_group():
            gpt.init_distributed(...)
            ...
    """
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    try:
        yield
    except BaseException:
        if not before and dist.is_available() and dist.is_initialized():
            try:
                shutdown_distributed(timeout_s)
            except Exception as e:  # noqa: BLE001 - the block's own error is the one to see
                warnings.warn(f"shutting the process group down after an error failed too: {e!r}", stacklevel=2)
        raise
    if not before and dist.is_available() and dist.is_initialized():
        shutdown_distributed(timeout_s)


def _megatron_module():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class GPTValueModel(torch.nn.Module):
    """A GPT trunk with a scalar value head (a PPO critic): tokens (B, T) -> values (B, T).

    The trunk is a megatron-core ``GPTModel`` built without its output layer
    (``post_process=False``), so it returns hidden states; the head is a LayerNorm and a
    ``hidden -> 1`` linear layer, replicated on every tensor-parallel rank. Its
    ``sharded_state_dict`` (for ``dist_checkpointing``) is megatron's ``MegatronModule`` one: the
    trunk's own, and the head's tensors as replicated across tensor-parallel ranks.
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

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None
    ) -> dict:
        return _megatron_module().sharded_state_dict(self, prefix, sharded_offsets, metadata)


def build_gpt_model(config: GPTTrainerConfig, value_head: bool = False) -> torch.nn.Module:
    """Build the bare model of a trainer without pipeline stages: a ``GPTModel`` (local layer
    spec), on the device, in ``config.precision``, frozen params applied. With ``value_head`` it
    is a :class:`GPTValueModel` instead.

    Requires :func:`init_distributed` first. The weights depend only on ``config.seed`` and the
    model-parallel rank, so models built with the same config start identical; an inference copy
    of a trainer's model (no DDP, no optimizer) is built by this same function.
    """
    _megatron()
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    tcfg = _transformer_config(config)
    torch.manual_seed(config.seed)
    model_parallel_cuda_manual_seed(config.seed)
    return _gpt_chunk(config, tcfg, None, value_head)


def build_gpt_trainer(config: GPTTrainerConfig, value_head: bool = False) -> GPTTrainer:
    """Build a GPTModel (local layer spec), wrap it in DDP and create its megatron optimizer.

    Requires :func:`init_distributed` first. The weights depend only on ``config.seed`` and the
    model-parallel rank, so two trainers built with the same config start identical. For pipeline
    parallel (or virtual pipeline) layouts use :func:`build_gpt_pipeline_trainer`.

    Args:
        value_head: Build a critic (:class:`GPTValueModel`) instead of a language model.
    """
    _megatron()
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            "pipeline parallel size > 1: use build_gpt_pipeline_trainer (a list of model "
            "chunks stepped by megatron's pipeline schedule)"
        )
    chunks, optimizer = _build_chunks_and_optimizer(config, value_head)
    return GPTTrainer(chunks[0], optimizer, config)


def build_gpt_pipeline_trainer(config: GPTTrainerConfig) -> "GPTPipelineTrainer":
    """Build this rank's model chunks and their optimizer, trained by megatron's pipeline schedule.

    One chunk per virtual pipeline stage (``virtual_pipeline_model_parallel_size`` given to
    :func:`init_distributed`; one chunk without it). ``config.num_layers`` must be divisible by
    pipeline size x chunks. Works for pipeline size 1 too (megatron's no-pipelining schedule).
    """
    _megatron()
    chunks, optimizer = _build_chunks_and_optimizer(config)
    return GPTPipelineTrainer(chunks, optimizer, config)


def _transformer_config(config: GPTTrainerConfig):
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    bf16 = config.precision == "bf16"
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    extra: dict = {}
    if pp > 1:
        extra.update(pipeline_model_parallel_size=pp, pipeline_dtype=torch.bfloat16 if bf16 else torch.float32)
    if vpp is not None:
        extra.update(virtual_pipeline_model_parallel_size=vpp)
    # megatron's experts add a bias in place into an autograd view: MoE layers have none
    add_bias_linear = config.add_bias_linear and config.num_moe_experts is None
    if config.num_moe_experts is not None:
        extra.update(
            num_moe_experts=config.num_moe_experts,
            moe_router_topk=config.moe_router_topk,
            moe_token_dispatcher_type="allgather",
            moe_aux_loss_coeff=0.0,
            moe_router_pre_softmax=config.moe_router_topk == 1,  # megatron requires it for top-1
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        )
    if config.activation == "swiglu":
        extra.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu)
    if config.ffn_hidden_size is not None:
        extra.update(ffn_hidden_size=config.ffn_hidden_size)
    if config.num_query_groups is not None:
        extra.update(num_query_groups=config.num_query_groups)
    return TransformerConfig(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        normalization=config.normalization,
        layernorm_epsilon=config.norm_epsilon,
        add_bias_linear=add_bias_linear,
        add_qkv_bias=add_bias_linear if config.add_qkv_bias is None else config.add_qkv_bias,
        use_cpu_initialization=True,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        **extra,
    )


def _hybrid_model(config: GPTTrainerConfig, common: dict) -> torch.nn.Module:
    """megatron's HybridModel with attention ("*") and MLP ("-") layers built from the local GPT layer spec."""
    try:
        from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
        from megatron.core.models.hybrid.hybrid_model import HybridModel
        from megatron.core.ssm.mlp_layer import MLPLayer
    except ImportError as e:
        raise ImportError("model_class='hybrid' needs megatron-core 0.18 or newer (HybridModel)") from e
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    local = get_gpt_layer_local_spec().submodules
    attention = ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=local.input_layernorm,
            self_attention=local.self_attention,
            self_attn_bda=local.self_attn_bda,
        ),
    )
    mlp = ModuleSpec(
        module=MLPLayer,
        submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=local.pre_mlp_layernorm, mlp=local.mlp, mlp_bda=local.mlp_bda
        ),
    )
    stack = ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(attention_layer=attention, mlp_layer=mlp))
    pattern = ("*-" * config.num_layers)[: config.num_layers]
    return HybridModel(hybrid_stack_spec=stack, hybrid_layer_pattern=pattern, **common)


def _layer_spec(config: GPTTrainerConfig):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if config.layer_spec == "local":
        return get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization=config.normalization)
    if not torch.cuda.is_available():
        raise ValueError(
            "layer_spec='transformer_engine' needs CUDA (Transformer Engine has no CPU kernels); "
            "use layer_spec='local' on this machine"
        )
    try:
        import transformer_engine  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "layer_spec='transformer_engine' needs Transformer Engine: pip install "
            "transformer-engine[pytorch] (or use layer_spec='local')"
        ) from e
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts)


def _gpt_chunk(config: GPTTrainerConfig, tcfg, vp_stage: Optional[int], value_head: bool) -> torch.nn.Module:
    """One model chunk (pipeline stage ``vp_stage``), on the device, in its dtype, frozen params set."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    if value_head and not last:
        raise ValueError("a value head needs the last pipeline stage; pipeline-parallel critics are not supported")
    common = dict(
        config=tcfg,
        vocab_size=config.vocab_size,
        max_sequence_length=config.seq_length,
        position_embedding_type=config.position_embedding,
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=last and not value_head,
        **({"vp_stage": vp_stage} if vp_stage is not None else {}),
    )
    if config.model_class == "hybrid":
        model = _hybrid_model(config, common)
    else:
        rope = {"rotary_base": config.rotary_base} if config.rotary_base is not None else {}
        model = GPTModel(
            transformer_layer_spec=_layer_spec(config),
            share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
            **rope,
            **common,
        )
    if value_head:
        model = GPTValueModel(model, config.hidden_size, tcfg.params_dtype)
    if torch.cuda.is_available():
        model = model.cuda()
    if config.precision == "bf16":
        model = model.bfloat16()
    for name, p in model.named_parameters():
        if any(f in name for f in config.frozen_params):
            p.requires_grad_(False)
    return model


def _build_chunks_and_optimizer(config: GPTTrainerConfig, value_head: bool = False):
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    torch.manual_seed(config.seed)
    model_parallel_cuda_manual_seed(config.seed)
    tcfg = _transformer_config(config)
    models = [_gpt_chunk(config, tcfg, stage if vpp is not None else None, value_head) for stage in range(vpp or 1)]
    ddp_extra = {"bucket_size": config.ddp_bucket_size} if config.ddp_bucket_size is not None else {}
    if config.fp32_accumulation_params:
        ddp_extra["param_name_patterns_for_fp32_local_accumulation"] = config.fp32_accumulation_params
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=config.use_distributed_optimizer,
        grad_reduce_in_fp32=config.grad_reduce_in_fp32,
        overlap_grad_reduce=config.overlap_grad_reduce,
        overlap_param_gather=config.overlap_param_gather,
        **ddp_extra,
    )
    chunks = [DistributedDataParallel(tcfg, ddp_config, m, disable_bucketing=i > 0) for i, m in enumerate(models)]
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        bf16=tcfg.bf16,
        params_dtype=tcfg.params_dtype,
        use_distributed_optimizer=config.use_distributed_optimizer,
        clip_grad=config.clip_grad,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    return chunks, optimizer


@dataclass
class GPTPipelineTrainer:
    """This rank's DDP-wrapped model chunks (one per virtual pipeline stage) and their optimizer,
    stepped by megatron-core's pipeline schedule (``get_forward_backward_func``)."""

    model: list
    optimizer: Any
    config: GPTTrainerConfig

    def __post_init__(self) -> None:
        from megatron.core.distributed import finalize_model_grads

        tcfg = self.model[0].module.config  # shared by every chunk
        tcfg.finalize_model_grads_func = finalize_model_grads
        no_sync = [c.no_sync for c in self.model]
        tcfg.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        if self.config.overlap_grad_reduce:
            sync = [c.start_grad_sync for c in self.model]
            tcfg.grad_sync_func = sync[0] if len(sync) == 1 else sync

    def train_step(self, tokens: torch.Tensor) -> float:
        """One optimizer step on ``tokens`` (B, T), split into ``config.num_microbatches`` micro
        batches; returns the mean loss (computed on the last pipeline stage, sent to every stage)."""
        from megatron.core import parallel_state
        from megatron.core.pipeline_parallel import get_forward_backward_func

        for c in self.model:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        micro = tokens.chunk(self.config.num_microbatches)
        if len({m.shape[0] for m in micro}) != 1 or len(micro) != self.config.num_microbatches:
            raise ValueError(
                f"batch of {tokens.shape[0]} does not split into {self.config.num_microbatches} equal micro batches"
            )
        data = [iter(micro) for _ in self.model]

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            positions = torch.arange(batch.shape[1], device=batch.device).unsqueeze(0).expand_as(batch)
            out = model(batch[:, :-1], positions[:, :-1], None, labels=batch[:, 1:])

            def loss_func(per_token):
                loss = per_token.float().mean()
                return loss, {"loss": loss.detach()}

            return out, loss_func

        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=data if len(data) > 1 else data[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(micro),
            seq_length=tokens.shape[1] - 1,
            micro_batch_size=micro[0].shape[0],
            forward_only=False,
        )
        self.optimizer.step()
        loss = torch.zeros(1, dtype=torch.float32, device=tokens.device)
        if losses:
            loss += torch.stack([d["loss"] for d in losses]).mean()
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            torch.distributed.broadcast(
                loss,
                src=parallel_state.get_pipeline_model_parallel_last_rank(),
                group=parallel_state.get_pipeline_model_parallel_group(),
            )
        return loss.item()


def estimate_part_bytes(
    config: GPTTrainerConfig,
    value_head: bool = False,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    trainer: bool = True,
) -> dict[str, int]:
    """About how many device bytes each part of one rank of this model takes, from the config alone
    (no megatron, no device): for checking a device budget before anything starts.

    Exact for the dense models of the local layer spec (GPT, Llama, Qwen2) without tensor
    parallelism, up to megatron's padding of its DDP buffers (a few % on tiny models, nothing on
    real ones); tensor-parallel
    splits are divided evenly (layer norms and row-parallel biases are in fact replicated). MoE,
    hybrid and frozen-parameter configs are estimated as the dense model.

    Args:
        value_head: A critic (:class:`GPTValueModel`): no output layer and no final norm in the
            trunk, a norm and a ``hidden -> 1`` head instead.
        trainer: False for an inference copy (weights only).

    Returns:
        ``{"weights", "grads", "main_weights", "optimizer_states"}`` (the last three 0 when not
        ``trainer``), in bytes.
    """
    h, v, s, n = config.hidden_size, config.vocab_size, config.seq_length, config.num_layers
    tp, dp = tensor_parallel_size, data_parallel_size
    kv = (config.num_query_groups or config.num_attention_heads) * (h // config.num_attention_heads)
    ffn = config.ffn_hidden_size or 4 * h
    fc1 = 2 * ffn if config.activation == "swiglu" else ffn  # the gated fc1 holds gate and up
    bias = config.add_bias_linear and config.num_moe_experts is None
    qkv_bias = bias if config.add_qkv_bias is None else config.add_qkv_bias
    norm = h if config.normalization == "RMSNorm" else 2 * h  # weight (and bias)
    # QKV, proj, fc1, fc2 weights; QKV and fc1 biases
    layer_split = h * (h + 2 * kv) + h * h + fc1 * h + ffn * h + (h + 2 * kv) * qkv_bias + fc1 * bias
    split = v * h // tp + n * layer_split // tp  # + embedding
    # layer norms, row-parallel biases (proj, fc2), the learned position table
    replicated = n * 2 * norm + n * 2 * h * bias + s * h * (config.position_embedding == "learned_absolute")
    if value_head:
        replicated += 2 * h + h + 1  # the head's norm and linear layer
    else:
        replicated += norm  # final norm
        if not config.share_embeddings_and_output_weights:
            split += v * h // tp  # output layer
    params = split + replicated
    width = 2 if config.precision == "bf16" else 4
    out = {"weights": params * width, "grads": 0, "main_weights": 0, "optimizer_states": 0}
    if trainer:
        owned = -(-params // dp) if config.use_distributed_optimizer else params
        out["grads"] = params * (4 if config.grad_reduce_in_fp32 else width)
        out["main_weights"] = owned * 4 if config.precision == "bf16" else 0
        out["optimizer_states"] = owned * 4 * 2  # Adam's exp_avg and exp_avg_sq, fp32
    return out


def synthetic_batch(config: GPTTrainerConfig, step: int, batch_size: int = 4, rank: int = 0) -> torch.Tensor:
    """A deterministic batch of token ids (B, T) for ``step`` on data-parallel ``rank``."""
    g = torch.Generator().manual_seed(config.seed * 1_000_003 + step * 101 + rank)
    tokens = torch.randint(0, config.vocab_size, (batch_size, config.seq_length), generator=g)
    return tokens.cuda() if torch.cuda.is_available() else tokens
