"""The app's module paths from before it was arranged by role still import, each with a
``DeprecationWarning`` naming where its contents live now (``chatlearn_mem_ray._moved``); so do the
config names that moved next to their loops, and ``load_config`` without a schema."""

import importlib
import sys

import pytest

import chatlearn_mem_ray
from chatlearn_mem_ray._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_gives_the_new_module_and_says_where(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved: import from {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


def test_what_users_imported_from_the_old_places_still_works():
    for old in ("chatlearn_mem_ray.supervisor", "chatlearn_mem_ray.tasks", "chatlearn_mem_ray.grpo"):
        sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning):
        from chatlearn_mem_ray.supervisor import run_grpo, run_loop, run_ppo
    assert (run_ppo, run_grpo, run_loop) == (
        chatlearn_mem_ray.run_ppo,
        chatlearn_mem_ray.run_grpo,
        chatlearn_mem_ray.run_loop,
    )
    with pytest.warns(DeprecationWarning):
        from chatlearn_mem_ray.tasks import TASKS
    assert TASKS is chatlearn_mem_ray.TASKS
    with pytest.warns(DeprecationWarning):
        from chatlearn_mem_ray.grpo import GRPO, grpo_loss  # noqa: F401


def test_a_reward_named_by_its_old_path_still_loads():
    from chatlearn_mem_ray.inputs.rewards import load_reward_function
    from chatlearn_mem_ray.inputs.text_task import position_reward

    sys.modules.pop("chatlearn_mem_ray.text_task", None)
    with pytest.warns(DeprecationWarning, match="chatlearn_mem_ray.text_task moved"):
        fn = load_reward_function("chatlearn_mem_ray.text_task:position_reward", fields=["answer"])
    assert fn is position_reward


def test_moved_config_names_warn_and_are_the_new_classes():
    from chatlearn_mem_ray import config
    from chatlearn_mem_ray.loops.grpo.config import GRPORunConfig
    from chatlearn_mem_ray.loops.ppo import RunConfig

    with pytest.warns(
        DeprecationWarning, match="chatlearn_mem_ray.config.RunConfig moved to chatlearn_mem_ray.loops.ppo"
    ):
        assert config.RunConfig is RunConfig
    with pytest.warns(DeprecationWarning, match="GRPORunConfig moved"):
        assert config.GRPORunConfig is GRPORunConfig
    with pytest.warns(DeprecationWarning, match="load_config without a schema"):
        assert isinstance(config.load_config("cpu_tiny"), RunConfig)
    with pytest.raises(AttributeError):
        config.NoSuchName  # noqa: B018
    with pytest.raises(TypeError, match="schema must be the loop's LoopConfig subclass"):
        config.load_config(None, (), dict)
