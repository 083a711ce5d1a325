"""The GPU tier: collected everywhere, run only where CUDA is available, skipped with the reason
otherwise (CI has no GPU). ``python -m pytest tests/gpu`` on a GPU machine, or
``scripts/gpu_validate.sh``, which runs it with the benchmark and a PPO run."""

import gc
import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
REASON = (
    "GPU tier: needs CUDA (torch.cuda.is_available() is False on this machine); run it on a GPU "
    "machine with `python -m pytest tests/gpu` or scripts/gpu_validate.sh"
)

# Reproducible GPU runs, so that "bit-identical to a run without offload" can be judged at all:
# cuBLAS keeps its algorithm choice only with a fixed workspace config, and Transformer Engine
# picks deterministic attention kernels only when told. Both are read when CUDA / TE start.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")


def pytest_collection_modifyitems(config, items):
    ours = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    for item in ours:
        item.add_marker(pytest.mark.gpu)
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason=REASON)
        for item in ours:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _release_device_memory():
    """Each test starts from an emptied allocator: the trainers of the previous test (kept alive by
    reference cycles through their hooks) are collected and their blocks returned."""
    yield
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
