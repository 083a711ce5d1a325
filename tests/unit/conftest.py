"""Fixtures shared by the unit tier."""

import pytest

import chatlearn_mem.device_memory as dm


@pytest.fixture
def madvise_calls(monkeypatch):
    """Record the ``madvise`` calls of :mod:`chatlearn_mem.device_memory` instead of making them, as on Linux."""
    calls = []

    def fake(address, length, advice):
        calls.append((address, length, advice))
        return 0

    monkeypatch.setattr(dm, "_libc_madvise", fake)
    monkeypatch.setattr(dm.sys, "platform", "linux")
    return calls


@pytest.fixture
def failing_regrow(monkeypatch):
    """``arm(n)``: from now on the ``n``-th regrow of a storage raises ``RuntimeError("simulated
    device OOM")`` (the regrows before it happen); returns the list of sizes regrown so far.
    ``arm.disarm()`` puts the real regrow back."""
    import chatlearn_mem.group_transfer as gt

    real = gt._grow_storage
    calls: list[int] = []

    def arm(at: int) -> list[int]:
        def failing(storage, nbytes, *args):
            calls.append(nbytes)
            if len(calls) == at:
                raise RuntimeError("simulated device OOM")
            real(storage, nbytes, *args)

        monkeypatch.setattr(gt, "_grow_storage", failing)
        return calls

    arm.disarm = lambda: monkeypatch.setattr(gt, "_grow_storage", real)
    return arm
