"""Where a run's actors go, without Ray: TP groups packed or spread over nodes, version skew named,
and the shared checkpoint directory check seen from a node that cannot read it."""

from chatlearn_mem_ray.actors.nodes import (
    check_shared_from_node,
    group_targets,
    remove_check_files,
    shared_dir_check,
    software_versions,
    unseen_nodes,
    version_skew,
)


def node(node_id, cpus, gpus=0, alive=True):
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": cpus, "GPU": gpus}}


def test_pack_fills_the_roomiest_node_first_spread_goes_round_robin():
    nodes = [node("a", 2), node("b", 4), node("c", 1), node("dead", 64, alive=False)]
    assert group_targets(4, 1, 0, nodes, "pack") == ["b", "b", "b", "b"]
    assert group_targets(6, 1, 0, nodes, "pack") == ["b", "b", "b", "b", "a", "a"]
    assert group_targets(4, 1, 0, nodes, "spread") == ["b", "a", "c", "b"]
    # a TP group of 2 ranks needs 2 CPUs on one node: node c cannot hold one
    assert group_targets(3, 2, 0, nodes, "spread") == ["b", "a", "b"]
    # GPUs: one per rank
    gpu = [node("g1", 16, 8), node("g2", 16, 8)]
    assert group_targets(4, 2, 2, gpu, "spread") == ["g1", "g2", "g1", "g2"]
    assert group_targets(4, 2, 2, gpu, "pack") == ["g1", "g1", "g1", "g1"]
    # more groups than room, or no node fits: left to Ray (None)
    assert group_targets(2, 1, 0, [node("a", 1)], "spread") == ["a", None]
    assert group_targets(2, 8, 0, nodes, "pack") == [None, None]


def test_version_skew_names_the_actor_its_node_and_both_versions():
    mine = software_versions()
    assert set(mine) >= {"chatlearn-mem", "megatron-core", "torch", "ray", "python"}
    assert mine["chatlearn-mem"] and mine["torch"]
    same = {"policy_0": {"versions": dict(mine), "node": "10.0.0.1/abcd1234"}}
    assert version_skew(mine, same) == []
    other = {
        **same,
        "critic_1": {"versions": {**mine, "torch": "2.5.0", "python": "3.10.0"}, "node": "10.0.0.2/ef567890"},
    }
    assert version_skew(mine, other) == [
        f"critic_1 on node 10.0.0.2/ef567890 runs torch 2.5.0 (the driver: {mine['torch']})"
    ]  # Python is reported, not compared


def test_a_node_that_cannot_see_the_directory_is_named(tmp_path):
    shared, private = tmp_path / "shared", tmp_path / "elsewhere"
    shared.mkdir()
    private.mkdir()
    token_path, token = shared_dir_check(shared)
    assert check_shared_from_node(str(token_path), token, "node-a")  # sees the driver's token, leaves a marker
    # node b mounts another filesystem at that path: it reads nothing there, and its marker lands elsewhere
    elsewhere = private / token_path.name
    assert not check_shared_from_node(str(elsewhere), token, "node-b")
    assert unseen_nodes(token_path, {"node-a": True, "node-b": False}) == ["node-b"]
    # a node that reads the token but whose marker the driver cannot see (a read-only or cached mount)
    assert unseen_nodes(token_path, {"node-a": True, "node-c": True}) == ["node-c"]
    remove_check_files(token_path)
    assert list(shared.iterdir()) == []
