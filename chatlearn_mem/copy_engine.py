"""The copy engine: where every byte that crosses between the device and the host store moves.

Each device has two *lanes*, one per direction: ``d2h`` runs offloads, ``h2d`` runs onloads. A lane
runs the steps submitted to it strictly in order, apart from the caller's own work, so that a
transition overlaps with compute and, in a swap, an offload overlaps with an onload.

* On CUDA a lane is a side stream of its device. Submitting a step enqueues its copies on that
  stream at once (nothing on the host waits); the *fence* after a step is a CUDA event.
* On a CPU "device" (megatron-core through :mod:`chatlearn_mem.cpu_backend`) a lane is a
  worker thread with a FIFO queue, standing in for the stream (torch's copy releases the GIL);
  the fence after a step is its sequence number in the lane.

A :class:`Batch` is the list of steps of one part's transition in one lane. A step that raises
skips the rest of its batch and of every later batch of the same :class:`Job` (one
``offload(parts)`` / ``onload(parts)`` / swap); the caller rolls back what had been done, on the
host, when it settles the job (see ``StorageGroup``). Nothing in the engine knows about parts,
managers or megatron.

Ordering rules
--------------
Each rule names what guards what and who waits for whom; each has a test in
``tests/unit/test_copy_engine.py`` (CPU lanes, the interleaving forced by holding the worker)
and the CUDA half runs in ``tests/gpu``.

R1. *An offload copies what the caller wrote before it.* Its device-to-host copies start only
    after every operation the caller queued before the offload call. CUDA: the d2h stream waits
    for an event recorded on the caller's current stream at submission. CPU: the caller's
    operations ran synchronously before it submitted.
R2. *A storage is released only after its bytes reached the host.* CUDA: the storage's block is
    marked in use by the d2h stream (``record_stream``) before ``resize_(0)``, so the caching
    allocator hands that memory out again only once the stream has passed the copy. CPU: the
    release is the step after the storage's copy steps in the d2h lane.
R3. *A storage is regrown just before its copy, and written only after the caller's earlier work.*
    It is regrown by the submitting thread as its copies are submitted: a step's regrows run
    before that step's copies. CUDA: on the caller's stream (the allocator's blocks stay in the
    caller's pool), and the h2d stream waits for the caller's stream once they ran, before the
    step's copies, so a block the caller freed earlier is not overwritten while the caller's queued
    kernels may still read it. CPU: from the caller's malloc arena, which the
    releases give it back to; the worker copies after it.
R4. *Nothing reads a restored storage before its bytes arrived.* Every guarded entry of a manager
    waits for the fence of the transition it depends on: the forward pre-hook of each module for
    the last copy step covering that module's own parameters and buffers (CUDA: the caller's
    stream waits for the event, the host does not block; CPU: the host waits for the worker),
    everything else (backward, ``step``, ``zero_grad_buffer``, state dicts, checkpoints,
    ``residency``, ``audit``) for the whole transition.
R5. *The host store is written only when no one reads it, and read only once written.* An
    offload that copies waits, before it submits, for the registered readers of the store (an
    asynchronous checkpoint save) and for any transition of the same part still in flight
    (whose onload may still read the store); whoever reads the store on the host (checkpoint,
    ``weights_state_dict``) first waits for the part's offload to complete.
R6. *A part moves in one direction at a time.* A transition of a part first waits for the one
    already in flight for that part (an onload never regrows a storage whose release is pending;
    an offload never releases a storage an onload is still filling).
R7. *The host store is freed only after every copy that touches it completed* (``close()``,
    ``drop_host_store()``, a re-planned store: each waits for the part's transition first).
R8. *A swap never holds both models whole.* Each regrow of the incoming model waits (on the host,
    at submission) for the release steps of the outgoing one that free at least as many bytes,
    less an allowance (``headroom_bytes``): the device holds at most the larger model plus that
    allowance. On CUDA the caching allocator then reuses the released blocks, the d2h stream
    having passed their copies (R2).
R9. *A failed step leaves nothing half done.* It skips the rest of its job; fences of steps that
    had completed stay valid, the failed and skipped ones raise. The caller settles the job on the
    host (waiting for every lane to have finished or skipped its steps) and rolls each part back
    to where it was: storages an offload released are regrown and refilled from their complete
    host copies, storages an onload regrew are released again.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from chatlearn_mem.errors import TransferError

__all__ = ["Action", "ActionRunner", "Batch", "CopyEngine", "Fence", "Job"]

LANES = ("d2h", "h2d")
_POLL_S = 0.1  # a host wait wakes this often to let Python handle signals (Ctrl-C)
HANDOFF_S = 0.005
"""CPU lanes: how long a submitter waits for an idle worker to take the first step it queued."""


def _before_step(lane: str, label: str) -> None:
    """Called by a lane before each action; tests replace it to slow a lane or make an action fail."""


_NO_HOOK = _before_step


def _run_action(runner, lane: str, action) -> None:
    """Run one action (the test hook first, when set); an error is tagged with the action's name."""
    hook = _before_step
    try:
        if hook is not _NO_HOOK:
            hook(lane, runner.describe(action))
        runner.run(action)
    except BaseException as e:
        try:
            e._chatlearn_action = runner.describe(action)  # which action failed, for messages
        except Exception:  # noqa: BLE001 - an exception type without a __dict__
            pass
        raise


_timing = [False]  # CUDA: whether the lanes' step events record timestamps (see timed_events)


@contextlib.contextmanager
def timed_events():
    """CUDA: the step events of the transitions submitted inside record timestamps, so that
    ``start.elapsed_time(fence.cuda_event)`` says when a step's copies landed (the bench's onload
    timeline). Outside it the events are the lighter untimed kind, which suffice for waiting."""
    before, _timing[0] = _timing[0], True
    try:
        yield
    finally:
        _timing[0] = before


@dataclass
class Action:
    """One piece of lane work given as a function (:meth:`Batch.add`).

    Attributes:
        fn: Does the work; on CUDA it runs with the lane's stream current (its copies go there).
        label: What it does, for messages and tests ("copy weights[0] 0:16777216").
        on_caller_stream: Run ``fn`` on the submitting thread at submission, before the lane's
            actions of the same step (allocations, R3); on CUDA on the caller's stream, and the
            lane's stream waits for the caller's once the step's caller-side actions ran. A CPU
            lane runs them on the submitting thread too.
    """

    fn: Callable[[], None]
    label: str = ""
    on_caller_stream: bool = False


class ActionRunner:
    """How a lane runs, names and places the actions of a batch. This default runs :class:`Action`
    objects; a runner of plain tuples (``StorageGroup``'s cached plans) allocates nothing per action."""

    @staticmethod
    def run(action: Action) -> None:
        action.fn()

    @staticmethod
    def describe(action: Action) -> str:
        return action.label

    @staticmethod
    def on_caller_stream(action: Action) -> bool:
        return action.on_caller_stream


class Job:
    """The batches submitted together by one transition call; the first failure skips the rest."""

    def __init__(self) -> None:
        self.batches: list[Batch] = []
        self.error: Optional[BaseException] = None
        self.failed_step: Optional[str] = None

    def _fail(self, error: BaseException, label: str) -> None:
        if self.error is None:
            self.error, self.failed_step = error, label

    def done(self) -> bool:
        """Whether every step of every batch has run, failed or been skipped."""
        return all(b.done() for b in self.batches)

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until :meth:`done` (or ``timeout`` seconds passed); returns :meth:`done`. Never raises
        the job's error: read :attr:`error`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for b in self.batches:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not b._wait_all(left):
                return False
        return True


class Batch:
    """The ordered steps of one part's transition in one lane. A step is a sequence of actions run
    as one unit, with one fence after it: a lane handles a few large steps instead of many tiny
    ones (a part of many small tensors moves in a handful of steps).

    Args:
        lane: ``"d2h"`` or ``"h2d"``.
        label: For messages ("offload weights").
        step_bytes: For :meth:`add`: copied bytes per step at most (one action may exceed it
            alone); 0 puts every action in a step of its own.
        steps: Prebuilt steps (sequences of actions ``runner`` understands); not copied.
        runner: Runs, names and places the actions (default: :class:`ActionRunner`).
    """

    def __init__(
        self, lane: str, label: str, step_bytes: int = 0, *, steps: Optional[list] = None, runner: Any = ActionRunner
    ):
        if lane not in LANES:
            raise ValueError(f"lane must be one of {LANES}, got {lane!r}")
        self.lane = lane
        self.label = label
        self.step_bytes = step_bytes
        self.steps: list = steps if steps is not None else []
        self.runner = runner
        self.job: Optional[Job] = None
        self.completed = 0  # steps that ran without error
        self.started_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        # seconds the host spent running the steps' actions, per side ("caller", "worker" or
        # "all": one thread writes each key); on CUDA the time to issue them, the copies run after
        self._host_s: dict[str, float] = {}
        self._step_finished_at: dict[int, float] = {}  # CPU: step -> perf_counter() when it finished
        self._afters: dict[tuple[int, int], Fence] = {}
        self._last_bytes = 0
        self._lane = None
        self._seq: list[int] = []  # CPU: each submitted step's sequence number in its lane
        self._threads = 0  # CPU: the intra-op threads of the thread that submitted the batch
        self._events: list = []  # CUDA: one event per step that ran (None after a failure)
        self._caller = None  # CUDA: the submitting thread's stream, read once at submission

    def add(
        self,
        fn: Callable[[], None],
        label: str = "",
        nbytes: int = 0,
        *,
        on_caller_stream: bool = False,
        new_step: bool = False,
    ) -> tuple[int, int]:
        """Append an :class:`Action`; returns ``(step index, action index)`` of where it landed.

        Actions are packed into steps of up to :attr:`step_bytes` copied bytes; ``new_step``
        starts a new step whatever the size (a fence of its own).
        """
        assert self._lane is None, "actions are added before the batch is submitted"
        if not self.steps or new_step or self.step_bytes <= 0 or self._last_bytes + nbytes > self.step_bytes:
            self.steps.append([])
            self._last_bytes = 0
        self.steps[-1].append(Action(fn, label, on_caller_stream))
        self._last_bytes += nbytes
        return len(self.steps) - 1, len(self.steps[-1]) - 1

    def set_after(self, where: tuple[int, int], fence: "Fence") -> None:
        """Make the action at ``where`` ``(step, action)`` wait for ``fence`` (of another lane) first.
        The wait is per step: the host waits for every fence set on a step before it runs any of
        that step's actions (R8)."""
        assert self._lane is None, "set before the batch is submitted"
        self._afters[where] = fence

    def step_label(self, index: int) -> str:
        return "; ".join(self.runner.describe(a) for a in self.steps[index])

    def _afters_of(self, index: int) -> list["Fence"]:
        return [f for (s, _), f in self._afters.items() if s == index] if self._afters else []

    def _run_step(
        self, lane: str, index: int, cuda: Optional["_CudaLane"] = None, caller=None, part: str = "all"
    ) -> None:
        """Run the actions of step ``index``; raises the first error (its action named on it).

        ``cuda``: the lane when it is a CUDA stream (current while this runs); ``caller``: the
        submitting thread's stream, where actions that allocate run (R3). ``part``: ``"caller"``
        or ``"worker"`` runs only the actions on that side (a CPU lane), ``"all"`` every one."""
        runner = self.runner
        t0 = time.perf_counter()
        try:
            self._run_actions(runner, lane, index, cuda, caller, part)
        finally:
            self._host_s[part] = self._host_s.get(part, 0.0) + time.perf_counter() - t0

    def _run_actions(self, runner, lane: str, index: int, cuda, caller, part: str) -> None:
        step = self.steps[index]
        if cuda is None:
            for action in step:
                on_caller = runner.on_caller_stream(action)
                if (part == "caller" and not on_caller) or (part == "worker" and on_caller):
                    continue
                _run_action(runner, lane, action)
            return
        # CUDA: the step's caller-side actions (its regrows) first, on the caller's stream, then
        # one wait of the lane for the caller's stream (R3), then the lane's actions on the lane's
        # stream: the order a CPU lane runs a step in (its caller part at submission, the rest on
        # the worker), with one switch and one cross-stream wait per step instead of per regrow
        on_caller, on_lane = [], []
        for a in step:
            (on_caller if runner.on_caller_stream(a) else on_lane).append(a)
        if on_caller:
            torch.cuda.set_stream(caller)  # run_step made the lane's stream current
            try:
                for action in on_caller:
                    _run_action(runner, lane, action)
            finally:
                torch.cuda.set_stream(cuda.stream)
            cuda.stream.wait_stream(caller)
        for action in on_lane:
            _run_action(runner, lane, action)

    def fence(self, index: int = -1) -> "Fence":
        """The completion of step ``index`` (the last step by default)."""
        if index < 0:
            index += len(self.steps)
        if not 0 <= index < len(self.steps):
            raise IndexError(f"{self.label} has {len(self.steps)} steps, no step {index}")
        return Fence(self, index)

    @property
    def submitted(self) -> bool:
        """Whether the batch was handed to a lane (its steps run or will run)."""
        return self._lane is not None

    def done(self) -> bool:
        return self._lane is not None and (not self.steps or self.fence().done())

    def _wait_all(self, timeout: Optional[float]) -> bool:
        if self._lane is None:
            return False
        return not self.steps or self.fence()._wait_reached(timeout)

    @property
    def host_seconds(self) -> float:
        """Seconds the host spent running the steps' actions (on the lane's thread and, for the
        regrows, the caller's): on CUDA the Python work and the launches, the copies run after; on a
        CPU device the copies themselves."""
        return sum(self._host_s.values())

    @property
    def seconds(self) -> float:
        """Time from the lane starting the first step to the end of the last one (0 when none ran)."""
        if self.started_at is None or self.finished_at is None:
            return 0.0
        return max(0.0, self.finished_at - self.started_at)

    def _skip(self) -> bool:
        return self.job is not None and self.job.error is not None


class Fence:
    """The completion of one step of a submitted batch."""

    def __init__(self, batch: Batch, index: int):
        self.batch, self.index = batch, index

    def done(self) -> bool:
        """Whether the step has run, failed or been skipped (never blocks)."""
        lane = self.batch._lane
        if lane is None:
            return False
        return lane._reached(self.batch, self.index)

    def ok(self) -> bool:
        """Whether the step has run without error (its bytes are where they belong)."""
        return self.done() and self.batch.completed > self.index

    @property
    def cuda_event(self):
        """CUDA: the event recorded on the lane's stream after the step (for ``elapsed_time`` or a
        stream of the caller's own to wait on); None on a CPU lane, before the step was submitted,
        or when it did not run."""
        events = self.batch._events
        return events[self.index] if self.index < len(events) else None

    @property
    def finished_at(self) -> Optional[float]:
        """CPU lane: the ``time.perf_counter()`` at which the step finished; None on CUDA (see
        :attr:`cuda_event`) or before it finished."""
        return self.batch._step_finished_at.get(self.index)

    def _wait_reached(self, timeout: Optional[float] = None) -> bool:
        lane = self.batch._lane
        if lane is None:
            return False
        return lane._wait(self.batch, self.index, timeout)

    def _raise_if_failed(self) -> None:
        if self.batch.completed <= self.index:
            job = self.batch.job
            cause = job.error if job is not None else None
            raise TransferError(
                f"the {self.batch.label} that this needs failed at step "
                f"'{job.failed_step if job is not None else '?'}' ({cause!r}); wait() for the "
                "transfer or call the manager again to roll the part back"
            ) from cause

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block the host until the step is done; returns False on timeout.

        Raises:
            TransferError: The step did not run (it or an earlier step of its job failed).
        """
        if not self._wait_reached(timeout):
            return False
        self._raise_if_failed()
        return True

    def wait_on_current_stream(self) -> None:
        """Make the caller's work wait for the step: on CUDA the current stream waits for the
        step's event (the host does not block); on CPU the host waits.

        Raises:
            TransferError: As :meth:`wait` (on CUDA, when the failure is already known).
        """
        lane = self.batch._lane
        if isinstance(lane, _CudaLane):
            event = self.batch._events[self.index] if self.index < len(self.batch._events) else None
            if event is None:
                self._raise_if_failed()
                return
            torch.cuda.current_stream(lane.device).wait_event(event)
        else:
            self.wait()


class _CpuLane:
    """A worker thread running the queued part of each step in order: the stand-in for a CUDA stream.

    The actions that run on the caller's side (allocations, R3) run on the submitting thread, as
    they do on CUDA: memory is then allocated by the thread that will use it (on Linux, from the
    caller's malloc arena, which the releases return it to; a worker's own arena would hand out
    fresh pages on every onload)."""

    def __init__(self, name: str):
        self.name = name
        self._cv = threading.Condition()
        self._queue: collections.deque = collections.deque()  # (batch, step index)
        self._submitted = 0  # sequence number of the last step queued
        self._finished = 0  # sequence number of the last step run, failed or skipped
        self._taken = 0  # sequence number of the last step the worker took from the queue
        self._handing_off = False  # a submitter waits for the worker to take its step
        self._thread: Optional[threading.Thread] = None

    def begin(self, batch: Batch) -> None:
        batch._lane = self
        batch._seq = []  # per step submitted: its sequence number in this lane
        batch._threads = torch.get_num_threads()  # the submitting thread's: the worker copies with as many

    def run_step(self, batch: Batch, index: int) -> None:
        """Run the step's caller-side actions now and queue the rest for the worker."""
        step_ok = True
        if not batch._skip():
            try:
                if batch.started_at is None:
                    batch.started_at = time.perf_counter()
                batch._run_step(self.name, index, part="caller")
            except BaseException as e:  # noqa: BLE001 - reported through the job
                step_ok = False
                if batch.job is not None:
                    batch.job._fail(e, getattr(e, "_chatlearn_action", None) or batch.step_label(index))
                if not isinstance(e, Exception):
                    self._enqueue(batch, index, False)
                    raise
        self._enqueue(batch, index, step_ok)

    def _enqueue(self, batch: Batch, index: int, run: bool) -> None:
        with self._cv:
            idle = self._finished == self._submitted  # the worker waits for work
            self._submitted += 1
            seq = self._submitted
            batch._seq.append(seq)
            self._queue.append((batch, index, run))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name=f"chatlearn-mem-{self.name}", daemon=True)
                self._thread.start()
            self._cv.notify_all()
            if idle and run:
                # Hand the step over before going on. The worker needs the interpreter lock to
                # take it, and this thread would hold it through the rest of the submission (the
                # regrows do not release it): the worker's copy would start only when the
                # submission ends. Waiting here releases the lock; the worker keeps it from taking
                # the step until its copy starts, which releases it again.
                self._handing_off = True
                try:
                    self._cv.wait_for(lambda: self._taken >= seq, timeout=HANDOFF_S)
                finally:
                    self._handing_off = False

    def skip_rest(self, batch: Batch) -> None:
        while len(batch._seq) < len(batch.steps):
            self._enqueue(batch, len(batch._seq), False)

    def _reached(self, batch: Batch, index: int) -> bool:
        return index < len(batch._seq) and self._finished >= batch._seq[index]

    def _wait(self, batch: Batch, index: int, timeout: Optional[float]) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while not self._reached(batch, index):
                # short slices: a Ctrl-C whose signal reached another thread still interrupts the wait
                left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
                if left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue))
                batch, index, run = self._queue.popleft()
                self._taken += 1
                if self._handing_off:
                    self._cv.notify_all()
            try:
                if run and not batch._skip():
                    if batch._threads and torch.get_num_threads() != batch._threads:
                        torch.set_num_threads(batch._threads)  # this thread's intra-op threads only
                    batch._run_step(self.name, index, part="worker")
                    batch.completed += 1
                    batch.finished_at = time.perf_counter()
                    batch._step_finished_at[index] = batch.finished_at
            except BaseException as e:  # noqa: BLE001 - reported through the job, never lost
                if batch.job is not None:
                    batch.job._fail(e, getattr(e, "_chatlearn_action", None) or batch.step_label(index))
            finally:
                with self._cv:
                    self._finished += 1
                    self._cv.notify_all()


class _CudaLane:
    """A side stream of one device; the submitting thread enqueues each step on it.

    The host's work per step is kept to what the step needs (the issue of each step is on the
    critical path of a non-blocking call): the caller's stream is read once per batch, at
    :meth:`begin`, and each step makes the lane's stream current and the caller's again with one
    ``set_stream`` each, inside the device and stream context that :meth:`CopyEngine.submit` holds
    for the whole submission (which restores the thread's device and streams however it ends)."""

    def __init__(self, name: str, device: torch.device):
        self.name = name
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def begin(self, batch: Batch) -> None:
        batch._lane = self
        batch._caller = torch.cuda.current_stream(self.device)

    def run_step(self, batch: Batch, index: int) -> None:
        """Enqueue step ``index`` (or record it skipped); a KeyboardInterrupt propagates after the
        step is recorded as failed, so that the caller can roll back what was submitted. Called
        within :meth:`CopyEngine.submit`'s context (this device current)."""
        event = None
        try:
            if not batch._skip():
                if batch.started_at is None:
                    batch.started_at = time.perf_counter()
                caller = batch._caller
                torch.cuda.set_stream(self.stream)
                try:
                    batch._run_step(self.name, index, cuda=self, caller=caller)
                finally:
                    torch.cuda.set_stream(caller)
                event = torch.cuda.Event(enable_timing=_timing[0])
                event.record(self.stream)
                batch.completed += 1
        except BaseException as e:  # noqa: BLE001 - reported through the job
            if batch.job is not None:
                batch.job._fail(e, getattr(e, "_chatlearn_action", None) or batch.step_label(index))
            if not isinstance(e, Exception):
                batch._events.append(None)
                raise
        batch._events.append(event)

    def skip_rest(self, batch: Batch) -> None:
        batch._events.extend([None] * (len(batch.steps) - len(batch._events)))

    def _reached(self, batch: Batch, index: int) -> bool:
        if index >= len(batch._events):
            return False
        event = batch._events[index]
        return event is None or event.query()

    def _wait(self, batch: Batch, index: int, timeout: Optional[float]) -> bool:
        if index >= len(batch._events):
            return False  # not submitted yet (a swap still pacing its submission)
        event = batch._events[index]
        if event is not None:
            if timeout is None:
                event.synchronize()
            else:
                deadline = time.monotonic() + timeout
                while not event.query():
                    if time.monotonic() >= deadline:
                        return False
                    time.sleep(1e-4)
        if index == len(batch.steps) - 1 and batch.finished_at is None:
            batch.finished_at = time.perf_counter()
        return True


class CopyEngine:
    """The two lanes of one device. One engine per device and process: :meth:`for_device`.

    Args:
        device: A ``cuda`` device (side streams) or ``cpu`` (worker threads).
    """

    _engines: dict[str, "CopyEngine"] = {}
    _lock = threading.Lock()

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.lanes = {name: _CudaLane(name, device) for name in LANES}
        else:
            self.lanes = {name: _CpuLane(f"{device.type}-{name}") for name in LANES}

    @classmethod
    def for_device(cls, device: torch.device) -> "CopyEngine":
        """The process's engine for ``device`` (created on first use)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = str(device)
        with cls._lock:
            engine = cls._engines.get(key)
            if engine is None:
                engine = cls._engines[key] = cls(device)
            return engine

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def caller_event(self):
        """CUDA: an event recorded now on the caller's current stream (R1); None on CPU."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def submit(self, job: Job, batches: list[Batch]) -> None:
        """Submit ``batches`` as part of ``job``, in order.

        Each step's caller-side actions (allocations) run now, on this thread; the rest is enqueued
        on the lane (CUDA: on its stream; CPU: for its worker). A step whose actions wait for a
        fence of another batch (``set_after``) is submitted once that step was submitted and has
        completed (the host waits, R8); the other batches' steps are submitted meanwhile.
        """
        with self._submitting():
            self._submit(job, batches)

    def _submitting(self):
        """CUDA: the device made current, with the caller's stream, for the submission; on exit the
        thread's current device and streams are what they were (the lanes switch streams per step
        with ``set_stream``). CPU: nothing."""
        if not self.is_cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(torch.cuda.current_stream(self.device))

    def _submit(self, job: Job, batches: list[Batch]) -> None:
        for b in batches:
            b.job = job
            job.batches.append(b)
        cursor = {id(b): 0 for b in batches}
        for b in batches:
            self.lanes[b.lane].begin(b)
        remaining = list(batches)
        try:
            while remaining:
                moved = False
                for b in remaining:
                    lane = self.lanes[b.lane]
                    while cursor[id(b)] < len(b.steps):
                        afters = b._afters_of(cursor[id(b)])
                        if any(
                            id(a.batch) in cursor and a.batch is not b and cursor[id(a.batch)] <= a.index
                            for a in afters
                        ):
                            break  # a step it waits for is not submitted yet: go on with the others
                        if not b._skip():
                            for a in afters:
                                a._wait_reached()
                        lane.run_step(b, cursor[id(b)])
                        cursor[id(b)] += 1
                        moved = True
                remaining = [b for b in remaining if cursor[id(b)] < len(b.steps)]
                if remaining and not moved:  # waits in a cycle: take the first step as it comes
                    b = remaining[0]
                    self.lanes[b.lane].run_step(b, cursor[id(b)])
                    cursor[id(b)] += 1
        finally:
            for b in batches:
                self.lanes[b.lane].skip_rest(b)


def _reset_after_fork() -> None:
    # A forked child has none of the parent's threads or streams: give it fresh engines.
    CopyEngine._engines = {}
    CopyEngine._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
