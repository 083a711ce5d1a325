#!/usr/bin/env bash
# Fill .whl/ (ignored by git) with what the GPU machine lacks, for scripts/gpu_validate.sh there.
# Run it here, in the repository root, with network access to PyPI and the [test] install active.
#
# The GPU machine has Python 3.12 with torch 2.11, numpy, typer,
# PyYAML, matplotlib, psutil, pytest and Ray's smaller requirements, but no megatron-core, Ray,
# pydantic or jsonschema, no network, and one call carries at most 64 MiB (repository included).
# So: megatron-core 0.19.2, pydantic and its three helpers, jsonschema and its three helpers (cp312,
# manylinux x86-64 wheels), torch_memory_saver 0.0.10 (the peer the `tms` step times: one cp39-abi3
# wheel of 2.6 MB with its CUDA 12 and 13 builds, no dependencies), nvidia-ml-py (pynvml, 58 kB: the
# device report's per-process view), this checkout's own wheel, and Ray repacked: its cp312 wheel is 79 MB,
# so the Java jars, RLlib, Data, Serve, Train, Tune, LLM and the dashboard's web client (none used
# by the PPO run) are left out and the rest compressed with xz (26 MB); about 35 MiB in all, under the
# 60 MiB the validation allows (the rest of a call's 64 MiB is the repository). Records the source
# revision the wheel is built from in .whl/REVISION (the copy of the repository on the GPU machine has
# no .git; the validation records it from there). Ends with
# `python -m chatlearn_mem_bench.gpu_validate --dry-run --wheelhouse .whl`, which checks the result.
#
# Then, on the GPU machine with .whl/ copied along (one command, at most 10 minutes):
#   bash scripts/gpu_validate.sh --out "$OUT"
# and copy what it writes under $OUT into benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
WH=.whl
MEGATRON=0.19.2
RAY=2.60.0
PYDANTIC=2.14.3
PYDANTIC_CORE=2.50.4   # the one pydantic $PYDANTIC requires
TMS=0.0.10             # torch_memory_saver: abi3, CUDA 12 and 13 builds in one wheel
NVML=13.615.71         # nvidia-ml-py
rm -rf "$WH" && mkdir -p "$WH"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {
  python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" -d "$WH" "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
download "megatron-core==$MEGATRON" "pydantic==$PYDANTIC" "pydantic-core==$PYDANTIC_CORE" "annotated-types>=0.6" \
  "typing-inspection>=0.4.2" "jsonschema>=4.18" jsonschema-specifications referencing rpds-py \
  "torch_memory_saver==$TMS" "nvidia-ml-py==$NVML"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
download "ray==$RAY" && mv "$WH"/ray-*.whl "$tmp"/
python3 - "$tmp"/ray-*.whl "$WH/ray-$RAY-cp312-pruned.tar.xz" <<'PY'
import sys, tarfile, zipfile
# Left out: never imported by ray.init, actors, placement groups or the dashboard agent.
SKIP = ("ray/jars/", "ray/rllib/", "ray/data/", "ray/serve/", "ray/train/", "ray/tune/", "ray/llm/",
        "ray/dashboard/client/")
src, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as zf, tarfile.open(dst, "w:xz", preset=6) as tf:
    for info in zf.infolist():
        if info.is_dir() or info.filename.startswith(SKIP) or "/__pycache__/" in info.filename:
            continue
        ti = tarfile.TarInfo(info.filename)
        ti.size = info.file_size
        ti.mode = (info.external_attr >> 16) & 0o777 or 0o644  # raylet and gcs_server stay executable
        with zf.open(info) as f:
            tf.addfile(ti, f)
PY
python3 -m pip wheel -q --disable-pip-version-check --no-deps -w "$WH" . 2>&1 | grep -v "^WARNING: Location" || true
python3 -c 'import sys; from chatlearn_mem_bench.measure import git_revision
rev = git_revision(".")
sys.exit("error: not a git checkout: the wheelhouse records the revision its wheel is built from") if not rev else print(rev)' \
  > "$WH/REVISION"
ls -l "$WH"
du -sh "$WH"
python3 -m chatlearn_mem_bench.gpu_validate --dry-run --wheelhouse "$WH"
