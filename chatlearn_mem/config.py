"""Configuration: the memory managers' :class:`MemoryConfig` and the one loader of YAML configs.

:func:`load_config` is what every command of the project uses to build a pydantic config: a
preset name or a YAML file, then dotted ``key=value`` overrides, validated at once, with every
problem listed by its dotted key in one :class:`~chatlearn_mem.errors.ConfigError`.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence, TypeVar, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chatlearn_mem.errors import ConfigError

__all__ = ["DEBUG_GUARD_ENV", "MemoryConfig", "load_config", "parse_overrides", "preset_names", "preset_of"]

M = TypeVar("M", bound=BaseModel)

DEBUG_GUARD_ENV = "CHATLEARN_MEM_DEBUG_GUARD"
"""Environment variable that turns on ``MemoryConfig.debug_guard`` for every manager."""


class MemoryConfig(BaseModel):
    """How the memory managers store offloaded state on the host."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    bucket_size_mb: float = Field(256.0, gt=0)
    """Size of one flat host bucket in MiB. It bounds the largest single host allocation (and
    pinned registration) an offload makes; tensors larger than a bucket span several."""

    pin_memory: Optional[bool] = None
    """Page-lock the host store for fast asynchronous copies. Default (None): pin when CUDA is
    available. Ignored, with a warning, when set to True on a machine without CUDA."""

    skip_unchanged_weights: bool = True
    """On offload, do not copy weights to the host again when the host copy is still current
    (nothing wrote to them since they were onloaded). See the managers' docs for how the
    manager knows; call ``mark_weights_dirty()`` after writing through ``param.data``."""

    copy_chunk_mb: float = Field(16.0, gt=0)
    """Largest single copy in MiB. Transitions move each storage in pieces of at most this size,
    in the order the model reads them, so that a forward pass can start on the first layers
    while later ones are still arriving and a storage is released as soon as its own copies are
    done. Smaller pieces start compute sooner; each costs one more copy call and event."""

    empty_cache: bool = True
    """Return freed blocks to the CUDA driver after an offload (``torch.cuda.empty_cache()``), so
    that reserved memory drops too. No effect without CUDA."""

    cpu_huge_pages: bool = True
    """When the "device" is the CPU (megatron-core on CPU, see ``cpu_backend``), ask Linux for
    transparent huge pages over every storage of 4 MiB or more that onload regrows
    (``madvise(MADV_HUGEPAGE)``). A released storage's memory goes back to the OS; growing it
    again costs one page fault per 4 KiB page on first touch, which made a CPU onload 3x slower
    than the copy itself. No effect on CUDA storages, on other systems or with THP disabled."""

    debug_guard: bool = False
    """Turn any torch operation on a released tensor into an ``OffloadedError`` naming the tensor,
    while anything is offloaded (a ``TorchFunctionMode`` on the thread that offloaded). Costs a
    Python call per torch operation on that thread while a part is offloaded (see the README for
    the measured cost); nothing while everything is resident. ``CHATLEARN_MEM_DEBUG_GUARD=1`` in
    the environment turns it on for every manager."""

    check_host_memory: bool = True
    """Refuse, before anything changes, an offload whose new host buffers would not fit in the host
    memory the process can use (the cgroup limit where there is one, else ``MemAvailable``)
    minus ``host_memory_margin_mb``."""

    host_memory_margin_mb: float = Field(1024.0, ge=0)
    """Host memory in MiB to leave free when checking that an offload's host buffers fit."""

    @property
    def bucket_size_bytes(self) -> int:
        """``bucket_size_mb`` in bytes, rounded down to a multiple of 512."""
        return max(512, int(self.bucket_size_mb * 2**20) // 512 * 512)

    @property
    def copy_chunk_bytes(self) -> int:
        """``copy_chunk_mb`` in bytes, rounded down to a multiple of 512 (at least 512)."""
        return max(512, int(self.copy_chunk_mb * 2**20) // 512 * 512)

    @property
    def host_memory_margin_bytes(self) -> int:
        """``host_memory_margin_mb`` in bytes."""
        return int(self.host_memory_margin_mb * 2**20)

    def resolved_debug_guard(self) -> bool:
        """Whether the debug guard is on: ``debug_guard`` or ``CHATLEARN_MEM_DEBUG_GUARD`` set to
        1/true/yes/on in the environment (read when a manager is created)."""
        env = os.environ.get(DEBUG_GUARD_ENV, "").strip().lower()
        return self.debug_guard or env in ("1", "true", "yes", "on")

    def resolved_pin_memory(self) -> bool:
        """Whether the host store is pinned on this machine."""
        cuda = torch.cuda.is_available()
        if self.pin_memory and not cuda:
            warnings.warn("MemoryConfig.pin_memory=True is ignored: CUDA is not available, so the "
                          "host store uses ordinary memory.", stacklevel=3)
            return False
        return cuda if self.pin_memory is None else self.pin_memory


# -- the config loader -------------------------------------------------------------------------
def _yaml():
    try:
        import yaml
    except ImportError as e:
        raise ImportError("reading YAML configs needs PyYAML: pip install pyyaml (the [ray] and "
                          "[bench] extras of chatlearn-mem include it)") from e
    return yaml


def preset_names(presets: Any) -> list[str]:
    """Names of the ``*.yaml`` files in ``presets`` (a directory path or an importlib resource)."""
    if presets is None:
        return []
    return sorted(f.name[:-5] for f in presets.iterdir() if f.name.endswith(".yaml"))


def parse_overrides(overrides: Sequence[str]) -> dict:
    """Turn ``["a.b=1", "c=x"]`` into ``{"a": {"b": 1}, "c": "x"}`` (values parsed as YAML).

    Raises:
        ConfigError: An item has no ``=``, an empty key, or sets a key both as a value and as a
            section; every bad item is listed.
    """
    yaml = _yaml()
    out: dict = {}
    bad = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not k for k in key.split(".")):
            bad.append(f"{item!r} is not key=value (example: ppo.iterations=5)")
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError:
            value = raw  # not YAML (e.g. an unbalanced bracket): keep the text, validation decides
        node = out
        *parents, leaf = key.split(".")
        for k in parents:
            node = node.setdefault(k, {})
            if not isinstance(node, dict):
                bad.append(f"{item!r}: {k} was already given a value")
                break
        else:
            node[leaf] = value
    if bad:
        raise ConfigError("invalid override(s):\n  " + "\n  ".join(bad))
    return out


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _format(error: ValidationError) -> str:
    lines = []
    for e in error.errors():
        where = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        got = f" (got {e['input']!r})" if e["type"] not in ("missing", "value_error") else ""
        if e["type"] == "extra_forbidden":
            msg, got = "unknown key", ""
        lines.append(f"  {where}: {msg}{got}")
    return f"invalid config ({len(lines)} problem{'s' * (len(lines) != 1)}):\n" + "\n".join(lines)


def _looks_like_a_name(text: str) -> bool:
    return os.sep not in text and "/" not in text and not text.endswith((".yaml", ".yml"))


def preset_of(source: Optional[Union[str, os.PathLike]], presets: Any) -> Optional[str]:
    """The preset ``source`` names, or None when it is a file path (an existing file wins over a
    preset of the same name) or no preset at all. The rule :func:`load_config` reads by."""
    if source is None:
        return None
    text = str(source)
    if Path(text).is_file() or not _looks_like_a_name(text) or text not in preset_names(presets):
        return None
    return text


def _read_source(source: Union[str, os.PathLike], presets: Any) -> dict:
    """The mapping in a preset (by name) or a YAML file (by path)."""
    yaml = _yaml()
    text = str(source)
    preset = preset_of(source, presets)
    if preset is not None:
        where, read = f"preset {preset!r}", (presets / f"{preset}.yaml").read_text
    elif Path(text).is_file():
        where, read = repr(text), Path(text).read_text
    else:
        names = preset_names(presets)
        listing = f"presets: {', '.join(names)}" if names else "no presets"
        if _looks_like_a_name(text):
            raise ConfigError(f"unknown config {text!r}: not a preset and not a file ({listing}; "
                              "or give the path of a YAML file)")
        raise ConfigError(f"config file {text!r} does not exist ({listing})")
    try:
        data = yaml.safe_load(read()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config {where} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {where} must hold a mapping of keys, got {type(data).__name__}")
    return data


def load_config(model: type[M], source: Optional[Union[str, os.PathLike]] = None,
                overrides: Sequence[str] = (), presets: Any = None) -> M:
    """Build a ``model`` from a preset or YAML file plus dotted ``key=value`` overrides.

    Args:
        model: The pydantic model class to validate against.
        source: A preset name (a ``<name>.yaml`` in ``presets``) or the path of a YAML file;
            None starts from the model's defaults.
        overrides: ``dotted.key=value`` strings applied on top; values are parsed as YAML
            (``ppo.iterations=5``, ``memory.enabled=false``, ``methods=[fresh_host_alloc]``).
        presets: Directory (a ``Path`` or an ``importlib.resources`` traversable) of the presets.

    Raises:
        ConfigError: The source is missing or not a YAML mapping, an override is malformed, or
            the result is invalid; the message lists every problem with its dotted key.
    """
    data = _read_source(source, presets) if source is not None else {}
    data = _merge(data, parse_overrides(overrides))
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format(e)) from None
