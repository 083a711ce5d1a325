"""PPO run presets (YAML). Installed as ``chatlearn_mem_ray.presets``; ``chatlearn-mem ppo --config NAME``."""
