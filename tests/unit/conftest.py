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
