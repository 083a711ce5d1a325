"""The weight sync from a trainer to the engine that follows it (``p.sync(trainer, engine)`` in a
phase), and with the vLLM rollout the training-inference mismatch and what the run says of both.

The megatron rollout (:func:`sync_rollout_model`) takes every tensor-parallel shard of the trainer's
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
from typing import Any, Optional, Protocol

import torch

from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.errors import WeightSyncError, iteration_label

__all__ = [
    "engine_mismatch",
    "recompute_old_logprobs",
    "sync_engine",
    "sync_rollout_model",
    "sync_summary",
    "sync_summary_line",
    "weight_sync_mismatch",
]


class SyncRecords(Protocol):
    """What a sync needs of the service (:class:`~chatlearn_mem_ray.service.service.Service`): its
    actors, its config, where the run is, and the list its checks go to."""

    colo: Any
    cfg: LoopConfig
    where: tuple
    manager_on: bool
    sync_checks: list[dict]

    def number(self, index: int) -> tuple[int, bool]: ...


class RunningPhase(Protocol):
    """What the mismatch needs of a running phase (:class:`~chatlearn_mem_ray.service.service.PhaseContext`)."""

    svc: SyncRecords

    def forward(self, model: str, tokens: torch.Tensor, *args) -> torch.Tensor: ...


def weight_sync_mismatch(policy_digests: list[str], rollout_digests: list[str]) -> Optional[str]:
    """None when the rollout's weights equal the policy's shard for shard, else what differs."""
    bad = [i for i, (a, b) in enumerate(zip(policy_digests, rollout_digests)) if a != b]
    if len(policy_digests) != len(rollout_digests) or bad:
        return f"tensor-parallel shard(s) {bad or 'count'} differ after the weight sync"
    return None


def sync_rollout_model(svc: SyncRecords, phase: str, rollout, senders: list) -> None:
    """megatron: the rollout model takes every tensor-parallel shard of the trainer's weights from
    ``senders`` (its tensor-parallel ranks, in order); with ``memory.verify_sync`` their digests
    must match on both sides."""
    c = svc.colo
    verify = svc.cfg.memory.verify_sync
    triples = [a.weights_for_sync.options(num_returns=3).remote(verify) for a in senders]
    # Waiting on the small refs finds a dead sender by name; the states go actor to actor.
    dims = c.call(phase, {senders[0]: triples[0][1]})[senders[0]]
    digests = c.call(phase, {a: digest_ref for a, (_, _, digest_ref) in zip(senders, triples)})
    rollout_digests = c.call(
        phase, {rollout: rollout.load_weights.remote(dims, *[state_ref for state_ref, _, _ in triples])}
    )[rollout]
    if verify:
        policy_digests = [digests[a] for a in senders]  # tensor-parallel rank order, as the shards
        mismatch = weight_sync_mismatch(policy_digests, rollout_digests)
        number, comparison = svc.number(svc.where[0])
        svc.sync_checks.append(
            {
                "iteration": number,
                "manager_on": svc.manager_on,
                "equal": mismatch is None,
                "policy": policy_digests,
                "rollout": rollout_digests,
            }
        )
        if mismatch:
            raise WeightSyncError(f"{iteration_label(number, comparison)}: {mismatch}")


def sync_engine(svc: SyncRecords, phase: str, engine, senders: list) -> dict:
    """The engine pulls the trainer's weights from its host store, streamed in buckets, and verifies
    them bit for bit (with ``memory.verify_sync``); returns the iteration's ``weight_sync`` record
    (without its share of the iteration, known at the end): seconds, bytes, the verification's
    seconds, the peak host memory growth of the engine's and the trainer's processes.

    Raises:
        WeightSyncError: The update failed, was incomplete or did not verify (the differing
            parameter named): before the engine samples. The log-probs the trainer recomputes
            later (:func:`engine_mismatch`) check what a digest cannot see."""
    c, rollout = svc.colo, svc.cfg.rollout
    bucket = int(rollout.sync_bucket_mb * 2**20)
    sync = c.call(phase, {engine: engine.sync_from.remote(senders, bucket)})[engine]
    number, comparison = svc.number(svc.where[0])
    if "error" in sync:  # the engine refuses to sample now: stop before it does
        svc.sync_checks.append({"iteration": number, "manager_on": svc.manager_on, "engine": "vllm", **sync})
        raise WeightSyncError(f"{iteration_label(number, comparison)}: the weight sync did not take: {sync['error']}")
    record = {
        "seconds": sync["seconds"],
        "bytes": sync["bytes"],
        "gb_per_s": sync["gb_per_s"],
        "verify_seconds": sync["hash_seconds"] + sync["verify_seconds"],
        "engine_peak_rss_bytes": sync["engine_peak_rss_bytes"],
        "policy_peak_rss_bytes": sync["policy_peak_rss_bytes"],
        "engine_peak_shared_bytes": sync["engine_peak_shared_bytes"],
        "policy_peak_shared_bytes": sync["policy_peak_shared_bytes"],
        "bucket_bytes": bucket,
    }
    if rollout.sync_baseline:  # every tensor-parallel rank copies its shards at once
        copies = c.call(phase, {a: a.host_weights_copy_seconds.remote(bucket) for a in senders})
        seconds = max(x["seconds"] for x in copies.values())
        record.update(
            plain_copy_seconds=seconds,
            plain_copy_bytes=sum(x["bytes"] for x in copies.values()),
            vs_plain_copy=sync["seconds"] / seconds if seconds > 0 else None,
        )
    svc.sync_checks.append({"iteration": number, "manager_on": svc.manager_on, "engine": "vllm", **sync})
    return record


def engine_mismatch(
    p: RunningPhase,
    model: str,
    tokens: torch.Tensor,
    engine_logprobs: torch.Tensor,
    mask: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, dict]:
    """Trainer ``model``'s own log-probs of the sampled sequences (the old log-probs of the clipped
    objective, (B, T-1)), and the training-inference mismatch against the engine's on the positions
    ``mask`` picks (``{"mean", "max"}``), also recorded with the iteration's sync.

    Args:
        p: The running phase (it must need ``model``).
        tokens: (B, T) the sampled sequences; ``engine_logprobs``, ``mask``: (B, T-1).

    Raises:
        WeightSyncError: The two differ by more than 10x ``rollout.mismatch_warn``, or not by a
            finite amount: the engine does not serve the trainer's weights.
    """
    svc = p.svc
    own = p.forward(model, tokens, temperature)
    diff = (own - engine_logprobs).abs()[mask.bool()]
    mismatch = {"mean": diff.mean().item(), "max": diff.max().item()}
    number, comparison = svc.number(svc.where[0])
    record = next((r for r in reversed(svc.sync_checks) if r["iteration"] == number), None)
    limit = svc.cfg.mismatch_warn
    bad = not mismatch["max"] <= 10 * limit  # a NaN is bad too
    if record is not None:
        record.update(logprob_mismatch=mismatch, equal=not bad)
    if bad:
        raise WeightSyncError(
            f"{iteration_label(number, comparison)}: the engine's log-probs differ from the policy's by "
            f"{mismatch['max']:.3g} (more than 10x rollout.mismatch_warn={limit:g}, or not a number): the engine "
            "does not serve the policy's weights"
        )
    if mismatch["max"] > limit:
        warnings.warn(
            f"{iteration_label(number, comparison)}: training-inference mismatch {mismatch['max']:.3g} "
            f"(max |policy - engine| log-prob) exceeds rollout.mismatch_warn={limit:g}",
            stacklevel=2,
        )
    return own, mismatch


def recompute_old_logprobs(
    p: RunningPhase,
    model: str,
    tokens: torch.Tensor,
    engine_old: torch.Tensor,
    prompt_length: int,
    temperature: float,
) -> tuple[torch.Tensor, dict]:
    """:func:`engine_mismatch` for prompts of one length and responses of another (PPO's): the
    engine's and the trainer's log-probs of the response tokens only, (B, R) each."""
    width = tokens.shape[1] - 1
    full = torch.zeros(tokens.shape[0], width, dtype=engine_old.dtype)
    full[:, prompt_length - 1 :] = engine_old
    mask = torch.zeros_like(full)
    mask[:, prompt_length - 1 :] = 1
    own, mismatch = engine_mismatch(p, model, tokens, full, mask, temperature)
    return own[:, prompt_length - 1 :], mismatch


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
    if all("engine_peak_rss_bytes" in s for s in syncs):  # host memory during a sync, in buckets
        bucket = syncs[-1]["bucket_bytes"]
        out["verify_seconds"] = _quartiles([s["verify_seconds"] for s in syncs])
        out["bucket_bytes"] = bucket
        for side in ("engine", "policy"):
            for kind in ("rss", "shared"):
                key = f"{side}_peak_{kind}_bytes"
                out[key] = max(s[key] for s in syncs)
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
    if "bucket_bytes" in summary:
        b = summary["bucket_bytes"]
        line += (
            f"; verified in {summary['verify_seconds']['median'] * 1e3:.0f} ms; private host memory grew by at most "
            f"{summary['engine_peak_rss_bytes'] / b:.1f} bucket(s) in the engine's process and "
            f"{summary['policy_peak_rss_bytes'] / b:.1f} in the policy's ({b / 2**20:g} MiB buckets; Ray's "
            f"object store {max(summary['engine_peak_shared_bytes'], summary['policy_peak_shared_bytes']) / b:.1f})"
        )
    if "vs_plain_copy" in summary:
        c, r = summary["plain_copy_seconds"], summary["vs_plain_copy"]
        line += (
            f"; {r['median']:.1f}x a plain copy of the same weights from the host store "
            f"({c['median'] * 1e3:.1f} ms, ratio IQR {r['q25']:.1f}-{r['q75']:.1f})"
        )
    return line
