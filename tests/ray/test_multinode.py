"""A run over several Ray nodes: a real multi-node cluster on this machine (a head and a second
raylet, each with its own resources, as ``ray.cluster_utils.Cluster`` makes them). DP=2 spread one
rank per node trains bit-identically to DP=2 packed on one node; every actor reports its node, the
log and the progress lines name them; the checkpoint directory is checked as shared."""

import pytest

from chatlearn_mem_ray import load_config, run_ppo

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

BASE = ["parallel.world_size=2", "ppo.iterations=2", "ppo.prompts_per_iteration=16", "memory.compare_iterations=0",
        "ray.cpus_per_rank=1", "ray.phase_timeout_s=300"]
TIMING = ("seconds", "phase_seconds", "checkpoint_seconds", "transition_seconds")


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
    return {"iterations": [{k: v for k, v in m.items() if k not in TIMING} for m in log["iterations"]],
            "syncs": [(c["iteration"], c["policy"], c["rollout"]) for c in log["sync_checks"]],
            "final_weights": log["final_weights"]}


def test_dp2_spread_over_two_nodes_equals_dp2_on_one(two_nodes, tmp_path):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    packed_lines, spread_lines = [], []
    packed = run_ppo(load_config("cpu_tiny", [*BASE, "ray.placement=pack", f"output_dir={tmp_path / 'pack'}"]),
                     progress=packed_lines.append)
    spread = run_ppo(load_config("cpu_tiny", [*BASE, "ray.placement=spread", f"output_dir={tmp_path / 'spread'}",
                                              "checkpoint.every=1"]), progress=spread_lines.append)
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
