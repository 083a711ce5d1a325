"""The vLLM rollout's sleep and wake-up order on CUDA, with a recording stand-in for ``vllm.LLM``
(the real engine's sleep mode needs a GPU; the real engine on CPU runs in tests/vllm).

A generate phase is: the weights wake (the actor's onload), the policy's weights are loaded, the
KV cache wakes (the actor's generate), the engine samples, and the phase ends in sleep level 2
(the actor's offload). The engine refuses to load weights that are asleep and to sample with
anything asleep, so that a wrong order fails loudly instead of touching released memory."""

from types import SimpleNamespace

import pytest
import torch

from chatlearn_mem.engines.vllm_rollout import SLEEP_TAGS, EngineError, VLLMRollout
from chatlearn_mem.models.gpt import GPTTrainerConfig


class RecordingLLM:
    """What VLLMRollout calls on ``vllm.LLM``, recorded in order."""

    def __init__(self):
        self.calls: list = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, kwargs=None):
        name = method if isinstance(method, str) else method.__name__
        loaded = [n for n, _ in kwargs["weights_iterator"]] if kwargs else []
        self.calls.append(("collective_rpc", name, tuple(loaded)))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))

    def generate(self, prompts, params, use_tqdm=False):
        self.calls.append(("generate", len(prompts)))
        n = params[0].max_tokens
        step = {1: SimpleNamespace(logprob=-0.5)}
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[1] * n, logprobs=[step] * n)]) for _ in prompts]


def cuda_engine() -> VLLMRollout:
    """A VLLMRollout as its constructor leaves it on CUDA, around a RecordingLLM."""
    engine = object.__new__(VLLMRollout)
    engine.cuda = True
    engine.config = GPTTrainerConfig(share_embeddings_and_output_weights=False)
    engine.names = {"model.w"}
    engine._llm = RecordingLLM()
    engine._sampling = lambda **kw: SimpleNamespace(**kw)
    engine._stale = None
    engine._said_no_sleep = False
    engine._sleeping = set()
    return engine


WEIGHTS = [("model.w", torch.zeros(4))]


def test_an_asleep_engine_refuses_to_load_or_sample_until_the_right_part_woke():
    engine = cuda_engine()
    engine.sleep(level=2)
    assert engine.asleep and engine.sleeping == set(SLEEP_TAGS)
    with pytest.raises(EngineError, match=r"weights are asleep.*wake_up\(tags=\['weights'\]\)"):
        engine.sync_weights(WEIGHTS)
    with pytest.raises(EngineError, match="kv_cache and weights are asleep"):
        engine.generate(torch.zeros(2, 3, dtype=torch.long), 4, 1.0)
    engine.wake_up(tags=["weights"])
    assert engine.sleeping == {"kv_cache"}
    engine.sync_weights(WEIGHTS)  # the update needs the weights only
    with pytest.raises(EngineError, match="kv_cache are asleep"):
        engine.score(torch.zeros(1, 3, dtype=torch.long))
    engine.wake_up(tags=["kv_cache"])
    assert not engine.asleep
    tokens, logprobs = engine.generate(torch.zeros(2, 3, dtype=torch.long), 4, 1.0)
    assert tokens.shape == (2, 7) and logprobs.shape == (2, 4)
    with pytest.raises(ValueError, match="unknown tag"):
        engine.wake_up(tags=["kv"])


def test_the_cpu_build_cannot_sleep_and_says_so_once():
    engine = cuda_engine()
    engine.cuda = False
    with pytest.warns(UserWarning, match="cannot sleep"):
        engine.sleep(level=2)
    engine.sleep(level=2)  # said once
    engine.wake_up()
    assert not engine.asleep and engine._llm.calls == []


def test_the_actor_runs_a_generate_phase_in_the_order_that_never_holds_the_kv_cache_during_the_update():
    from chatlearn_mem_ray.actors.vllm import VLLMRolloutActor

    actor = object.__new__(VLLMRolloutActor)
    actor.engine = engine = cuda_engine()
    llm = engine._llm
    actor.offload()  # the end of the previous generate phase
    actor.onload()  # this one's start: the weights only
    assert engine.sleeping == {"kv_cache"}
    engine.sync_weights(WEIGHTS)  # what sync_from does with the policy's stream
    actor.generate(torch.zeros(2, 3, dtype=torch.long), 4, 1.0, seed=0)
    actor.offload()
    assert [c[0] if c[0] != "wake_up" else c for c in llm.calls] == [
        "sleep",
        ("wake_up", ("weights",)),
        "collective_rpc",
        "reset_prefix_cache",
        ("wake_up", ("kv_cache",)),
        "generate",
        "sleep",
    ]
    assert [c for c in llm.calls if c[0] == "sleep"] == [("sleep", 2), ("sleep", 2)]
