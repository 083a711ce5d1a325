"""Record what ``chatlearn-mem ppo`` (preset ``cpu_tiny``) must keep producing, bit for bit.

Run from the repository root after a change that must not alter PPO's results on purpose::

    chatlearn-mem ppo output_dir=/tmp/ppo_golden && python tests/ray/golden/record.py /tmp/ppo_golden/log.json

It writes ``tests/ray/golden/ppo_cpu_tiny.json`` (compared by ``tests/ray/test_ppo_ray.py``): every metric of every iteration but the measured
timings and process sizes, the weight-sync digests, the device bytes of every phase, the summary's
colocation figures and the final weights' SHA-256, with the CPU capability and versions it was
recorded on (CPU kernels of another instruction set may round differently).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/

from golden_outcome import outcome  # noqa: E402

if __name__ == "__main__":
    import torch

    log = json.loads(Path(sys.argv[1]).read_text())
    record = {
        "command": "chatlearn-mem ppo",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
        "megatron-core": log["versions"]["megatron-core"],
        "outcome": outcome(log),
    }
    out = Path(__file__).resolve().parent / "ppo_cpu_tiny.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")
