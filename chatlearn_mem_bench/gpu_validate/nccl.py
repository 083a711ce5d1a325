"""The ``report`` step's figures of NCCL: what one communicator holds on the device outside the
allocator, what destroying it gives back and how long destroying and re-creating it take (in a
process of its own), and what tearing down every process group of the report's process gives back."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from chatlearn_mem_bench.gpu_validate import checkout

__all__ = ["NCCL_TIMEOUT_S", "measure_nccl", "measure_teardown"]

NCCL_TIMEOUT_S = 20
"""Seconds the report step gives its NCCL measurement (a process of its own)."""

_NCCL_SCRIPT = r"""
import json, tempfile, time
import torch
import torch.distributed as dist
from chatlearn_mem.process_memory import process_memory

out = {}
def emit(stage):  # after every stage: a teardown that hangs still leaves what came before
    out["stage"] = stage
    print("NCCL-JSON " + json.dumps(out), flush=True)

def now():
    torch.cuda.synchronize()
    return process_memory()

def group():
    dist.init_process_group("nccl", init_method=f"file://{tempfile.mkdtemp()}/init", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    dist.all_reduce(x)

torch.cuda.init(); torch.cuda.set_device(0)
x = torch.ones(1, device="cuda")
base = now()
out.update(nccl_version=".".join(map(str, torch.cuda.nccl.version())), ranks=1, per_process=base.per_process,
           nvml_note=base.nvml_note, context_bytes=base.used)
t0 = time.perf_counter(); group(); made = now()
out.update(create_s=time.perf_counter() - t0, communicator_bytes=made.outside_allocator - base.outside_allocator)
emit("created")
t0 = time.perf_counter(); dist.destroy_process_group(); gone = now()
out.update(destroy_s=time.perf_counter() - t0, freed_by_destroy_bytes=made.outside_allocator - gone.outside_allocator)
emit("destroyed")
t0 = time.perf_counter(); group(); again = now()
out.update(recreate_s=time.perf_counter() - t0, recreated_bytes=again.outside_allocator - gone.outside_allocator)
emit("recreated")
dist.destroy_process_group()
"""


def measure_nccl(timeout_s: float = NCCL_TIMEOUT_S) -> dict:
    """What one NCCL communicator (one rank) holds on the device outside the allocator, what
    destroying it gives back, and how long destroying and re-creating it take: in a process of its
    own (megatron's groups in this one are held by DDP and the optimizer). A one-rank figure: with
    peers NCCL allocates buffers per channel and peer (about 1 GiB per rank at TP4, reported)."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", _NCCL_SCRIPT], capture_output=True, text=True, timeout=timeout_s, cwd=checkout.REPO
        )
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"error": f"timed out after {timeout_s:.0f} s", **_nccl_json(text)}
    found = _nccl_json(out.stdout)
    if not found:
        return {"error": f"exit status {out.returncode}: {(out.stdout + out.stderr)[-1500:]}"}
    return found


def measure_teardown(timeout_s: float = 10.0) -> dict:
    """Destroy this process's process groups (megatron's and the default one: every NCCL
    communicator it made) and say what that gave back outside the allocator and how long it took.
    Last thing the report step does; a teardown that does not return in ``timeout_s`` is left
    behind (``returned`` False) and the process ends without waiting for it."""
    from chatlearn_mem.models import gpt
    from chatlearn_mem.process_memory import process_memory

    before = process_memory()
    t0 = time.perf_counter()
    returned = gpt.shutdown_distributed(timeout_s)
    seconds = time.perf_counter() - t0
    after = process_memory() if returned else None
    return {
        "returned": returned,
        "seconds": seconds,
        "freed_bytes": before.outside_allocator - after.outside_allocator if after else None,
        "per_process": bool(after and before.per_process and after.per_process),
    }


def _nccl_json(text: str) -> dict:
    """The last stage the NCCL measurement reported (``{}`` when none)."""
    found = [line[len("NCCL-JSON ") :] for line in text.splitlines() if line.startswith("NCCL-JSON ")]
    return json.loads(found[-1]) if found else {}
