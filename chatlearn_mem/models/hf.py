"""Hugging Face checkpoints in and out of megatron-core GPT trainers: the Llama and Qwen2 families.

The adapter between a Hugging Face directory (``config.json`` and ``*.safetensors``) and the models
of :mod:`chatlearn_mem.models.gpt` built with megatron-core's local layer spec:

- :func:`config_from_hf`: ``config.json`` -> :class:`~chatlearn_mem.models.gpt.GPTTrainerConfig`.
- :func:`load_hf_weights`: fill a built model (or trainer) from the safetensors files; each
  tensor-parallel rank reads only its own slices of the files.
- :func:`to_hf_state_dict`: megatron weights (a model, or the state dicts of every
  tensor-parallel rank, e.g. from a sleeping trainer's ``weights_state_dict()``) -> full tensors
  with Hugging Face names; :func:`gather_tensor_parallel` collects the ranks' state dicts.
- :func:`save_hf`: write those tensors as a directory ``transformers`` loads; :func:`save_hf_stream`
  the same from a stream of tensors, a file of at most a given size at a time.

One table of names per family (:data:`FAMILIES`); the tensors only move, so import and export
are bit-exact. Needs ``safetensors`` (``pip install 'chatlearn-mem[hf]'``), imported when used;
``transformers`` is not needed here at all.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch

from chatlearn_mem.models.gpt import GPTTrainerConfig, GPTValueModel

__all__ = [
    "FAMILIES",
    "config_from_hf",
    "load_hf_weights",
    "to_hf_state_dict",
    "iter_hf_weights",
    "hf_shapes",
    "family_of",
    "hf_weight_buckets",
    "hf_named_buckets",
    "megatron_shard_buckets",
    "merge_shard_buckets",
    "hf_digest",
    "gather_tensor_parallel",
    "save_hf",
    "save_hf_stream",
    "hf_config_dict",
    "save_random_hf",
    "CHECKPOINT_FIELDS",
    "TOKENIZER_FILES",
]

INSTALL_HINT = "pip install 'chatlearn-mem[hf]'"

# How one megatron tensor is made of Hugging Face tensors, and how tensor parallelism cuts it.
COPY = "copy"  # the same tensor, replicated on every TP rank (norms)
VOCAB = "vocab"  # rows split over TP ranks (embedding, output layer: the vocabulary)
COLS = "cols"  # columns split over TP ranks (row-parallel linear layers: o_proj, down_proj)
QKV = "qkv"  # q, k, v fused and interleaved by query group; whole groups per TP rank
GATE_UP = "gate_up"  # gate and up fused into linear_fc1: each rank holds [its gate rows; its up rows]

_SPLIT_DIM = {COPY: None, VOCAB: 0, COLS: 1, QKV: 0, GATE_UP: 0}
"""The dimension of each Hugging Face tensor that tensor parallelism cuts (None: not cut)."""


@dataclass(frozen=True)
class Rule:
    """One megatron tensor and the Hugging Face tensors it is made of."""

    megatron: str
    """Name in the megatron model's state dict; ``{i}`` is the layer."""
    kind: str
    """How the Hugging Face tensors combine and split (COPY, VOCAB, COLS, QKV, GATE_UP)."""
    hf: tuple[tuple[str, str], ...]
    """``(name, shape)`` of each Hugging Face tensor, in order; the shape in the symbols of
    :func:`_dims` (``"q h"``: heads x head_dim rows, hidden columns)."""


@dataclass(frozen=True)
class Family:
    """A Hugging Face architecture this adapter maps, and its table of names."""

    architecture: str
    """``config.json``'s ``architectures[0]``."""
    model_type: str
    """``config.json``'s ``model_type``."""
    qkv_bias: bool
    """Whether q, k and v projections carry biases (megatron's ``add_qkv_bias``)."""
    model: tuple[Rule, ...]
    """Tensors that exist once (embedding, final norm, output layer)."""
    layer: tuple[Rule, ...]
    """Tensors of each transformer layer."""
    unsupported: tuple[tuple[str, Any], ...] = ()
    """``(config.json key, the only value supported)`` beyond the common ones."""


_OUTPUT = "output_layer.weight"
_MODEL_RULES = (
    Rule("embedding.word_embeddings.weight", VOCAB, (("model.embed_tokens.weight", "v h"),)),
    Rule("decoder.final_layernorm.weight", COPY, (("model.norm.weight", "h"),)),
    Rule(_OUTPUT, VOCAB, (("lm_head.weight", "v h"),)),  # absent when tied to the embedding
)
_L, _A = "model.layers.{i}", "model.layers.{i}.self_attn"
_LLAMA_LAYER = (
    Rule("decoder.layers.{i}.input_layernorm.weight", COPY, ((f"{_L}.input_layernorm.weight", "h"),)),
    Rule(
        "decoder.layers.{i}.self_attention.linear_qkv.weight",
        QKV,
        ((f"{_A}.q_proj.weight", "q h"), (f"{_A}.k_proj.weight", "kv h"), (f"{_A}.v_proj.weight", "kv h")),
    ),
    Rule("decoder.layers.{i}.self_attention.linear_proj.weight", COLS, ((f"{_A}.o_proj.weight", "h q"),)),
    Rule("decoder.layers.{i}.pre_mlp_layernorm.weight", COPY, ((f"{_L}.post_attention_layernorm.weight", "h"),)),
    Rule(
        "decoder.layers.{i}.mlp.linear_fc1.weight",
        GATE_UP,
        ((f"{_L}.mlp.gate_proj.weight", "f h"), (f"{_L}.mlp.up_proj.weight", "f h")),
    ),
    Rule("decoder.layers.{i}.mlp.linear_fc2.weight", COLS, ((f"{_L}.mlp.down_proj.weight", "h f"),)),
)
_QKV_BIAS = Rule(
    "decoder.layers.{i}.self_attention.linear_qkv.bias",
    QKV,
    ((f"{_A}.q_proj.bias", "q"), (f"{_A}.k_proj.bias", "kv"), (f"{_A}.v_proj.bias", "kv")),
)

LLAMA = Family(
    "LlamaForCausalLM",
    "llama",
    qkv_bias=False,
    model=_MODEL_RULES,
    layer=_LLAMA_LAYER,
    unsupported=(("attention_bias", False), ("mlp_bias", False)),
)
QWEN2 = replace(
    LLAMA,
    architecture="Qwen2ForCausalLM",
    model_type="qwen2",
    qkv_bias=True,
    layer=_LLAMA_LAYER + (_QKV_BIAS,),
    unsupported=(("use_sliding_window", False),),
)
FAMILIES: dict[str, Family] = {f.architecture: f for f in (LLAMA, QWEN2)}
"""The supported architectures by ``config.json`` name. Qwen2 is Llama with q/k/v biases."""

_IGNORED = re.compile(r"\.rotary_emb\.inv_freq$")  # a buffer some older Llama files carry; recomputed

_CONFIG_FIELDS = {
    "num_layers": ("num_hidden_layers", None),
    "hidden_size": ("hidden_size", None),
    "num_attention_heads": ("num_attention_heads", None),
    "ffn_hidden_size": ("intermediate_size", None),
    "vocab_size": ("vocab_size", None),
    "num_query_groups": ("num_key_value_heads", "num_attention_heads"),
    "seq_length": ("max_position_embeddings", 2048),
    "norm_epsilon": ("rms_norm_eps", 1e-6),
    "share_embeddings_and_output_weights": ("tie_word_embeddings", False),
}
"""``GPTTrainerConfig`` field: (``config.json`` key, default when absent: a value, the name of
another key, or None for a required key)."""

_ARCHITECTURE = dict(normalization="RMSNorm", activation="swiglu", position_embedding="rope", add_bias_linear=False)
"""What every supported family is: RMSNorm, SwiGLU, rotary embeddings, no linear biases."""

CHECKPOINT_FIELDS: tuple[str, ...] = (
    *(f for f in _CONFIG_FIELDS if f != "seq_length"),
    *_ARCHITECTURE,
    "add_qkv_bias",
    "rotary_base",
)
"""The ``GPTTrainerConfig`` fields a checkpoint decides (:func:`config_from_hf` reads them from
``config.json`` and the family); ``seq_length`` and ``precision`` stay the trainer's choice."""

_COMMON_UNSUPPORTED = (("hidden_act", "silu"), ("rope_scaling", None))
_DTYPES = {"BF16": "bf16", "F32": "fp32"}
"""safetensors dtype -> ``GPTTrainerConfig.precision``: the dtypes we train in."""


def _safetensors():
    try:
        import safetensors  # noqa: F401
        import safetensors.torch  # noqa: F401
    except ImportError as e:
        raise ImportError(f"Hugging Face checkpoints need safetensors: {INSTALL_HINT}") from e
    return safetensors


# -- reading a checkpoint directory ---------------------------------------------------------------


@dataclass
class _Checkpoint:
    """A validated Hugging Face directory: its config.json, family and tensor headers."""

    path: str
    hf: dict
    family: Family
    tensors: dict[str, tuple[str, str, tuple[int, ...]]]
    """name -> (file, safetensors dtype, shape)."""


def _open_checkpoint(path: Union[str, os.PathLike]) -> _Checkpoint:
    path = os.fspath(path)
    if not os.path.isdir(path):
        if re.fullmatch(r"[\w.-]+/[\w.-]+", path) and not os.path.exists(path):
            raise FileNotFoundError(
                f"{path!r} is not a local directory (looked for {os.path.abspath(path)}); models are read from "
                f"local paths only: put the checkpoint there, or, if {path!r} is a Hugging Face Hub name, "
                f"download it first (huggingface-cli download {path} --local-dir DIR) and pass DIR"
            )
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist: pass a Hugging Face model directory")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(
            f"{path!r} has no config.json: pass the directory a Hugging Face model was saved to "
            "(save_pretrained writes config.json and *.safetensors)"
        )
    with open(config_path) as f:
        hf = json.load(f)
    arch = (hf.get("architectures") or [None])[0]
    if arch not in FAMILIES:
        raise ValueError(
            f"{config_path} declares architecture {arch!r}; supported: {', '.join(FAMILIES)}. "
            "Other families need their own table of names in chatlearn_mem.models.hf"
        )
    family = FAMILIES[arch]
    files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{path!r} has no *.safetensors files (only safetensors are read): re-save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
    safe_open = _safetensors().safe_open
    tensors: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    for name in files:
        file = os.path.join(path, name)
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                tensors[key] = (file, sl.get_dtype(), tuple(sl.get_shape()))
    return _Checkpoint(path, hf, family, tensors)


def _rope_theta(hf: dict) -> float:
    params = hf.get("rope_parameters") or {}
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def _check_supported(ckpt: _Checkpoint) -> None:
    hf, where = ckpt.hf, os.path.join(ckpt.path, "config.json")
    for key, value in _COMMON_UNSUPPORTED + ckpt.family.unsupported:
        if hf.get(key, value) != value:
            raise ValueError(
                f"{where}: {key}={hf[key]!r} is not supported for {ckpt.family.architecture} (only "
                f"{key}={value!r}); use a checkpoint without it"
            )
    rope_type = (hf.get("rope_parameters") or {}).get("rope_type", "default")
    if rope_type != "default":
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported (only 'default' RoPE, no scaling)")
    heads, hidden = hf.get("num_attention_heads"), hf.get("hidden_size")
    head_dim = hf.get("head_dim")
    if head_dim is not None and heads and hidden and head_dim * heads != hidden:
        raise ValueError(
            f"{where}: head_dim={head_dim} with {heads} heads is not hidden_size={hidden}; only "
            "head_dim = hidden_size / num_attention_heads is supported"
        )


def config_from_hf(path: Union[str, os.PathLike], **overrides: Any) -> GPTTrainerConfig:
    """The trainer config of a Hugging Face Llama or Qwen2 checkpoint directory.

    Shape fields come from ``config.json`` (``max_position_embeddings`` becomes ``seq_length``),
    the architecture is fixed by the family (RMSNorm, SwiGLU, RoPE, no linear biases; q/k/v biases
    for Qwen2) and ``precision`` is the dtype of the files' embedding (bf16 or fp32).

    Args:
        path: A local directory with ``config.json`` and ``*.safetensors``.
        **overrides: Other ``GPTTrainerConfig`` fields (``lr``, ``seq_length``,
            ``use_distributed_optimizer``...).

    Raises:
        FileNotFoundError: No such directory (a Hub name says to download it first), no
            config.json or no safetensors files.
        ValueError: An architecture other than Llama and Qwen2, a config.json feature the mapping
            does not cover, or a checkpoint dtype other than bf16 and fp32.
    """
    ckpt = _open_checkpoint(path)
    return _config(ckpt, overrides)


def _config(ckpt: _Checkpoint, overrides: Mapping[str, Any]) -> GPTTrainerConfig:
    _check_supported(ckpt)
    hf, fields = ckpt.hf, {}
    for field, (key, default) in _CONFIG_FIELDS.items():
        if key in hf and hf[key] is not None:
            fields[field] = hf[key]
        elif default is None:
            raise ValueError(f"{os.path.join(ckpt.path, 'config.json')} has no {key!r}: it is required")
        else:
            fields[field] = hf[default] if isinstance(default, str) else default
    fields["rotary_base"] = _rope_theta(hf)
    embed = ckpt.tensors.get(ckpt.family.model[0].hf[0][0])
    fields["precision"] = _DTYPES.get(embed[1], "bf16") if embed else "bf16"
    for name, (_, dtype, _) in ckpt.tensors.items():
        if dtype not in _DTYPES:
            raise ValueError(
                f"{ckpt.path}: tensor {name} is {dtype}; trainers train in bf16 or fp32: convert the "
                "checkpoint first (model.to(torch.bfloat16).save_pretrained(DIR))"
            )
    clash = sorted(set(overrides) & (set(_ARCHITECTURE) | {"add_qkv_bias"} | set(_CONFIG_FIELDS) - {"seq_length"}))
    if clash:
        raise ValueError(f"{', '.join(clash)} come from {ckpt.path}/config.json and cannot be overridden")
    return GPTTrainerConfig(**{**fields, **_ARCHITECTURE, "add_qkv_bias": ckpt.family.qkv_bias, **dict(overrides)})


# -- the mapping ----------------------------------------------------------------------------------


def family_of(config: GPTTrainerConfig) -> Family:
    """The family a trainer config exports as; raises if it is not one of them."""
    bad = [f"{k}={getattr(config, k)!r}" for k, v in _ARCHITECTURE.items() if getattr(config, k) != v]
    if bad or config.model_class != "gpt":
        raise ValueError(
            f"a Llama or Qwen2 model needs {', '.join(f'{k}={v!r}' for k, v in _ARCHITECTURE.items())} and "
            f"model_class='gpt'; this config has {', '.join(bad) or repr(config.model_class)}: build it from "
            "config_from_hf(path)"
        )
    return QWEN2 if config.add_qkv_bias else LLAMA


def _dims(config: GPTTrainerConfig) -> dict[str, int]:
    head_dim = config.hidden_size // config.num_attention_heads
    groups = config.num_query_groups or config.num_attention_heads
    return dict(
        h=config.hidden_size,
        q=config.num_attention_heads * head_dim,
        kv=groups * head_dim,
        f=config.ffn_hidden_size or 4 * config.hidden_size,
        v=config.vocab_size,
    )


@dataclass(frozen=True)
class _Entry:
    """One rule for one layer: the megatron name and its Hugging Face names and full shapes."""

    megatron: str
    kind: str
    hf: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    def shard_shape(self, tp: int) -> tuple[int, ...]:
        """This megatron tensor's shape on one of ``tp`` ranks."""
        first = self.shapes[0]
        dim = _SPLIT_DIM[self.kind]
        if dim is None:
            return first
        if self.kind in (QKV, GATE_UP):
            return (sum(s[0] for s in self.shapes) // tp, *first[1:])
        return tuple(n // tp if d == dim else n for d, n in enumerate(first))


def _entries(config: GPTTrainerConfig, family: Family) -> list[_Entry]:
    dims = _dims(config)

    def entry(rule: Rule, i: Optional[int] = None) -> _Entry:
        fmt = (lambda s: s.format(i=i)) if i is not None else (lambda s: s)
        shapes = tuple(tuple(dims[d] for d in shape.split()) for _, shape in rule.hf)
        return _Entry(fmt(rule.megatron), rule.kind, tuple(fmt(n) for n, _ in rule.hf), shapes)

    tied = config.share_embeddings_and_output_weights
    out = [entry(r) for r in family.model if not (tied and r.megatron == _OUTPUT)]
    return out + [entry(r, i) for i in range(config.num_layers) for r in family.layer]


def _split_megatron(entry: _Entry, shard: torch.Tensor, config: GPTTrainerConfig, tp: int) -> list[torch.Tensor]:
    """One rank's megatron tensor -> its piece of each Hugging Face tensor."""
    if entry.kind == GATE_UP:
        return list(shard.chunk(2, dim=0))
    if entry.kind == QKV:
        d = config.hidden_size // config.num_attention_heads
        groups = (config.num_query_groups or config.num_attention_heads) // tp
        n = config.num_attention_heads // (config.num_query_groups or config.num_attention_heads)
        rest = shard.shape[1:]
        per_group = shard.reshape(groups, (n + 2) * d, *rest)  # (G, [q heads; k; v] x d, ...)
        return [p.reshape(-1, *rest) for p in per_group.split([n * d, d, d], dim=1)]
    return [shard]


def _join_megatron(entry: _Entry, pieces: list[torch.Tensor], config: GPTTrainerConfig, tp: int) -> torch.Tensor:
    """This rank's piece of each Hugging Face tensor -> its megatron tensor (inverse of _split_megatron)."""
    if entry.kind == GATE_UP:
        return torch.cat(pieces, dim=0)
    if entry.kind == QKV:
        d = config.hidden_size // config.num_attention_heads
        groups = (config.num_query_groups or config.num_attention_heads) // tp
        q, k, v = pieces
        rest = q.shape[1:]
        per_group = [q.reshape(groups, -1, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)]
        return torch.cat(per_group, dim=1).reshape(-1, *rest)  # (G x [q heads; k; v] x d, ...)
    return pieces[0]


# -- import ---------------------------------------------------------------------------------------


def _language_model(model: torch.nn.Module) -> torch.nn.Module:
    """The megatron ``GPTModel`` inside a DDP wrapper and/or a value model."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model.trunk if isinstance(model, GPTValueModel) else model


def _parallel() -> tuple[int, int]:
    """(tensor-parallel size, this rank's index); (1, 0) without megatron's parallel state."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 1, 0
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        raise ValueError(
            "Hugging Face import/export is for pipeline-parallel size 1; build the trainer without "
            "pipeline stages (tensor and data parallelism are supported)"
        )
    return parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()


def _check_divisible(config: GPTTrainerConfig, tp: int, where: str) -> None:
    for what, n in (
        ("vocab_size", config.vocab_size),
        ("num_attention_heads", config.num_attention_heads),
        ("num_key_value_heads", config.num_query_groups or config.num_attention_heads),
        ("intermediate_size", config.ffn_hidden_size or 4 * config.hidden_size),
    ):
        if n % tp:
            raise ValueError(
                f"{where}: {what}={n} is not divisible by the tensor-parallel size {tp}: use a "
                "tensor-parallel size that divides it"
            )


_MODEL_CHECKS = (
    ("num_layers", "num_layers"),
    ("hidden_size", "hidden_size"),
    ("num_attention_heads", "num_attention_heads"),
    ("num_query_groups", "num_query_groups"),
    ("ffn_hidden_size", "ffn_hidden_size"),
    ("norm_epsilon", "layernorm_epsilon"),
    ("normalization", "normalization"),
    ("add_qkv_bias", "add_qkv_bias"),
    ("add_bias_linear", "add_bias_linear"),
)
"""(GPTTrainerConfig field, megatron ``TransformerConfig`` field) a loaded model must agree on."""


def _check_model(lm: torch.nn.Module, config: GPTTrainerConfig, where: str) -> None:
    tcfg = lm.config
    built = {ours: getattr(tcfg, theirs) for ours, theirs in _MODEL_CHECKS}
    built["activation"] = "swiglu" if tcfg.gated_linear_unit else "gelu"
    built["vocab_size"] = getattr(lm, "vocab_size", config.vocab_size)
    built["position_embedding"] = getattr(lm, "position_embedding_type", config.position_embedding)
    want = {k: getattr(config, k) for k in built}
    want["num_query_groups"] = config.num_query_groups or config.num_attention_heads
    built["num_query_groups"] = built["num_query_groups"] or tcfg.num_attention_heads
    want["ffn_hidden_size"] = config.ffn_hidden_size or 4 * config.hidden_size
    wrong = [f"{k}={built[k]!r} (config.json: {want[k]!r})" for k in built if built[k] != want[k]]
    if wrong:
        raise ValueError(f"the model was not built for {where}: {', '.join(wrong)}; build it from config_from_hf(path)")


def load_hf_weights(model: torch.nn.Module, path: Union[str, os.PathLike], optimizer: Any = None) -> int:
    """Fill a megatron GPT model from a Hugging Face Llama or Qwen2 checkpoint, bit for bit.

    Every name, shape and dtype is checked against ``config.json`` and the model before the first
    tensor is written, so a bad checkpoint leaves the model untouched. Each tensor-parallel rank
    reads only its own slices of the files (``safe_open(...).get_slice``); norms are read whole.

    Args:
        model: A model of :func:`~chatlearn_mem.models.gpt.build_gpt_model` or a trainer's
            ``model`` (DDP-wrapped) built from :func:`config_from_hf` of the same ``path``. A
            critic's trunk (a value model) takes the embedding and the layers; its head stays new.
        path: The checkpoint directory.
        optimizer: The trainer's megatron optimizer: its fp32 main weights are reloaded from the
            new weights (``reload_model_params``), so training starts from them. Pass it whenever
            the optimizer already exists. A memory manager already attached to the model sees the
            write (the weights' version counters move).

    Returns:
        The bytes read from the files by this rank.

    Raises:
        FileNotFoundError, ValueError: see :func:`config_from_hf`; a tensor missing from the files,
            one the mapping does not know, a shape that does not match config.json or the model,
            a size the tensor-parallel size does not divide, a model built from another config.
    """
    ckpt = _open_checkpoint(path)
    config = _config(ckpt, {})
    family, where = ckpt.family, ckpt.path
    tp, rank = _parallel()
    _check_divisible(config, tp, where)
    lm = _language_model(model)
    _check_model(lm, config, where)
    entries = _entries(config, family)

    # 1. The files hold exactly the family's tensors, in the shapes config.json implies.
    expected = {name: shape for e in entries for name, shape in zip(e.hf, e.shapes)}
    missing = sorted(set(expected) - set(ckpt.tensors))
    if missing:
        raise ValueError(
            f"{where}: tensor {missing[0]} is missing ({len(missing)} missing in all) but config.json's "
            f"{family.architecture} needs it: the files do not match config.json"
        )
    tied_head = config.share_embeddings_and_output_weights and "lm_head.weight" in ckpt.tensors
    extra = sorted(
        n
        for n in ckpt.tensors
        if n not in expected and not _IGNORED.search(n) and not (tied_head and n == "lm_head.weight")
    )
    if extra:
        raise ValueError(
            f"{where}: tensor {extra[0]} is not part of a {family.architecture} with this config.json "
            f"({len(extra)} unknown in all): the files do not match config.json"
        )
    for name, shape in expected.items():
        if ckpt.tensors[name][2] != shape:
            raise ValueError(
                f"{where}: tensor {name} has shape {list(ckpt.tensors[name][2])} but config.json implies "
                f"{list(shape)}: the files do not match config.json"
            )

    # 2. The model holds what the mapping fills, in this rank's shard shapes.
    params = dict(lm.named_parameters())
    unknown = sorted(set(params) - {e.megatron for e in entries})
    if unknown:
        raise ValueError(
            f"the model has parameters the {family.architecture} mapping does not fill ({unknown[0]}, "
            f"{len(unknown)} in all): build it with the local layer spec from config_from_hf(path)"
        )
    todo = []
    for e in entries:
        if e.megatron not in params:
            if e.megatron.startswith("decoder.layers."):
                raise ValueError(f"the model has no {e.megatron}: build it from config_from_hf(path)")
            continue  # a critic's trunk has no final norm nor output layer
        param, shape = params[e.megatron], e.shard_shape(tp)
        if tuple(param.shape) != shape:
            raise ValueError(
                f"model parameter {e.megatron} has shape {list(param.shape)} but {where} gives "
                f"{list(shape)} on each of {tp} tensor-parallel ranks: build the model from config_from_hf(path)"
            )
        todo.append((e, param))

    # 3. Read this rank's slices and write them.
    safe_open = _safetensors().safe_open
    handles: dict[str, Any] = {}
    read = 0
    try:
        with torch.no_grad():
            for e, param in todo:
                pieces = []
                for name in e.hf:
                    file = ckpt.tensors[name][0]
                    if file not in handles:
                        handles[file] = safe_open(file, framework="pt").__enter__()
                    piece = _read_shard(handles[file].get_slice(name), ckpt.tensors[name][2], e.kind, tp, rank)
                    read += piece.numel() * piece.element_size()
                    pieces.append(piece)
                param.copy_(_join_megatron(e, pieces, config, tp).to(param.dtype))
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    if optimizer is not None:
        optimizer.reload_model_params()
    return read


def _read_shard(sl: Any, shape: tuple[int, ...], kind: str, tp: int, rank: int) -> torch.Tensor:
    """Read this rank's slice of one Hugging Face tensor (its whole when not cut)."""
    dim = _SPLIT_DIM[kind]
    if dim is None or tp == 1:
        return sl[:]
    n = shape[dim] // tp
    index = (slice(None),) * dim + (slice(rank * n, (rank + 1) * n),)
    return sl[index]


# -- export ---------------------------------------------------------------------------------------

WeightsArg = Union[torch.nn.Module, Mapping[str, torch.Tensor], Sequence[Mapping[str, torch.Tensor]]]


def _as_state_dicts(weights: WeightsArg) -> list[Mapping[str, torch.Tensor]]:
    if isinstance(weights, torch.nn.Module):
        lm = _language_model(weights)
        # no copy here: every exported tensor is a new one (cat or clone), moved to the CPU one by one
        return [{k: v.detach() for k, v in lm.state_dict().items() if torch.is_tensor(v)}]
    if isinstance(weights, Mapping):
        return [weights]
    return list(weights)


def to_hf_state_dict(weights: WeightsArg, config: GPTTrainerConfig) -> dict[str, torch.Tensor]:
    """Full Hugging Face tensors (on the CPU, in the weights' dtype) of a megatron Llama or Qwen2.

    Args:
        weights: One of: a resident model (its weights are copied, so later training does not
            change the result); a state dict in the model's naming, e.g. a memory manager's
            ``weights_state_dict()``, which a sleeping trainer serves from its host store without
            waking up; or the state dicts of every tensor-parallel rank in rank order (see
            :func:`gather_tensor_parallel`), whose shards are merged.
        config: The trainer's config (:func:`config_from_hf`); it says the family (Qwen2 when
            ``add_qkv_bias``, else Llama) and the head layout.

    Raises:
        ValueError: The config is not a Llama/Qwen2 architecture, or a state dict lacks a tensor,
            has one the mapping does not know, or has a shard of the wrong shape (a single rank's
            state dict of a tensor-parallel model: pass every rank's).
    """
    return dict(iter_hf_weights(weights, config))


def iter_hf_weights(weights: WeightsArg, config: GPTTrainerConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`to_hf_state_dict` one tensor at a time, in the checkpoint's order (embeddings, then
    layer by layer): at most one megatron tensor's Hugging Face tensors exist at once, so that
    feeding an engine (``weights_iterator``) never holds a second copy of the model. Every input
    is checked before the first tensor is yielded. Arguments and errors as :func:`to_hf_state_dict`.
    """
    family = family_of(config)
    shards = _as_state_dicts(weights)
    tp = len(shards)
    _check_divisible(config, tp, "to_hf_state_dict")
    entries = _entries(config, family)
    _check_shards(shards, entries, family, tp)
    return _hf_tensors(shards, entries, config, tp)


def _check_shards(shards: list, entries: list[_Entry], family: Family, tp: int, who: Optional[str] = None) -> None:
    """Every shard dict holds exactly ``entries``' tensors in their shapes on ``tp`` ranks; ``who``
    names a lone shard in the messages (else its tensor-parallel rank)."""
    names = {e.megatron for e in entries}
    label = (lambda r: who) if who else (lambda r: f"tensor-parallel rank {r}")
    for r, sd in enumerate(shards):
        tensors = {k for k, v in sd.items() if torch.is_tensor(v) and not k.endswith("._extra_state")}
        missing, extra = sorted(names - tensors), sorted(tensors - names)
        if missing or extra:
            problem = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the mapping does not know"
            raise ValueError(
                f"the state dict of {label(r)} {problem}: pass the weights of a whole "
                f"{family.architecture} language model built from its config (not a critic's trunk)"
            )
    for e in entries:
        want = e.shard_shape(tp)
        for r, sd in enumerate(shards):
            if tuple(sd[e.megatron].shape) != want:
                raise ValueError(
                    f"{e.megatron} of {label(r)} has shape {list(sd[e.megatron].shape)}, expected "
                    f"{list(want)} for {tp} rank(s): pass the state dicts of every tensor-parallel rank, in order"
                )


def _hf_tensors(
    shards: list, entries: list[_Entry], config: GPTTrainerConfig, tp: int
) -> Iterator[tuple[str, torch.Tensor]]:
    for e in entries:
        per_rank = [_split_megatron(e, sd[e.megatron].detach().cpu(), config, tp) for sd in shards]
        dim = _SPLIT_DIM[e.kind]
        for j, name in enumerate(e.hf):
            if dim is None:
                yield name, per_rank[0][j].clone()
            else:
                yield name, torch.cat([pieces[j] for pieces in per_rank], dim=dim)


def hf_shapes(config: GPTTrainerConfig) -> dict[str, tuple[int, ...]]:
    """The full shape of every Hugging Face tensor of ``config``'s model, by name, in the
    checkpoint's order: what a complete export holds.

    Raises:
        ValueError: The config is not a Llama or Qwen2 architecture.
    """
    return {n: s for e in _entries(config, family_of(config)) for n, s in zip(e.hf, e.shapes)}


def hf_weight_buckets(
    weights: WeightsArg, config: GPTTrainerConfig, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """:func:`iter_hf_weights` in buckets of at most ``bucket_bytes`` (a tensor larger than that is
    a bucket of its own): what an engine's weight update receives per call, so that the host holds
    at most one bucket beside the weights it is made from.

    Raises:
        ValueError: ``bucket_bytes`` is not positive; else as :func:`to_hf_state_dict`.
    """
    _check_bucket_bytes(bucket_bytes)
    return _in_buckets(iter_hf_weights(weights, config), bucket_bytes)  # checks everything now


def hf_named_buckets(
    weights: Mapping[str, torch.Tensor], config: GPTTrainerConfig, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """A model that is already in Hugging Face naming (a ``transformers`` Llama or Qwen2's
    ``state_dict()``, a torch-native trainer's ``iter_weights()``) as :func:`hf_weight_buckets`
    streams a megatron one: every tensor of :func:`hf_shapes` once, in the checkpoint's order, in
    buckets of at most ``bucket_bytes``; a tied output layer's second name (``lm_head.weight``
    beside the embedding) is left out, as a Hugging Face checkpoint leaves it out. Each tensor is
    passed as it is (a view of a host store stays a view). Everything is checked before the first
    bucket is yielded.

    Raises:
        ValueError: ``bucket_bytes`` is not positive, or ``weights`` lacks a tensor of the model,
            holds one it does not know, or one of another shape or dtype than the config's.
    """
    _check_bucket_bytes(bucket_bytes)
    shapes = hf_shapes(config)
    tied = config.share_embeddings_and_output_weights
    names = {k for k, v in weights.items() if torch.is_tensor(v)} - ({"lm_head.weight"} if tied else set())
    missing, extra = sorted(shapes.keys() - names), sorted(names - shapes.keys())
    if missing or extra:
        problem = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the model does not have"
        raise ValueError(
            f"the Hugging Face weights do not match the config's {family_of(config).architecture}: {problem}"
        )
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[config.precision]
    wrong = [
        f"{n}: {tuple(weights[n].shape)} {weights[n].dtype} (want {shape} {dtype})"
        for n, shape in shapes.items()
        if tuple(weights[n].shape) != tuple(shape) or weights[n].dtype != dtype
    ]
    if wrong:
        raise ValueError(f"the Hugging Face weights do not match the config: {wrong[0]}")
    return _in_buckets(((n, weights[n].detach()) for n in shapes), bucket_bytes)


def _check_bucket_bytes(bucket_bytes: int) -> None:
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")


def _in_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``named`` in lists of at most ``bucket_bytes`` (a tensor larger than that alone), lazily."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def megatron_shard_buckets(
    weights: Mapping[str, torch.Tensor], config: GPTTrainerConfig, tp: int, bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """One tensor-parallel rank's own megatron tensors, in the checkpoint's order, in buckets of at
    most ``bucket_bytes`` (a tensor larger than that is a bucket of its own). The boundaries
    depend only on the config and ``tp``, so every rank's stream has the same names in the same
    buckets: :func:`merge_shard_buckets` takes one bucket of each rank at a time. This is how a
    tensor-parallel policy feeds an engine without any process holding a whole copy of the model:
    each rank sends its shards bucket by bucket, and the receiver merges and converts one bucket
    at a time. Every tensor is checked before the first bucket is yielded.

    Raises:
        ValueError: ``bucket_bytes`` is not positive, or ``weights`` is not one rank's state dict
            of ``config``'s model at this ``tp`` (a tensor missing, unknown or of another shape).
    """
    _check_bucket_bytes(bucket_bytes)
    family = family_of(config)
    _check_divisible(config, tp, "megatron_shard_buckets")
    entries = _entries(config, family)
    _check_shards([weights], entries, family, tp, who=f"this rank (of {tp})")  # shard shapes, so sizes too
    return _in_buckets(((e.megatron, weights[e.megatron].detach().cpu()) for e in entries), bucket_bytes)


def merge_shard_buckets(
    steps: Iterable[Sequence[list[tuple[str, torch.Tensor]]]], config: GPTTrainerConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face tensors from the buckets of :func:`megatron_shard_buckets`, taken one bucket of
    every tensor-parallel rank (in rank order) at a time: the same tensors, in the same order, as
    :func:`iter_hf_weights` of the whole state dicts, holding one step's buckets at a time.

    Raises:
        ValueError: The ranks' buckets name different tensors, a shard has the wrong shape, a tensor
            comes twice, or the streams ended before every tensor came (raised at the end).
    """
    family = family_of(config)
    entries = {e.megatron: e for e in _entries(config, family)}
    seen: set[str] = set()
    for step in steps:
        tp = len(step)
        names = [n for n, _ in step[0]]
        for r, bucket in enumerate(step[1:], 1):
            if [n for n, _ in bucket] != names:
                raise ValueError(
                    f"tensor-parallel rank {r}'s bucket names other tensors than rank 0's: the ranks' "
                    "streams must come from megatron_shard_buckets with the same config, tp and bucket size"
                )
        unknown = [n for n in names if n not in entries]
        twice = [n for n in names if n in seen]
        if unknown or twice:
            raise ValueError(f"{(unknown or twice)[0]} {'is not a tensor of this model' if unknown else 'came twice'}")
        seen.update(names)
        shards = [dict(bucket) for bucket in step]
        batch = [entries[n] for n in names]
        _check_shards(shards, batch, family, tp)
        yield from _hf_tensors(shards, batch, config, tp)
    missing = [n for n in entries if n not in seen]
    if missing:
        raise ValueError(
            f"the shard streams ended before {missing[0]} ({len(missing)} tensor(s) missing): an incomplete stream"
        )


def hf_digest(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 over named tensors (name, dtype, shape and bytes of each), whatever their order: equal
    digests mean the same names with bit-identical tensors (what a trainer exported and what an
    engine holds). Consumes an iterator one tensor at a time (:func:`iter_hf_weights`).

    Raises:
        ValueError: A name occurs twice.
    """
    per_name: dict[str, str] = {}
    for name, t in named_tensors:
        if name in per_name:
            raise ValueError(f"hf_digest: {name} occurs twice")
        per_name[name] = _tensor_digest(name, t)
    return _combine(per_name)


def _tensor_digest(name: str, t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
    return h.hexdigest()


def _combine(per_name: Mapping[str, str]) -> str:
    return hashlib.sha256("".join(f"{k}:{v};" for k, v in sorted(per_name.items())).encode()).hexdigest()


def gather_tensor_parallel(weights: Mapping[str, torch.Tensor]) -> Optional[list[dict[str, torch.Tensor]]]:
    """Every tensor-parallel rank's state dict on the group's first rank, in rank order.

    A collective of the tensor-parallel group: every rank of it calls this with its own
    ``weights`` (e.g. ``mm.weights_state_dict()``). Returns the list on tensor-parallel rank 0
    (pass it to :func:`to_hf_state_dict`) and None on the others; ``[weights]`` without tensor
    parallelism.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp, rank = _parallel()
    if tp == 1:
        return [dict(weights)]
    group = parallel_state.get_tensor_model_parallel_group()
    cpu = {k: v.detach().cpu() for k, v in weights.items() if torch.is_tensor(v)}
    out: Optional[list] = [None] * tp if rank == 0 else None
    dist.gather_object(cpu, out, dst=dist.get_global_rank(group, 0), group=group)
    return out


# -- writing a checkpoint directory ---------------------------------------------------------------

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
"""A Hugging Face tokenizer directory's files (those it has), carried beside exported weights."""
_CARRIED_FILES = ("generation_config.json", *TOKENIZER_FILES)
"""Files :func:`save_hf` copies from ``source`` beside the weights, so that an engine can serve them."""

_TORCH_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def hf_config_dict(config: GPTTrainerConfig, source: Optional[Union[str, os.PathLike]] = None) -> dict:
    """The ``config.json`` of a trainer config: ``source``'s config.json (token ids and the rest are
    kept) with every field the trainer defines written over it."""
    family = family_of(config)
    out: dict = {}
    if source is not None:
        with open(os.path.join(_open_checkpoint(source).path, "config.json")) as f:
            out = json.load(f)
    dtype = "bfloat16" if config.precision == "bf16" else "float32"
    rope_theta = config.rotary_base if config.rotary_base is not None else 10000.0
    out.update({key: getattr(config, field) for field, (key, _) in _CONFIG_FIELDS.items()})
    out.update(
        architectures=[family.architecture],
        model_type=family.model_type,
        num_key_value_heads=config.num_query_groups or config.num_attention_heads,
        intermediate_size=config.ffn_hidden_size or 4 * config.hidden_size,
        head_dim=config.hidden_size // config.num_attention_heads,
        hidden_act="silu",
        rope_theta=rope_theta,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        dtype=dtype,
        torch_dtype=dtype,
        **{key: value for key, value in family.unsupported},
    )
    if source is not None:  # the source's context length stays (seq_length is the training length)
        with open(os.path.join(os.fspath(source), "config.json")) as f:
            out["max_position_embeddings"] = json.load(f).get("max_position_embeddings", config.seq_length)
    return out


def save_hf(
    state_dict: Mapping[str, torch.Tensor],
    config: GPTTrainerConfig,
    path: Union[str, os.PathLike],
    source: Optional[Union[str, os.PathLike]] = None,
) -> None:
    """Write ``state_dict`` (from :func:`to_hf_state_dict`) as a Hugging Face directory:
    ``config.json`` and ``model.safetensors``, which ``transformers.AutoModelForCausalLM.
    from_pretrained(path)`` loads.

    Args:
        config: The trainer's config (see :func:`hf_config_dict`).
        path: The directory (created; existing files of these names are replaced).
        source: The checkpoint the trainer was loaded from: its config.json's other keys (token
            ids, ...) and tokenizer and generation files are carried over.

    Raises:
        ValueError: ``state_dict`` is not exactly the family's tensors for this config.
    """
    family = family_of(config)
    expected = set(hf_shapes(config))
    if set(state_dict) != expected:
        odd = sorted(set(state_dict) ^ expected)
        raise ValueError(
            f"save_hf: the state dict does not hold exactly the {family.architecture} tensors of this config "
            f"({odd[0]} {'is missing' if odd[0] in expected else 'is unknown'}): pass to_hf_state_dict(...)"
        )
    for name, t in state_dict.items():
        if t.dtype not in _TORCH_DTYPES:
            raise ValueError(f"save_hf: {name} is {t.dtype}; write bf16 or fp32 tensors")
    _safetensors()
    from safetensors.torch import save_file

    hf = hf_config_dict(config, source)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    if source is not None:
        for name in _CARRIED_FILES:
            src = os.path.join(os.fspath(source), name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(path, name))


def save_hf_stream(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    config: GPTTrainerConfig,
    path: Union[str, os.PathLike],
    source: Optional[Union[str, os.PathLike]] = None,
    max_shard_bytes: int = 4 * 2**30,
) -> dict:
    """Write Hugging Face tensors as they come (from :func:`iter_hf_weights` or
    :func:`merge_shard_buckets`) as a directory ``transformers`` and vLLM load: ``config.json`` and
    ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files of at most
    ``max_shard_bytes`` each (a larger tensor alone) with ``model.safetensors.index.json``. At most
    one file's tensors are held at once.

    Args:
        config: The trainer's config (see :func:`hf_config_dict`).
        path: The directory (created; existing files of these names are replaced).
        source: As in :func:`save_hf`: its config.json's other keys, tokenizer and generation files.

    Returns:
        ``{"files", "tensors", "bytes", "digest"}``; ``digest`` is :func:`hf_digest` of what was written.

    Raises:
        ValueError: The stream is not exactly the family's tensors for this config (a name unknown,
            repeated or missing, a shape other than config.json implies, a dtype other than bf16/fp32).
    """
    family = family_of(config)
    expected = hf_shapes(config)
    _safetensors()
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    per_name: dict[str, str] = {}
    files: list[tuple[str, list[str]]] = []
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        name = f".part-{len(files):05d}.safetensors"  # renamed once the count is known
        save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
        files.append((name, list(shard)))

    for name, t in named_tensors:
        if name in per_name:
            raise ValueError(f"save_hf_stream: {name} came twice")
        if name not in expected:
            raise ValueError(f"save_hf_stream: {name} is not a tensor of a {family.architecture} of this config")
        if tuple(t.shape) != tuple(expected[name]) or t.dtype not in _TORCH_DTYPES:
            raise ValueError(
                f"save_hf_stream: {name} is {t.dtype} {list(t.shape)}; expected bf16 or fp32 {list(expected[name])}"
            )
        t = t.detach().cpu().contiguous()
        n = t.numel() * t.element_size()
        if shard and size + n > max_shard_bytes:
            flush()
            shard, size = {}, 0
        shard[name], size, total = t, size + n, total + n
        per_name[name] = _tensor_digest(name, t)
    missing = [n for n in expected if n not in per_name]
    if missing:
        raise ValueError(f"save_hf_stream: the stream ended before {missing[0]} ({len(missing)} tensor(s) missing)")
    flush()
    count = len(files)
    weight_map = {}
    for i, (part, names) in enumerate(files):
        final = "model.safetensors" if count == 1 else f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        os.replace(os.path.join(path, part), os.path.join(path, final))
        weight_map.update({n: final for n in names})
    if count > 1:
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(config, source), f, indent=2, sort_keys=True)
    if source is not None:
        for name in _CARRIED_FILES:
            src = os.path.join(os.fspath(source), name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(path, name))
    return {"files": count, "tensors": len(per_name), "bytes": total, "digest": _combine(per_name)}


def save_random_hf(config: GPTTrainerConfig, path: Union[str, os.PathLike], seed: int = 0) -> None:
    """Write a randomly initialised Hugging Face checkpoint of ``config``'s family and shape to ``path``.

    Made by ``transformers`` itself (its own initialisation, seeded with ``seed``), in
    ``config.precision``; nothing is downloaded. For tests and demos that need a real checkpoint
    directory without a real model (the PPO app's tiny-Llama preset).

    Raises:
        ImportError: ``transformers`` is not installed (the ``[hf]`` extra).
        ValueError: ``config`` is not a Llama or Qwen2 architecture.
    """
    family = family_of(config)
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"making a Hugging Face checkpoint needs transformers: {INSTALL_HINT}") from e
    fields = {k: v for k, v in hf_config_dict(config).items() if k not in ("architectures", "model_type")}
    fields.pop("torch_dtype", None)
    hf_config = transformers.AutoConfig.for_model(family.model_type, **fields)
    torch.manual_seed(seed)
    model = getattr(transformers, family.architecture)(hf_config)
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # a checkpoint of a few MB: no bar on the caller's console
    try:
        model.to(torch.bfloat16 if config.precision == "bf16" else torch.float32).save_pretrained(os.fspath(path))
    finally:
        if bars:
            transformers.utils.logging.enable_progress_bar()
