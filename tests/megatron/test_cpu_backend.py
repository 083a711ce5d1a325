"""Tests of the CPU backend: CUDA device arguments, torch.cuda stand-ins and RNG on a CPU build.

``install()`` is process-global and permanent; every test here installs it (idempotently).
"""

import threading

import pytest
import torch

from chatlearn_mem import cpu_backend

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU backend is for CPU-only builds")


@pytest.fixture(autouse=True)
def installed():
    assert cpu_backend.install() is True
    assert cpu_backend.is_installed()


def test_install_is_idempotent():
    assert cpu_backend.install() is True
    assert cpu_backend.install() is True
    assert torch.empty(1, device="cuda").device.type == "cpu"


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(3, device="cuda"),
        lambda: torch.zeros(2, device=torch.cuda.current_device()),
        lambda: torch.ones(2, device="cuda:0"),
        lambda: torch.empty(2, device=torch.device("cuda", 0)),
        lambda: torch.ones(2).cuda(),
        lambda: torch.ones(2).cuda(torch.cuda.current_device()),
        lambda: torch.ones(2).to("cuda"),
        lambda: torch.ones(2).to(device=torch.cuda.current_device()),
        lambda: torch.ones(2).new_zeros(3, device="cuda"),
    ],
    ids=[
        "empty-str",
        "zeros-index",
        "ones-cuda0",
        "empty-device",
        "cuda()",
        "cuda(index)",
        "to-str",
        "to-index-kw",
        "new_zeros",
    ],
)
def test_cuda_device_arguments_give_cpu_tensors(make):
    t = make()
    assert t.device.type == "cpu"


def test_to_positional_device_index():
    # regression: a positional index (cuda:N) used to reach torch and fail on a CPU build
    assert torch.ones(2).to(torch.cuda.current_device()).device.type == "cpu"


def test_values_survive_cuda_moves():
    t = torch.arange(5, dtype=torch.float32)
    assert torch.equal(t.cuda(), t)
    assert torch.equal(t.to("cuda", torch.float16), t.half())


def test_pin_memory_is_dropped():
    t = torch.empty(2, pin_memory=True)
    assert t.device.type == "cpu" and not t.is_pinned()
    src = torch.arange(4.0)
    pinned = src.pin_memory()
    assert torch.equal(pinned, src)
    assert pinned.data_ptr() != src.data_ptr()


@pytest.mark.parametrize(
    "dtype, name",
    [
        (torch.bfloat16, "torch.cuda.BFloat16Tensor"),
        (torch.float32, "torch.cuda.FloatTensor"),
        (torch.float16, "torch.cuda.HalfTensor"),
        (torch.int64, "torch.cuda.LongTensor"),
    ],
)
def test_type_reports_cuda_names(dtype, name):
    assert torch.ones(2, dtype=dtype).type() == name


def test_type_with_dtype_still_converts():
    t = torch.tensor([1.5, -2.25])
    out = t.type(torch.float64)
    assert out.dtype == torch.float64
    assert torch.equal(out, torch.tensor([1.5, -2.25], dtype=torch.float64))


def test_streams_and_events_are_no_ops():
    s = torch.cuda.Stream()
    e = torch.cuda.Event(enable_timing=True)
    e.record()
    s.wait_event(e)
    s.wait_stream(torch.cuda.current_stream())
    assert s.record_event() is not None
    e.synchronize()
    assert e.query() and s.query()
    assert e.elapsed_time(torch.cuda.Event()) == 0.0
    t = torch.ones(3)
    with torch.cuda.stream(torch.cuda.Stream()):
        t = t * 2
    torch.cuda.synchronize()
    assert torch.equal(t, torch.full((3,), 2.0))
    assert torch.cuda.current_device() == 0
    assert torch.cuda.memory_allocated() == 0


def test_cuda_seed_seeds_the_cpu_generator():
    torch.manual_seed(5)
    expected = torch.get_rng_state()
    torch.manual_seed(11)
    torch.cuda.manual_seed(5)
    assert torch.equal(torch.cuda.get_rng_state(), expected)
    state = torch.cuda.get_rng_state()
    a = torch.rand(4)
    torch.cuda.set_rng_state(state)
    assert torch.equal(torch.rand(4), a)


def test_seeding_does_not_grow_lazy_call_queue():
    before = len(torch.cuda._queued_calls)
    for i in range(1000):
        torch.cuda.manual_seed(i)
        torch.cuda.manual_seed_all(i)
        torch.manual_seed(i)
    assert len(torch.cuda._queued_calls) == before


def test_megatron_tracker_fork_uses_seeded_stream():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    torch.manual_seed(7)
    expected_fork = torch.rand(3)
    torch.manual_seed(123)
    torch.rand(2)
    expected_after = torch.rand(3)

    torch.manual_seed(123)
    tracker = CudaRNGStatesTracker()
    tracker.add("a", 7)
    torch.rand(2)
    with tracker.fork("a"):
        drawn = torch.rand(3)
    after = torch.rand(3)
    assert torch.equal(drawn, expected_fork)
    assert torch.equal(after, expected_after)
    # A second fork continues the tracked stream where the first left off.
    torch.manual_seed(7)
    torch.rand(3)
    expected_next = torch.rand(3)
    with tracker.fork("a"):
        assert torch.equal(torch.rand(3), expected_next)


def test_cuda_device_arguments_work_in_other_threads():
    # regression: the mode used to be active on the installing thread only
    result = {}

    def worker():
        try:
            result["device"] = torch.empty(3, device="cuda").device.type
        except BaseException as e:  # noqa: BLE001 - reported below
            result["error"] = repr(e)

    t = threading.Thread(target=worker)
    t.start()
    t.join(timeout=10)
    assert result == {"device": "cpu"}


def test_moe_router_gate_runs_without_transformer_engine():
    # megatron-core 0.13 and 0.16 import te_general_gemm only when Transformer Engine is
    # installed, yet the router's gating function reads it unconditionally (NameError).
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.moe import moe_utils

    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(4, 8, requires_grad=True)
    try:
        out = moe_utils.router_gating_linear(x, w, None, torch.float32)  # 0.16: (inp, weight, bias, dtype)
    except TypeError:
        out = moe_utils.router_gating_linear(x, w, torch.float32)  # 0.13: (inp, weight, dtype)
    assert torch.allclose(out, x @ w.t())
    out.sum().backward()
    assert torch.allclose(w.grad, x.detach().sum(0).expand(4, 8))


class _AllocatesInBackward(torch.autograd.Function):
    """Like megatron's gather/scatter mappings: the backward allocates on the current CUDA device."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        out = torch.empty(grad.shape, dtype=grad.dtype, device=torch.cuda.current_device())
        return out.copy_(grad * 2)


@pytest.mark.parametrize(
    "run",
    [
        lambda y, x: y.sum().backward(),
        lambda y, x: torch.autograd.backward([y.sum()]),
        lambda y, x: setattr(x, "grad", torch.autograd.grad(y.sum(), x)[0]),
    ],
    ids=["Tensor.backward", "autograd.backward", "autograd.grad"],
)
def test_backward_passes_run_under_the_mode(run):
    # A torch function mode is switched off while its own handler runs, so a backward pass
    # started through the mode ran every Python backward without it (MoE's all-gather
    # dispatcher allocates with device=torch.cuda.current_device() in its backward).
    x = torch.ones(3, requires_grad=True)
    run(_AllocatesInBackward.apply(x), x)
    assert torch.equal(x.grad, torch.full((3,), 2.0))


GLOO_CHILD = """
import datetime, os, sys, tempfile, warnings
import torch, torch.distributed as dist
warnings.simplefilter("ignore")
from chatlearn_mem import cpu_backend
from chatlearn_mem.models import gpt

if sys.argv[1] == "group-first":  # a default group before the backend: torch's class is left alone
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/init", rank=0, world_size=1)
cpu_backend.install(quiet=True)
gpt.init_distributed(init_method=f"file://{tempfile.mkdtemp()}/init", cpu_backend=True)
if sys.argv[1] == "timeout":
    dist.new_group([0], timeout=datetime.timedelta(seconds=7))
from megatron.core import parallel_state as ps

t = torch.ones(4)
dist.all_reduce(t, group=ps.get_data_parallel_group())
dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
dist.all_reduce(t, group=ps.get_data_parallel_group_gloo())
loops = sum(
    open(f"/proc/self/task/{tid}/comm").read().strip() == "gloo_tcp_loop" for tid in os.listdir("/proc/self/task")
)
backends = [pg._get_backend(torch.device("cpu")) for pg in dist.distributed_c10d._world.pg_map]
timeouts = sorted({b.options._timeout.total_seconds() for b in backends})
print(loops, len(backends), float(t.sum()), ",".join(str(int(s)) for s in timeouts))
gpt.shutdown_distributed()
"""


def _gloo_child(how: str, env: dict) -> tuple[int, int, float, str]:
    import os
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", GLOO_CHILD, how],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loops, groups, total, timeouts = out.stdout.split()[-4:]
    return int(loops), int(groups), float(total), timeouts


needs_proc = pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="counts threads in /proc")


@needs_proc
def test_megatrons_gloo_groups_share_one_polling_thread():
    # torch gives each gloo group a transport device whose thread wakes every 10 ms; megatron makes
    # about twenty groups: one thread for all of them once the backend is installed
    loops, groups, total, timeouts = _gloo_child("default", {})
    assert groups >= 10 and loops == 1
    assert total == 4.0  # the collectives on three of the groups ran (one rank: the sum is unchanged)
    assert timeouts == "1800"  # torch's default timeout, as without the shared device


@needs_proc
def test_the_shared_gloo_device_can_be_turned_off_and_keeps_each_groups_timeout():
    loops, groups, _, _ = _gloo_child("default", {cpu_backend.SHARED_GLOO_DEVICE_ENV: "0"})
    assert loops == groups  # torch's default: a device (and its thread) per group
    loops, _, _, timeouts = _gloo_child("timeout", {})
    assert loops == 1 and timeouts == "7,1800"


@needs_proc
def test_a_default_group_made_before_the_backend_keeps_torchs_gloo_class():
    # a subclass swapped in afterwards would fail torch's isinstance checks for the groups made before
    loops, groups, total, _ = _gloo_child("group-first", {})
    assert loops == groups and total == 4.0


@pytest.mark.parametrize(
    "value, on", [(None, True), ("1", True), ("0", False), ("False", False), (" off ", False), ("no", False)]
)
def test_the_shared_gloo_device_switch_reads_the_environment_as_the_other_switches_do(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(cpu_backend.SHARED_GLOO_DEVICE_ENV, raising=False)
    else:
        monkeypatch.setenv(cpu_backend.SHARED_GLOO_DEVICE_ENV, value)
    assert cpu_backend._sharing_gloo_device_by_env() is on
