"""Exceptions raised by chatlearn-mem."""

__all__ = [
    "ChatlearnMemError",
    "ConfigError",
    "ExternalChangeError",
    "HostMemoryError",
    "OffloadedError",
    "TransferError",
    "UnsupportedLayoutError",
]


class ChatlearnMemError(RuntimeError):
    """Base class of the errors this library raises on purpose."""


class OffloadedError(ChatlearnMemError):
    """State needed by an operation is offloaded; the message names what to onload."""


class HostMemoryError(ChatlearnMemError, MemoryError):
    """An offload was refused before anything changed: its host buffers would not fit in the host
    memory the process can use. The message gives the numbers and where they were read."""


class UnsupportedLayoutError(ChatlearnMemError):
    """The model, optimizer or megatron-core version is not one the manager can handle."""


class ConfigError(ChatlearnMemError, ValueError):
    """A configuration is missing or invalid; the message lists every problem with its dotted key."""


class ExternalChangeError(ChatlearnMemError):
    """Memory the manager manages was released, regrown or moved by something else (typically
    megatron-core's own offload calls); the message says what and how to get back to a state the
    manager can work from. See :mod:`chatlearn_mem.external`."""


class TransferError(ChatlearnMemError):
    """Memory that a guarded call needs was being moved by a non-blocking transition that failed;
    the message names the step, and ``__cause__`` is the original error. Wait for the transition
    (``Transfer.wait()``) or call the manager again: either rolls the part back to where it was."""
