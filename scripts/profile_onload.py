#!/usr/bin/env python3
"""Where the host's time goes in a non-blocking weights onload, on a bench-sized trainer.

Builds the trainer of a bench preset (``gpu`` by default) and, for a manager with
``empty_cache=True`` and then one with ``empty_cache=False``, measures:

* ``forward_host_ms`` / ``forward_wall_ms``: a no-grad forward of 2 x 512 tokens, until it returns
  and until the device is idle (close: the forward is bound by the host launching its kernels);
* ``malloc_after_empty_cache_ms``: one device allocation of the weights' bytes from an emptied
  cache (what the regrow costs at most);
* ``nonblocking_return_ms`` / ``onload_total_ms``: ``onload(weights, blocking=False)`` until it
  returns, and until its ``wait()`` and the device are done (6 calls), with the last call's
  :class:`~chatlearn_mem.TransferStats`;
* ``serial_ms`` / ``overlapped_ms``: a blocking onload then the forward, against the non-blocking
  onload and the forward at once (4 each);
* ``forward_host_ms_inflight``: the forward's host time while the onload is in flight (the
  per-module fences' cost to the host);
* ``profile_tottime`` / ``profile_cumtime``: cProfile of one non-blocking onload call.

Run (on a GPU; on a CPU it runs through the CPU backend)::

    python scripts/profile_onload.py [--preset gpu] [--out FILE.json] [overrides ...]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
import warnings


def measure(trainer, cfg, empty_cache: bool) -> dict:
    import torch

    from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager
    from chatlearn_mem.models import gpt
    from chatlearn_mem_bench.measure import timed

    cuda = torch.cuda.is_available()
    mm = TrainerMemoryManager(
        trainer.model,
        trainer.optimizer,
        MemoryConfig(
            bucket_size_mb=cfg.bucket_size_mb,
            pin_memory=cuda or None,
            skip_unchanged_weights=False,
            empty_cache=empty_cache,
        ),
    )
    try:
        dev = mm.device
        sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
        for _ in range(2):
            mm.offload()
            mm.onload()
        batch = gpt.synthetic_batch(cfg.trainer, 1, batch_size=2)[:, :512]

        def forward():
            with torch.no_grad():
                trainer.loss(batch)

        forward()
        sync()
        r: dict = {}
        host, wall = [], []
        for _ in range(5):
            sync()
            t0 = time.perf_counter()
            forward()
            host.append(time.perf_counter() - t0)
            sync()
            wall.append(time.perf_counter() - t0)
        r["forward_host_ms"] = statistics.median(host) * 1e3
        r["forward_wall_ms"] = statistics.median(wall) * 1e3
        storages = mm.state.storages(Part.WEIGHTS)
        nbytes = sum(s.nbytes() for s in storages)
        r["weights_storages"], r["weights_mib"] = len(storages), nbytes / 2**20
        if cuda:
            samples = []
            for _ in range(5):
                torch.cuda.empty_cache()
                sync()
                t0 = time.perf_counter()
                x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                samples.append(time.perf_counter() - t0)
                del x
            r["malloc_after_empty_cache_ms"] = statistics.median(samples) * 1e3
        returned, total, stats = [], [], None
        for _ in range(6):
            mm.offload(Part.WEIGHTS)
            sync()
            t0 = time.perf_counter()
            handle = mm.onload(Part.WEIGHTS, blocking=False)
            returned.append(time.perf_counter() - t0)
            stats = handle.wait()
            sync()
            total.append(time.perf_counter() - t0)
        r["nonblocking_return_ms"] = [round(x * 1e3, 2) for x in returned]
        r["onload_total_ms"] = [round(x * 1e3, 2) for x in total]
        r["stats"] = repr(stats)[:600]

        def serial():
            mm.onload(Part.WEIGHTS)
            forward()

        def overlapped():
            handle = mm.onload(Part.WEIGHTS, blocking=False)
            forward()
            handle.wait()

        for name, fn in (("serial", serial), ("overlapped", overlapped)):
            xs = []
            for _ in range(4):
                mm.offload(Part.WEIGHTS)
                xs.append(timed(fn, dev)[0])  # the device idle before and after
            r[name + "_ms"] = [round(x * 1e3, 2) for x in xs]
        mm.offload(Part.WEIGHTS)
        sync()
        handle = mm.onload(Part.WEIGHTS, blocking=False)
        t0 = time.perf_counter()
        forward()
        r["forward_host_ms_inflight"] = (time.perf_counter() - t0) * 1e3
        handle.wait()
        sync()
        mm.offload(Part.WEIGHTS)
        sync()
        prof = cProfile.Profile()
        prof.enable()
        handle = mm.onload(Part.WEIGHTS, blocking=False)
        prof.disable()
        handle.wait()
        sync()
        for key, n in (("tottime", 22), ("cumtime", 30)):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(n)
            r["profile_" + key] = s.getvalue()
        return r
    finally:
        mm.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpu", help="the bench preset whose trainer to build (default gpu)")
    p.add_argument("--out", help="write every figure and both profiles here as JSON")
    p.add_argument("overrides", nargs="*", help="bench config overrides, key=value")
    args = p.parse_args(argv)

    from chatlearn_mem.errors import ConfigError
    from chatlearn_mem.models import gpt
    from chatlearn_mem_bench.config import load_config
    from chatlearn_mem_bench.run import _init_distributed

    try:
        cfg = load_config(args.preset, args.overrides)
    except ConfigError as e:
        p.error(str(e))
    # the group destroyed before exit: a NCCL group left to it holds it up (an older build, the base
    # of scripts/gpu_ab_host.sh, lacks owned_process_group: that script destroys the group at exit)
    with getattr(gpt, "owned_process_group", contextlib.nullcontext)():
        with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # megatron-core's notices about apex / TE / deprecations
            _init_distributed(tmp)
            trainer = gpt.build_gpt_trainer(cfg.trainer)
            trainer.train_step(gpt.synthetic_batch(cfg.trainer, 0, batch_size=cfg.batch_size))
        results = {f"empty_cache={e}": measure(trainer, cfg, e) for e in (True, False)}
    for key, r in results.items():
        print("=====", key)
        for name, value in r.items():
            if not name.startswith("profile"):
                print(name, value)
        print(r["profile_cumtime"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    code = main()
    from chatlearn_mem.models import gpt

    getattr(gpt, "exit_process", sys.exit)(code)  # at once when the process group's teardown hung
