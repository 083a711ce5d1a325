"""Memory benchmarks for chatlearn-mem (installed as ``chatlearn_mem_bench``): ``chatlearn-mem bench``.

:class:`BenchConfig` holds every parameter (presets in the repository's ``configs/bench/``);
:func:`run_benchmark` measures and returns the results; :func:`run_and_report` also writes the
JSON, markdown and PNG and prints the targets. See benchmarks/README.md.
"""

from chatlearn_mem_bench.config import BenchConfig, load_config
from chatlearn_mem_bench.run import PARTS, run_and_report, run_benchmark

__all__ = ["BenchConfig", "PARTS", "load_config", "run_and_report", "run_benchmark"]
