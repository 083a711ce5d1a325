"""On a GPU with torch_memory_saver installed: the benchmark's TMS worker (chatlearn_mem_bench.tms)
loads TMS as slime does, builds the trainer under its tags, and every pause really gives the device
memory back and every resume brings the same bytes. Skipped without CUDA (conftest) or without
TMS. The GPU validation's ``tms`` step times it; this test is for running alone
(``pytest tests/gpu/test_gpu_tms.py``). The protocol runs on CPU in tests/megatron/test_bench_tms.py."""

import pytest

pytest.importorskip(
    "torch_memory_saver", reason="torch_memory_saver is not installed (scripts/gpu_wheelhouse.sh carries it)"
)

from chatlearn_mem_bench import tms  # noqa: E402
from chatlearn_mem_bench.config import load_config  # noqa: E402


def test_every_pause_gives_the_memory_back_and_every_resume_the_same_bytes():
    cfg = load_config(
        "tiny",
        [
            "trainer.num_layers=2",
            "trainer.hidden_size=1024",
            "trainer.num_attention_heads=16",
            "trainer.vocab_size=32000",
            "trainer.seq_length=128",
        ],
    )
    assert tms.skip_reason(True) is None
    method = tms.TorchMemorySaverMethod.spawn(cfg).ready(mm=None, trainer=None, pin=True)
    try:
        info = method.info
        assert not info["fake"] and info["environment"]["TMS_INIT_ENABLE"] == "1", info
        parts = info["bytes_per_part"]
        for part in ("weights", "main_weights", "optimizer_states", "full"):
            out = method.round(part, check=True, snap=True)
            print(part, {k: v for k, v in out.items() if k != "memory"})
            assert out["bytes_equal"], part
            needed = parts[part] + (parts["grads"] if part in ("weights", "full") else 0)
            assert out["released_bytes"] >= 0.99 * needed, (part, out["released_bytes"], needed)
            assert out["restored_bytes"] >= 0.99 * needed, (part, out["restored_bytes"], needed)
    finally:
        bye = method.close()
    assert bye.get("audit_ok"), bye
