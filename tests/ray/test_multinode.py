"""A run over several Ray nodes: a real multi-node cluster on this machine (a head and a second
raylet, each with its own resources, as ``ray.cluster_utils.Cluster`` makes them). DP=2 spread one
rank per node trains bit-identically to DP=2 packed on one node; every actor reports its node, the
log and the progress lines name them; the checkpoint directory is checked as shared. A node lost
mid-run: with a replacement joining, the run restarts and ends bit-identical; with none and
``checkpoint.elastic``, it goes on with DP=1 and keeps training."""

import math

import pytest

from chatlearn_mem_ray import load_config, run_ppo

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

BASE = [
    "parallel.world_size=2",
    "ppo.iterations=2",
    "ppo.prompts_per_iteration=16",
    "memory.compare_iterations=0",
    "ray.cpus_per_rank=1",
    "ray.phase_timeout_s=300",
]
# measured, not computed: they differ between two runs of the same training (process RSS included)
TIMING = ("seconds", "phase_seconds", "checkpoint_seconds", "transition_seconds", "rss_bytes")


@pytest.fixture(scope="module")
def two_nodes():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def outcome(log):
    return {
        "iterations": [{k: v for k, v in m.items() if k not in TIMING} for m in log["iterations"]],
        "syncs": [(c["iteration"], c["policy"], c["rollout"]) for c in log["sync_checks"]],
        "final_weights": log["final_weights"],
    }


@pytest.fixture(scope="module")
def undisturbed():
    return {}  # the spread run's log, for the node-loss tests


def test_dp2_spread_over_two_nodes_equals_dp2_on_one(two_nodes, tmp_path, undisturbed):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    packed_lines, spread_lines = [], []
    packed = run_ppo(
        load_config("cpu_tiny", [*BASE, "ray.placement=pack", f"output_dir={tmp_path / 'pack'}"]),
        progress=packed_lines.append,
    )
    spread = run_ppo(
        load_config(
            "cpu_tiny", [*BASE, "ray.placement=spread", f"output_dir={tmp_path / 'spread'}", "checkpoint.every=1"]
        ),
        progress=spread_lines.append,
    )
    # pack: every actor on one node; spread: rank 1's policy and critic on the other one
    assert len(set(packed["nodes"].values())) == 1
    nodes = spread["nodes"]
    assert set(nodes) == {"policy_0", "policy_1", "critic_0", "critic_1", "rollout", "reference"}
    assert nodes["policy_0"] == nodes["critic_0"] == nodes["rollout"] == nodes["reference"]
    assert nodes["policy_1"] == nodes["critic_1"] != nodes["policy_0"]
    assert any(line.startswith("actors on 2 node(s): ") for line in spread_lines), spread_lines
    assert any(line.startswith("actors on 1 node(s): ") for line in packed_lines), packed_lines
    # the checkpoint directory was checked as shared (it is: one machine) and the checkpoints are complete
    assert [c["iterations_done"] for c in spread["checkpoints"]] == [1, 2]
    assert outcome(spread) == outcome(packed)
    undisturbed["spread"] = spread


def _lose_the_worker_node(cluster, replace: bool):
    """``on_phase`` hook: as iteration 2's policy training starts (the checkpoint after iteration 1 is
    complete by then), kill the raylet of the node that is not the head, and the actors on it; with
    ``replace``, a new node joins at once."""
    lost = []

    def hook(run, iteration, phase):
        if (iteration, phase) == (1, "train_policy") and not lost:
            worker = next(n for n in cluster.worker_nodes)
            cluster.remove_node(worker, allow_graceful=False)
            lost.append(worker)
            if replace:
                cluster.add_node(num_cpus=2)

    return hook, lost


def test_a_lost_node_replaced_restarts_and_ends_bit_identical(two_nodes, tmp_path, undisturbed):
    lines = []
    hook, lost = _lose_the_worker_node(two_nodes, replace=True)
    cfg = load_config(
        "cpu_tiny",
        [
            *BASE,
            "ray.placement=spread",
            f"output_dir={tmp_path}",
            "checkpoint.every=1",
            "checkpoint.max_restarts=1",
            "ray.node_wait_s=120",
        ],
    )
    log = run_ppo(cfg, progress=lines.append, on_phase=hook)
    assert lost and log["status"] == "completed"
    [restart] = log["restarts"]
    assert restart["phase"] == "train_policy" and restart["resumed_from"].endswith("iter_00000001")
    assert outcome(log) == outcome(undisturbed["spread"])


@pytest.mark.slow
def test_a_lost_node_without_replacement_goes_on_smaller_when_elastic(two_nodes, tmp_path):
    # two CPUs per rank: each node holds one rank, so the head alone holds only DP=1
    lines = []
    hook, lost = _lose_the_worker_node(two_nodes, replace=False)
    cfg = load_config(
        "cpu_tiny",
        [
            *BASE,
            "ppo.iterations=4",
            "ray.placement=spread",
            f"output_dir={tmp_path}",
            "ray.cpus_per_rank=2",
            "checkpoint.every=1",
            "checkpoint.max_restarts=1",
            "ray.node_wait_s=45",
            "checkpoint.elastic=true",
        ],
    )
    log = run_ppo(cfg, progress=lines.append, on_phase=hook)
    assert lost and log["status"] == "completed" and log["config"]["parallel"]["world_size"] == 1
    # Ray may count the lost node until its health checks declare it dead: the wait is either for
    # room or for the placement groups, bounded by ray.node_wait_s in both cases
    assert any(line.startswith("checkpoint.elastic: the cluster holds 1 of 2 rank(s)") for line in lines), lines
    assert sorted(log["nodes"]) == ["critic_0", "policy_0", "reference", "rollout"]  # DP=1 from the restart on
    assert [m["iteration"] for m in log["iterations"]] == [1, 2, 3, 4]
    for m in log["iterations"]:
        assert all(math.isfinite(m[k]) for k in ("reward", "policy_loss", "value_loss", "kl"))
    rewards = [m["reward"] for m in log["iterations"]]
    assert rewards[-1] > rewards[0], rewards
