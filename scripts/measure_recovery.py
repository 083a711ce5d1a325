"""How long a colocated PPO run takes to recover from a lost node, on a two-node Ray cluster on this
machine (a head and a second raylet, each with 2 CPUs; ``ray.cluster_utils.Cluster``).

DP=2 spread one rank per node (the ``cpu_tiny`` preset, checkpoints every iteration, one restart
allowed). As iteration 2 trains the policy, the worker node's raylet and its actors are killed
(``--replace``: a new node joins at once; else ``checkpoint.elastic=true`` goes on with DP=1).
Every progress line is time-stamped; the script prints when the loss was seen (the restart line),
when the actors were ready again, when the run resumed and the first iteration after it ended,
each in seconds after the kill, and the undisturbed iteration time for scale.

Run: ``python scripts/measure_recovery.py [--replace] [--node-wait-s 45] [--out FILE]``. Prints one
JSON object (and Ray's own lines about the killed raylet).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replace", action="store_true", help="a replacement node joins right after the loss")
    ap.add_argument("--node-wait-s", type=float, default=45.0, help="ray.node_wait_s")
    ap.add_argument("--out", default=None, help="also write the JSON to this file (Ray's own lines go to stdout)")
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    from chatlearn_mem_ray import load_config, run_ppo

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    cluster.wait_for_nodes()
    events: list[tuple[float, str]] = []
    killed: list[float] = []

    def progress(line: str) -> None:
        events.append((time.monotonic(), line))

    def hook(run, iteration, phase):
        if (iteration, phase) == (1, "train_policy") and not killed:
            killed.append(time.monotonic())
            cluster.remove_node(next(iter(cluster.worker_nodes)), allow_graceful=False)
            if args.replace:
                cluster.add_node(num_cpus=2)

    overrides = [
        "parallel.world_size=2",
        "ppo.iterations=4",
        "ppo.prompts_per_iteration=16",
        "memory.compare_iterations=0",
        "ray.placement=spread",
        "checkpoint.every=1",
        "checkpoint.max_restarts=1",
        f"ray.node_wait_s={args.node_wait_s}",
        f"output_dir={tempfile.mkdtemp(prefix='recovery-')}",
    ]
    overrides += [] if args.replace else ["ray.cpus_per_rank=2", "checkpoint.elastic=true"]
    try:
        log = run_ppo(load_config("cpu_tiny", overrides), progress=progress, on_phase=hook)
    finally:
        ray.shutdown()
        cluster.shutdown()
    t0 = killed[0]

    def first(text: str, after: float = 0.0):
        """Seconds after the kill of the first line containing ``text`` later than ``after``."""
        return next((round(t - t0, 2) for t, line in events if text in line and t - t0 > after), None)

    restart = first("restart 1 of 1")
    ready = first(" actors ready on ", after=restart or 0)
    resumed = first("resumed from ", after=restart or 0)
    after = first("iter ", after=resumed or 0)
    seconds = [m["seconds"] for m in log["iterations"]]
    out = {
        "scenario": "replacement node" if args.replace else "no replacement, checkpoint.elastic",
        "node_wait_s": args.node_wait_s,
        "status": log["status"],
        "world_size_at_end": log["config"]["parallel"]["world_size"],
        "seconds_after_kill": {
            "loss_seen (restart line)": restart,
            "actors_ready": ready,
            "resumed": resumed,
            "first_iteration_after_resume_done": after,
        },
        "undisturbed_iteration_s_median": sorted(seconds)[len(seconds) // 2],
        "lines": [f"{t - t0:+8.2f} s  {line}" for t, line in events if t - t0 > -1],
    }
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
