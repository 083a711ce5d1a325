"""A trainer's config and where its architecture comes from: :class:`TrainerModelConfig` (a
:class:`~chatlearn_mem.models.gpt.GPTTrainerConfig` and the Hugging Face checkpoint its weights
start from), and the rule that makes a user's checkpoint work in any preset
(:func:`checkpoint_decides`).

With ``from_hf`` the checkpoint's ``config.json`` decides the architecture: a preset's shape
fields that contradict it give way (said on the run's console), and only the fields a user set
(on the command line, or in their own YAML) are held against it, one error naming each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Literal, Optional

from pydantic import model_validator

from chatlearn_mem.models.gpt import GPTTrainerConfig

__all__ = ["TrainerModelConfig", "architecture_line", "checkpoint_decides", "export_problem"]


class TrainerModelConfig(GPTTrainerConfig):
    """A trainer's :class:`~chatlearn_mem.models.gpt.GPTTrainerConfig`, and the Hugging Face
    checkpoint its weights start from."""

    from_hf: Optional[Path] = None
    """A local Hugging Face Llama or Qwen2 checkpoint directory (``config.json`` and
    ``*.safetensors``) the weights start from instead of a random init; ``{output_dir}`` in it
    stands for the run's ``output_dir``. Its ``config.json`` decides the architecture fields (see
    ``chatlearn_mem.models.hf.CHECKPOINT_FIELDS``): those left unset are filled in, a preset's that
    differ give way to it, and one the user set to another value is an error. The rollout and
    reference models start from the policy's checkpoint; the critic takes its trunk and a fresh
    value head. With several nodes the directory must be readable on every node."""
    create_hf: bool = False
    """When ``from_hf`` does not exist yet, write a randomly initialised checkpoint of this
    config's architecture there (with ``transformers``: nothing is downloaded) before the actors
    start; the architecture fields must then be given here. Used by the ``cpu_tiny_llama`` preset."""
    backend: Literal["megatron", "torch"] = "megatron"
    """Which framework builds and trains the model. ``megatron``: megatron-core's GPT in its DDP with
    its optimizer. ``torch``: a Hugging Face Llama or Qwen2 (``transformers``) built from these
    fields (or loaded from ``from_hf``), trained with torch's AdamW (``lr``, gradients clipped at
    ``clip_grad``), in torch's ``DistributedDataParallel`` over several data-parallel ranks, under
    the torch-native memory manager (docs/torch-native.md); its actors never import megatron. It
    needs the Llama fields (``normalization: RMSNorm``, ``activation: swiglu``,
    ``position_embedding: rope``, ``add_bias_linear: false``; ``add_qkv_bias: true`` for Qwen2), an
    LM head, and data parallelism only. A model copied from it (the rollout, the reference) is
    built the same way."""

    @model_validator(mode="after")
    def _torch_needs_a_hugging_face_architecture(self):
        if self.backend != "torch":
            return self
        from chatlearn_mem.models import hf

        try:
            hf.family_of(self)
        except ValueError as e:
            raise ValueError(f"backend: torch builds a Hugging Face Llama or Qwen2: {e}") from None
        if self.num_moe_experts is not None:
            raise ValueError(
                f"backend: torch has no MoE layers; num_moe_experts must be unset, got {self.num_moe_experts}"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _fields_from_checkpoint(cls, data):
        if not isinstance(data, dict) or not data.get("from_hf"):
            return data
        found = _checkpoint_config(data)
        if found is None:
            return data  # written when the run starts, from the fields given here
        data = dict(data)
        wrong = []
        for field in (*_fields(), "precision"):
            value = getattr(found, field)
            if field not in data:
                data[field] = value
            elif field != "precision" and data[field] != value:
                wrong.append(f"{field}={data[field]!r} (config.json: {value!r})")
        if wrong:
            raise ValueError(
                f"the checkpoint {data['from_hf']} says otherwise: {', '.join(wrong)}; drop these keys (from_hf "
                "fills them in)"
            )
        return data


def _fields() -> tuple[str, ...]:
    from chatlearn_mem.models import hf

    return hf.CHECKPOINT_FIELDS


def _checkpoint_config(section: dict) -> Optional[GPTTrainerConfig]:
    """The architecture ``section``'s ``from_hf`` holds; None when it is to be written
    (``create_hf`` and not there yet).

    Raises:
        ValueError: No such checkpoint (or not one we read), said as :func:`~chatlearn_mem.models.hf.config_from_hf` says.
    """
    path = Path(section["from_hf"])
    if not path.exists() and section.get("create_hf"):
        return None
    try:
        from chatlearn_mem.models import hf

        return hf.config_from_hf(path)
    except (FileNotFoundError, ImportError) as e:
        raise ValueError(str(e)) from None


def checkpoint_decides(data: dict, sections: Iterable[str], user_keys: Optional[set[str]]) -> tuple[dict, list[str]]:
    """Let each model section's ``from_hf`` checkpoint decide its architecture over values the user
    did not set (a preset's): those fields are dropped from ``data``, so the checkpoint fills them.

    Args:
        data: The config as read (sections as dicts), before validation.
        sections: The model sections (``policy``, ``critic``).
        user_keys: Dotted keys the user set (command line, own YAML file); None: every key is the
            user's (a config built in Python), and nothing gives way.

    Returns:
        ``(data, notes)``: the data with the preset's contradicting fields left out, and one line
        per section that gave way, naming the fields and the checkpoint.
    """
    if user_keys is None:
        return data, []
    notes = []
    for role in sections:
        section = data.get(role)
        if not isinstance(section, dict) or not section.get("from_hf"):
            continue
        try:
            found = _checkpoint_config(section)
        except ValueError:
            continue  # the section's own validation says what is wrong with the path
        if found is None:
            continue
        gave_way = [
            f for f in _fields() if f in section and section[f] != getattr(found, f) and f"{role}.{f}" not in user_keys
        ]
        if gave_way:
            data = {**data, role: {k: v for k, v in section.items() if k not in gave_way}}
            said = ", ".join(f"{f}={section[f]!r} -> {getattr(found, f)!r}" for f in gave_way)
            notes.append(f"{role}: the preset's {said} gave way to {Path(section['from_hf']) / 'config.json'}")
    return data, notes


def architecture_line(role: str, model: GPTTrainerConfig) -> str:
    """``policy: LlamaForCausalLM from ckpt/config.json: 2 layers, hidden 128, ...`` (from_hf set)."""
    try:
        from chatlearn_mem.models import hf

        name = hf.family_of(model).architecture
    except (ImportError, ValueError):
        name = "GPT"
    groups = model.num_query_groups or model.num_attention_heads
    return (
        f"{role}: {name} from {Path(model.from_hf) / 'config.json'}: {model.num_layers} layers, hidden "
        f"{model.hidden_size}, {model.num_attention_heads} heads ({groups} key/value), ffn "
        f"{model.ffn_hidden_size or 4 * model.hidden_size}, vocabulary {model.vocab_size}, {model.precision}"
    )


def export_problem(model: GPTTrainerConfig) -> Optional[str]:
    """Why ``model`` cannot be exported as a Hugging Face directory, or None when it can."""
    try:
        from chatlearn_mem.models import hf
    except ImportError as e:
        return f"exporting needs the [hf] extra ({e})"
    names = " and ".join(hf.FAMILIES)
    try:
        hf.family_of(model)
    except ValueError:
        return (
            f"the policy is a GPT of megatron's own (normalization={model.normalization}, activation="
            f"{model.activation}, position_embedding={model.position_embedding}); the architectures that export to "
            f"Hugging Face are {names}"
        )
    if model.num_moe_experts:
        return f"a mixture-of-experts policy does not export (only dense {names})"
    return None
