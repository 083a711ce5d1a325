"""A device-rewriting torch function mode (the CPU backend's) is off while a manager's call runs."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from chatlearn_mem import InferenceMemoryManager, MemoryConfig


class CountingMode(TorchFunctionMode):
    """Counts the torch calls that reach it (a user's mode: stays on)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


class RewritingMode(CountingMode):
    skip_in_manager_calls = True  # what the CPU backend's mode declares


@pytest.mark.parametrize("mode_type, popped", [(CountingMode, False), (RewritingMode, True)], ids=["user", "rewriting"])
def test_only_a_rewriting_mode_is_popped_for_the_calls_duration(mode_type, popped):
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(3)])
    x = torch.randn(2, 16)
    with torch.no_grad():
        expected = model(x)
    mm = InferenceMemoryManager(model, MemoryConfig(check_host_memory=False))
    with mode_type() as mode:
        mm.offload()
        mm.onload()
        assert mm.audit().ok
        in_calls = mode.calls
        with torch.no_grad():
            got = model(x)  # outside the manager's calls the mode applies again
    assert (in_calls == 0) is popped
    assert mode.calls > in_calls
    assert torch.equal(got, expected)
