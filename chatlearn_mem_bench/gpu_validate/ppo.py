"""The ``ppo`` step: ``chatlearn-mem ppo --config gpu`` scaled to one GPU (optional, last), its config
as the command line resolves it, how its log is read and its section of the summary.

The benchmark does not import the app (``chatlearn_mem_ray``): the config comes from
``chatlearn-mem ppo ... --print-config`` in a process of its own, exactly as the step's run reads it.
The ``report`` step measures the policy trainer of that same config (:func:`policy_config`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from chatlearn_mem_bench.gpu_validate import checkout

__all__ = ["PPO_OVERRIDES", "PRESET", "collect", "command", "lines", "outputs", "policy_config", "ppo_config"]

PRESET = "gpu"
"""The PPO preset the step scales down (configs/ppo/gpu.yaml: 8 ranks, TP=2)."""
PPO_OVERRIDES = (
    "parallel.world_size=1",
    "parallel.tensor_model_parallel_size=1",
    "ppo.iterations=2",
    "ppo.prompts_per_iteration=64",
    "ppo.prompt_length=64",
    "ppo.response_length=64",
    "ppo.minibatch_size=16",
    "memory.compare_iterations=1",
    "memory.verify_sync=true",
    "ray.cpus_per_rank=4",
)
"""configs/ppo/gpu.yaml (8 ranks, TP=2) scaled to one GPU and its step's budget."""
CONFIG_TIMEOUT_S = 120
"""Seconds ``chatlearn-mem ppo --print-config`` may take (about 2 s on a 2-core machine)."""


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "chatlearn_mem_cli", "ppo", "--config", PRESET, *PPO_OVERRIDES, *args]


def command(out: Path, stem: str) -> list[str]:
    """The PPO run, its log and memory timeline under ``<out>/<stem>_ppo``."""
    return _cli(f"output_dir={out / (stem + '_ppo')}")


def outputs(out: Path, stem: str) -> list[Path]:
    """The run's log (first: what :func:`collect` reads) and its memory timeline."""
    return [out / f"{stem}_ppo" / "log.json", out / f"{stem}_ppo" / "memory_timeline.png"]


def ppo_config() -> dict:
    """The step's config, resolved and validated by the command line (``--print-config``).

    Raises:
        ConfigError: The command refused the config or failed; its error output is quoted.
    """
    from chatlearn_mem.errors import ConfigError

    args = _cli("--print-config")
    out = subprocess.run(args, capture_output=True, text=True, timeout=CONFIG_TIMEOUT_S, cwd=checkout.REPO)
    start = out.stdout.find("{")
    if out.returncode != 0 or start < 0:
        raise ConfigError(
            f"`chatlearn-mem ppo --config {PRESET} ... --print-config` exited {out.returncode}: "
            f"{(out.stderr or out.stdout).strip()[-1500:]}"
        )
    return json.JSONDecoder().raw_decode(out.stdout[start:])[0]


def policy_config():
    """The policy trainer of the step's config as a :class:`~chatlearn_mem.models.gpt.GPTTrainerConfig`
    (the app's own fields, a Hugging Face checkpoint to start from, left out: the report builds a
    random init, as it did from the app's config)."""
    from chatlearn_mem.models.gpt import GPTTrainerConfig

    policy = ppo_config()["policy"]
    return GPTTrainerConfig(**{k: v for k, v in policy.items() if k in GPTTrainerConfig.model_fields})


def collect(results: dict, entry: dict) -> None:
    """The run's log into ``results["ppo"]`` (summary, syncs verified, audits clean), and the detail."""
    path = Path(entry["outputs"][0])
    if not path.exists():
        return
    log = json.loads(path.read_text())
    audits = log.get("audits") or {}
    results["ppo"] = {
        "summary": log["summary"],
        "iterations": len(log["iterations"]),
        "sync_ok": all(c.get("equal", False) for c in log.get("sync_checks", [])),
        "audits_ok": audits.get("runs") == audits.get("checks_clean"),
        "audits": audits,
    }
    on = log["summary"].get("memory_manager_on") or {}
    entry["detail"] = f"colocation ratio {on.get('ratio', float('nan')):.3f} with the manager on"


def lines(results: dict) -> list[str]:
    """The summary's section: peak colocated bytes over the largest phase, with and without the manager."""
    ppo = results.get("ppo")
    if not ppo:
        return []
    out = ["", "## Colocated PPO on one GPU", ""]
    for key in ("memory_manager_on", "memory_manager_off"):
        s = ppo["summary"].get(key)
        if s:
            out.append(
                f"- {key.replace('_', ' ')}: peak colocated {s['peak_colocated_bytes'] / 2**30:.2f} GiB "
                f"({s['peak_phase']}) / largest phase {s['largest_phase_bytes'] / 2**30:.2f} GiB "
                f"({s['largest_phase']}) = {s['ratio']:.3f}"
            )
    out.append(
        f"- {ppo['iterations']} iterations in {ppo['summary'].get('seconds', 0):.0f} s; "
        f"weight syncs verified: {ppo['sync_ok']}; audits clean: {ppo['audits_ok']}"
    )
    return out
