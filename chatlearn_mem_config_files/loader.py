"""The one loader of YAML configs, shared by the PPO app and the benchmark (``chatlearn-mem ppo``
and ``chatlearn-mem bench``).

:func:`load_config` builds a pydantic config from a preset name or a YAML file, then dotted
``key=value`` overrides, validated at once, with every problem listed by its dotted key in one
:class:`~chatlearn_mem.errors.ConfigError`. The PPO app's and the benchmark's own ``load_config``
call it with their model and presets. PyYAML is imported only when a config is read (the
``[ray]`` and ``[bench]`` extras install it; the core library never reads YAML).
"""

from __future__ import annotations

import difflib
import os
import typing
from pathlib import Path
from typing import Any, Optional, Sequence, TypeVar, Union

from pydantic import BaseModel, ValidationError

from chatlearn_mem.errors import ConfigError

__all__ = ["load_config", "parse_overrides", "preset_description", "preset_names", "preset_of"]

M = TypeVar("M", bound=BaseModel)


def _yaml():
    try:
        import yaml
    except ImportError as e:
        raise ImportError(
            "reading YAML configs needs PyYAML: pip install pyyaml (the [ray] and "
            "[bench] extras of chatlearn-mem include it)"
        ) from e
    return yaml


def preset_names(presets: Any) -> list[str]:
    """Names of the ``*.yaml`` files in ``presets`` (a directory path or an importlib resource)."""
    if presets is None:
        return []
    return sorted(f.name[:-5] for f in presets.iterdir() if f.name.endswith(".yaml"))


def preset_description(presets: Any, name: str) -> str:
    """The one-line summary of preset ``name``: the first line of its YAML when that line is a
    comment (``# ...``), without the ``#``; an empty string otherwise."""
    first = (presets / f"{name}.yaml").read_text().partition("\n")[0]
    return first[1:].strip() if first.startswith("#") else ""


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


def _leaf_types(annotation: Any) -> list:
    args = typing.get_args(annotation)
    return [t for a in args for t in _leaf_types(a)] if args else [annotation]


def _section(model: type[BaseModel], path: Sequence) -> Optional[type[BaseModel]]:
    """The model of the config section at ``path`` (field names from ``model`` down), or None
    where the path leaves the models (a list index, a mapping, a union of several models)."""
    for name in path:
        field = model.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            return None
        models = [t for t in _leaf_types(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)]
        if len(models) != 1:
            return None
        model = models[0]
    return model


def _did_you_mean(model: type[BaseModel], loc: tuple) -> str:
    """`` (did you mean a.b?)`` for an unknown key ``loc`` close to a field of its section, else ''."""
    *parents, leaf = loc
    section = _section(model, parents)
    if section is None or not isinstance(leaf, str):
        return ""
    close = difflib.get_close_matches(leaf, list(section.model_fields), n=1)
    return f" (did you mean {'.'.join([*map(str, parents), close[0]])}?)" if close else ""


def _format(error: ValidationError, model: type[BaseModel]) -> str:
    lines = []
    for e in error.errors():
        where = ".".join(str(x) for x in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        got = f" (got {e['input']!r})" if e["type"] not in ("missing", "value_error") else ""
        if e["type"] == "extra_forbidden":
            msg, got = "unknown key" + _did_you_mean(model, tuple(e["loc"])), ""
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
            raise ConfigError(
                f"unknown config {text!r}: not a preset and not a file ({listing}; or give the path of a YAML file)"
            )
        raise ConfigError(f"config file {text!r} does not exist ({listing})")
    try:
        data = yaml.safe_load(read()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config {where} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {where} must hold a mapping of keys, got {type(data).__name__}")
    return data


def load_config(
    model: type[M], source: Optional[Union[str, os.PathLike]] = None, overrides: Sequence[str] = (), presets: Any = None
) -> M:
    """Build a ``model`` from a preset or YAML file plus dotted ``key=value`` overrides.

    Args:
        model: The pydantic model class to validate against.
        source: A preset name (a ``<name>.yaml`` in ``presets``) or the path of a YAML file;
            None starts from the model's defaults.
        overrides: ``dotted.key=value`` strings applied on top; values are parsed as YAML
            (``ppo.iterations=5``, ``memory.enabled=false``, ``methods=[fresh_host_alloc]``).
        presets: Directory (a ``Path`` or an ``importlib.resources`` traversable) of the presets.

    The model is validated with ``context={"user_keys": ...}``: the dotted keys the user set
    (``overrides``, and a YAML file of their own, not a preset), for validators that let a
    preset's values give way.

    Raises:
        ConfigError: The source is missing or not a YAML mapping, an override is malformed, or
            the result is invalid; the message lists every problem with its dotted key, and
            suggests the nearest known key for an unknown one.
    """
    data = _read_source(source, presets) if source is not None else {}
    updates = parse_overrides(overrides)
    # what the user set (their own file, the command line) as against what a preset set: a model's
    # validators may let a preset's values give way (a checkpoint's architecture over a preset's)
    user_keys = _dotted(updates) | (_dotted(data) if preset_of(source, presets) is None else set())
    data = _merge(data, updates)
    try:
        return model.model_validate(data, context={"user_keys": user_keys})
    except ValidationError as e:
        raise ConfigError(_format(e, model)) from None


def _dotted(data: dict, prefix: str = "") -> set[str]:
    """Every key of a nested mapping, dotted (``{"a": {"b": 1}}`` -> ``{"a", "a.b"}``)."""
    out = set()
    for k, v in data.items():
        out.add(f"{prefix}{k}")
        if isinstance(v, dict):
            out |= _dotted(v, f"{prefix}{k}.")
    return out
