"""The chatlearn-mem command: every run failure is one ``error:`` line and exit 1, never a traceback."""

import sys

import pytest
from typer.testing import CliRunner

from chatlearn_mem_cli.app import app
from chatlearn_mem_ray import errors, loops


@pytest.mark.parametrize(
    "error",
    [
        errors.WeightSyncError("iteration 3: tensor-parallel shard 0 differs"),
        errors.AuditFailedError("audit of policy_0 after onload in phase 'train_policy' found 1 problem(s)"),
        errors.ActorFailedError("critic_0", "values", "the actor process died (ActorDiedError)"),
        errors.PhaseTimeoutError("phase 'generate' did not finish within 600 s"),
        errors.ResourceError("not enough resources for this run"),
        PermissionError(13, "Permission denied", "/readonly/log.json"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_run_failure_is_one_error_line_and_exit_1(monkeypatch, error):
    def fail(cfg, progress):
        raise error

    monkeypatch.setattr(loops, "run_ppo", fail)
    result = CliRunner().invoke(app, ["ppo", "ppo.iterations=1"])
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and str(error.args[-1]) in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


def test_every_run_error_shares_one_base():
    from chatlearn_mem import ChatlearnMemError

    for cls in (
        errors.WeightSyncError,
        errors.AuditFailedError,
        errors.ActorFailedError,
        errors.PhaseTimeoutError,
        errors.ResourceError,
    ):
        assert issubclass(cls, errors.RunError) and issubclass(cls, ChatlearnMemError)


def test_a_missing_extra_names_what_to_install(monkeypatch):
    def fail(cfg, progress):
        raise ModuleNotFoundError("No module named 'ray'", name="ray")

    monkeypatch.setattr(loops, "run_ppo", fail)
    result = CliRunner().invoke(app, ["ppo"])
    assert result.exit_code == 1 and "chatlearn-mem with the [ray] extra" in result.output
    assert "Traceback" not in result.output


def test_the_command_without_its_extras_says_which_to_install(monkeypatch, capsys):
    from chatlearn_mem_cli.__main__ import main

    monkeypatch.delitem(sys.modules, "chatlearn_mem_cli.app")
    monkeypatch.setitem(sys.modules, "typer", None)  # as in a core-only install
    with pytest.raises(SystemExit) as e:
        main(["ppo"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the chatlearn-mem command needs 'typer'") and "chatlearn-mem[ray]" in err


def test_ppo_does_not_need_the_benchmark_package(monkeypatch):
    """With the benchmark's dependencies missing, `ppo` still loads its config (it used to import
    the benchmark package, and with it psutil, when the command line started)."""
    import subprocess

    code = (
        "import sys; sys.modules['psutil'] = None; sys.modules['chatlearn_mem_bench'] = None\n"
        "from typer.testing import CliRunner\n"
        "from chatlearn_mem_cli.app import app\n"
        "r = CliRunner().invoke(app, ['ppo', '--print-config'])\n"
        "assert r.exit_code == 0, r.output\n"
        "r = CliRunner().invoke(app, ['bench'])\n"
        "assert r.exit_code == 1 and 'the [bench] extra' in r.output, r.output\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_bench_without_config_is_the_cpu_preset():
    from chatlearn_mem_bench.config import DEFAULT_PRESET

    result = CliRunner().invoke(app, ["bench", "--print-config"])
    assert result.exit_code == 0 and f'"preset": "{DEFAULT_PRESET}"' in result.output


def test_ppo_without_ray_installed_says_which_extra_to_install(tmp_path):
    """A `[bench]`-only install has the command but not Ray: `ppo` ends in one error line."""
    import subprocess

    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from typer.testing import CliRunner\n"
        "from chatlearn_mem_cli.app import app\n"
        f"r = CliRunner().invoke(app, ['ppo', 'ppo.iterations=1', 'output_dir={tmp_path}'])\n"
        "print(r.exit_code); print(r.output)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    code_line, *message = out.stdout.strip().splitlines()
    assert code_line == "1", out.stdout
    assert message[0].startswith("error: Ray is required") and "chatlearn-mem[ray]" in message[0], out.stdout
    assert "Traceback" not in out.stdout


def _help(args: list, columns: int = 200) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": str(columns), "TERMINAL_WIDTH": None})
    assert result.exit_code == 0, result.output
    return result.output


def test_bench_help_shows_its_default_preset_and_a_bench_override_example():
    """Before: `bench --help` gave the ppo override example (ppo.iterations=5) and no default preset
    (the hand-written "[default: cpu]" was eaten as rich markup)."""
    from chatlearn_mem_bench.config import DEFAULT_PRESET

    text = _help(["bench"])
    assert f"[default: {DEFAULT_PRESET}]" in text
    assert "repeats=5" in text and "ppo.iterations" not in text


def test_ppo_help_shows_its_default_preset_and_a_ppo_override_example():
    from chatlearn_mem_ray.loops.ppo import DEFAULT_PRESET

    text = _help(["ppo"])
    assert f"[default: {DEFAULT_PRESET}]" in text and "ppo.iterations=5" in text


def _ragged(text: str) -> list:
    """Lines broken although the next line's first word would have fitted: the source's hand
    wrapping printed as is. Table cells (between │) are checked against the cell's right edge."""
    lines = text.splitlines()
    bad = []
    for line, nxt in zip(lines, lines[1:]):
        boxed = line.startswith("│")
        if boxed != nxt.startswith("│") or not line.strip(" │") or not nxt.strip(" │"):
            continue  # a paragraph or table ends here
        a, b = (line[1:-1], nxt[1:-1]) if boxed else (line, nxt)
        if boxed and len(b) - len(b.lstrip()) <= 2:
            continue  # the next row of the table, not the continuation of this one
        word = b.split()[0]
        if word.startswith("["):
            continue  # typer puts [default: ...] and [required] on a line of their own
        if len(a.rstrip()) + 1 + len(word) < len(a) - 1:
            bad.append(f"{line.rstrip()!r} / {nxt.strip()!r}")
    return bad


@pytest.mark.parametrize("columns", [80, 100])
@pytest.mark.parametrize(
    "command", [[], ["ppo"], ["bench"], ["bench-report"], ["presets"]], ids=lambda c: " ".join(c) or "top"
)
def test_help_wraps_cleanly(command, columns):
    """Before: typer's rich help kept the docstrings' line breaks, so `ppo --help` printed
    "continues from the" alone on a line of 80 columns."""
    text = _help(command, columns)
    assert max(map(len, text.splitlines())) <= columns
    assert not _ragged(text), "\n".join(_ragged(text))
