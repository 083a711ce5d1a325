"""Benchmark presets (YAML). Installed as ``chatlearn_mem_bench.presets``; ``chatlearn-mem bench --config NAME``."""
