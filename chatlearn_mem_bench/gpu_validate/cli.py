"""The command line: ``python -m chatlearn_mem_bench.gpu_validate [--dry-run] [--steps ...] ...``
(``scripts/gpu_validate.sh`` runs it on the GPU machine). See the package's docstring."""

from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from chatlearn_mem_bench.gpu_validate import checkout
from chatlearn_mem_bench.gpu_validate.steps import DEFAULT_STEPS, STEPS, TOTAL_BUDGET_S

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m chatlearn_mem_bench.gpu_validate",
        description="Validate chatlearn-mem on one GPU in one command; --dry-run checks everything up to "
        "the first CUDA call, anywhere.",
    )
    p.add_argument("--dry-run", action="store_true", help="check everything up to the first CUDA call, then stop")
    p.add_argument("--out", default=str(checkout.REPO / "benchmarks" / "results"), help="where the results go")
    p.add_argument("--wheelhouse", default=None, help="check this wheelhouse (e.g. .whl)")
    p.add_argument(
        "--steps",
        default=",".join(DEFAULT_STEPS),
        help=f"comma-separated subset of {','.join(STEPS)} (default {','.join(DEFAULT_STEPS)}); they run in that order",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=float(TOTAL_BUDGET_S),
        help=f"seconds for all steps; a step with too little left is skipped (default {TOTAL_BUDGET_S})",
    )
    p.add_argument(
        "--revision",
        default=None,
        help="source revision to record (default: git HEAD here, else the wheelhouse's REVISION)",
    )
    p.add_argument("--report-json", default=None, help=argparse.SUPPRESS)  # the report step's own process
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse the command line and run: the report step's process, the dry run or the GPU run.
    Returns the exit status (0 ok, 1 a step failed, 2 a setup problem); a bad ``--steps`` exits 2."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.report_json:
        from chatlearn_mem_bench.gpu_validate import device_report

        device_report.main(args.report_json)  # ends the process
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    bad = [s for s in steps if s not in STEPS]
    if bad or not steps:
        ap.error(f"unknown step(s) {bad}; steps are {', '.join(STEPS)}")
    os.chdir(checkout.REPO)
    if args.dry_run:
        from chatlearn_mem_bench.gpu_validate.dry_run import dry_run

        return dry_run(args, steps)
    from chatlearn_mem_bench.gpu_validate.run import run

    return run(args, steps)
