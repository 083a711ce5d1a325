"""Processes forked to write a checkpoint die with the trainer that forked them.

megatron-core up to 0.16 (at least; 0.19 writes with threads) forks one process per file to write
a checkpoint. A forked writer holds every descriptor of the trainer's process: when the trainer is
killed mid-save, Ray sees its actor alive until the orphaned writer exits (a run then waits for its
phase timeout instead of restarting), and the writer can block forever on a results queue nobody
reads. Processes forked while a thread is inside :func:`writers_die_with_this_thread` get SIGKILL
when that thread ends (Linux's parent-death signal; the writers are joined before a save's thread
returns). Elsewhere than on Linux the writers are left to megatron.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Iterator

__all__ = ["install_parent_death_signal", "writers_die_with_this_thread"]

_writing = threading.local()  # .pid: the process that writes, while this thread runs a save's write
_prctl = None
_install_lock = threading.Lock()


def _die_with_the_writing_thread() -> None:
    """``os.register_at_fork(after_in_child=...)``: in a process forked during a save's write, ask
    the kernel for SIGKILL when the forking thread ends, and exit if it already has."""
    parent = getattr(_writing, "pid", None)
    if parent is None or _prctl is None:
        return
    _prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the trainer died between fork() and prctl()
        os._exit(1)
    _writing.pid = os.getpid()  # the writer's own children die with it


def install_parent_death_signal() -> None:
    """Register the fork hook once per process (idempotent; does nothing where ``prctl`` is missing)."""
    global _prctl
    with _install_lock:
        if _prctl is not None or not hasattr(os, "register_at_fork"):
            return
        try:
            import ctypes

            prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved now: dlopen after fork may deadlock
        except (OSError, AttributeError):  # not Linux: writers are left to megatron
            return
        prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        _prctl = prctl
        os.register_at_fork(after_in_child=_die_with_the_writing_thread)


@contextlib.contextmanager
def writers_die_with_this_thread() -> Iterator[None]:
    """While inside, a process this thread forks gets SIGKILL when this thread ends (once
    :func:`install_parent_death_signal` was called)."""
    _writing.pid = os.getpid()
    try:
        yield
    finally:
        _writing.pid = None
