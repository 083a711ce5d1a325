#!/usr/bin/env bash
# The product as a user installs it, not as a developer's checkout sees it:
#   1. build the wheel and check what it holds: the four project packages (no generic top-level
#      name such as `benchmarks`), the presets, and only torch, megatron-core and pydantic as
#      requirements outside the extras;
#   2. install it (not editable) with the [ray] extra (the whole command line) into a fresh venv
#      and, from a directory outside the repository, run `chatlearn-mem ppo ppo.iterations=2` and
#      `chatlearn-mem bench --config tiny`;
#   3. install it with the core requirements only into another fresh venv: `import chatlearn_mem`
#      works, Ray is not installed, and the command says which extra to install.
# Uses the `python3` on PATH (run it from the test venv or any Python >= 3.10).
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pip_quiet() { "$@" -q --disable-pip-version-check 2>&1 | grep -v "^WARNING: Location" || true; }
step() { echo "== wheel check: $*"; }

step "build"
pip_quiet python3 -m pip wheel --no-deps -w "$work/dist" "$repo"
wheel="$(ls "$work"/dist/chatlearn_mem-*.whl)"
python3 - "$wheel" <<'EOF'
import sys
import zipfile
from email.parser import Parser

wheel = zipfile.ZipFile(sys.argv[1])
names = wheel.namelist()
top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
assert top == {"chatlearn_mem", "chatlearn_mem_ray", "chatlearn_mem_bench", "chatlearn_mem_config_files", "chatlearn_mem_cli"}, f"top-level names: {sorted(top)}"
for preset in ("chatlearn_mem_ray/presets/cpu_tiny.yaml", "chatlearn_mem_ray/presets/gpu.yaml",
               "chatlearn_mem_bench/presets/cpu.yaml", "chatlearn_mem_bench/presets/tiny.yaml"):
    assert preset in names, f"{preset} is not in the wheel"
meta = Parser().parsestr(wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
core = sorted(r.split(">")[0].split("<")[0].split("=")[0].strip() for r in meta.get_all("Requires-Dist")
              if "extra ==" not in r)
assert core == ["megatron-core", "pydantic", "torch"], f"core requirements: {core}"
print(f"   {len(names)} files; top-level packages {sorted(top)}; core requirements {core}; "
      f"extras {meta.get_all('Provides-Extra')}")
EOF

step "install with [ray] into a fresh venv"
python3 -m venv "$work/app"
pip_quiet "$work/app/bin/python" -m pip install torch==2.13.0
pip_quiet "$work/app/bin/python" -m pip install "${wheel}[ray]"
cd "$work"  # outside the repository: nothing may be read from the checkout
export PATH="$work/app/bin:$PATH"
"$work/app/bin/python" - <<'EOF'
import chatlearn_mem, chatlearn_mem_bench, chatlearn_mem_cli, chatlearn_mem_config_files, chatlearn_mem_ray
for m in (chatlearn_mem, chatlearn_mem_bench, chatlearn_mem_cli, chatlearn_mem_config_files, chatlearn_mem_ray):
    assert "site-packages" in m.__file__, f"{m.__name__} imported from {m.__file__}, not the installed wheel"
EOF
step "chatlearn-mem ppo ppo.iterations=2 (from $work)"
chatlearn-mem ppo ppo.iterations=2
test -s runs/ppo_cpu_tiny/log.json && test -s runs/ppo_cpu_tiny/memory_timeline.png
step "chatlearn-mem bench --config tiny (from $work)"
chatlearn-mem bench --config tiny -q
ls runs/bench/*.json runs/bench/*.md runs/bench/*.png > /dev/null

step "install with the core requirements only into a fresh venv"
python3 -m venv "$work/core"
pip_quiet "$work/core/bin/python" -m pip install torch==2.13.0
pip_quiet "$work/core/bin/python" -m pip install "$wheel"
"$work/core/bin/python" - <<'EOF'
import importlib.util
import sys

import chatlearn_mem
from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager  # noqa: F401

missing = [m for m in ("ray", "typer", "yaml", "matplotlib", "psutil") if importlib.util.find_spec(m) is not None]
assert not missing, f"installed without being asked for: {missing}"
assert "ray" not in sys.modules
print(f"   import chatlearn_mem {chatlearn_mem.__version__} works; ray, typer, yaml, matplotlib, psutil are not installed")
EOF
set +e
out="$("$work/core/bin/chatlearn-mem" ppo 2>&1)"
rc=$?
set -e
echo "   chatlearn-mem without the extras: exit $rc: $out"
test "$rc" = 1 && [[ "$out" == "error: "*"chatlearn-mem[ray]"* ]] && [[ "$out" != *Traceback* ]]
step "passed"
