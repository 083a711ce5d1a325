"""The ``chatlearn-mem`` command: ``ppo`` and ``grpo`` run a colocated PPO or GRPO job on the
colocation service, ``bench`` the memory benchmark, ``bench-report`` redraws a benchmark's markdown
and plot from its JSON.

Every subcommand reads its config the same way, through the project's one loader
(:func:`chatlearn_mem_cli.config_files.load_config`): ``--config`` takes a preset name or the path
of a YAML file, and every other argument is a dotted ``key=value`` override. ``presets`` lists the
shipped presets with their one-line summaries. A bad config prints ``error: ...`` (every problem,
with its key; an unknown key with the nearest known one) and exits 2; a run that fails prints
``error: ...`` and exits 1; Ctrl-C prints how far the run got and where its log is, and exits 130;
SIGTERM (a scheduler's preemption) stops the run at the end of the iteration, saves a checkpoint
when checkpoints are on (``checkpoint.on_sigterm``), says how to resume and exits 143.
"""

from __future__ import annotations

import inspect
import json
import shlex
from typing import Callable, List, Optional, TypeVar

import typer

from chatlearn_mem.errors import ChatlearnMemError, ConfigError
from chatlearn_mem_ray.loops.grpo.config import DEFAULT_GRPO_PRESET as GRPO_DEFAULT
from chatlearn_mem_ray.loops.ppo import DEFAULT_PRESET as PPO_DEFAULT

try:  # shown by `bench --help`; without the benchmark's extras, `bench` says what to install when run
    from chatlearn_mem_bench.config import DEFAULT_PRESET as BENCH_DEFAULT
except ImportError:
    BENCH_DEFAULT = None

__all__ = ["app"]

T = TypeVar("T")

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Colocated RLHF on shared devices with an exact memory manager for megatron-core.",
)

# Help texts hold no square brackets: typer's rich help reads them as markup and drops them.
_OVERRIDES_HELP = "dotted key=value overrides, values parsed as YAML (e.g. {})"
_CONFIG_HELP = "a preset name (see `chatlearn-mem presets`) or the path of a YAML file"


def _paragraphs(doc: str) -> str:
    """``doc`` with each paragraph on one line. Typer's rich help keeps a docstring's single line
    breaks, so the source's hand wrapping would print as ragged lines; the terminal wraps instead."""
    return "\n\n".join(" ".join(p.split()) for p in inspect.cleandoc(doc).split("\n\n"))


def _command(name: Optional[str] = None) -> Callable[[Callable], Callable]:
    """``app.command``, its help the function's docstring with the paragraphs unwrapped. The first
    paragraph is what the command list shows: keep it to one sentence."""
    return lambda f: app.command(name, help=_paragraphs(f.__doc__))(f)


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
        hint = (
            ""
            if "chatlearn-mem[" in str(e)
            else (
                " (a dependency of this command is missing; install chatlearn-mem with the [ray] extra "
                "for `ppo` or the [bench] extra for `bench`)"
            )
        )
        raise _fail(f"{e}{hint}", 1) from None
    except OSError as e:  # an output directory that cannot be written, a disk that is full, ...
        raise _fail(f"{type(e).__name__}: {e}", 1) from None
    except KeyboardInterrupt as e:  # RunInterrupted says how far the run got and where its log is
        from chatlearn_mem_ray.errors import RunTerminated

        typer.echo(str(e) or "stopped by Ctrl-C", err=True)
        raise typer.Exit(143 if isinstance(e, RunTerminated) else 130) from None


_RESUME_HELP = "continue from the newest complete checkpoint in checkpoint.directory (same as checkpoint.resume=true)"


def _run_loop(kind: str, config: str, overrides: Optional[List[str]], print_config: bool, resume: bool) -> None:
    """Load ``kind``'s config (``ppo`` or ``grpo``), print it or run the loop, as the commands say."""
    from chatlearn_mem_ray.config import load_config
    from chatlearn_mem_ray.loops import GRPORunConfig, RunConfig

    schema = {"ppo": RunConfig, "grpo": GRPORunConfig}[kind]
    extra = ["checkpoint.resume=true"] if resume else []
    cfg = _guarded(lambda: load_config(config, [*(overrides or []), *extra], schema))
    if print_config:
        typer.echo(cfg.model_dump_json(indent=2))
        return

    def run() -> None:
        from chatlearn_mem_ray.loops import run_grpo, run_ppo

        (run_ppo if kind == "ppo" else run_grpo)(cfg, progress=typer.echo)

    _guarded(run)


@_command()
def ppo(
    overrides: Optional[List[str]] = typer.Argument(
        None, help=_OVERRIDES_HELP.format("ppo.iterations=5 memory.enabled=false"), show_default=False
    ),
    config: str = typer.Option(PPO_DEFAULT, "--config", "-c", help=_CONFIG_HELP),
    print_config: bool = typer.Option(False, "--print-config", help="print the resolved config and exit"),
    resume: bool = typer.Option(False, "--resume", help=_RESUME_HELP),
) -> None:
    """Run PPO with the policy, critic, rollout and reference models colocated through Ray.

    Prints one line per iteration and writes log.json and memory_timeline.png to output_dir.
    With checkpoint.every=N it saves a checkpoint every N iterations; --resume continues from the
    newest one; checkpoint.max_restarts=K restarts the actors (up to K times) when one dies.
    """
    _run_loop("ppo", config, overrides, print_config, resume)


@_command()
def grpo(
    overrides: Optional[List[str]] = typer.Argument(
        None, help=_OVERRIDES_HELP.format("grpo.group_size=8 grpo.kl_coef=0"), show_default=False
    ),
    config: str = typer.Option(GRPO_DEFAULT, "--config", "-c", help=_CONFIG_HELP),
    print_config: bool = typer.Option(False, "--print-config", help="print the resolved config and exit"),
    resume: bool = typer.Option(False, "--resume", help=_RESUME_HELP),
) -> None:
    """Run GRPO with the policy, its rollout and (with a KL term) a reference colocated through Ray.

    group_size responses per prompt, advantages normalised within each group (grpo.variant=dr_grpo:
    Dr. GRPO; grpo.estimator, grpo.loss_agg, grpo.policy_loss, grpo.dynamic_sampling for the
    others), no critic; with grpo.kl_coef=0 no reference model is launched. data.val_files with
    validation.every validates on held-out prompts; the policy is exported as a Hugging Face
    directory at the end (export.hf_every for more); logger=[console,tensorboard,wandb,mlflow].
    Output, checkpoints, --resume and restarts as for ppo.
    """
    _run_loop("grpo", config, overrides, print_config, resume)


@_command()
def bench(
    overrides: Optional[List[str]] = typer.Argument(
        None, help=_OVERRIDES_HELP.format("repeats=5 trainer.num_layers=4"), show_default=False
    ),
    config: Optional[str] = typer.Option(
        BENCH_DEFAULT, "--config", "-c", show_default=BENCH_DEFAULT is not None, help=_CONFIG_HELP
    ),
    print_config: bool = typer.Option(False, "--print-config", help="print the resolved config and exit"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="print only the targets"),
) -> None:
    """Time offload/onload of a megatron-core trainer against a plain-copy ceiling and the usual
    alternatives.

    Writes JSON, markdown and a PNG to output_dir (default runs/bench) and prints the targets.
    """

    def load():  # without the [bench] extra, this import fails: one error line naming it
        from chatlearn_mem_bench.config import DEFAULT_PRESET, load_config

        return load_config(config or DEFAULT_PRESET, overrides or [])

    cfg = _guarded(load)
    if print_config:
        typer.echo(json.dumps(cfg.model_dump(mode="json"), indent=2))
        return
    command = shlex.join(
        ["chatlearn-mem", "bench", "--config", cfg.preset if config is None else config, *(overrides or [])]
    )

    def run() -> None:
        from chatlearn_mem.models import gpt
        from chatlearn_mem_bench.run import run_and_report

        with gpt.owned_process_group():  # destroyed before exit: a NCCL group left to it holds it up
            run_and_report(cfg, command, quiet=quiet, echo=typer.echo)

    _guarded(run)


@_command("bench-report")
def bench_report(
    results: str = typer.Argument(..., help="the .json a benchmark run wrote (finished or not)"),
    plot: bool = typer.Option(True, "--plot/--no-plot", help="draw the PNG too"),
) -> None:
    """Rebuild a benchmark's markdown and PNG next to its JSON, from the JSON alone.

    For a run that was killed or timed out: every part it finished, the targets of those rows, and
    what is missing.
    """

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


@_command()
def presets() -> None:
    """List the presets of `ppo`, `grpo` and `bench`, one line on each (use them with --config NAME)."""
    from importlib import resources

    from chatlearn_mem_config_files import preset_description, preset_names

    def show(label: str, module: str, default: Optional[str]) -> None:
        where = resources.files(module)
        names = preset_names(where)
        typer.echo(
            f"{label}: {', '.join(names) if names else '(none installed)'}"
            + (f" (default: {default})" if default in names else "")
        )
        width = max(map(len, names), default=0)
        for name in names:
            typer.echo(f"  {name:<{width}}  {preset_description(where, name)}".rstrip())

    show("ppo", "chatlearn_mem_ray.presets", PPO_DEFAULT)
    show("grpo", "chatlearn_mem_ray.grpo_presets", GRPO_DEFAULT)
    show("bench", "chatlearn_mem_bench.presets", BENCH_DEFAULT)
