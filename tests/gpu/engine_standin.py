"""A process standing in for an inference engine that takes the device memory a sleeping trainer gave back.

Used by ``tests/gpu/test_gpu_handoff.py`` (and its protocol by ``tests/unit/test_engine_standin.py``
on CPU). Two commands, each printing one JSON line on stdout:

``take``: allocate all but ``--margin-bytes`` of what the device reports free once this process's
own CUDA context exists (or exactly ``--bytes``), write every byte, read samples back, free it and
exit. Prints ``{"got_bytes", "free_seen_bytes", "written", "seconds"}``.

``hold``: allocate as ``take`` does, print ``{"holding_bytes", "free_seen_bytes"}``, then hold the
memory until a line ``release`` arrives on stdin (or stdin closes), free it, print
``{"released": true}`` and exit.

``--device cpu`` allocates host memory instead (``--bytes`` required): the protocol on any
machine, no GPU involved; there is no free device memory to read then (``free_seen_bytes`` null).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

STEP = 256 * 2**20
PATTERN = 0xA5


def _allocate(device: str, nbytes: int | None, margin: int) -> tuple[torch.Tensor, int | None]:
    """The largest uint8 buffer of ``nbytes`` (or all free but ``margin``) the device grants, and
    the free bytes seen before allocating (None on the CPU: nothing reports them)."""
    if device == "cpu":
        if nbytes is None:
            raise SystemExit("--device cpu needs --bytes")
        return torch.empty(nbytes, dtype=torch.uint8), None
    torch.cuda.init()
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    size = nbytes if nbytes is not None else free - margin
    while size > 0:
        try:
            return torch.empty(size, dtype=torch.uint8, device=device), free
        except torch.cuda.OutOfMemoryError:
            size -= STEP
    raise SystemExit(f"could not allocate anything leaving {margin} of {free} free bytes")


def _write_and_check(buf: torch.Tensor) -> bool:
    """Write every byte, then read the first and last MiB back (the memory is really this process's)."""
    buf.fill_(PATTERN)
    if buf.is_cuda:
        torch.cuda.synchronize()
    n = min(buf.numel(), 2**20)
    return bool((buf[:n] == PATTERN).all()) and bool((buf[-n:] == PATTERN).all())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["take", "hold"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--bytes", type=int, default=None, help="allocate exactly this many bytes")
    parser.add_argument("--margin-bytes", type=int, default=256 * 2**20, help="leave this much of the free memory")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    buf, free = _allocate(args.device, args.bytes, args.margin_bytes)
    got = buf.numel()
    if args.command == "take":
        written = _write_and_check(buf)
        del buf
        if args.device != "cpu":
            torch.cuda.empty_cache()
        print(
            json.dumps(
                {"got_bytes": got, "free_seen_bytes": free, "written": written, "seconds": time.perf_counter() - t0}
            )
        )
        return 0 if written else 1
    written = _write_and_check(buf)
    print(json.dumps({"holding_bytes": got, "free_seen_bytes": free, "written": written}), flush=True)
    for line in sys.stdin:
        if line.strip() == "release":
            break
    del buf
    if args.device != "cpu":
        torch.cuda.empty_cache()
    print(json.dumps({"released": True}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
