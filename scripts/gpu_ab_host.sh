#!/usr/bin/env bash
# On the GPU machine: the host-time A/B of two builds of chatlearn-mem, processes alternating.
#
# Installs the wheelhouse carried along with the repository (.whl/, as scripts/gpu_validate.sh does)
# twice: as it is ("new") and with the chatlearn-mem wheel of .whl/base/ in its place ("base"; make
# it with `pip wheel --no-deps -w .whl/base .` and `git rev-parse HEAD > .whl/base/REVISION` in a
# checkout of the other commit). Then, for
# --rounds rounds, runs scripts/profile_onload.py for base and then new, and last
# scripts/measure_host_overhead.py --profile for base and then new (with each kind of call's leading
# functions under cProfile on the largest model). The scripts are this checkout's: the
# builds differ only in the library. Everything is written under --out as it happens (a command cut
# short keeps what it measured):
#   bash scripts/gpu_ab_host.sh --out "$OUT" [--rounds 1] [--layers 4,64] [--repeats 10] [--preset gpu] [--run-timeout 150]
# Each process destroys its process group at exit (a build without gpt.shutdown_distributed() hung
# in its exit with NCCL) and runs under `timeout --run-timeout` seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
WH="${WHEELHOUSE:-.whl}"
PY="${PYTHON:-python3}"
OUTDIR="" ROUNDS=1 LAYERS="4,64" REPEATS=10 PRESET=gpu RUN_TIMEOUT=150
usage() {
  echo "usage: bash scripts/gpu_ab_host.sh --out DIR [--rounds N] [--layers 4,64] [--repeats 10] [--preset gpu] [--run-timeout 150]" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  [ $# -ge 2 ] || usage  # every option takes a value
  case "$1" in
    --out) OUTDIR="$2"; shift 2 ;;
    --rounds) ROUNDS="$2"; shift 2 ;;
    --layers) LAYERS="$2"; shift 2 ;;
    --repeats) REPEATS="$2"; shift 2 ;;
    --preset) PRESET="$2"; shift 2 ;;
    --run-timeout) RUN_TIMEOUT="$2"; shift 2 ;;
    *) usage ;;
  esac
done
if [ -z "$OUTDIR" ]; then
  echo "error: --out DIR is required (where the results go)" >&2; exit 2
fi
if ! ls "$WH"/base/chatlearn_mem-*.whl > /dev/null 2>&1; then
  echo "error: no base wheel in $WH/base/: run 'pip wheel --no-deps -w $WH/base .' in a checkout of the base commit" >&2
  exit 2
fi
if [ ! -f "$WH/base/REVISION" ]; then
  echo "[ab] warning: no $WH/base/REVISION: the results will not say which commit the base is (git rev-parse HEAD > $WH/base/REVISION)" >&2
fi
mkdir -p "$OUTDIR"
t0=$(date +%s)
for build in base new; do
  rm -rf "/tmp/ab_$build"  # nothing left from another wheelhouse
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "/tmp/ab_$build" "$WH"/*.whl
done
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ab_base "$WH"/base/chatlearn_mem-*.whl
for build in base new; do
  cp "$WH/$([ "$build" = base ] && echo base/)REVISION" "$OUTDIR/revision_$build" 2> /dev/null || true
done
echo "[ab] installed both builds in $(( $(date +%s) - t0 )) s"
export PYTHONUNBUFFERED=1
# Each script runs with the process group destroyed at exit, whatever the build: one left to the
# interpreter's exit held a process of a build before gpt.shutdown_distributed() up for minutes.
LEAVE='import atexit, runpy, sys

def leave():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

atexit.register(leave)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")'
run() {  # run BUILD NAME SCRIPT ARGS...: one process of one build, its log and JSON under --out
  local build="$1" name="$2"; shift 2
  local t=$(date +%s)
  PYTHONPATH="/tmp/ab_$build" timeout -k 10 "$RUN_TIMEOUT" "$PY" -c "$LEAVE" "$@" --out "$OUTDIR/${name}_$build.json" \
    > "$OUTDIR/${name}_$build.log" 2>&1 || echo "[ab] $name $build exited with $? (124: cut at $RUN_TIMEOUT s)"
  echo "[ab] $name $build: $(( $(date +%s) - t )) s"
}
for r in $(seq 1 "$ROUNDS"); do
  for build in base new; do
    run "$build" "profile$r" scripts/profile_onload.py --preset "$PRESET"
  done
done
for build in base new; do
  run "$build" host scripts/measure_host_overhead.py --layers "$LAYERS" --repeats "$REPEATS" --profile
done
echo "[ab] done in $(( $(date +%s) - t0 )) s"
