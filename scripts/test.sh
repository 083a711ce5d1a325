#!/usr/bin/env bash
# Install chatlearn-mem with its test extras and run the test suite on three legs:
#   1. Python 3.11 (the active Python) + megatron-core 0.16.1, the newest release for 3.11 (the default install);
#   2. Python 3.11 + megatron-core 0.13.1, the oldest supported (put first on PYTHONPATH from a --target install);
#   3. Python 3.12 + megatron-core 0.19.2, the newest (0.17 and later need Python 3.12), in its own venv
#      `.venv312` (torch 2.13.0 comes there as the registry's CUDA build, about 4.7 GB; it runs on CPU);
# first the formatter and linter (ruff, configured in pyproject.toml), and last the wheel as a user installs it
# (scripts/wheel_check.sh).
#
# One leg, RAY_LEG (default 0.19, the newest megatron-core, what a new user installs; the first leg of LEGS when
# RAY_LEG is not among them), runs every tier. The other legs run what depends on the megatron-core version:
# tests/megatron, tests/multirank and tests/gpu (the unit tier imports no megatron and the Ray tier runs the same
# code on every version). Legs 0.16 and 0.13 run at the same time, beside the Python 3.12 install, each into its
# own log printed when it ends (PARALLEL=0 runs them one after the other).
#
# Environment: LEGS (default "0.16 0.13 0.19") picks legs; RAY_LEG (above); PARALLEL (above); PYTHON312 names the
# Python 3.12 to use (else it is looked up on PATH and under ~/.pyenv/versions/3.12*); SKIP_WHEEL_CHECK=1 skips the
# wheel check. Extra arguments go to pytest and then pick what every leg runs (the Ray tier still only on RAY_LEG),
# e.g. `LEGS=0.19 bash scripts/test.sh tests/unit` for one tier on one leg.
set -euo pipefail
cd "$(dirname "$0")/.."
LEGS="${LEGS:-0.16 0.13 0.19}"
RAY_LEG="${RAY_LEG:-0.19}"
PARALLEL="${PARALLEL:-1}"
VERSIONED_TIERS=(tests/megatron tests/multirank tests/gpu)
case " $LEGS " in *" $RAY_LEG "*) ;; *) RAY_LEG="$(echo $LEGS | cut -d' ' -f1)" ;; esac
pip_quiet() { "$1" -m pip install -q --disable-pip-version-check "${@:2}" 2>&1 | grep -v "^WARNING: Location" || true; }
summary=()

run_leg() {  # run_leg NAME PYTHON PYTHONPATH [PYTEST ARGS]: the suite on one interpreter / megatron-core
  local name="$1" py="$2" path="${3:-}" start=$SECONDS
  local version
  version="$(PYTHONPATH="$path" "$py" -c 'import sys; from chatlearn_mem.mcore.layout import megatron_core_version as v; print(f"Python {sys.version.split()[0]} + megatron-core {v()}")')"
  local args=("${@:4}") what="every tier"
  if [ "$name" != "$RAY_LEG" ]; then
    if [ ${#args[@]} -eq 0 ]; then
      args=("${VERSIONED_TIERS[@]}"); what="the megatron-core tiers (unit and Ray run on the $RAY_LEG leg)"
    else
      args=(-m "not ray" "${args[@]}"); what="what was asked, but the Ray tier (it runs on the $RAY_LEG leg)"
    fi
  fi
  echo "== test suite on $version: $what"
  PYTHONPATH="$path" "$py" -m pytest -q -p no:cacheprovider "${args[@]}"
  echo "== leg $name ($version, $what): passed in $((SECONDS - start)) s"
}

wait_logged() {  # wait_logged NAME PID LOG: wait, print the log, fail when the command failed
  local rc=0
  wait "$2" || rc=$?
  cat "$3"
  if [ "$rc" != 0 ]; then
    echo "error: $1 failed (exit $rc); its output is above" >&2
    exit "$rc"
  fi
}

find_python312() {  # print a working Python 3.12; a pyenv shim that cannot run counts as missing
  local c
  for c in "${PYTHON312:-}" python3.12 $(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | sort -rV) \
           /usr/local/bin/python3.12 /usr/bin/python3.12; do
    if [ -n "$c" ] && "$c" -c 'import sys, venv; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; then
      command -v "$c"
      return 0
    fi
  done
  return 1
}

install_312() {  # the Python 3.12 venv with megatron-core 0.19
  local start=$SECONDS
  [ -x .venv312/bin/python ] || "$py312" -m venv .venv312
  pip_quiet .venv312/bin/python torch==2.13.0
  pip_quiet .venv312/bin/python -e '.[test]' megatron-core==0.19.2
  .venv312/bin/python -c "import chatlearn_mem, chatlearn_mem_cli, chatlearn_mem_ray, chatlearn_mem_bench, megatron.core"
  echo "== installed for Python 3.12 ($py312) in $((SECONDS - start)) s"
}

lint() {  # lint PYTHON: the formatter and the linter, as configured in pyproject.toml (ruff, pinned in [test])
  "$1" -m ruff format --check --quiet . || { echo "error: ruff format would change the files above; run 'ruff format .'" >&2; exit 1; }
  "$1" -m ruff check --quiet . || { echo "error: ruff check found the problems above; run 'ruff check --fix .' for the fixable ones" >&2; exit 1; }
  echo "== ruff: formatted and lint-clean"
}

has_leg() { case " $LEGS " in *" $1 "*) return 0 ;; esac; return 1; }
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT

if has_leg 0.19 && ! py312="$(find_python312)"; then
  echo "error: the Python 3.12 leg needs a Python 3.12 interpreter and none was found (looked at \$PYTHON312," \
       "python3.12 on PATH, ~/.pyenv/versions/3.12*/bin, /usr/local/bin, /usr/bin). Install one" \
       "(e.g. 'pyenv install 3.12') and/or set PYTHON312=/path/to/python3.12, or run the other legs with" \
       "LEGS='0.16 0.13'." >&2
  exit 1
fi
if has_leg 0.16 || has_leg 0.13; then
  start=$SECONDS
  pip_quiet python torch==2.13.0
  pip_quiet python -e '.[test]'
  python -c "import chatlearn_mem, chatlearn_mem_cli, chatlearn_mem_ray, chatlearn_mem_bench, megatron.core" # fail early if the install did not work
  echo "== installed for Python 3.11 in $((SECONDS - start)) s"
  lint python
  if has_leg 0.13 && [ ! -f .mcore013/megatron/core/package_info.py ]; then
    pip_quiet python --no-deps --target .mcore013 megatron-core==0.13.1
  fi
fi
install_pid=""  # after the 3.11 install: two editable installs of one checkout at once would race
if has_leg 0.19 && [ "$PARALLEL" = 1 ]; then
  echo "== installing for Python 3.12 in the background"
  install_312 > "$logs/install312" 2>&1 &
  install_pid=$!
fi
if has_leg 0.16 && has_leg 0.13 && [ "$PARALLEL" = 1 ]; then
  echo "== legs 0.16 and 0.13 run at the same time; each one's output follows when it ends"
  run_leg 0.16 python "" "$@" > "$logs/leg016" 2>&1 &
  pid16=$!
  run_leg 0.13 python "$PWD/.mcore013" "$@" > "$logs/leg013" 2>&1 &
  pid13=$!
  wait_logged "leg 0.16" "$pid16" "$logs/leg016"
  wait_logged "leg 0.13" "$pid13" "$logs/leg013"
  summary+=("$(grep '^== leg 0.16' "$logs/leg016")" "$(grep '^== leg 0.13' "$logs/leg013")")
else
  if has_leg 0.16; then run_leg 0.16 python "" "$@" | tee "$logs/leg016"; summary+=("$(grep '^== leg 0.16' "$logs/leg016")"); fi
  if has_leg 0.13; then run_leg 0.13 python "$PWD/.mcore013" "$@" | tee "$logs/leg013"; summary+=("$(grep '^== leg 0.13' "$logs/leg013")"); fi
fi
if has_leg 0.19; then
  if [ -n "$install_pid" ]; then wait_logged "the Python 3.12 install" "$install_pid" "$logs/install312"; else install_312; fi
  if ! has_leg 0.16 && ! has_leg 0.13; then lint .venv312/bin/python; fi
  run_leg 0.19 .venv312/bin/python "" "$@" | tee "$logs/leg019"
  summary+=("$(grep '^== leg 0.19' "$logs/leg019")")
fi
if [ "${SKIP_WHEEL_CHECK:-0}" != 1 ]; then
  bash scripts/wheel_check.sh
fi
printf '%s\n' "${summary[@]}"
