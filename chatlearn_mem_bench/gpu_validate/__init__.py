"""Validate chatlearn-mem on one GPU in one command: the manager against torch_memory_saver, what
stays on the device after a full offload (by NVML), another process taking the memory a sleeping
trainer gave back, the largest trainer one GPU holds, the GPU test tier; results named after the GPU.

On the GPU machine (everything it lacks is carried as wheels, see scripts/gpu_wheelhouse.sh)::

    bash scripts/gpu_validate.sh --out "$OUT"          # installs .whl/ into /tmp/site, runs this

Anywhere, without a GPU (CI runs this; it needs the [test] install), from the repository root::

    python -m chatlearn_mem_bench.gpu_validate --dry-run --wheelhouse .whl

The dry run (:mod:`~chatlearn_mem_bench.gpu_validate.dry_run`) does everything up to the first
CUDA call: checks the wheelhouse (:mod:`~chatlearn_mem_bench.gpu_validate.wheelhouse`: every
package the GPU machine lacks, one version each, built for CPython 3.12 on x86-64 Linux, within the
64 MiB a device call may carry, and the source revision it was built from), resolves the benchmark
presets and the PPO config (through ``chatlearn-mem ppo --print-config``: the benchmark does not
import the app), plans each bench step's host and device memory and estimates its time from the
config alone and fails when one exceeds its bound (:mod:`~chatlearn_mem_bench.gpu_validate.bounds`),
imports every module the GPU run imports (in a process of its own), collects the GPU tier, and
prints the plan (steps, commands, time budgets, output files). Then it stops with one line saying so.

Steps (:mod:`~chatlearn_mem_bench.gpu_validate.steps`: ``STEPS``; without ``--steps`` the
``DEFAULT_STEPS``, most important first), each a fresh process in its own process group, so one
crash or CUDA error cannot take the others with it; each within its time budget (``BUDGET_S``; the
default steps add up to ``TOTAL_BUDGET_S`` = 560 s of the 600 s one device call may run, the rest
for installing the wheelhouse and writing the summary; a step that ends early leaves its unused
seconds to the next). Each step's command, what it writes, how its results are read and its
section of the summary live in one module:

1. ``tms``     (:mod:`.benches`) ``chatlearn-mem bench --config gpu_tms``: the manager against
   torch_memory_saver (as slime runs it, in a worker process) and megatron-core's own offload, per
   part, in one run.
2. ``report``  (:mod:`.device_report`, :mod:`.nccl`) what stays on the device after a full offload
   of the PPO preset's policy trainer (about 0.35 B parameters), by the allocator and by NVML: the
   CUDA context, NCCL's communicator, cuBLAS workspaces, the allocator's cache, with and without
   the release of idle memory, its cost to the next step, the target (context + 1% of the awake
   state), and a NCCL communicator's bytes, destroy and re-create times (in a process of its own).
3. ``handoff`` (:mod:`.gpu_tests`) ``pytest tests/gpu/test_gpu_handoff.py``: another process
   allocates what the sleeping trainer gave back; a trainer that cannot wake fails cleanly and
   wakes later, exact.
4. ``large``   (:mod:`.benches`) ``chatlearn-mem bench --config gpu_large``: a 2.3 B-parameter
   trainer, full sleep and wake against the ceiling.
5. ``tests``   (:mod:`.gpu_tests`) ``pytest tests/gpu`` but the handoff and torch_memory_saver
   files (exactness with NCCL, policy + critic sharing the GPU, allocated and reserved bytes after
   offload with and without expandable segments, pinned host store, device OOM during onload, TE
   layer spec when TE imports, the device report and the release of idle memory).
6. ``bench``   (:mod:`.benches`) not by default: ``chatlearn-mem bench --config gpu`` (every
   alternative, the overlap rows; 270 s).
7. ``ppo``     (:mod:`.ppo`) not by default, optional, last: ``chatlearn-mem ppo --config gpu``
   scaled to one GPU. Its outcome is reported but does not change the exit status.

The run (:mod:`.run`) writes everything under ``--out`` as it happens: each step's output streams
into ``<stem>_validation/<step>.log`` (with the junit files, ``report.json`` and ``handoff.json``),
the summary (:mod:`.summary`) is rewritten after every step, each benchmark rewrites its JSON after
every part and the PPO run its log after every iteration; a step cut off by its budget keeps what
it wrote, and a benchmark's markdown and plot are rebuilt from its partial JSON.

Outputs (``--out``, default ``benchmarks/results``; ``<stem>`` = ``<date>_gpu-<gpu name>``):
``<stem>_validation.{json,md,png}`` (every step's status, the test outcomes, the device reports,
the manager against its peers, the handoff's figures, the targets), ``<stem>_validation/`` (the
step logs), ``<stem>_tms.{json,md,png}`` and ``<stem>_large.{json,md,png}`` (the benchmarks' own
files; ``<stem>.{json,md,png}`` for ``bench``) and ``<stem>_ppo/{log.json,memory_timeline.png}``.

The source revision is recorded in every result (:mod:`.checkout`): ``--revision``, else ``git
rev-parse HEAD`` of this checkout, else the ``REVISION`` file ``scripts/gpu_wheelhouse.sh`` writes
into the wheelhouse (the copy on the GPU machine has no ``.git``); a run without one stops before
it starts.

Exit status: 0 when every required step ran and every GPU test passed or was skipped; 1 otherwise;
2 for a setup problem (no CUDA without --dry-run, a wheelhouse that is incomplete, no revision).
Benchmark and report targets are data, not failures.
"""

from chatlearn_mem_bench.gpu_validate.cli import main

__all__ = ["main"]
