"""Tests of the CPU backend: CUDA device arguments, torch.cuda stand-ins and RNG on a CPU build.

``install()`` is process-global and permanent; every test here installs it (idempotently).
"""

import _thread
import inspect
import os
import textwrap
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


def threads_by_name(started_after: set, deadline_s: float = 20.0) -> tuple:
    """Count this process's threads by name (``/proc/self/task/*/comm``) once every thread started
    since ``started_after`` (thread ids) has named itself, or when ``deadline_s`` seconds have passed
    (0: at once).

    A new thread carries the name of the thread that started it until it has run far enough to set
    its own, which on a loaded machine can be long after the call that started it returned: counted
    at once, gloo's loop threads were 21 of 24 in a CI run. A thread counts as unnamed while it
    carries the caller's name (the caller started the threads). The gloo child runs a copy of this
    function, so it imports what it needs itself.

    Returns:
        ``(counts, unnamed)``: a ``collections.Counter`` of the names, and how many of the new
        threads still carried the caller's name when they were counted (0 unless the deadline
        passed).
    """
    import collections
    import os
    import threading
    import time

    def names() -> dict:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    out[tid] = f.read().strip()
            except (FileNotFoundError, ProcessLookupError):  # it ended between the listing and the read
                pass
        return out

    creator = names()[str(threading.get_native_id())]
    deadline = time.monotonic() + deadline_s
    while True:
        now = names()
        unnamed = sum(name == creator for tid, name in now.items() if tid not in started_after)
        if unnamed == 0 or time.monotonic() >= deadline:
            return collections.Counter(now.values()), unnamed
        time.sleep(0.01)


# run after a copy of threads_by_name
GLOO_CHILD = """
import datetime, os, sys, tempfile, warnings
import torch, torch.distributed as dist
warnings.simplefilter("ignore")
from chatlearn_mem import cpu_backend
from chatlearn_mem.models import gpt

# after the imports (torch's starts a thread that never names itself), before any process group
started_after = set(os.listdir("/proc/self/task"))

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
names, unnamed = threads_by_name(started_after)
backends = [pg._get_backend(torch.device("cpu")) for pg in dist.distributed_c10d._world.pg_map]
timeouts = sorted({b.options._timeout.total_seconds() for b in backends})
print(names["gloo_tcp_loop"], unnamed, len(backends), float(t.sum()), ",".join(str(int(s)) for s in timeouts))
gpt.shutdown_distributed()
"""


def _gloo_child(how: str, env: dict) -> tuple[int, int, float, str]:
    """Run GLOO_CHILD; returns its gloo loop threads, process groups, all-reduced sum and timeouts."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(inspect.getsource(threads_by_name)) + GLOO_CHILD, how],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **env},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    loops, unnamed, groups, total, timeouts = out.stdout.split()[-5:]
    # a thread still unnamed could be one more loop thread: counted without it, "exactly one" could
    # pass for a device per group
    assert unnamed == "0", f"{unnamed} threads the process groups started had not named themselves in 20 s"
    return int(loops), int(groups), float(total), timeouts


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")


def _name_this_thread(name: bytes) -> None:
    import ctypes

    assert ctypes.CDLL(None, use_errno=True).prctl(15, name, 0, 0, 0) == 0  # 15: PR_SET_NAME


def _start_raw_thread(body) -> threading.Event:
    """Start ``body`` on a thread that sets no OS name of its own (Python 3.14's threading.Thread
    names its threads as they start); returns an event set when it ends."""
    ended = threading.Event()

    def run():
        try:
            body()
        finally:
            ended.set()

    _thread.start_new_thread(run, ())
    return ended


@needs_proc
def test_threads_are_counted_once_each_new_one_has_named_itself():
    """A thread that names itself late (gloo's loop thread on a loaded machine) is counted under its
    own name: the count waits for it. Read at once, as the gloo tests once did, it is missing."""
    started_after = set(os.listdir("/proc/self/task"))
    go, counted = threading.Event(), threading.Event()

    def names_itself_late():
        go.wait(10)
        _name_this_thread(b"late_namer")
        counted.wait(10)  # alive until counted: a thread that ended is not listed

    ended = _start_raw_thread(names_itself_late)
    try:
        names, unnamed = threads_by_name(started_after, deadline_s=0)  # the race, held open
        assert names["late_namer"] == 0 and unnamed == 1
        go.set()
        names, unnamed = threads_by_name(started_after, deadline_s=10)
        assert names["late_namer"] == 1 and unnamed == 0
    finally:
        go.set()
        counted.set()
    assert ended.wait(10)


@needs_proc
def test_a_thread_that_never_names_itself_is_reported_at_the_deadline():
    """The wait ends at its deadline and says how many new threads were still unnamed, so that a
    count cannot pass for complete when it is not."""
    started_after = set(os.listdir("/proc/self/task"))
    counted = threading.Event()
    ended = _start_raw_thread(lambda: counted.wait(10))
    try:
        _, unnamed = threads_by_name(started_after, deadline_s=0.2)
    finally:
        counted.set()
    assert unnamed == 1
    assert ended.wait(10)


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


IMPORT_CHILD = """
import sys, tempfile, torch
compile_ = torch.compile
from chatlearn_mem import cpu_backend
from chatlearn_mem.models import gpt
assert "megatron.core" not in sys.modules
if sys.argv[1] == "install":
    cpu_backend.install(quiet=True)
else:  # the backend installed by init_distributed, as the actors and the benchmark do
    gpt.init_distributed(init_method=f"file://{tempfile.mkdtemp()}/init", cpu_backend=True)
from megatron.core import jit
print("megatron.core" in sys.modules, "torch._dynamo" in sys.modules, torch.compile is compile_,
      jit.jit_fuser(len) is len)
"""


@pytest.mark.parametrize("how", ["install", "init_distributed"])
def test_megatron_imported_by_the_backend_decorates_nothing_with_torch_compile(how):
    """The backend on before megatron's first import: megatron's fused kernels are not
    torch.compile'd (none runs on the CPU backend; the decorations alone cost ~2 s of every
    process's start) and torch.compile is torch's own again afterwards."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", IMPORT_CHILD, how], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True", "False", "True", "True"], out.stderr[-2000:]
