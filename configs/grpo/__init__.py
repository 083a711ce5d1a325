"""GRPO run presets (YAML). Installed as ``chatlearn_mem_ray.grpo_presets``; ``chatlearn-mem grpo --config NAME``."""
