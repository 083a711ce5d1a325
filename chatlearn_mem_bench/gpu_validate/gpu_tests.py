"""The steps that run the GPU test tier with pytest: ``handoff`` (another process takes the memory a
sleeping trainer gave back, with the figures the test writes) and ``tests`` (the rest of
``tests/gpu``). Each one's command, how its outcomes are read (from the junit file, or from the
streamed log of a run cut off before it) and its sections of the summary."""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = [
    "HANDOFF_JSON_ENV",
    "HANDOFF_TEST",
    "TMS_TEST",
    "collect_handoff",
    "collect_tests",
    "handoff_command",
    "handoff_lines",
    "tests_command",
    "tests_lines",
]

HANDOFF_TEST = "tests/gpu/test_gpu_handoff.py"
TMS_TEST = "tests/gpu/test_gpu_tms.py"
"""GPU tests the ``tests`` step leaves to the steps that cover them (``handoff``, ``tms``)."""
HANDOFF_JSON_ENV = "CHATLEARN_MEM_HANDOFF_JSON"
"""Where the handoff test writes its figures (``handoff.json`` in the step's folder)."""
_PYTEST_LINE = re.compile(r"^(tests/\S+?\.py)::(\S+) (PASSED|FAILED|ERROR|SKIPPED)")


def _pytest(*paths: str, junit: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        *paths,
        "-v",
        "-rA",
        "-p",
        "no:cacheprovider",
        # a test still running after 60 s prints every thread's stack into the log (and goes on)
        "-o",
        "faulthandler_timeout=60",
        "--durations=0",
        f"--junitxml={junit}",
    ]


def handoff_command(work: Path) -> list[str]:
    """``pytest tests/gpu/test_gpu_handoff.py``, its junit file in ``work``."""
    return _pytest(HANDOFF_TEST, junit=work / "junit_handoff.xml")


def tests_command(work: Path) -> list[str]:
    """``pytest tests/gpu`` but the files the ``handoff`` and ``tms`` steps cover."""
    return _pytest("tests/gpu", f"--ignore={HANDOFF_TEST}", f"--ignore={TMS_TEST}", junit=work / "junit.xml")


def _pytest_log(path: Path) -> list[dict]:
    """Outcomes of the tests a ``pytest -v`` log reports (for a run cut off before its junit file)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        m = _PYTEST_LINE.match(line)
        if m:
            out.append(
                {
                    "test": f"{Path(m.group(1)).stem}::{m.group(2)}",
                    "outcome": m.group(3).lower(),
                    "seconds": 0.0,
                    "message": "from the log (the run was cut off before its junit file)",
                }
            )
    return out


def _junit(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (el.get("message") or "")[:500]
        out.append(
            {
                "test": f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}",
                "outcome": outcome,
                "seconds": float(case.get("time") or 0),
                "message": message,
            }
        )
    return out


def _outcomes(results: dict, key: str, junit: Path, entry: dict) -> None:
    """A pytest step's outcomes into ``results[key]`` and the step's status and detail."""
    results[key] = _junit(junit) or _pytest_log(Path(entry["log"]))
    if any(t["outcome"] in ("failed", "error") for t in results[key]):
        entry["status"] = "failed"
    counts = {o: sum(t["outcome"] == o for t in results[key]) for o in ("passed", "failed", "error", "skipped")}
    entry["detail"] = ", ".join(f"{n} {o}" for o, n in counts.items() if n)


def collect_tests(results: dict, work: Path, entry: dict) -> None:
    """The ``tests`` step's outcomes into ``results["tests"]``."""
    _outcomes(results, "tests", work / "junit.xml", entry)


def collect_handoff(results: dict, work: Path, entry: dict) -> None:
    """The ``handoff`` step's outcomes into ``results["handoff_tests"]``, its figures into
    ``results["handoff"]``."""
    _outcomes(results, "handoff_tests", work / "junit_handoff.xml", entry)
    figures = work / "handoff.json"
    if figures.exists():
        results["handoff"] = json.loads(figures.read_text())
        take = results["handoff"].get("take")
        if take:
            entry["detail"] += (
                f"; the other process got {take['engine_got_bytes'] / 2**30:.1f} GiB, "
                f"{take['engine_got_over_state']:.1f}x the trainer's state"
            )


def tests_lines(results: dict) -> list[str]:
    """The GPU tests' table: outcome, seconds and message of each."""
    tests = results.get("tests", [])
    if not tests:
        return []
    lines = ["", "## GPU tests", "", "| test | outcome | seconds | message |", "|---|---|---:|---|"]
    for t in tests:
        msg = t["message"].replace("|", "/").replace("\n", " ")[:200]
        lines.append(f"| {t['test']} | {t['outcome']} | {t['seconds']:.1f} | {msg} |")
    return lines


def handoff_lines(results: dict) -> list[str]:
    """The handoff's tests and figures: what the other process got, what a failed wake left."""
    tests, figures = results.get("handoff_tests"), results.get("handoff") or {}
    if not tests and not figures:
        return []
    lines = ["", "## Another process takes the memory the trainer gave back (`handoff` step)", ""]
    lines += [f"- {t['test']}: {t['outcome']} ({t['seconds']:.1f} s) {t['message'][:200]}" for t in tests or []]
    take = figures.get("take")
    if take:
        lines.append(
            f"- the trainer's state {take['trainer_state_bytes'] / 2**30:.2f} GiB; its offload freed "
            f"{take['freed_by_the_offload_bytes'] / 2**30:.2f} GiB; the other process got "
            f"{take['engine_got_bytes'] / 2**30:.2f} GiB ({take['engine_got_over_state']:.1f}x the state) of the "
            f"{take['engine_free_seen_bytes'] / 2**30:.2f} GiB it saw free, wrote it in {take['engine_seconds']:.1f} s"
        )
    hold = figures.get("hold")
    if hold:
        lines.append(
            f"- while another process held {hold['engine_held_bytes'] / 2**30:.2f} GiB, the onload failed and left "
            f"{', '.join(hold['parts_still_offloaded_after_the_failed_onload'])} offloaded; it woke once the memory was back"
        )
    return lines
