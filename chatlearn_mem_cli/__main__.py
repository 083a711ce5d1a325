"""``chatlearn-mem`` and ``python -m chatlearn_mem_cli``: run the command line, or say what to install."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

__all__ = ["main"]

_CLI_PACKAGES = {"typer", "click", "yaml"}


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Entry point of the ``chatlearn-mem`` console script."""
    try:
        from chatlearn_mem_cli.app import app
    except ModuleNotFoundError as e:
        if e.name not in _CLI_PACKAGES:
            raise
        sys.stderr.write(
            f"error: the chatlearn-mem command needs {e.name!r}, which is not installed; install "
            "it with pip install 'chatlearn-mem[ray]' (the PPO run) or "
            "'chatlearn-mem[bench]' (the benchmark)\n"
        )
        raise SystemExit(1) from None
    try:
        app(args=None if argv is None else list(argv), prog_name="chatlearn-mem")
    except SystemExit as e:
        gpt = sys.modules.get("chatlearn_mem.models.gpt")  # loaded by the commands that use megatron
        if gpt is None:
            raise
        gpt.exit_process(e.code)  # at once, when the process group's teardown hung (else sys.exit)


if __name__ == "__main__":
    main()
