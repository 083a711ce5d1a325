"""The process group's lifetime in our commands and scripts: a group they create is destroyed before
the process exits (with NCCL, one left to the interpreter's exit holds the exit up), and a group that
was there before (a test session's, a caller's) is left alone."""

import subprocess
import sys
import textwrap

import pytest
import torch

from chatlearn_mem.models import gpt

CHILD = textwrap.dedent(
    """
    import sys, tempfile, warnings
    import torch.distributed as dist
    from megatron.core import parallel_state
    from chatlearn_mem.models import gpt

    warnings.simplefilter("ignore")
    fail = sys.argv[1] == "fail"
    try:
        with gpt.owned_process_group():
            gpt.init_distributed(init_method=f"file://{tempfile.mkdtemp()}/init", cpu_backend=True)
            assert dist.is_initialized() and parallel_state.model_parallel_is_initialized()
            if fail:
                raise KeyError("boom")
    except KeyError:
        print("raised")
    print("after", dist.is_initialized(), parallel_state.model_parallel_is_initialized())
    gpt.shutdown_distributed()  # again, with nothing left: a no-op
    print("ok")
    """
)


@pytest.mark.parametrize("how", ["ok", "fail"])
def test_a_group_created_inside_the_block_is_destroyed_on_leaving_it_however_it_ends(how):
    out = subprocess.run(
        [sys.executable, "-c", CHILD, how], capture_output=True, text=True, timeout=120, check=True
    ).stdout.split("\n")
    assert "after False False" in out and out[-2] == "ok"
    assert ("raised" in out) == (how == "fail")


def test_a_group_that_was_there_before_is_left_alone(dist1):
    from megatron.core import parallel_state

    with gpt.owned_process_group():
        gpt.init_distributed(cpu_backend=True)  # joins the session's group
    assert torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()


def test_the_blocks_own_error_is_the_one_raised_when_the_shutdown_fails_too(monkeypatch):
    # a NCCL collective that failed can make destroy_process_group() raise as well: that error must
    # not replace the one that ended the block (it is reported as a warning)
    answers = iter([False])  # not initialised before the block, initialised after
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: next(answers, True))

    def broken():
        raise RuntimeError("NCCL communicator was aborted")

    monkeypatch.setattr(gpt, "shutdown_distributed", broken)
    with pytest.raises(KeyError, match="the block's own"), pytest.warns(UserWarning, match="failed too"):
        with gpt.owned_process_group():
            raise KeyError("the block's own")
