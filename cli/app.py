"""The ``chatlearn-mem`` command: ``ppo`` runs a colocated PPO job, ``bench`` the memory benchmark,
``bench-report`` redraws a benchmark's markdown and plot from its JSON.

Both subcommands read their config the same way, through the project's one loader
(:func:`chatlearn_mem_cli.config_files.load_config`): ``--config`` takes a preset name or the path of a YAML
file, and every other argument is a dotted ``key=value`` override. ``presets`` lists the shipped
presets. A bad config prints ``error: ...`` (every problem, with its key) and exits 2; a run that
fails prints ``error: ...`` and exits 1; Ctrl-C prints how far the run got and where its log is,
and exits 130; SIGTERM (a scheduler's preemption) stops the run at the end of the iteration, saves
a checkpoint when checkpoints are on (``checkpoint.on_sigterm``), says how to resume and exits 143.
"""

from __future__ import annotations

import json
import shlex
from typing import Callable, List, Optional, TypeVar

import typer

from chatlearn_mem.errors import ChatlearnMemError, ConfigError
from chatlearn_mem_ray.config import DEFAULT_PRESET as PPO_DEFAULT

__all__ = ["app"]

T = TypeVar("T")

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Colocated RLHF on shared devices with an exact memory manager for megatron-core.")

_OVERRIDES_HELP = "dotted key=value overrides, values parsed as YAML (e.g. ppo.iterations=5)"
_CONFIG_HELP = "a preset name (see `chatlearn-mem presets`) or the path of a YAML file"


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _guarded(work: Callable[[], T]) -> T:
    """Run ``work``; a user mistake or run failure becomes one ``error:`` line and an exit code."""
    try:
        return work()
    except ConfigError as e:
        raise _fail(str(e), 2) from None
    except ChatlearnMemError as e:
        raise _fail(str(e), 1) from None
    except ImportError as e:  # an extra that is not installed (Ray, psutil, ...)
        hint = "" if "chatlearn-mem[" in str(e) else (
            " (a dependency of this command is missing; install chatlearn-mem with the [ray] extra "
            "for `ppo` or the [bench] extra for `bench`)")
        raise _fail(f"{e}{hint}", 1) from None
    except OSError as e:  # an output directory that cannot be written, a disk that is full, ...
        raise _fail(f"{type(e).__name__}: {e}", 1) from None
    except KeyboardInterrupt as e:  # RunInterrupted says how far the run got and where its log is
        from chatlearn_mem_ray.errors import RunTerminated

        typer.echo(str(e) or "stopped by Ctrl-C", err=True)
        raise typer.Exit(143 if isinstance(e, RunTerminated) else 130) from None


@app.command()
def ppo(overrides: Optional[List[str]] = typer.Argument(None, help=_OVERRIDES_HELP, show_default=False),
        config: str = typer.Option(PPO_DEFAULT, "--config", "-c", help=_CONFIG_HELP),
        print_config: bool = typer.Option(False, "--print-config", help="print the resolved config and exit"),
        resume: bool = typer.Option(False, "--resume", help="continue from the newest complete checkpoint in "
                                    "checkpoint.directory (same as checkpoint.resume=true)"),
        ) -> None:
    """Run PPO with the policy, critic, rollout and reference models colocated through Ray.

    Prints one line per iteration and writes log.json and memory_timeline.png to output_dir.
    With checkpoint.every=N it saves a checkpoint every N iterations; --resume continues from the
    newest one; checkpoint.max_restarts=K restarts the actors (up to K times) when one dies.
    """
    from chatlearn_mem_ray.config import load_config

    cfg = _guarded(lambda: load_config(config, [*(overrides or []), *(["checkpoint.resume=true"] if resume else [])]))
    if print_config:
        typer.echo(cfg.model_dump_json(indent=2))
        return

    def run() -> None:
        from chatlearn_mem_ray.ppo import run_ppo

        run_ppo(cfg, progress=typer.echo)

    _guarded(run)


@app.command()
def bench(overrides: Optional[List[str]] = typer.Argument(None, help=_OVERRIDES_HELP, show_default=False),
          config: Optional[str] = typer.Option(None, "--config", "-c", show_default=False,
                                               help=_CONFIG_HELP + " [default: cpu]"),
          print_config: bool = typer.Option(False, "--print-config", help="print the resolved config and exit"),
          quiet: bool = typer.Option(False, "--quiet", "-q", help="print only the targets"),
          ) -> None:
    """Time offload/onload of a megatron-core trainer against a plain-copy ceiling and the usual
    alternatives; write JSON, markdown and a PNG (to output_dir, default runs/bench)."""

    def load():  # the benchmark package is imported only when `bench` runs
        from chatlearn_mem_bench.config import DEFAULT_PRESET, load_config

        return load_config(config or DEFAULT_PRESET, overrides or [])

    cfg = _guarded(load)
    if print_config:
        typer.echo(json.dumps(cfg.model_dump(mode="json"), indent=2))
        return
    command = shlex.join(["chatlearn-mem", "bench", "--config", cfg.preset if config is None else config,
                          *(overrides or [])])

    def run() -> None:
        from chatlearn_mem_bench.run import run_and_report

        run_and_report(cfg, command, quiet=quiet, echo=typer.echo)

    _guarded(run)


@app.command("bench-report")
def bench_report(results: str = typer.Argument(..., help="the .json a benchmark run wrote (finished or not)"),
                 plot: bool = typer.Option(True, "--plot/--no-plot", help="draw the PNG too"),
                 ) -> None:
    """Rebuild a benchmark's markdown and PNG next to its JSON, from the JSON alone: for a run that
    was killed or timed out, every part it finished, the targets of those rows, and what is missing."""

    def run() -> None:
        from pathlib import Path

        from chatlearn_mem_bench.report import missing_summary, rebuild

        try:
            res, paths = rebuild(Path(results), plot=plot)
        except ValueError as e:  # not a benchmark's results
            raise _fail(str(e), 2) from None
        for p in paths:
            typer.echo(f"wrote {p}")
        typer.echo(missing_summary(res) or "complete run")

    _guarded(run)


@app.command()
def presets() -> None:
    """List the shipped presets of `ppo` and `bench` (use them with --config NAME)."""
    from chatlearn_mem_cli.config_files import preset_names

    def show(label: str, module: str) -> None:
        from importlib import resources

        names = preset_names(resources.files(module))
        typer.echo(f"{label}: {', '.join(names) if names else '(none installed)'}")

    show("ppo", "chatlearn_mem_ray.presets")
    show("bench", "chatlearn_mem_bench.presets")
