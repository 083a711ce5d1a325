"""Checkpoints: saved from the host store while asleep, bit-exact resume, complete or ignored, clear errors."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
from trainer_runs import train

from chatlearn_mem import Part, UnsupportedLayoutError
from chatlearn_mem.checkpoint import (
    METADATA_FILE,
    CheckpointError,
    estimate_checkpoint_nbytes,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from chatlearn_mem.mcore import layout
from chatlearn_mem.models import gpt

BATCH = 4


def full_state(trainer) -> list[tuple[str, torch.Tensor]]:
    """Weights, fp32 main weights, optimizer states and step counts, by name (state keys sorted:
    a loaded optimizer holds them in another order)."""
    out = [(f"param {n}", p.detach().clone()) for n, p in trainer.model.named_parameters()]
    for i, leaf in enumerate(layout.leaf_optimizers(trainer.optimizer)):
        out += [(f"main {i}.{j}", t.detach().clone()) for j, t in enumerate(layout.main_weights(leaf))]
        for j, state in enumerate(layout.torch_optimizer(leaf).state.values()):
            out += [(f"state {i}.{j}.{k}", state[k].clone()) for k in sorted(state)]
    return out


def assert_same(a, b) -> None:
    assert [n for n, _ in a] == [n for n, _ in b]
    differ = [n for (n, x), (_, y) in zip(a, b) if x.dtype != y.dtype or not torch.equal(x, y)]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[:3]}"


def steps(trainer, cfg, first: int, n: int) -> list[float]:
    return [trainer.train_step(gpt.synthetic_batch(cfg, s, batch_size=BATCH)) for s in range(first, first + n)]


@pytest.mark.parametrize(
    "distopt,resharding",
    [(True, True), (True, False), (False, True)],
    ids=["distopt", "distopt-dp_reshardable", "float16opt"],
)
def test_save_asleep_reads_host_store_and_equals_awake_save(dist1, tmp_path, distopt, resharding):
    if not resharding and layout.megatron_core_version().startswith("0.13."):
        pytest.skip("resharding=False needs megatron-core 0.14+ (tested below that it says so)")
    cfg = gpt.GPTTrainerConfig(use_distributed_optimizer=distopt)
    _, _, mm, trainer = train(cfg, steps=2)
    expected = full_state(trainer)
    save_checkpoint(mm, tmp_path / "awake", step=2, resharding=resharding)
    mm.offload()
    handle = save_checkpoint(mm, tmp_path / "asleep", step=2, async_=True, resharding=resharding)
    handle.wait()
    assert mm.residency().device_bytes == 0  # nothing was allocated (or left) on the device
    assert all(mm.is_offloaded(p) for p in Part)
    assert handle.path == latest_checkpoint(tmp_path / "asleep")
    mm.onload()
    assert mm.audit().ok, str(mm.audit())
    assert_same(full_state(trainer), expected)  # the save changed nothing

    loaded = []
    for which in ("awake", "asleep"):
        _, _, mm2, t2 = train(cfg, steps=0)
        meta = load_checkpoint(mm2, latest_checkpoint(tmp_path / which))
        assert meta["step"] == 2
        loaded.append(full_state(t2))
    assert_same(loaded[1], loaded[0])
    assert_same(loaded[1], expected)


@pytest.mark.parametrize("distopt", [True, False], ids=["distopt", "float16opt"])
def test_resume_from_checkpoint_is_bit_exact(dist1, tmp_path, distopt):
    cfg = gpt.GPTTrainerConfig(use_distributed_optimizer=distopt)
    _, _, mm, trainer = train(cfg, steps=2)
    torch.manual_seed(7)
    mm.offload()
    save_checkpoint(mm, tmp_path, step=2, metadata={"iteration": 2})
    rng_after_save = torch.rand(3)
    mm.onload()
    losses = steps(trainer, cfg, 2, 3)

    _, _, mm2, resumed = train(cfg, steps=1)  # a trainer that already moved on: everything is overwritten
    meta = load_checkpoint(mm2, latest_checkpoint(tmp_path))
    assert meta["metadata"] == {"iteration": 2}
    assert torch.equal(torch.rand(3), rng_after_save)  # RNG state restored
    assert steps(resumed, cfg, 2, 3) == losses
    assert_same(full_state(resumed), full_state(trainer))
    mm2.offload()  # the manager took the loaded tensors over
    mm2.onload()
    assert mm2.audit().ok, str(mm2.audit())


def test_async_save_makes_an_overwriting_offload_wait(dist1, tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    cfg = gpt.GPTTrainerConfig()
    _, _, mm, trainer = train(cfg, steps=2)
    expected = full_state(trainer)
    release = threading.Event()
    # the writer's entry point: ..._multiproc up to 0.16, ..._multithread from 0.17
    name = next(
        n
        for n in ("write_preloaded_data_multiproc", "write_preloaded_data_multithread")
        if hasattr(FileSystemWriterAsync, n)
    )
    original = getattr(FileSystemWriterAsync, name)

    def held_write(*args, **kwargs):
        release.wait()
        return original(*args, **kwargs)

    monkeypatch.setattr(FileSystemWriterAsync, name, staticmethod(held_write))
    mm.offload()
    handle = save_checkpoint(mm, tmp_path, step=2, async_=True)
    assert not handle.done()
    mm.onload()  # reads the host store only: goes ahead
    steps(trainer, cfg, 2, 1)  # new weights and states on the device
    offloader = threading.Thread(target=mm.offload)
    offloader.start()
    offloader.join(timeout=1.0)
    assert offloader.is_alive(), "the offload overwrote host stores an asynchronous save was still reading"
    assert mm.state.group(Part.WEIGHTS).readers > 0
    release.set()
    offloader.join()
    handle.wait()
    assert mm.residency().device_bytes == 0
    mm.onload()
    _, _, mm2, t2 = train(cfg, steps=0)
    load_checkpoint(mm2, handle.path)
    assert_same(full_state(t2), expected)  # the state at the save, not the step after it


_KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {tests!r})
    import torch
    from trainer_runs import train
    from chatlearn_mem import checkpoint
    from chatlearn_mem.models import gpt
    gpt.init_distributed(init_method="file://" + {init!r}, cpu_backend=True)
    cfg = gpt.GPTTrainerConfig()
    _, _, mm, trainer = train(cfg, steps=1)
    mm.offload()
    checkpoint.save_checkpoint(mm, {root!r}, step=1)
    mm.onload()
    trainer.train_step(gpt.synthetic_batch(cfg, 1, batch_size=4))
    mm.offload()
    real_dump = checkpoint.json.dump
    def killed(*args, **kwargs):  # every tensor is written; the metadata file is not
        os.kill(os.getpid(), signal.SIGKILL)
    checkpoint.json.dump = killed
    checkpoint.save_checkpoint(mm, {root!r}, step=2, async_=True).wait()
""")


def test_kill_during_save_leaves_previous_checkpoint_loadable(dist1, tmp_path):
    root = tmp_path / "ckpt"
    script = _KILLED_SAVE.format(
        tests=os.path.dirname(os.path.dirname(__file__)), init=str(tmp_path / "init"), root=str(root)
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert os.path.isdir(root / ".tmp.step_00000002")  # the killed save's tensors are there ...
    assert latest_checkpoint(root) == str(root / "step_00000001")  # ... and ignored
    assert list_checkpoints(root) == [str(root / "step_00000001")]
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        load_checkpoint(None, str(root / ".tmp.step_00000002"))

    cfg = gpt.GPTTrainerConfig()
    _, _, _, reference = train(cfg, steps=1)
    _, _, mm, trainer = train(cfg, steps=0)
    load_checkpoint(mm, latest_checkpoint(root))
    assert_same(full_state(trainer), full_state(reference))
    save_checkpoint(mm, root, step=2)  # the same step again replaces the leftover
    assert latest_checkpoint(root) == str(root / "step_00000002")
    assert not os.path.exists(root / ".tmp.step_00000002")


_KILLED_MID_WRITE = textwrap.dedent("""
    import os, sys, time, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {tests!r})
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
    from trainer_runs import train
    from chatlearn_mem import checkpoint
    from chatlearn_mem.models import gpt
    gpt.init_distributed(init_method="file://" + {init!r}, cpu_backend=True)
    _, _, mm, _ = train(gpt.GPTTrainerConfig(), steps=1)
    mm.offload()
    real_write = FileSystemWriterAsync.write_preloaded_data
    def slow_write(*args, **kwargs):  # a write that takes two minutes (a big model, a slow disk)
        print("writing in", os.getpid(), flush=True)
        time.sleep(120)
        return real_write(*args, **kwargs)
    FileSystemWriterAsync.write_preloaded_data = staticmethod(slow_write)
    checkpoint.save_checkpoint(mm, {root!r}, step=1, async_=True).wait()
""")


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_no_writer_process_outlives_a_killed_trainer(dist1, tmp_path):
    """megatron-core up to 0.16 (at least) forks a process to write each file. Orphaned by a
    SIGKILLed trainer, such a writer held every descriptor the trainer had (Ray's sockets: Ray saw
    the actor alive until the writer exited, a run waited for its phase timeout) and could block
    forever on a results queue nobody reads. It must die with the trainer."""
    script = _KILLED_MID_WRITE.format(
        tests=os.path.dirname(os.path.dirname(__file__)), init=str(tmp_path / "init"), root=str(tmp_path / "ckpt")
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    writer = None
    try:
        line = proc.stdout.readline()  # the trainer (or its writer) is writing
        assert line.startswith("writing in "), f"the save did not start writing: {line!r}"
        writer = int(line.split()[-1])
        proc.kill()
        assert proc.wait(timeout=60) == -9
        deadline = time.monotonic() + 10
        while _running(writer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _running(writer), f"writer process {writer} outlived the trainer {proc.pid}"
    finally:
        proc.kill()
        if writer is not None and _running(writer):
            os.kill(writer, signal.SIGKILL)
        proc.stdout.close()


def test_shape_mismatch_names_what_differs(dist1, tmp_path):
    _, _, mm, _ = train(gpt.GPTTrainerConfig(), steps=1)
    save_checkpoint(mm, tmp_path, step=1)
    _, _, other, _ = train(gpt.GPTTrainerConfig(hidden_size=32), steps=0)
    with pytest.raises(
        CheckpointError,
        match=r"does not fit this model: .*decoder\.layers\.mlp\.linear_fc1\.weight: "
        r"checkpoint \(2, 256, 64\) bfloat16, model \(2, 128, 32\) bfloat16",
    ):
        load_checkpoint(other, latest_checkpoint(tmp_path))


def test_unwritable_directory_or_unstepped_optimizer_fail_before_writing(dist1, tmp_path):
    _, _, fresh, _ = train(gpt.GPTTrainerConfig(), steps=0)
    with pytest.raises(CheckpointError, match="has not taken a step yet"):
        save_checkpoint(fresh, tmp_path / "ckpt", step=0)
    assert os.listdir(tmp_path / "ckpt") == []
    os.rmdir(tmp_path / "ckpt")
    _, _, mm, _ = train(gpt.GPTTrainerConfig(), steps=1)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="cannot write checkpoints to .*a-file/ckpt.*Choose a writable directory"):
        save_checkpoint(mm, blocker / "ckpt", step=1)
    assert blocker.read_text() == "x" and os.listdir(tmp_path) == ["a-file"]


def test_keep_last_and_incomplete_directories_are_ignored(dist1, tmp_path):
    _, _, mm, _ = train(gpt.GPTTrainerConfig(), steps=1)
    for step in (1, 2, 3):
        save_checkpoint(mm, tmp_path, step=step, keep_last=2)
    os.makedirs(tmp_path / "step_00000009")  # no metadata: incomplete
    assert list_checkpoints(tmp_path) == [str(tmp_path / "step_00000002"), str(tmp_path / "step_00000003")]
    assert os.path.isfile(tmp_path / "step_00000003" / METADATA_FILE)
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        save_checkpoint(mm, tmp_path, step=4, keep_last=0)
    if layout.megatron_core_version().startswith("0.13."):
        with pytest.raises(UnsupportedLayoutError, match="resharding=False needs megatron-core 0.14"):
            save_checkpoint(mm, tmp_path, step=4, resharding=False)


@pytest.mark.parametrize("distopt", [True, False], ids=["distopt", "float16opt"])
def test_estimated_size_matches_what_a_save_writes(dist1, tmp_path, distopt):
    cfg = gpt.GPTTrainerConfig(use_distributed_optimizer=distopt)
    _, _, mm, _ = train(cfg, steps=0)
    estimate = estimate_checkpoint_nbytes(mm)  # before the first step: no optimizer state exists yet
    _, _, mm, _ = train(cfg, steps=1)
    written = save_checkpoint(mm, tmp_path, step=1).nbytes
    assert abs(estimate - written) <= 0.02 * written, (estimate, written)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "step_00000001").rglob("*") if f.is_file())
    assert written <= on_disk <= 1.5 * written + 2**20, (written, on_disk)


def test_estimate_refuses_a_format_this_megatron_cannot_save(dist1):
    _, _, mm, _ = train(gpt.GPTTrainerConfig(), steps=0)
    if layout.megatron_core_version().startswith("0.13."):
        with pytest.raises(UnsupportedLayoutError, match="resharding=False needs megatron-core 0.14"):
            estimate_checkpoint_nbytes(mm, resharding=False)
    else:
        assert estimate_checkpoint_nbytes(mm, resharding=False) == estimate_checkpoint_nbytes(mm)


def test_the_manifest_names_a_damaged_file_and_nothing_is_loaded(dist1, tmp_path):
    """Every file is in the manifest with its size and CRC-32; a truncated file, a changed byte, a
    missing file and unreadable metadata are each one CheckpointDamagedError naming the file, raised
    before megatron reads anything; the trainer is untouched and loads the intact copy after."""
    import json
    import shutil

    from chatlearn_mem import CheckpointDamagedError, verify_checkpoint

    cfg = gpt.GPTTrainerConfig()
    _, _, mm, trainer = train(cfg, steps=2)
    handle = save_checkpoint(mm, tmp_path / "a", step=2, async_=True)
    handle.wait()
    path = latest_checkpoint(tmp_path / "a")
    meta = json.loads(open(os.path.join(path, METADATA_FILE)).read())
    on_disk = sorted(os.path.relpath(os.path.join(b, n), path) for b, _, ns in os.walk(path) for n in ns)
    assert sorted(meta["files"]) == [f for f in on_disk if f != METADATA_FILE]
    assert any(f.startswith("__0_") for f in meta["files"])  # the rank's own tensor file(s), from the write thread
    assert all(v["bytes"] == os.path.getsize(os.path.join(path, f)) for f, v in meta["files"].items())
    assert handle.manifest_seconds > 0
    report = verify_checkpoint(path)
    assert report["verified"] and report["files"] == len(meta["files"])
    assert report["bytes"] == sum(v["bytes"] for v in meta["files"].values())

    _, _, mm2, other = train(cfg, steps=1)
    before = full_state(other)
    data = max(meta["files"], key=lambda f: meta["files"][f]["bytes"])

    def damaged(name, how):
        copy = tmp_path / name / "step_00000002"
        shutil.copytree(path, copy)
        how(copy)
        return str(copy)

    def truncate(p):
        os.truncate(p / data, meta["files"][data]["bytes"] // 2)

    def flip(p):
        with open(p / data, "r+b") as f:
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0xFF]))

    cases = [
        ("truncated", truncate, rf"{data} has {meta['files'][data]['bytes'] // 2} bytes, the manifest says "),
        ("flipped", flip, rf"{data} has CRC-32 [0-9a-f]{{8}}, the manifest says"),
        ("missing", lambda p: os.remove(p / data), rf"{data} is missing"),
        ("metadata", lambda p: (p / METADATA_FILE).write_text('{"format": '), rf"{METADATA_FILE} cannot be read"),
    ]
    for name, how, message in cases:
        broken = damaged(name, how)
        with pytest.raises(CheckpointDamagedError, match=message) as e:
            load_checkpoint(mm2, broken)
        assert e.value.path == broken and e.value.file in (data, METADATA_FILE)
        if name != "metadata":
            with pytest.raises(CheckpointDamagedError, match=message):
                verify_checkpoint(broken)
    assert_same(full_state(other), before)  # nothing was loaded
    load_checkpoint(mm2, path)
    assert_same(full_state(other), full_state(trainer))


def test_a_checkpoint_without_a_manifest_loads_unverified(dist1, tmp_path):
    import json

    from chatlearn_mem import verify_checkpoint

    _, _, mm, trainer = train(gpt.GPTTrainerConfig(), steps=1)
    save_checkpoint(mm, tmp_path, step=1)
    path = latest_checkpoint(tmp_path)
    meta_path = os.path.join(path, METADATA_FILE)
    meta = json.loads(open(meta_path).read())
    del meta["files"]  # as written before manifests
    open(meta_path, "w").write(json.dumps(meta))
    assert verify_checkpoint(path) == {"files": 0, "bytes": 0, "seconds": 0.0, "verified": False}
    _, _, mm2, other = train(gpt.GPTTrainerConfig(), steps=0)
    load_checkpoint(mm2, path)
    assert_same(full_state(other), full_state(trainer))
