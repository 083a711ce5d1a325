"""Non-blocking transitions: the :class:`Transfer` handle and :func:`swap`.

``offload(parts, blocking=False)``, ``onload(parts, blocking=False)`` and
``swap(out=a, into=b, blocking=False)`` submit their copies to the device's copy engine
(:mod:`chatlearn_mem.copy_engine`) and return a :class:`Transfer` at once. The parts are in their
target state from that moment: a guarded call that needs a part being onloaded waits for it
(CUDA: its stream waits, the host does not), one that needs a part being offloaded raises
``OffloadedError`` as if the offload had finished.

What a handle guarantees:

* ``wait()`` blocks until every copy has finished, settles the transition (records the host
  copies, returns freed blocks to the driver on CUDA) and returns one ``TransferStats`` per part.
  Calling it again returns the same list. A failure raises the original error, once the parts
  have been rolled back to where they were (the error's note says what was rolled back); calling
  ``wait()`` again raises it again.
* ``done()`` never blocks.
* Dropping a handle without waiting is allowed: the copies finish in the background and the
  manager's next call that touches those parts settles it. If it failed, that call raises the
  error (once) after the rollback.
* Ctrl-C (``KeyboardInterrupt``) while waiting interrupts the wait, not the copies; the next wait
  or manager call settles the transition. Ctrl-C while a call is submitting rolls back what it had
  submitted and re-raises.
* ``close()`` of a manager waits for its transitions first.
"""

from __future__ import annotations

import threading
import time
import warnings
from typing import Any, Callable, Optional, Protocol

import torch

from chatlearn_mem.copy_engine import CopyEngine, Job
from chatlearn_mem.group_transfer import GroupTransfer, TransferStats
from chatlearn_mem.parts import Part, PartsArg
from chatlearn_mem.parts_state import PartsState

__all__ = ["Mover", "Transfer", "swap"]


class Mover(Protocol):
    """A memory manager, as a transition sees it (:class:`~chatlearn_mem.manager.MemoryManagerBase`):
    the device it moves parts on and its parts' state, which begins, tracks and settles them."""

    @property
    def device(self) -> torch.device: ...

    @property
    def state(self) -> PartsState: ...


class Transfer:
    """An offload, onload or swap submitted to the copy engine: what ``blocking=False`` returns.

    Attributes:
        kind: ``"offload"``, ``"onload"`` or ``"swap"``.
        parts: ``(manager, part)`` for each part it moves, in submission order.
    """

    def __init__(
        self,
        kind: str,
        entries: list[tuple[Mover, Part, GroupTransfer]],
        on_settled: list[Callable[[], None]] = (),
    ):
        self.kind = kind
        self._entries = entries
        self._job = Job()
        self._lock = threading.Lock()
        self._settled = False
        self._stats: list[TransferStats] = []
        self._error: Optional[BaseException] = None
        self._reported = False  # the error was raised to someone
        self._on_settled = list(on_settled)
        self.submitted_at = time.perf_counter()

    @property
    def parts(self) -> list[tuple[Any, Part]]:
        return [(m, p) for m, p, _ in self._entries]

    def _submit(self) -> None:
        batches = [gt.batch for _, _, gt in self._entries]
        device = self._entries[0][2].engine.device if self._entries else None
        if device is not None:
            CopyEngine.for_device(device).submit(self._job, batches)

    def done(self) -> bool:
        """Whether every copy has finished (or the transition failed); never blocks."""
        return self._settled or self._job.done()

    def wait(self, timeout: Optional[float] = None) -> list["TransferStats"]:
        """Wait for the copies and settle the transition; see the module docstring.

        Args:
            timeout: Seconds to wait at most; None waits as long as it takes.

        Returns:
            One :class:`TransferStats` per part moved, in submission order.

        Raises:
            TimeoutError: ``timeout`` passed first (nothing changes; wait again later).
            The error of the step that failed, after the rollback.
        """
        if not self._settled and not self._job.wait(timeout):
            raise TimeoutError(f"the {self.kind} of {self._describe()} did not finish within {timeout} s")
        return self._settle(observed=True)

    @property
    def stats(self) -> list["TransferStats"]:
        """The per-part stats of a finished transition (:meth:`wait` returns them too).

        Raises:
            RuntimeError: It is still running.
        """
        if not self._settled:
            if not self._job.done():
                raise RuntimeError(f"the {self.kind} of {self._describe()} is still running: call wait() first")
            return self._settle(observed=True)
        return list(self._stats)

    def settle_unobserved(self) -> None:
        """Settle as the manager's next call does: raise a failure only if no one saw it yet."""
        self._settle(observed=False)

    def _describe(self) -> str:
        return ", ".join(dict.fromkeys(str(p) for _, p, _ in self._entries)) or "nothing"

    def _settle(self, observed: bool) -> list["TransferStats"]:
        """Wait for the copies, then (once) finish every part: record or roll back."""
        self._job.wait()
        with self._lock:
            if not self._settled:
                for manager, part, gt in self._entries:
                    if not gt.batch.submitted:  # never submitted (interrupted): nothing ran
                        gt.cancel()
                        manager.state.transfer_settled(part, self, gt)
                        continue
                    try:
                        self._stats.append(gt.finish())
                    except BaseException as e:  # noqa: BLE001 - every part is settled, the first error raised
                        if self._error is None:
                            self._error = e
                    manager.state.transfer_settled(part, self, gt)
                for fn in self._on_settled:
                    fn()
                self._settled = True
            if self._error is not None and (observed or not self._reported):
                self._reported = True
                raise self._error
            return list(self._stats)

    def __repr__(self) -> str:
        state = "settled" if self._settled else ("done" if self._job.done() else "in flight")
        return f"<Transfer {self.kind} of {self._describe()}: {state}>"

    def __del__(self) -> None:
        try:
            if not self._settled and self._job.error is not None and not self._reported:
                warnings.warn(
                    f"a non-blocking {self.kind} of {self._describe()} failed and was dropped "
                    f"unwaited: {self._job.error!r}; the manager rolls it back on its next call",
                    RuntimeWarning,
                    stacklevel=2,
                )
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass


def run(
    kind: str,
    entries: list[tuple[Mover, Part, GroupTransfer]],
    blocking: bool,
    on_settled: list[Callable[[], None]] = (),
):
    """Submit the started group transitions as one job; wait when ``blocking``.

    Returns the stats (blocking) or the :class:`Transfer`. A ``KeyboardInterrupt`` (or any error)
    during the submission settles what was submitted, rolling it back, and re-raises.
    """
    transfer = Transfer(kind, entries, on_settled)
    for manager, part, gt in entries:
        manager.state.transfer_started(part, transfer, gt)
    try:
        transfer._submit()
    except BaseException:
        try:
            transfer._settle(observed=False)
        except BaseException:  # noqa: BLE001 - the interrupt (or submission error) is what matters
            pass
        raise
    if blocking:
        return transfer.wait()
    return transfer


def swap(
    out: Mover,
    into: Mover,
    *,
    out_parts: PartsArg = None,
    into_parts: PartsArg = None,
    headroom_bytes: Optional[int] = None,
    force: bool = False,
    blocking: bool = True,
):
    """Move ``out`` off the device and ``into`` onto it at the same time.

    The outgoing model's copies (device to host) and the incoming one's (host to device) run in
    their two lanes concurrently: on CUDA the two copy directions work at once. The incoming
    storages are regrown only as the outgoing ones are released (R8 in
    :mod:`chatlearn_mem.copy_engine`), so the device holds at most the larger of the two plus
    ``headroom_bytes`` on the way, never both models whole.

    Args:
        out: The manager to put to sleep (its parts must be resident).
        into: The manager to wake up (its parts must be offloaded).
        out_parts: Parts of ``out`` to offload (None: all).
        into_parts: Parts of ``into`` to onload (None: all).
        headroom_bytes: Device bytes the swap may hold beyond the larger model, so that incoming
            copies start before the whole of a large outgoing storage is out. Default: the
            largest single storage of the two (the pipelining unit: a storage is released whole),
            or segment where a part is in a DeviceSlab (``MemoryConfig.cuda_contiguous``: memory
            comes and goes a segment at a time).
        force: Passed to ``out.offload`` (drop unconsumed gradients).
        blocking: Wait and return the stats (default), or return the :class:`Transfer` at once.

    Returns:
        ``list[TransferStats]`` (the outgoing parts first), or the :class:`Transfer`.

    Raises:
        ValueError: ``out`` and ``into`` are the same manager, or live on different devices.
        Whatever ``out.offload`` / ``into.onload`` would raise before any copy (nothing changes).
    """
    if out is into:
        raise ValueError(
            "swap(out=..., into=...) needs two different managers; to move one manager's parts "
            "use its offload() and onload()"
        )
    if out.device != into.device:
        raise ValueError(f"swap() moves models on one device; out is on {out.device}, into on {into.device}")
    if headroom_bytes is not None and headroom_bytes < 0:
        raise ValueError(f"headroom_bytes must be >= 0, got {headroom_bytes}")
    first, second = sorted((out, into), key=id)
    with first.state.lock, second.state.lock:
        for m in (out, into):
            m.state.check_open("swap")
        out_started = out.state.begin_offload(out_parts, force=force, paced=True)
        try:
            into_started = into.state.begin_onload(into_parts, paced=True)
        except BaseException:
            for _, gt in out_started:
                gt.cancel()
            raise
        _pace(out_started, into_started, headroom_bytes)
        entries = [(out, p, gt) for p, gt in out_started] + [(into, p, gt) for p, gt in into_started]
        if not entries:
            return [] if blocking else run("swap", [], blocking=False)
        return run("swap", entries, blocking, on_settled=[out.state.after_offload_settled])


def _pace(
    out_started: list[tuple[Part, GroupTransfer]],
    into_started: list[tuple[Part, GroupTransfer]],
    headroom_bytes: Optional[int],
) -> None:
    """Make each regrow of the incoming storages wait for enough outgoing releases (R8)."""
    releases = []  # (fence, cumulative bytes released)
    total = 0
    freed = [(gt, step, n) for _, gt in out_started for step, n in gt.release_steps()]
    for gt, step, n in freed:
        total += n
        releases.append((gt.batch.fence(step), total))
    # the memory comes by storages, or by segments where a part is in a DeviceSlab (cuda_contiguous)
    grows = [(gt, where, n) for _, gt in into_started for where, n in gt.grow_actions()]
    if headroom_bytes is None:  # the largest unit that comes or goes at once
        headroom_bytes = max([n for _, _, n in freed] + [n for _, _, n in grows] + [0])
    grown = 0
    k = 0
    for gt, where, n in grows:
        grown += n
        need = grown - headroom_bytes
        if need <= 0:
            continue
        while k < len(releases) - 1 and releases[k][1] < need:
            k += 1
        if releases:
            gt.batch.set_after(where, releases[k][0])
