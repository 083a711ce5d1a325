"""Run checkpoints on the driver, without Ray: what counts as complete, what may change on resume,
and the checks made before anything starts (writable, room, another run's checkpoints)."""

import json

import pytest
from typer.testing import CliRunner

from chatlearn_mem_cli.app import app
from chatlearn_mem_ray import load_config
from chatlearn_mem_ray.errors import CheckpointDirError, ResumeError
from chatlearn_mem_ray.job import checkpoints as ck
from chatlearn_mem_ray.job.prepare import find_resume_point, prepare_checkpoints, prepare_output_dir


def _cfg(tmp_path, *overrides):
    return load_config("cpu_tiny", ["ppo.iterations=4", f"output_dir={tmp_path}", *overrides])


def fake_checkpoint(cfg, iterations: int, complete: bool = True):
    """A run checkpoint directory as the driver commits it; each trainer's checkpoint holds one
    tensor file and megatron's metadata, with the manifest the library writes."""
    from chatlearn_mem.checkpoint_format import FORMAT as _FORMAT
    from chatlearn_mem.checkpoint_format import METADATA_FILE
    from chatlearn_mem.checkpoint_format import file_digest as _digest

    path = cfg.checkpoint_dir / f"iter_{iterations:08d}"
    path.mkdir(parents=True)
    for role in ck.TRAINERS:
        step = path / role / f"step_{iterations:08d}"
        step.mkdir(parents=True)
        (step / "__0_0.distcp").write_bytes(bytes(range(256)) * (16 * iterations))
        (step / ".metadata").write_bytes(b"megatron's metadata")
        files = {f: _digest(str(step / f)) for f in ("__0_0.distcp", ".metadata")}
        (step / METADATA_FILE).write_text(json.dumps({"format": _FORMAT, "step": iterations, "files": files}))
    if complete:
        (path / ck.RUN_FILE).write_text(
            json.dumps(
                {
                    "format": ck._FORMAT,
                    "iterations_done": iterations,
                    "config": json.loads(cfg.model_dump_json()),
                    "iterations": [{"iteration": i} for i in range(iterations)],
                    "memory_timeline": [],
                    "sync_checks": [],
                    "audits": {"runs": 0, "checks_clean": 0},
                }
            )
        )
    return path


def test_only_complete_checkpoints_count(tmp_path):
    cfg = _cfg(tmp_path)
    fake_checkpoint(cfg, 2)
    fake_checkpoint(cfg, 3)
    fake_checkpoint(cfg, 4, complete=False)  # killed between the trainers' writes and run.json
    (cfg.checkpoint_dir / ".tmp.iter_00000005").mkdir()  # killed while writing
    (cfg.checkpoint_dir / "notes.txt").write_text("x")
    assert [n for n, _ in ck.list_run_checkpoints(cfg.checkpoint_dir)] == [2, 3]
    assert ck.latest_run_checkpoint(cfg.checkpoint_dir).name == "iter_00000003"
    assert ck.latest_run_checkpoint(tmp_path / "missing") is None
    assert ck.remove_temporaries(cfg.checkpoint_dir) == [".tmp.iter_00000005"]
    assert not (cfg.checkpoint_dir / ".tmp.iter_00000005").exists()


def test_a_checkpoint_of_another_format_is_refused(tmp_path):
    path = fake_checkpoint(_cfg(tmp_path), 1)
    (path / ck.RUN_FILE).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ResumeError, match="has format 'something else'; this version reads"):
        ck.read_run_state(path)


def test_config_differences_split_model_shape_from_other_settings(tmp_path):
    saved = json.loads(_cfg(tmp_path).model_dump_json())
    blocking, changed = ck.config_differences(
        saved,
        _cfg(
            tmp_path,
            "policy.hidden_size=128",
            "critic.num_layers=3",
            "policy.lr=0.01",
            "ppo.kl_coef=0.1",
            "ppo.iterations=40",
            "checkpoint.every=5",
            "ray.num_cpus=4",
        ),
    )
    assert blocking == ["critic.num_layers: checkpoint 2, config 3", "policy.hidden_size: checkpoint 64, config 128"]
    assert changed == ["policy.lr: checkpoint 0.001, config 0.01", "ppo.kl_coef: checkpoint 0.05, config 0.1"]


def test_resume_true_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(
        ResumeError,
        match=r"nothing to resume: no complete checkpoint in .*checkpoints\. Run without "
        r"--resume",
    ):
        find_resume_point(_cfg(tmp_path, "checkpoint.resume=true"))


def test_resume_auto_without_a_checkpoint_starts_fresh_and_says_so(tmp_path):
    lines = []
    assert find_resume_point(_cfg(tmp_path, "checkpoint.resume=auto"), lines.append) is None
    assert lines == [
        f"checkpoint.resume=auto: no complete checkpoint in {tmp_path / 'checkpoints'}; starting from the beginning"
    ]
    assert find_resume_point(_cfg(tmp_path)) is None  # resume=false never looks


def test_resume_finds_the_newest_complete_checkpoint_and_reports_changed_settings(tmp_path):
    cfg = _cfg(tmp_path, "checkpoint.every=1")
    fake_checkpoint(cfg, 1)
    newest = fake_checkpoint(cfg, 2)
    fake_checkpoint(cfg, 3, complete=False)
    lines = []
    path, state = find_resume_point(_cfg(tmp_path, "checkpoint.resume=auto", "ppo.iterations=10"), lines.append)
    assert path == newest and state["iterations_done"] == 2
    assert lines == []  # more iterations is what a resumed run is for
    find_resume_point(
        _cfg(tmp_path, "checkpoint.resume=true", "ppo.temperature=0.5", "parallel.world_size=2"), lines.append
    )
    assert len(lines) == 1 and lines[0].startswith(
        "resuming with settings that differ from the checkpoint's: "
        "parallel.world_size: checkpoint 1, config 2; ppo.temperature"
    )
    assert "megatron reshards the trainers to the new split" in lines[0]


def test_resume_with_another_model_shape_names_every_difference(tmp_path):
    fake_checkpoint(_cfg(tmp_path), 2)
    with pytest.raises(ResumeError) as e:
        find_resume_point(_cfg(tmp_path, "checkpoint.resume=true", "policy.num_layers=4", "critic.precision=fp32"))
    assert str(e.value) == (
        f"cannot resume from {tmp_path / 'checkpoints' / 'iter_00000002'}: the config's model "
        "differs from the checkpoint's: critic.precision: checkpoint 'bf16', config 'fp32'; "
        "policy.num_layers: checkpoint 2, config 4. Resume with the checkpoint's model settings, "
        "or start a new run in another output_dir / checkpoint.directory"
    )


def test_a_resumed_run_continues_its_own_log(tmp_path):
    cfg = _cfg(tmp_path)
    (tmp_path / "log.json").write_text(json.dumps({"status": "failed", "pid": 1, "iterations": [{}, {}]}))
    fake_checkpoint(cfg, 1)
    with pytest.raises(
        Exception,
        match=r"already holds the log of another run \(2 iteration\(s\), failed\); "
        r"choose another output_dir, resume it \(--resume\)",
    ):
        prepare_output_dir(cfg)
    assert prepare_output_dir(cfg, resuming=True) == tmp_path / "log.json"


def test_a_fresh_start_refuses_an_earlier_runs_checkpoints_unless_overwrite(tmp_path):
    cfg = _cfg(tmp_path, "checkpoint.every=1")
    fake_checkpoint(cfg, 2)
    (cfg.checkpoint_dir / ".tmp.iter_00000003").mkdir()
    with pytest.raises(
        CheckpointDirError,
        match=r"holds checkpoints of an earlier run \(newest: iter_00000002\); "
        r"resume it \(--resume or checkpoint.resume=auto\)",
    ):
        prepare_checkpoints(cfg, None, lambda line: None)
    lines = []
    prepare_checkpoints(_cfg(tmp_path, "checkpoint.every=1", "output_dir_exists=overwrite"), None, lines.append)
    assert list(cfg.checkpoint_dir.iterdir()) == []
    assert (
        lines[-1]
        == f"deleted 1 checkpoint(s) of an earlier run from {cfg.checkpoint_dir} (output_dir_exists=overwrite)"
    )


def test_an_unwritable_checkpoint_directory_fails_before_anything_starts(tmp_path):
    (tmp_path / "a-file").write_text("x")
    cfg = _cfg(tmp_path / "out", "checkpoint.every=1", f"checkpoint.directory={tmp_path / 'a-file' / 'ckpt'}")
    with pytest.raises(
        CheckpointDirError,
        match=r"cannot write checkpoints to .*a-file/ckpt: .*set "
        r"checkpoint.directory to a writable directory",
    ):
        prepare_checkpoints(cfg, None, lambda line: None)
    prepare_checkpoints(_cfg(tmp_path / "out"), None, lambda line: None)  # no checkpoints: not checked


def test_room_for_keep_last_plus_one_checkpoints_is_checked(tmp_path):
    gib = 2**30
    ck.check_room(tmp_path, nbytes=gib, keep_last=2, free_bytes=3 * gib)
    with pytest.raises(CheckpointDirError) as e:
        ck.check_room(tmp_path, nbytes=gib, keep_last=2, free_bytes=3 * gib - 1)
    assert "has 3.00 GiB free, but 3 more checkpoint(s) of about 1.00 GiB each" in str(e.value)
    assert "lower checkpoint.keep_last" in str(e.value)
    cfg = _cfg(tmp_path)
    fake_checkpoint(cfg, 1)  # already written: one slot less to find
    ck.check_room(cfg.checkpoint_dir, nbytes=gib, keep_last=2, free_bytes=2 * gib)
    ck.check_room(tmp_path, nbytes=1, keep_last=1)  # this disk, a tiny checkpoint


def test_the_resume_flag_sets_checkpoint_resume(tmp_path):
    result = CliRunner().invoke(app, ["ppo", "--resume", "--print-config", f"output_dir={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["checkpoint"]["resume"] is True
    result = CliRunner().invoke(app, ["ppo", "--print-config", "checkpoint.resume=auto"])
    assert json.loads(result.output)["checkpoint"]["resume"] == "auto"
    result = CliRunner().invoke(app, ["ppo", "--resume", f"output_dir={tmp_path}", "checkpoint.every=1"])
    assert result.exit_code == 1 and result.output.startswith("error: nothing to resume: no complete checkpoint in ")


def test_resume_skips_a_damaged_newest_checkpoint_naming_the_file(tmp_path):
    """A truncated tensor file in the newest checkpoint: one line naming it, and the run resumes
    from the older intact one; damage in every checkpoint: one error naming each; never a traceback
    from a reader."""
    cfg = _cfg(tmp_path, "checkpoint.resume=true")
    fake_checkpoint(cfg, 2)
    newest = fake_checkpoint(cfg, 3)
    data = newest / "critic" / "step_00000003" / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)
    lines = []
    path, state = find_resume_point(cfg, lines.append)
    assert path.name == "iter_00000002" and state["iterations_done"] == 2
    assert lines == [
        f"checkpoint iter_00000003 is damaged, skipped: critic/step_00000003/__0_0.distcp has "
        f"{size // 2} bytes, the manifest says {size}"
    ]

    older = cfg.checkpoint_dir / "iter_00000002" / "policy" / "step_00000002" / ".metadata"
    older.write_bytes(b"megatron's metadatA")  # same size, one byte changed
    for mode in ("true", "auto"):
        with pytest.raises(
            ResumeError,
            match=r"no intact checkpoint in .* to resume from \(iter_00000003: .*"
            r"__0_0.distcp has .*; iter_00000002: .*\.metadata has CRC-32 ",
        ):
            find_resume_point(_cfg(tmp_path, f"checkpoint.resume={mode}"), lambda line: None)


def test_a_damaged_run_json_is_skipped_too(tmp_path):
    cfg = _cfg(tmp_path, "checkpoint.resume=true")
    fake_checkpoint(cfg, 2)
    (fake_checkpoint(cfg, 3) / ck.RUN_FILE).write_text('{"format": ')
    lines = []
    assert find_resume_point(cfg, lines.append)[0].name == "iter_00000002"
    assert len(lines) == 1 and lines[0].startswith("checkpoint iter_00000003 is damaged, skipped: ")
