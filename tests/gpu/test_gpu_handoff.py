"""On a GPU: the memory a sleeping trainer gives back is another process's to use, and a trainer
that cannot wake because another process holds the memory fails cleanly and wakes later, exact.

The other process (``engine_standin.py``) stands in for an inference engine: it starts its own CUDA
context and allocates all but a small margin of what the device then reports free. Each test
prints its figures, and writes them as JSON to ``$CHATLEARN_MEM_HANDOFF_JSON`` when set (the GPU
validation's ``handoff`` step collects them). Skipped without CUDA (conftest); the helper's
protocol is checked on CPU by ``tests/unit/test_engine_standin.py``.
"""

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_runs import BATCH, bit_equal, snapshot, train

from chatlearn_mem import Part, TrainerMemoryManager
from chatlearn_mem.models import gpt

STANDIN = Path(__file__).resolve().parent / "engine_standin.py"
# about 1.5 GB of trainer state (83 M parameters), built in seconds
CFG = gpt.GPTTrainerConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32000, seq_length=128)
STEPS = 4
MARGIN = 256 * 2**20
"""What the stand-in leaves of the free memory."""


def _record(name: str, figures: dict) -> None:
    print(f"{name}: {json.dumps(figures)}")
    path = os.environ.get("CHATLEARN_MEM_HANDOFF_JSON")
    if path:
        p = Path(path)
        data = json.loads(p.read_text()) if p.exists() else {}
        data[name] = figures
        p.write_text(json.dumps(data, indent=1))


def _host(tensors):
    return [t.cpu() for t in tensors]


def _twin():
    """The same trainer trained STEPS steps without sleeping: its losses and final state, on the host
    (its device memory is freed, so that it does not count against the stand-in)."""
    losses, state, mm, trainer = train(CFG, steps=STEPS)
    out = losses, _host(state)
    mm.close()
    del state, mm, trainer
    gc.collect()
    torch.cuda.empty_cache()
    return out


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def _batch(step):
    return gpt.synthetic_batch(CFG, step, batch_size=BATCH)


def test_another_process_takes_the_memory_the_sleeping_trainer_gave_back(dist1):
    base_losses, base_state = _twin()
    trainer = gpt.build_gpt_trainer(CFG)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    losses = [trainer.train_step(_batch(s)) for s in range(2)]
    state = mm.residency().device_bytes
    free_awake = _free()
    mm.offload()  # a full offload: the cache and the cuBLAS workspaces go back too
    free_asleep = _free()
    out = subprocess.run(
        [sys.executable, str(STANDIN), "take", "--margin-bytes", str(MARGIN)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    engine = json.loads(out.stdout.strip().splitlines()[-1])
    mm.onload()
    losses += [trainer.train_step(_batch(s)) for s in range(2, STEPS)]
    figures = {
        "trainer_state_bytes": state,
        "freed_by_the_offload_bytes": free_asleep - free_awake,
        "free_when_asleep_bytes": free_asleep,
        "engine_got_bytes": engine["got_bytes"],
        "engine_free_seen_bytes": engine["free_seen_bytes"],
        "engine_got_over_state": engine["got_bytes"] / state,
        "engine_seconds": engine["seconds"],
    }
    _record("take", figures)
    # The driver has the trainer's state back, and the other process allocated and wrote it (and
    # all else that was free but its margin and its own context).
    assert free_asleep - free_awake >= 0.99 * state, figures
    assert engine["written"] and engine["got_bytes"] >= engine["free_seen_bytes"] - MARGIN - 2**21, figures
    assert engine["got_bytes"] >= state, figures
    # and the trainer went on as if it had never slept
    assert losses == base_losses
    assert bit_equal(_host(snapshot(trainer)), base_state)
    assert mm.audit().ok


def test_a_trainer_that_cannot_wake_fails_cleanly_and_wakes_once_the_memory_is_back(dist1):
    base_losses, base_state = _twin()
    trainer = gpt.build_gpt_trainer(CFG)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    losses = [trainer.train_step(_batch(s)) for s in range(2)]
    state = mm.residency().device_bytes
    mm.offload()
    host_before = mm.residency().host_bytes
    holder = subprocess.Popen(
        [sys.executable, str(STANDIN), "hold", "--margin-bytes", str(MARGIN)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        held = json.loads(holder.stdout.readline())
        assert held["written"], held
        with pytest.raises(torch.cuda.OutOfMemoryError):
            mm.onload()
        offloaded = [p.value for p in mm.parts if mm.is_offloaded(p)]
        # nothing lost: what did not come back is still whole on the host, the rest whole on the device
        assert offloaded, "the onload did not fail"
        assert mm.is_offloaded(Part.OPTIMIZER_STATES)
        assert mm.audit().ok, mm.audit()
        assert mm.residency().host_bytes == host_before
    finally:
        holder.stdin.write("release\n")
        holder.stdin.flush()
        released = json.loads(holder.stdout.readline())
        holder.wait(timeout=60)
    mm.onload()
    losses += [trainer.train_step(_batch(s)) for s in range(2, STEPS)]
    _record(
        "hold",
        {
            "trainer_state_bytes": state,
            "engine_held_bytes": held["holding_bytes"],
            "parts_still_offloaded_after_the_failed_onload": offloaded,
            "released": released["released"],
        },
    )
    assert losses == base_losses
    assert bit_equal(_host(snapshot(trainer)), base_state)
    assert mm.audit().ok
