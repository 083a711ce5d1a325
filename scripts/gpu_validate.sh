#!/usr/bin/env bash
# On the GPU machine: install the carried wheelhouse (.whl/, made by scripts/gpu_wheelhouse.sh) into
# /tmp/site, then run scripts/gpu_validate.py with the given arguments (e.g. --out "$OUT").
# The device tool's call, from the repository root (carry the wheelhouse):
#   run(command="bash scripts/gpu_validate.sh --out $OUT", carry=[".whl"], timeout_s=600)
# If that runs out of time, two calls (each installs again; a fresh machine is bare):
#   run(command="bash scripts/gpu_validate.sh --out $OUT --steps tests,report,bench", carry=[".whl"], timeout_s=600)
#   run(command="bash scripts/gpu_validate.sh --out $OUT --steps ppo", carry=[".whl"], timeout_s=600)
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
exec "$PY" scripts/gpu_validate.py --wheelhouse "$WH" "$@"
