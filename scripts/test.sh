#!/usr/bin/env bash
# Install chatlearn-mem with its test extras into the active Python and run the test suite twice:
# on the newest supported megatron-core (the default install) and on the oldest (0.13.1, put first
# on PYTHONPATH from a --target install). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
pip_quiet() { python -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" || true; }
pip_quiet torch==2.13.0
pip_quiet -e '.[test]'
python -c "import chatlearn_mem, megatron.core" # fail early and loudly if the install did not work
echo "== test suite on megatron-core $(python -c 'import megatron.core as m; print(m.__version__)')"
python -m pytest -q -p no:cacheprovider "$@"
if [ ! -f .mcore013/megatron/core/package_info.py ]; then
  pip_quiet --no-deps --target .mcore013 megatron-core==0.13.1
fi
echo "== test suite on megatron-core $(PYTHONPATH=.mcore013 python -c 'import megatron.core as m; print(m.__version__)')"
PYTHONPATH="$PWD/.mcore013" python -m pytest -q -p no:cacheprovider "$@"
