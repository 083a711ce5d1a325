"""Memory benchmarks for chatlearn-mem: ``python -m benchmarks`` (see benchmarks/README.md).

``main(argv)`` is the command-line entry point; :class:`BenchConfig` holds every parameter.
"""

from benchmarks.config import BenchConfig, load_config
from benchmarks.run import PARTS, main, run_benchmark

__all__ = ["BenchConfig", "load_config", "main", "run_benchmark", "PARTS"]
