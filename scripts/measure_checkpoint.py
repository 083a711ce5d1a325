"""Measure checkpoint save throughput against a plain sequential write of the same bytes, one run.

Builds the trainer of a bench preset (default ``configs/bench/cpu.yaml``: the default CPU bench
trainer), takes one train step (so the optimizer has states), then, in one process and into one
directory:

* ``save_awake``: ``save_checkpoint`` of the resident trainer (synchronous);
* ``save_asleep``: the same after ``offload()``: every tensor read from the host store;
* ``save_async_return`` / ``save_async_total``: an asynchronous save of the sleeping trainer, the
  time until the call returns and until ``wait()`` has committed it;
* the same three with suffix ``_dp``: ``resharding=False`` (megatron's ``dp_reshardable``
  optimizer format: no gather copy; the default ``fully_reshardable`` copies the optimizer state
  while the call runs);
* ``plain_write``: the ceiling: the same number of bytes written with one sequential ``f.write``
  from a preallocated host buffer, then ``fsync`` (megatron's writer fsyncs too); before and
  after the saves of each repeat.

Throughputs are tensor bytes (what ``SaveHandle.nbytes`` counts) per second of wall time, the
median of ``--repeats``. Also checks that the sleeping trainer held 0 device bytes throughout.

Run: ``python scripts/measure_checkpoint.py [--preset cpu|tiny|PATH] [--dir DIR] [--repeats 3]``.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import statistics
import tempfile
import time
import warnings

import torch


def plain_write_seconds(directory: str | os.PathLike, nbytes: int) -> float:
    """One sequential write of ``nbytes`` from a preallocated host buffer, then ``fsync``: the
    disk's ceiling for a checkpoint of that many bytes (the file is removed after)."""
    buf = torch.ones(nbytes, dtype=torch.uint8).numpy()
    path = os.path.join(directory, "plain-write.bin")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(buf))
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    os.remove(path)
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--dir", default=None, help="directory to write into (default: a temporary one)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    warnings.simplefilter("ignore")
    from chatlearn_mem import MemoryConfig, TrainerMemoryManager
    from chatlearn_mem.checkpoint import save_checkpoint
    from chatlearn_mem.models import gpt
    from chatlearn_mem_bench.config import load_config

    bench = load_config(args.preset)
    cfg = gpt.GPTTrainerConfig(**bench.trainer.model_dump()) if hasattr(bench.trainer, "model_dump") else bench.trainer
    gpt.init_distributed(init_method=f"file://{tempfile.mktemp()}", cpu_backend=True)
    atexit.register(gpt.shutdown_distributed)  # a NCCL group left to the exit holds it up
    trainer = gpt.build_gpt_trainer(cfg)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(bucket_size_mb=bench.bucket_size_mb))
    trainer.train_step(gpt.synthetic_batch(cfg, 0, batch_size=bench.batch_size))
    root = args.dir or tempfile.mkdtemp(prefix="ckpt-measure-")
    os.makedirs(root, exist_ok=True)
    times: dict[str, list[float]] = {
        k: []
        for k in (
            "save_awake",
            "save_asleep",
            "save_async_return",
            "save_async_total",
            "save_awake_dp",
            "save_asleep_dp",
            "save_async_return_dp",
            "save_async_total_dp",
            "plain_write",
        )
    }
    # seconds of each save spent checksumming its files for the manifest (in the writing thread)
    manifest: dict[str, list[float]] = {k: [] for k in times if k.startswith("save") and "return" not in k}
    nbytes = 0
    asleep_device_bytes = []
    step = 0

    def plain_write():
        times["plain_write"].append(plain_write_seconds(root, nbytes))

    for _ in range(args.repeats):
        if nbytes:
            plain_write()  # before and after the saves: the disk's state affects both the same way
        for suffix, resharding in (("", True), ("_dp", False)):
            step += 1
            t0 = time.perf_counter()
            handle = save_checkpoint(mm, root, step=step, keep_last=1, resharding=resharding)
            nbytes = handle.nbytes
            times["save_awake" + suffix].append(time.perf_counter() - t0)
            manifest["save_awake" + suffix].append(handle.manifest_seconds)
            mm.offload()
            step += 1
            t0 = time.perf_counter()
            handle = save_checkpoint(mm, root, step=step, keep_last=1, resharding=resharding)
            times["save_asleep" + suffix].append(time.perf_counter() - t0)
            manifest["save_asleep" + suffix].append(handle.manifest_seconds)
            asleep_device_bytes.append(mm.residency().device_bytes)
            step += 1
            t0 = time.perf_counter()
            handle = save_checkpoint(mm, root, step=step, async_=True, keep_last=1, resharding=resharding)
            times["save_async_return" + suffix].append(time.perf_counter() - t0)
            handle.wait()
            times["save_async_total" + suffix].append(time.perf_counter() - t0)
            manifest["save_async_total" + suffix].append(handle.manifest_seconds)
            asleep_device_bytes.append(mm.residency().device_bytes)
            mm.onload()
        plain_write()
    med = {k: statistics.median(v) for k, v in times.items()}
    samples = {k: [round(x, 3) for x in v] for k, v in times.items()}
    out = {
        "preset": args.preset,
        "trainer": cfg.model_dump(),
        "tensor_bytes": nbytes,
        "repeats": args.repeats,
        "seconds": med,
        "samples_s": samples,
        "gb_per_s": {k: nbytes / v / 1e9 for k, v in med.items() if "return" not in k},
        "save_vs_plain_write": {k: med["plain_write"] / v for k, v in med.items() if "return" not in k},
        "asleep_device_bytes_max": max(asleep_device_bytes),
        "manifest_seconds": {k: statistics.median(v) for k, v in manifest.items()},
        "manifest_share_of_save": {k: statistics.median(v) / med[k] for k, v in manifest.items()},
        "torch": torch.__version__,
        "megatron_core": __import__("chatlearn_mem.mcore.layout", fromlist=["x"]).megatron_core_version(),
        "cpu_count": os.cpu_count(),
        "dir": root,
    }
    print(json.dumps(out, indent=1))
    if args.dir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
