"""Shared fixtures: one world-size-1 gloo process group per test session."""

import os
import sys
import warnings

import pytest

sys.path.insert(
    0, os.path.dirname(__file__)
)  # trainer_runs is importable from every tier (and, through spawn, in the workers)


@pytest.fixture(scope="session")
def dist1(tmp_path_factory):
    """megatron-core initialised for one rank (gloo on CPU)."""
    from chatlearn_mem.models import gpt

    init_file = tmp_path_factory.mktemp("dist") / "init"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gpt.init_distributed(init_method=f"file://{init_file}", cpu_backend=True)
    yield
    gpt.shutdown_distributed()  # before the exit: a NCCL group left to it (GPU tier) holds it up


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray cluster for the module (the runs join it instead of starting their own)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("CI", "").lower() == "true":
        skip = pytest.mark.skip(reason="slow test; skipped when CI=true")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


def pytest_report_header(config):
    # The installed distribution's version, read without importing megatron (which takes seconds
    # and would put megatron into every tier, the megatron-free unit tier included).
    from importlib.metadata import PackageNotFoundError, version

    try:
        __version__ = version("megatron-core")
    except PackageNotFoundError:
        __version__ = "not installed"
    import torch

    return f"megatron-core {__version__}, torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
