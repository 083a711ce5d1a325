"""Where a run's actors are, on one Ray node or several: how the trainer ranks are placed over the
nodes, which versions every node runs, and whether the checkpoint directory is one that every node
sees.

Placement (``ray.placement``): one placement group per tensor-parallel group, ``STRICT_PACK``, with
one bundle per rank, so a TP group never spans nodes (its collectives stay on one machine's links).
Bundle ``i`` holds rank ``i`` of the policy and of the critic; the first group's first bundle also
holds the rollout and reference models. ``pack`` asks Ray to put the groups on as few nodes as it
can (the nodes with the most free resources first); ``spread`` puts each group on another node,
round-robin, when the cluster has room there. Both targets are soft: a group goes where it fits.

Versions: every actor reports the versions of chatlearn-mem, megatron-core, torch and Ray it runs;
any difference from the driver's stops the run before work starts, naming the actor, its node and
both versions.

Shared checkpoint directory: with actors on more than one node (or the driver on a node without
actors), the driver writes a token file into the checkpoint directory, one actor per node checks
that it reads the same token and writes a marker of its own, and the driver checks every marker.
A directory some node cannot see stops the run with one line naming those nodes.
"""

from __future__ import annotations

import os
import platform
import uuid
from pathlib import Path
from typing import Mapping, Optional, Sequence

__all__ = [
    "VERSIONED",
    "check_shared_from_node",
    "group_targets",
    "node_label",
    "remove_check_files",
    "shared_dir_check",
    "software_versions",
    "unseen_nodes",
    "version_skew",
]

VERSIONED = ("chatlearn-mem", "megatron-core", "torch", "ray")
"""Packages whose versions must match between the driver and every actor."""


def software_versions() -> dict:
    """Versions of :data:`VERSIONED` (None: not installed) and Python, read without importing them."""
    from importlib.metadata import PackageNotFoundError, version

    def of(dist: str) -> Optional[str]:
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    return {**{d: of(d) for d in VERSIONED}, "python": platform.python_version()}


def version_skew(driver: Mapping[str, Optional[str]], actors: Mapping[str, Mapping]) -> list[str]:
    """Every difference between the driver's versions and an actor's, one string each.

    Args:
        driver: :func:`software_versions` of the driver.
        actors: Actor name -> ``{"versions": ..., "node": label}`` as the actors report them.
    """
    out = []
    for name in sorted(actors):
        theirs, where = actors[name]["versions"], actors[name].get("node", "?")
        for dist in VERSIONED:
            if theirs.get(dist) != driver.get(dist):
                out.append(f"{name} on node {where} runs {dist} {theirs.get(dist)} (the driver: {driver.get(dist)})")
    return out


def node_label(node_id: str, ip: str) -> str:
    """How messages and the log name a node: its address and the start of Ray's node id."""
    return f"{ip}/{node_id[:8]}"


def group_targets(
    groups: int, group_cpus: float, group_gpus: float, nodes: Sequence[Mapping], strategy: str
) -> list[Optional[str]]:
    """The node each placement group (a TP group) is asked to go to (a soft target; None: anywhere).

    Args:
        groups: Number of TP groups.
        group_cpus, group_gpus: Resources of one group (all its bundles).
        nodes: Alive nodes as ``ray.nodes()`` lists them (``NodeID``, ``Alive``, ``Resources``).
        strategy: ``pack``: fill the node with the most room first, then the next; ``spread``: one
            group per node round-robin, over the nodes that can hold a group.
    """
    room = []
    for n in nodes:
        if not n.get("Alive", False):
            continue
        res = n.get("Resources", {})
        fits = min(
            res.get("CPU", 0.0) // group_cpus if group_cpus else groups,
            res.get("GPU", 0.0) // group_gpus if group_gpus else groups,
        )
        if fits >= 1:
            room.append([n["NodeID"], int(fits)])
    if not room:
        return [None] * groups
    room.sort(key=lambda r: (-r[1], r[0]))
    out: list[Optional[str]] = []
    if strategy == "spread":
        i = 0
        for _ in range(groups):
            for _ in range(len(room)):  # the next node round-robin that still has room
                node = room[i % len(room)]
                i += 1
                if node[1] > 0:
                    node[1] -= 1
                    out.append(node[0])
                    break
            else:
                out.append(None)
        return out
    for _ in range(groups):
        node = next((r for r in room if r[1] > 0), None)
        if node is None:
            out.append(None)
        else:
            node[1] -= 1
            out.append(node[0])
    return out


def shared_dir_check(directory: Path) -> tuple[Path, str]:
    """Write the token file the nodes look for; returns ``(path, token)``."""
    token = uuid.uuid4().hex
    path = Path(directory) / f".shared-check-{token[:12]}"
    path.write_text(token)
    return path, token


def check_shared_from_node(token_path: str, token: str, node_id: str) -> bool:
    """On a node (inside an actor): whether it reads the driver's token, and its own marker written
    beside it (``<token_path>.<node_id>``) so the driver can see that this node writes there."""
    try:
        seen = Path(token_path).read_text() == token
    except OSError:
        seen = False
    try:
        Path(f"{token_path}.{node_id}").write_text(token)
    except OSError:
        pass
    return seen


def unseen_nodes(token_path: Path, reports: Mapping[str, bool]) -> list[str]:
    """Node ids that did not read the driver's token or whose marker the driver does not read."""
    out = []
    for node_id, seen in sorted(reports.items()):
        marker = Path(f"{token_path}.{node_id}")
        if not seen or not marker.is_file():
            out.append(node_id)
    return out


def remove_check_files(token_path: Path) -> None:
    for p in Path(token_path).parent.glob(Path(token_path).name + "*"):
        try:
            os.remove(p)
        except OSError:
            pass
