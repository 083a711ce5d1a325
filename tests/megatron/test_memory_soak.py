"""Soak: hundreds of sleep/wake cycles with training between them grow no process memory.

Run in a fresh interpreter, so that the RSS is the trainer's and nothing the test session held
before. A 4-layer bf16 GPT with the distributed optimizer, 200 full offload/onload cycles, a train
step every 5: the RSS (after ``gc.collect()``) must not grow over the second half. It grew by
about 200 MiB every 50 cycles, without end, for two reasons (``chatlearn_mem.device_memory``):
the storages the manager released and regrew came from the C heap, which training's allocations
between the cycles fragmented; and what training freed stayed in the heap (glibc returns only its
top), which an offload now gives back (``MemoryConfig.empty_cache``).
"""

import json
import subprocess
import sys

CYCLES, TRAIN_EVERY, SAMPLE_EVERY = 200, 5, 25
GROWTH_BOUND = 16 * 2**20  # bytes over the second half; the defects grew 100-200 MiB per 50 cycles here

SCRIPT = f"""
import gc, json, os
from chatlearn_mem import MemoryConfig, TrainerMemoryManager, cpu_backend
from chatlearn_mem.models import gpt

cpu_backend.install(quiet=True)
os.environ["MASTER_PORT"] = "29531"
gpt.init_distributed()
cfg = gpt.GPTTrainerConfig(num_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=4096, seq_length=128)
trainer = gpt.build_gpt_trainer(cfg)
batch = gpt.synthetic_batch(cfg, 1, batch_size=2)
trainer.train_step(batch)
mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(bucket_size_mb=16))

def rss():
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

samples = [(0, rss())]
for c in range(1, {CYCLES} + 1):
    mm.offload(force=True)
    mm.onload()
    if c % {TRAIN_EVERY} == 0:
        trainer.train_step(batch)
    if c % {SAMPLE_EVERY} == 0:
        samples.append((c, rss()))
print("SOAK " + json.dumps({{"samples": samples, "audit_ok": mm.audit().ok}}))
"""


def test_cycles_with_training_between_them_grow_no_process_memory():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SOAK ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    res = json.loads(line[len("SOAK ") :])
    samples = dict(res["samples"])
    assert res["audit_ok"]
    warm, last = samples[CYCLES // 2], samples[CYCLES]
    trace = " / ".join(f"{c}: {b / 2**20:.0f}" for c, b in res["samples"])
    assert last - warm < GROWTH_BOUND, f"RSS grew {(last - warm) / 2**20:.1f} MiB over the second half ({trace} MiB)"
    print(f"RSS by cycle (MiB): {trace}")
