#!/usr/bin/env bash
# Install chatlearn-mem with its test extras into the active Python and run the test suite twice:
# on the newest supported megatron-core (the default install) and on the oldest (0.13.1, put first
# on PYTHONPATH from a --target install); then check the wheel as a user installs it
# (scripts/wheel_check.sh; SKIP_WHEEL_CHECK=1 skips it). Extra arguments go to pytest, e.g.
# `bash scripts/test.sh tests/unit` for one tier.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_quiet() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
pip_quiet torch==2.13.0
pip_quiet -e '.[test]'
python -c "import chatlearn_mem, chatlearn_mem_ray, chatlearn_mem_bench, megatron.core" # fail early and loudly if the install did not work
echo "== test suite on megatron-core $(python -c 'import megatron.core as m; print(m.__version__)')"
python -m pytest -q -p no:cacheprovider "$@"
if [ ! -f .mcore013/megatron/core/package_info.py ]; then
  pip_quiet --no-deps --target .mcore013 megatron-core==0.13.1
fi
echo "== test suite on megatron-core $(PYTHONPATH=.mcore013 python -c 'import megatron.core as m; print(m.__version__)')"
PYTHONPATH="$PWD/.mcore013" python -m pytest -q -p no:cacheprovider "$@"
if [ "${SKIP_WHEEL_CHECK:-0}" != 1 ]; then
  bash scripts/wheel_check.sh
fi
