"""What a run's ``log.json`` holds that must not depend on timing: the outcome two runs of the same
training share bit for bit (PPO's golden record, restarts, resumes)."""

TIMING = (
    "seconds",
    "phase_seconds",
    "checkpoint_seconds",
    "transition_seconds",
    "rss_bytes",
    "reward_seconds",  # a run on text: the reward function's seconds, and the driver's wait for it
    "reward_wait_seconds",
    "weight_sync",  # a vLLM rollout: the sync's seconds and host memory (its digests are in sync_checks)
    "export_seconds",  # a Hugging Face export's seconds (its digest is in the log's exports)
)
"""Measured, not computed: they differ between two runs of the same training."""


def outcome(log: dict) -> dict:
    """Every iteration's metrics (timings left out), the weight syncs' digests, every phase's
    device bytes, the colocation figures and the final weights of every trainer rank."""
    return {
        "iterations": [{k: v for k, v in m.items() if k not in TIMING} for m in log["iterations"]],
        "syncs": [_sync(c) for c in log["sync_checks"]],
        "phase_bytes": [
            (p["iteration"], p["manager_on"], p["phase"], p["device_bytes"], p["need_bytes"])
            for p in log["memory_timeline"]
        ],
        "colocation": {
            k: {
                f: s[f] for f in ("peak_colocated_bytes", "largest_phase_bytes", "ratio", "peak_phase", "largest_phase")
            }
            for k, s in log["summary"].items()
            if isinstance(s, dict) and "ratio" in s
        },
        "final_weights": log["final_weights"],
    }


def _sync(check: dict) -> tuple:
    """What a weight sync's check shows of the weights: the megatron rollout's digests on both sides
    per tensor-parallel shard, or a vLLM engine's digest of the parameters it loaded and whether it
    verified them against the policy's stream (its seconds and memory are timing)."""
    if check.get("engine") == "vllm":
        return (check["iteration"], "vllm", check.get("digest"), check.get("verified"), check.get("param"))
    return (check["iteration"], check.get("policy"), check.get("rollout"))
