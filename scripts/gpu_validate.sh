#!/usr/bin/env bash
# On the GPU machine: install the wheelhouse copied along with the repository (.whl/, made by
# scripts/gpu_wheelhouse.sh) into /tmp/site, then run the validation (python -m
# chatlearn_mem_bench.gpu_validate, under chatlearn_mem_bench/gpu_validate/) with the given arguments.
# From the repository root, in one command of at most 10 minutes (the default steps take at most
# 560 s: tms 165, report 45, handoff 70, large 180, tests 100, most important first):
#   bash scripts/gpu_validate.sh --out "$OUT"
# Everything is written under --out as it happens, so a command cut short still leaves what it
# measured. The earlier runs' steps `bench` (270 s) and `ppo` (160 s, optional) run when named:
# --steps bench,ppo in a command of their own (a fresh machine installs again).
set -euo pipefail
cd "$(dirname "$0")/.."
WH="${WHEELHOUSE:-.whl}"
SITE="${SITE:-/tmp/site}"
PY="${PYTHON:-python3}"
if [ ! -d "$WH" ]; then
  echo "error: no wheelhouse at $WH: run scripts/gpu_wheelhouse.sh where pip can reach PyPI and carry $WH" >&2
  exit 2
fi
t0=$(date +%s)
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WH"/*.whl
for archive in "$WH"/ray-*-pruned.tar.xz; do
  "$PY" -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], **({'filter': 'tar'} if hasattr(tarfile, 'tar_filter') else {}))" "$archive" "$SITE"
done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
echo "[gpu-validate] installed $WH into $SITE in $(( $(date +%s) - t0 )) s"
exec "$PY" -m chatlearn_mem_bench.gpu_validate --wheelhouse "$WH" "$@"
