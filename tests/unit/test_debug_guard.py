"""The opt-in debug guard (MemoryConfig.debug_guard / CHATLEARN_MEM_DEBUG_GUARD=1).

Reads of released tensors run in a child process (without the guard they crash it); the mode-stack
bookkeeping, which reads nothing, runs here.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from chatlearn_mem import InferenceMemoryManager, MemoryConfig
from chatlearn_mem.debug_guard import ReleasedTensorGuard

GUARD = MemoryConfig(debug_guard=True)


def _guards() -> list:
    return [m for m in _get_current_function_mode_stack() if isinstance(m, ReleasedTensorGuard)]


# -- reads (child process) -------------------------------------------------------------------------
def child() -> dict:
    out = {}
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(2, 16)
    expected = module(x)
    mm = InferenceMemoryManager(module, GUARD)
    mm.offload()
    w, b = module[0].weight, module[2].bias
    reads = {
        "norm": lambda: w.norm(),
        "add": lambda: w + 1,
        "functional": lambda: torch.nn.functional.linear(x, w),
        "list_argument": lambda: torch.cat([torch.zeros(4), b]),
        "kwarg_out": lambda: torch.add(torch.zeros(4), torch.ones(4), out=b),
        "print": lambda: str(b),
        "clone_of_view": lambda: w[0].clone(),
    }
    for name, read in reads.items():
        try:
            read()
            out[name] = None
        except Exception as e:  # noqa: BLE001 - recorded for the test
            out[name] = f"{type(e).__name__}: {e}"
    out["metadata"] = [
        list(w.shape),
        str(w.dtype),
        w.requires_grad,
        w.grad is None,
        w.numel(),
        w.dim(),
        w.untyped_storage().nbytes(),
        w.detach().shape[0],
    ]
    host = mm.weights_state_dict()  # the manager's own reads of released tensors pass
    mm.onload()
    out["after_onload_equal"] = bool(torch.equal(module(x), expected)) and bool(torch.equal(host["0.weight"], w))
    out["guards_left"] = len(_guards())
    return out


if __name__ == "__main__":
    print(json.dumps(child()))
    sys.exit(0)


@pytest.fixture(scope="module")
def reads():
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "read,what,tensor",
    [
        ("norm", "norm()", "0.weight"),
        ("add", "add()", "0.weight"),
        ("functional", "linear()", "0.weight"),
        ("list_argument", "torch.cat()", "2.bias"),
        ("kwarg_out", "torch.add()", "2.bias"),
        ("print", "__repr__()", "2.bias"),
        ("clone_of_view", "__getitem__()", "0.weight"),
    ],
)
def test_any_read_of_a_released_tensor_raises_naming_it(reads, read, what, tensor):
    assert reads[read] == (
        f"OffloadedError: {what} on {tensor} while weights are offloaded: call onload_weights() (or onload()) "
        "first. Raised by the debug guard (MemoryConfig.debug_guard / CHATLEARN_MEM_DEBUG_GUARD=1); without it "
        "this operation would read released memory (a crash on CPU, garbage on a GPU)"
    )


def test_metadata_and_the_managers_own_reads_pass_and_onload_restores(reads):
    assert reads["metadata"] == [[16, 16], "torch.float32", True, True, 256, 2, 0, 16]
    assert reads["after_onload_equal"] is True
    assert reads["guards_left"] == 0


# -- the mode stack (in process: nothing is read) --------------------------------------------------------
class _UserMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_guard_sits_below_user_modes_and_leaves_them_intact():
    module = torch.nn.Linear(4, 4)
    mm = InferenceMemoryManager(module, GUARD)
    base = _get_current_function_mode_stack()
    assert not _guards()
    with _UserMode() as user:
        mm.offload()  # installed at the bottom, under the user's mode
        stack = _get_current_function_mode_stack()
        assert isinstance(stack[0], ReleasedTensorGuard) and stack[1:] == base + [user]
        mm.onload()  # removed from under it
        assert _get_current_function_mode_stack() == base + [user]
        mm.offload()
    assert _get_current_function_mode_stack()[1:] == base  # the user's exit popped the user's mode
    mm.onload()
    assert _get_current_function_mode_stack() == base
    mm.close()


def test_guard_off_by_default_and_removed_by_close(monkeypatch):
    monkeypatch.delenv("CHATLEARN_MEM_DEBUG_GUARD", raising=False)
    module = torch.nn.Linear(4, 4)
    mm = InferenceMemoryManager(module)
    mm.offload()
    assert not _guards()
    mm.onload()
    mm.close()
    monkeypatch.setenv("CHATLEARN_MEM_DEBUG_GUARD", "1")
    assert MemoryConfig().resolved_debug_guard()
    mm = InferenceMemoryManager(module)
    mm.offload()
    assert len(_guards()) == 1
    mm.onload()
    assert not _guards()
    mm.close()
