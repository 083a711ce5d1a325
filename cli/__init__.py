"""The ``chatlearn-mem`` command line (installed as ``chatlearn_mem_cli``).

- :mod:`chatlearn_mem_cli.app`: the typer app (``ppo``, ``bench``, ``bench-report``, ``presets``).
- :mod:`chatlearn_mem_cli.config_files`: the one loader of YAML configs and ``key=value``
  overrides, which the PPO app's and the benchmark's ``load_config`` use.
- :mod:`chatlearn_mem_cli.__main__`: the console script (``chatlearn-mem``,
  ``python -m chatlearn_mem_cli``).

Nothing is imported here, so that the config loader is usable without typer, Ray or the benchmark.
"""

__all__: list[str] = []
