"""The CUDA lanes' bookkeeping without a GPU: torch.cuda's streams and events replaced by recording
fakes, so that the order in which a CUDA lane enqueues work, waits, records events and skips after
a failure is checked in CI (the GPU tier runs the real thing)."""

import contextlib

import pytest
import torch

from chatlearn_mem import TransferError
from chatlearn_mem.copy_engine import Action, Batch, CopyEngine, Job


class FakeStream:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")

    def wait_event(self, event):
        self.log.append(f"{self.name} waits for event {event.id}")


class FakeEvent:
    count = 0

    def __init__(self, log, current):
        FakeEvent.count += 1
        self.id, self.log, self.current, self.done = FakeEvent.count, log, current, True

    def record(self, stream=None):
        self.log.append(f"event {self.id} on {(stream or self.current[0]).name}")

    def query(self):
        return self.done

    def synchronize(self):
        self.log.append(f"host waits for event {self.id}")


@pytest.fixture
def fake_cuda(monkeypatch):
    log = []
    caller = FakeStream(log, "caller")
    current = [caller]
    made = iter(["d2h", "h2d"])

    @contextlib.contextmanager
    def stream(s):
        prev, current[0] = current[0], s
        try:
            yield
        finally:
            current[0] = prev

    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream(log, next(made)))
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(log, current))
    monkeypatch.setattr(torch.cuda, "stream", stream)

    def set_stream(s):
        current[0] = s

    def current_stream(device=None):
        reads.append(device)
        return current[0]

    reads = []
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    engine = CopyEngine(torch.device("cuda", 0))
    engine.stream_reads = reads  # every current_stream() call, for the per-step cost tests
    return engine, log, current


def test_steps_run_on_the_lane_stream_and_allocations_on_the_callers(fake_cuda):
    engine, log, current = fake_cuda
    seen = []
    b = Batch("h2d", "onload x")
    b.add(lambda: seen.append(("grow", current[0].name)), "regrow x[0]", on_caller_stream=True)
    b.add(lambda: seen.append(("copy", current[0].name)), "copy x[0]", 10)
    job = Job()
    engine.submit(job, [b])
    assert seen == [("grow", "caller"), ("copy", "h2d")]
    # R3: after the allocation, the lane waits for the caller's stream before it copies into it
    assert log.index("h2d waits for caller") < log.index("event 2 on h2d")
    assert job.done() and job.wait(1)
    assert b.fence(1).ok()


def test_a_failed_action_skips_the_rest_and_its_fences_raise(fake_cuda):
    engine, log, _ = fake_cuda
    ran = []
    b = Batch("d2h", "offload x")
    b.add(lambda: ran.append(0), "a")
    b.add(lambda: (_ for _ in ()).throw(RuntimeError("boom")), "b")
    b.add(lambda: ran.append(2), "c")
    job = Job()
    engine.submit(job, [b])
    assert ran == [0] and job.failed_step == "b" and isinstance(job.error, RuntimeError)
    assert b.fence(0).ok() and not b.fence(1).ok()
    assert job.done()  # failed and skipped steps are done: nothing to wait for
    with pytest.raises(TransferError, match="failed at step 'b'"):
        b.fence(2).wait_on_current_stream()


def test_ctrl_c_while_enqueuing_marks_the_rest_skipped_and_propagates(fake_cuda):
    engine, _, _ = fake_cuda
    b = Batch("d2h", "offload x")
    b.add(lambda: None, "a")
    b.add(lambda: (_ for _ in ()).throw(KeyboardInterrupt()), "b")
    b.add(lambda: None, "c")
    job = Job()
    with pytest.raises(KeyboardInterrupt):
        engine.submit(job, [b])
    assert job.done() and len(b._events) == 3 and b._events[1] is None and b._events[2] is None


def test_guard_waits_on_the_stream_not_the_host(fake_cuda):
    engine, log, _ = fake_cuda
    b = Batch("h2d", "onload x")
    b.add(lambda: None, "copy x[0]", 10)
    engine.submit(Job(), [b])
    log.clear()
    b.fence().wait_on_current_stream()
    assert log == [f"caller waits for event {b._events[0].id}"]  # no "host waits"


def test_swap_pacing_enqueues_a_regrow_only_after_the_release_it_waits_for(fake_cuda):
    engine, log, _ = fake_cuda
    order = []
    out = Batch("d2h", "offload a")
    out.add(lambda: order.append("copy a0"), "copy a[0]", 10)
    release = out.add(lambda: order.append("release a0"), "release a[0]")
    out.add(lambda: order.append("copy a1"), "copy a[1]", 10, new_step=True)
    out.add(lambda: order.append("release a1"), "release a[1]")
    into = Batch("h2d", "onload b")
    grow = into.add(lambda: order.append("grow b0"), "regrow b[0]", on_caller_stream=True)
    into.add(lambda: order.append("copy b0"), "copy b[0]", 10)
    into.set_after(grow, out.fence(release[0]))
    # submitted in the "wrong" order: the engine must still put a's release first
    engine.submit(Job(), [into, out])
    assert order.index("release a0") < order.index("grow b0")
    assert any(line.startswith("host waits for event") for line in log)  # R8 on CUDA: the host waited


def _onload_batch(current, steps: int, seen: list) -> Batch:
    b = Batch("h2d", "onload x", step_bytes=10)  # a step per regrow and its copy
    for i in range(steps):
        b.add(lambda: seen.append(("grow", current[0].name)), f"regrow x[{i}]", on_caller_stream=True, new_step=True)
        b.add(lambda: seen.append(("copy", current[0].name)), f"copy x[{i}]", 10)
    return b


def test_the_callers_stream_is_read_once_per_submission_not_per_step(fake_cuda):
    # the issue of each step is host time on the critical path of a non-blocking onload: reading
    # the caller's stream per step (a device-index lookup and a Stream object each) made it O(steps)
    engine, _, current = fake_cuda
    reads = engine.stream_reads
    counts = {}
    for steps in (1, 40):
        seen = []
        reads.clear()
        engine.submit(Job(), [_onload_batch(current, steps, seen)])
        counts[steps] = len(reads)
        assert seen == [("grow", "caller"), ("copy", "h2d")] * steps
    assert counts[40] == counts[1] <= 2


@pytest.mark.parametrize("fail", [None, RuntimeError, KeyboardInterrupt])
def test_the_callers_stream_is_current_again_after_a_submission_however_it_ends(fake_cuda, fail):
    engine, _, current = fake_cuda
    caller = current[0]
    seen = []
    b = _onload_batch(current, 3, seen)

    def boom():
        raise fail("boom")

    if fail is not None:
        # the second step fails on the caller's stream, between its regrow and its copy
        b.steps[1].insert(1, Action(boom, "regrow x[1] again", on_caller_stream=True))
    job = Job()
    if fail is KeyboardInterrupt:
        with pytest.raises(KeyboardInterrupt):
            engine.submit(job, [b])
    else:
        engine.submit(job, [b])
    assert current[0] is caller
    if fail is not None:
        assert job.failed_step == "regrow x[1] again" and seen == [
            ("grow", "caller"),
            ("copy", "h2d"),
            ("grow", "caller"),
        ]


def test_a_steps_regrows_run_first_on_the_callers_stream_then_one_wait_then_its_copies(fake_cuda):
    # as a CPU lane runs a step (its caller part at submission, the rest on the worker); one
    # switch and one cross-stream wait per step, not per regrow (a full onload regrows a storage
    # per main weight and optimizer state)
    engine, log, current = fake_cuda
    seen = []
    b = Batch("h2d", "onload x", step_bytes=100)
    for name in "abc":
        b.add(lambda n=name: seen.append(("grow " + n, current[0].name)), f"regrow {name}", on_caller_stream=True)
        b.add(lambda n=name: seen.append(("copy " + n, current[0].name)), f"copy {name}", 10)
    assert len(b.steps) == 1
    engine.submit(Job(), [b])
    assert seen == [
        ("grow a", "caller"),
        ("grow b", "caller"),
        ("grow c", "caller"),
        ("copy a", "h2d"),
        ("copy b", "h2d"),
        ("copy c", "h2d"),
    ]
    assert log.count("h2d waits for caller") == 1  # R3: before the copies, after every regrow
    assert log.index("h2d waits for caller") < next(i for i, x in enumerate(log) if x.endswith("on h2d"))
    assert current[0].name == "caller"
