"""The checkout the validation runs in: where it is, its version, and the source revision recorded
in every result (``--revision``, this checkout's git, or the wheelhouse's ``REVISION``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

__all__ = [
    "REPO",
    "REVISION_FILE",
    "checkout_revision",
    "find_repo",
    "repo_version",
    "source_revision",
    "wheelhouse_revision",
]


def find_repo() -> Path:
    """The repository the validation runs its tests and commands in: the checkout this package
    sits in (a source tree or an editable install), else the working directory (the package
    installed from the wheelhouse, run from the repository root as ``scripts/gpu_validate.sh``
    does). A directory is a checkout when it holds ``pyproject.toml`` and ``tests/gpu``."""
    for candidate in (Path(__file__).resolve().parents[2], Path.cwd()):
        if (candidate / "pyproject.toml").is_file() and (candidate / "tests" / "gpu").is_dir():
            return candidate
    return Path.cwd()


REPO = find_repo()
"""The repository root (see :func:`find_repo`)."""
REVISION_FILE = "REVISION"
"""The wheelhouse's record of the source revision its chatlearn-mem wheel was built from."""


def repo_version() -> str:
    """The version ``pyproject.toml`` gives the project."""
    text = (REPO / "pyproject.toml").read_text()
    return re.search(r'^version = "([^"]+)"', text, re.M).group(1)


def checkout_revision() -> Optional[str]:
    """``HEAD`` of this checkout with ``+dirty`` for uncommitted changes; None without ``.git``."""
    from chatlearn_mem_bench.measure import git_revision

    return git_revision(REPO)


def wheelhouse_revision(path: Path) -> Optional[str]:
    """The revision in ``path/REVISION`` (None when there is none)."""
    try:
        return (Path(path) / REVISION_FILE).read_text().strip() or None
    except OSError:
        return None


def source_revision(explicit: Optional[str], wheelhouse: Optional[str]) -> tuple[Optional[str], str]:
    """The revision to record and where it came from: ``--revision``, else, with ``--wheelhouse``
    given (the library that runs is then the wheel's), its ``REVISION`` when this checkout's git is
    at another commit (a copy of the repository may carry a ``.git`` of an older commit, the newer
    changes dirty on it), else this checkout's git ``HEAD`` (``+dirty`` kept), else the
    wheelhouse's ``REVISION`` (a copy without ``.git``)."""
    if explicit:
        return explicit, "--revision"
    here = checkout_revision()
    wh = Path(wheelhouse) if wheelhouse else REPO / ".whl"
    built_from = wheelhouse_revision(wh)
    if wheelhouse and here and built_from and here.split("+")[0] != built_from.split("+")[0]:
        return built_from, f"{wh / REVISION_FILE}, the wheel's; git in {REPO} says {here}"
    if here:
        return here, f"git in {REPO}"
    return (built_from, f"{wh / REVISION_FILE}") if built_from else (None, "")
