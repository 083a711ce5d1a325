"""A checkpoint saved under one parallel split, loaded and saved again under another, loads back bit-exactly."""

import pytest
from trainer_runs import spawn


def _spec(name, role, tp, d):
    return dict(name=name, world=2, tp=tp, pp=1, vpp=None, ep=1, steps=2, cfg={}, role=role, dir=str(d))


def test_round_trip_through_another_tensor_parallel_split(tmp_path):
    # DP=2 (TP=1) -> TP=2 (DP=1) -> DP=2: weights, main weights, states, step counts all survive
    out = spawn(
        [
            _spec("save_dp2", "save", 1, tmp_path),
            _spec("reshard_tp2", "reshard", 2, tmp_path),
            _spec("check_dp2", "check", 1, tmp_path),
        ],
        fn_name="checkpoint_reshard",
    )
    for name, results in out.items():
        for r in results:
            if "error" in r:
                pytest.fail(f"{name} rank {r['rank']}: {r['error'][-3000:]}")
    for r in out["check_dp2"]:
        assert r["compared"] > 0 and r["saved_split"]["tp"] == 2
        assert r["differ"] == [], f"rank {r['rank']}: {len(r['differ'])} tensors differ, e.g. {r['differ'][:3]}"
    # both saves' manifests hold the tensor files of both ranks (each checksummed by its writer) and
    # megatron's metadata; every file reads back as recorded
    import json
    import os

    from chatlearn_mem.checkpoint import METADATA_FILE, latest_checkpoint, verify_checkpoint

    for name in ("a", "b"):
        path = latest_checkpoint(str(tmp_path / name))
        files = json.loads(open(os.path.join(path, METADATA_FILE)).read())["files"]
        assert {f[:3] for f in files if f.endswith(".distcp")} == {"__0", "__1"}
        assert ".metadata" in files
        assert verify_checkpoint(path)["files"] == len(files)
