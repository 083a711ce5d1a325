"""The driver's SIGTERM handling, without Ray: the first signal only notes the time (the run stops at
its next safe point), a second stops at once, the previous handler comes back; and what the
checkpoint taken at the safe point does with the time left."""

import signal
import time
from types import SimpleNamespace

import pytest

from chatlearn_mem_ray import load_config
from chatlearn_mem_ray.job.stops import SigtermWatch, Terminate, sigterm_checkpoint


def test_first_sigterm_is_noted_a_second_stops_and_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    lines = []
    watch = SigtermWatch(lines.append)
    watch.install()
    try:
        signal.raise_signal(signal.SIGTERM)
        assert watch.at is not None and lines == [
            "SIGTERM received: the run stops once this iteration ends (a second SIGTERM stops it now)"
        ]
        with pytest.raises(Terminate):
            signal.raise_signal(signal.SIGTERM)
    finally:
        watch.restore()
    assert signal.getsignal(signal.SIGTERM) == before


class FakeCheckpointer:
    def __init__(self, record):
        self.record, self.saved = record, []

    def complete(self):
        return 0.0

    def save(self, done, state):
        self.saved.append(done)
        self.states = [*getattr(self, "states", []), state]
        self.record["checkpoints"].append({"iterations_done": done, "seconds": 1.0})


def _run(record):
    return SimpleNamespace(checkpointer=FakeCheckpointer(record), where=None, state=lambda: {})


LOOP = SimpleNamespace(state_dict=lambda: {"cursor": 7})  # the loop's own state, saved with the checkpoint


def test_the_sigterm_checkpoint_saves_what_the_newest_lacks_when_there_is_time(tmp_path):
    cfg = load_config("cpu_tiny", ["checkpoint.every=3", "checkpoint.sigterm_grace_s=30", f"output_dir={tmp_path}"])
    term = SimpleNamespace(at=time.monotonic())
    record = {"restarts": [], "checkpoints": [{"iterations_done": 3, "seconds": 2.0}]}
    run = _run(record)
    assert sigterm_checkpoint(cfg, run, LOOP, record, 4, term) == "saved on SIGTERM, it holds all 4 iterations"
    assert run.checkpointer.saved == [4]
    assert run.checkpointer.states[0]["loop"] == {"cursor": 7}  # the loop's own state goes with the models
    assert sigterm_checkpoint(cfg, run, LOOP, record, 4, term) == "it holds all 4 iterations"  # nothing more to save
    slow = {"restarts": [], "checkpoints": [{"iterations_done": 3, "seconds": 40.0}]}
    run = _run(slow)
    note = sigterm_checkpoint(cfg, run, LOOP, slow, 5, term)
    assert note.startswith("no time to save the last iterations: the previous save took 40.0s and ")
    assert run.checkpointer.saved == []
    off = load_config("cpu_tiny", ["checkpoint.every=3", "checkpoint.on_sigterm=false", f"output_dir={tmp_path}"])
    assert sigterm_checkpoint(off, _run(record), LOOP, record, 5, term).startswith("checkpoint.on_sigterm=false")
    none = load_config("cpu_tiny", [f"output_dir={tmp_path}"])
    assert sigterm_checkpoint(none, _run(record), LOOP, record, 5, term) == "checkpoints are off (checkpoint.every=0)"
