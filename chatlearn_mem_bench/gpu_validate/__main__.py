"""``python -m chatlearn_mem_bench.gpu_validate``: the GPU validation (see the package's docstring)."""

import sys

from chatlearn_mem_bench.gpu_validate.cli import main

if __name__ == "__main__":
    sys.exit(main())
