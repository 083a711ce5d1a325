"""scripts/gpu_ab_host.sh refuses a bad command line or a missing base wheel with one line naming
the fix, before it installs anything (its real run needs a GPU machine's wheelhouse)."""

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_ab_host.sh"


def _run(*args, env_wheelhouse=None):
    env = {"PATH": "/usr/bin:/bin"}
    if env_wheelhouse is not None:
        env["WHEELHOUSE"] = str(env_wheelhouse)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=30, env=env)


@pytest.mark.parametrize(
    "args, expected",
    [
        ((), "error: --out DIR is required"),
        (("--out", "x", "--bogus"), "usage: bash scripts/gpu_ab_host.sh --out DIR"),
    ],
)
def test_a_bad_command_line_is_refused_with_its_usage(args, expected):
    r = _run(*args)
    assert r.returncode == 2 and expected in r.stderr and r.stdout == ""


def test_without_a_base_wheel_it_says_how_to_make_one(tmp_path):
    (tmp_path / "base").mkdir()
    r = _run("--out", str(tmp_path / "out"), env_wheelhouse=tmp_path)
    assert r.returncode == 2
    assert f"no base wheel in {tmp_path}/base/" in r.stderr and "pip wheel --no-deps -w" in r.stderr
    assert not (tmp_path / "out").exists()  # nothing made before the check
