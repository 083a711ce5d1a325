"""The weight sync from the policy to the rollout before each generate phase, and with the vLLM
rollout the training-inference mismatch in train_policy and what the run says of both.

The megatron rollout (:func:`sync_rollout_model`) takes every tensor-parallel shard of the policy's
weights; with ``memory.verify_sync`` the digests on both sides must match. The vLLM rollout
(:func:`sync_engine`) pulls them streamed in buckets.

Per iteration (``log.json``, each iteration's ``weight_sync``):

- ``seconds``, ``bytes``, ``gb_per_s``: the engine's update from the policy's host store, streamed
  in buckets of ``rollout.sync_bucket_mb`` (the policy asleep throughout);
- ``share_of_iteration``: those seconds over the iteration's;
- with ``rollout.sync_baseline``: ``plain_copy_seconds`` and ``plain_copy_bytes``, a plain copy of the
  same weights from the same host stores into preallocated host tensors, timed by the policy's
  actors (every tensor-parallel rank at once: the slowest one's seconds) right after the sync, and
  ``vs_plain_copy``, the sync's time over the copy's.

The run's summary (``summary.weight_sync``) gives the medians and quartiles of these and says them
in one line at the end.
"""

from __future__ import annotations

import statistics
import warnings
from typing import TYPE_CHECKING, Optional

import torch

from chatlearn_mem_ray.errors import WeightSyncError, iteration_label

if TYPE_CHECKING:
    from chatlearn_mem_ray.ppo import PPORun

__all__ = [
    "recompute_old_logprobs",
    "sync_engine",
    "sync_rollout_model",
    "sync_summary",
    "sync_summary_line",
    "weight_sync_mismatch",
]


def weight_sync_mismatch(policy_digests: list[str], rollout_digests: list[str]) -> Optional[str]:
    """None when the rollout's weights equal the policy's shard for shard, else what differs."""
    bad = [i for i, (a, b) in enumerate(zip(policy_digests, rollout_digests)) if a != b]
    if len(policy_digests) != len(rollout_digests) or bad:
        return f"tensor-parallel shard(s) {bad or 'count'} differ after the weight sync"
    return None


def sync_rollout_model(run: "PPORun", index: int, senders: list) -> None:
    """megatron: the rollout model takes every tensor-parallel shard of the policy's weights;
    with ``memory.verify_sync`` their digests must match on both sides."""
    c = run.colo
    verify = run.cfg.memory.verify_sync
    triples = [a.weights_for_sync.options(num_returns=3).remote(verify) for a in senders]
    # Waiting on the small refs finds a dead sender by name; the states go actor to actor.
    dims = c.call("generate", {senders[0]: triples[0][1]})[senders[0]]
    digests = c.call("generate", {a: digest_ref for a, (_, _, digest_ref) in zip(senders, triples)})
    rollout_digests = c.call(
        "generate", {c.rollout: c.rollout.load_weights.remote(dims, *[state_ref for state_ref, _, _ in triples])}
    )[c.rollout]
    if verify:
        policy_digests = [digests[a] for a in senders]  # tensor-parallel rank order, as the shards
        mismatch = weight_sync_mismatch(policy_digests, rollout_digests)
        number, comparison = run.number(index)
        run.sync_checks.append(
            {
                "iteration": number,
                "manager_on": run.manager_on,
                "equal": mismatch is None,
                "policy": policy_digests,
                "rollout": rollout_digests,
            }
        )
        if mismatch:
            raise WeightSyncError(f"{iteration_label(number, comparison)}: {mismatch}")


def sync_engine(run: "PPORun", index: int, senders: list) -> dict:
    """The engine pulls the policy's weights from its host store, streamed in buckets; returns the
    iteration's ``weight_sync`` record (without its share of the iteration, known at the end). A
    stream that missed a tensor is an error there; whether the engine serves the policy's weights
    is checked in train_policy (:func:`recompute_old_logprobs`)."""
    c, rollout = run.colo, run.cfg.rollout
    bucket = int(rollout.sync_bucket_mb * 2**20)
    sync = c.call("generate", {c.rollout: c.rollout.sync_from.remote(senders, bucket)})[c.rollout]
    record = {"seconds": sync["seconds"], "bytes": sync["bytes"], "gb_per_s": sync["gb_per_s"]}
    if rollout.sync_baseline:  # every tensor-parallel rank copies its shards at once
        copies = c.call("generate", {a: a.host_weights_copy_seconds.remote() for a in senders})
        seconds = max(x["seconds"] for x in copies.values())
        record.update(
            plain_copy_seconds=seconds,
            plain_copy_bytes=sum(x["bytes"] for x in copies.values()),
            vs_plain_copy=sync["seconds"] / seconds if seconds > 0 else None,
        )
    number, _ = run.number(index)
    run.sync_checks.append({"iteration": number, "manager_on": run.manager_on, "engine": "vllm", **sync})
    return record


def recompute_old_logprobs(
    run: "PPORun", index: int, tokens: torch.Tensor, engine_old: torch.Tensor
) -> tuple[torch.Tensor, dict]:
    """The policy's own log-probs of the sampled tokens (PPO's old log-probs), and the
    training-inference mismatch against the engine's (``{"mean", "max"}``), also recorded with
    the iteration's sync.

    Raises:
        WeightSyncError: The two differ by more than 10x ``rollout.mismatch_warn``: the engine
            does not serve the policy's weights.
    """
    P = run.cfg.ppo.prompt_length
    old = run.forward_on("train_policy", run.colo.policy, tokens, run.cfg.ppo.temperature)[:, P - 1 :]
    diff = (old - engine_old).abs()
    mismatch = {"mean": diff.mean().item(), "max": diff.max().item()}
    number, comparison = run.number(index)
    record = next((r for r in reversed(run.sync_checks) if r["iteration"] == number), None)
    limit = run.cfg.rollout.mismatch_warn
    if record is not None:
        record.update(logprob_mismatch=mismatch, equal=mismatch["max"] <= 10 * limit)
    if mismatch["max"] > 10 * limit:
        raise WeightSyncError(
            f"{iteration_label(number, comparison)}: the engine's log-probs differ from the policy's by "
            f"{mismatch['max']:.3g} (more than 10x rollout.mismatch_warn={limit:g}): the engine does not "
            "serve the policy's weights"
        )
    if mismatch["max"] > limit:
        warnings.warn(
            f"{iteration_label(number, comparison)}: training-inference mismatch {mismatch['max']:.3g} "
            f"(max |policy - engine| log-prob) exceeds rollout.mismatch_warn={limit:g}",
            stacklevel=2,
        )
    return old, mismatch


def _quartiles(values: list[float]) -> dict:
    values = sorted(values)
    if len(values) < 2:
        return {"median": values[0], "q25": values[0], "q75": values[0], "n": len(values)}
    q = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": statistics.median(values), "q25": q[0], "q75": q[2], "n": len(values)}


def sync_summary(iterations: list[dict]) -> Optional[dict]:
    """Medians and quartiles over the iterations with the manager on that synced an engine (the
    first is left out when there are more: it includes the engine's first load of each layer's
    kernels); None when none did."""
    syncs = [m["weight_sync"] for m in iterations if m.get("weight_sync") and m["manager_on"]]
    if not syncs:
        return None
    if len(syncs) > 1:
        syncs = syncs[1:]
    out = {
        "iterations": len(syncs),
        "bytes": syncs[-1]["bytes"],
        "seconds": _quartiles([s["seconds"] for s in syncs]),
        "gb_per_s": _quartiles([s["gb_per_s"] for s in syncs]),
        "share_of_iteration": _quartiles([s["share_of_iteration"] for s in syncs]),
    }
    copies = [s for s in syncs if s.get("vs_plain_copy")]
    if copies:
        out["plain_copy_seconds"] = _quartiles([s["plain_copy_seconds"] for s in copies])
        out["vs_plain_copy"] = _quartiles([s["vs_plain_copy"] for s in copies])
    return out


def sync_summary_line(summary: dict) -> str:
    """``weight sync: ...`` for the end of the run."""
    s, share = summary["seconds"], summary["share_of_iteration"]
    line = (
        f"weight sync: {s['median'] * 1e3:.0f} ms per iteration (IQR {s['q25'] * 1e3:.0f}-{s['q75'] * 1e3:.0f}, "
        f"{summary['iterations']} iterations), {summary['bytes'] / 2**20:.1f} MiB at "
        f"{summary['gb_per_s']['median']:.2f} GB/s, {share['median'] * 100:.1f}% of the iteration"
    )
    if "vs_plain_copy" in summary:
        c, r = summary["plain_copy_seconds"], summary["vs_plain_copy"]
        line += (
            f"; {r['median']:.1f}x a plain copy of the same weights from the host store "
            f"({c['median'] * 1e3:.1f} ms, ratio IQR {r['q25']:.1f}-{r['q75']:.1f})"
        )
    return line
