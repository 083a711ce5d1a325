"""The ``chatlearn-mem`` command: ``ppo`` runs a colocated PPO job, ``bench`` the memory benchmark."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Colocated RLHF on shared devices with an exact memory manager for megatron-core.")


@app.command()
def ppo(config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML run config (see configs/)."),
        overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides, e.g. ppo.iterations=5"),
        ) -> None:
    """Run PPO with the policy, critic, rollout and reference models colocated through Ray.

    Prints one line per iteration and writes log.json and memory_timeline.png to output_dir.
    """
    from ray_actors.cluster import ActorFailedError, PhaseTimeoutError, ResourceError
    from ray_actors.config import ConfigError, load_config
    from ray_actors.ppo import AuditFailedError, run_ppo

    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    try:
        run_ppo(cfg, progress=typer.echo)
    except (ResourceError, ActorFailedError, PhaseTimeoutError, AuditFailedError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False)
def bench(ctx: typer.Context) -> None:
    """Memory benchmark (arguments go to ``python -m benchmarks``; try ``bench --help``)."""
    try:
        from benchmarks import main as bench_main
    except ImportError as e:
        typer.echo(f"error: the benchmarks package is not importable ({e}); run from a source checkout "
                   "installed with `pip install -e .`", err=True)
        raise typer.Exit(2)
    raise typer.Exit(bench_main(list(ctx.args)))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
