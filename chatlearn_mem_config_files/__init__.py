"""The one loader of YAML configs (installed as ``chatlearn_mem_config_files``).

Below both the PPO app (``chatlearn_mem_ray``) and the benchmark (``chatlearn_mem_bench``), whose
own ``load_config`` call :func:`load_config` with their model and presets; the command line
builds on all three. It needs pydantic and, when a config is read, PyYAML;
nothing of Ray, typer or megatron. The library (``chatlearn_mem``) never reads YAML.
"""

from chatlearn_mem_config_files.loader import (
    load_config,
    parse_overrides,
    preset_description,
    preset_names,
    preset_of,
)

__all__ = ["load_config", "parse_overrides", "preset_description", "preset_names", "preset_of"]
