"""The ``chatlearn-mem`` command line (installed as ``chatlearn_mem_cli``).

- :mod:`chatlearn_mem_cli.app`: the typer app (``ppo``, ``bench``, ``bench-report``, ``presets``).
- :mod:`chatlearn_mem_cli.__main__`: the console script (``chatlearn-mem``,
  ``python -m chatlearn_mem_cli``).

The top layer: it imports the PPO app, the benchmark and the config loader
(``chatlearn_mem_config_files``), and nothing imports it. Nothing is imported here, so that
``python -m chatlearn_mem_cli`` can say what to install when typer is missing.
"""

__all__: list[str] = []
