"""What two runs of the same training must share (``tests/golden_outcome.py``): a timing may
differ, a digest of the weights may not, whichever engine took them."""

import copy

from golden_outcome import outcome


def _log(sync_checks: list[dict]) -> dict:
    return {
        "iterations": [{"iteration": 1, "reward": 0.5, "seconds": 1.0, "weight_sync": {"seconds": 0.2}}],
        "sync_checks": sync_checks,
        "memory_timeline": [],
        "summary": {},
        "final_weights": {"policy_0": "ab"},
    }


VLLM = {"iteration": 1, "manager_on": True, "engine": "vllm", "verified": True, "digest": "d" * 64, "seconds": 0.2}
MEGATRON = {"iteration": 1, "manager_on": True, "equal": True, "policy": ["p" * 64], "rollout": ["p" * 64]}


def test_timings_are_left_out():
    a, b = _log([VLLM]), _log([{**VLLM, "seconds": 9.0, "engine_peak_rss_bytes": 7}])
    b["iterations"][0].update(seconds=3.0, weight_sync={"seconds": 0.9})
    assert outcome(a) == outcome(b)


def test_an_engines_digest_is_compared():
    """A vLLM sync's record has no ``policy``/``rollout`` keys: the outcome compared
    ``(iteration, None, None)`` for every one of them, whatever the engine loaded."""
    other = copy.deepcopy(VLLM)
    other["digest"] = "e" * 64
    assert outcome(_log([VLLM])) != outcome(_log([other]))
    assert outcome(_log([VLLM])) != outcome(_log([{**VLLM, "verified": False}]))


def test_the_megatron_rollouts_digests_are_compared_as_recorded():
    """The shape PPO's golden record holds (``tests/ray/golden/ppo_cpu_tiny.json``) is unchanged."""
    assert outcome(_log([MEGATRON]))["syncs"] == [(1, ["p" * 64], ["p" * 64])]
    assert outcome(_log([MEGATRON])) != outcome(_log([{**MEGATRON, "rollout": ["q" * 64]}]))
