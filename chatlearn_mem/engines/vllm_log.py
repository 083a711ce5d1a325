"""Where the vLLM engine's own output goes, and what in it we say on the console.

vLLM logs through the ``vllm`` logger (and its children) to stdout, and at start-up also prints
to the process's file descriptors (a C++ NUMA note, import-time notes, progress bars). Every weight
update logs "Reloading and processing weights", "Successfully reset prefix cache" and two warnings
that are benign here but read as a failed sync (:data:`BENIGN`). With a log file,
:class:`EngineLog` sends all of it there, and :meth:`EngineLog.take` hands the caller the few
lines that matter (a real load failure, memory pressure, an error) to say in its own words.

vLLM's switches used: ``LoggingConfig(configure_logging=False)`` (the ``logging_config`` argument
of ``vllm.LLM``; ``VLLM_CONFIGURE_LOGGING=0`` before vLLM is imported does the same at import),
so that vLLM installs no console handler of its own, and ``use_tqdm_on_load=False``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator
from typing import Any, Optional, Union

__all__ = ["BENIGN", "EngineLog", "what_matters"]

LOGGER = "vllm"
"""The logger every vLLM module logs under (``vllm.<module>``)."""

BENIGN: tuple[tuple[str, str], ...] = (
    (
        r"^RotaryEmbedding: Failed to load weights$",
        "the rotary embedding's cos/sin cache is a buffer vLLM computes from config.json: no "
        "checkpoint holds it, and the reload keeps the computed one",
    ),
    (
        r"^ParallelLMHead: Failed to load weights$",
        "with tied embeddings the head has no tensor of its own (it is the embedding); the wrapper "
        "rebuilds its kernel copy after every update and the digest reads it back",
    ),
)
"""vLLM warnings on every weight update that are not failures: (pattern, why). The second holds
for tied embeddings only; untied, the same line means the head was not in the stream, which the
update's own check of the names reports."""

_LOAD_FAILURE = re.compile(r"Failed to load weights|weights were not loaded", re.IGNORECASE)
_MEMORY = re.compile(
    r"out of memory|\bOOM\b|not enough (free )?(memory|space)|insufficient memory|"
    r"(KV cache|memory) (is )?(too small|exhausted)|preempt",
    re.IGNORECASE,
)


def what_matters(message: str, levelno: int, tied: bool) -> Optional[str]:
    """The kind of a vLLM log line the caller must hear of: ``"load"`` (a weight that did not
    load), ``"memory"`` (memory pressure), ``"error"`` (any other error), or None (the line stays
    in the engine's log). ``tied``: the model ties its head to the embedding."""
    if levelno < logging.WARNING:
        return None
    first = message.strip().splitlines()[0] if message.strip() else ""
    for i, (pattern, _) in enumerate(BENIGN):
        if re.search(pattern, first) and (i == 0 or tied):
            return None
    if _LOAD_FAILURE.search(first):
        return "load"
    if _MEMORY.search(first):
        return "memory"
    return "error" if levelno >= logging.ERROR else None


class _Watch(logging.Handler):
    """Keeps the vLLM records that matter (:func:`what_matters`) until taken."""

    def __init__(self, tied: bool):
        super().__init__(logging.WARNING)
        self.tied = tied
        self.kept: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record of vLLM's must not break the engine
            return
        kind = what_matters(message, record.levelno, self.tied)
        if kind is not None:
            self.kept.append((kind, message.strip().splitlines()[0]))


class EngineLog:
    """The engine's output: to ``log_file`` (appended) when one is given, else vLLM's default
    (the console); in both cases the lines that matter are kept for :meth:`take`.

    One per engine; vLLM's logger is process-wide, so :meth:`close` puts back what it found.

    Args:
        log_file: Where vLLM's loggers and, while the engine starts, the process's stdout and
            stderr go. None: vLLM logs to the console as it does by default.
        tied: The model ties its head to the embedding (one more benign warning).
    """

    def __init__(self, log_file: Optional[Union[str, os.PathLike]], tied: bool):
        self.path = os.fspath(log_file) if log_file is not None else None
        self._watch = _Watch(tied)
        self._file: Optional[logging.Handler] = None
        self._saved: Optional[tuple[list[logging.Handler], int, bool]] = None
        self._closed = False

    def llm_kwargs(self, engine_args_fields: set[str]) -> dict[str, Any]:
        """Arguments for ``vllm.LLM`` that keep vLLM from installing its console handler and
        progress bars (only those this vLLM knows, from ``engine_args_fields``)."""
        if self.path is None:
            return {}
        out: dict[str, Any] = {}
        if "logging_config" in engine_args_fields:
            from vllm.config.logging import LoggingConfig

            out["logging_config"] = LoggingConfig(configure_logging=False)
        if "use_tqdm_on_load" in engine_args_fields:
            out["use_tqdm_on_load"] = False
        return out

    def before_import(self) -> None:
        """Call before vLLM is first imported: with a log file, vLLM configures no logging of its
        own at import (``VLLM_CONFIGURE_LOGGING=0``)."""
        if self.path is not None:
            os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

    def attach(self) -> None:
        """Route the ``vllm`` logger: to the file (its handlers replaced) or, without one, keep
        vLLM's handlers; the watch is added in both cases. Idempotent; nothing once closed."""
        if self._closed:
            return
        logger = logging.getLogger(LOGGER)
        if self.path is not None and self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = logging.FileHandler(self.path, mode="a", encoding="utf-8")
            self._file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s [%(name)s] %(message)s"))
        if self._saved is None:
            self._saved = (list(logger.handlers), logger.level, logger.propagate)
        if self._file is not None:
            for h in list(logger.handlers):
                if h is not self._file and h is not self._watch:
                    logger.removeHandler(h)
            if self._file not in logger.handlers:
                logger.addHandler(self._file)
            logger.setLevel(logging.INFO)
            logger.propagate = False
        if self._watch not in logger.handlers:
            logger.addHandler(self._watch)

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """While the engine starts: with a log file, the process's stdout and stderr (file
        descriptors 1 and 2: C++, ``print`` and progress-bar output) go to it too."""
        self.attach()
        if self.path is None:
            yield
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = [os.dup(1), os.dup(2)]
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            yield
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for f in (*saved, fd):
                os.close(f)
            self.attach()  # vLLM's start may have configured its logger again

    def take(self) -> list[tuple[str, str]]:
        """The ``(kind, first line)`` of each record that mattered since the last call (kinds as
        :func:`what_matters`), oldest first."""
        kept, self._watch.kept = self._watch.kept, []
        return kept

    def close(self) -> None:
        """Put the ``vllm`` logger back as :meth:`attach` found it and close the file."""
        self._closed = True
        logger = logging.getLogger(LOGGER)
        for h in (self._watch, self._file):
            if h is not None and h in logger.handlers:
                logger.removeHandler(h)
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._saved is not None:
            handlers, level, propagate = self._saved
            for h in handlers:
                if h not in logger.handlers:
                    logger.addHandler(h)
            logger.setLevel(level)
            logger.propagate = propagate
            self._saved = None
