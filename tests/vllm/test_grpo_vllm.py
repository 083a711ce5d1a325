"""GRPO generating with the real vLLM engine through a local Ray cluster: it learns; every sync is
verified bit for bit before the engine samples; a sync that does not take stops the run before
sampling; host memory during a sync stays within a few buckets on both sides; and an engine killed
during a sync or during a generate is restarted and the run ends as the undisturbed one.

The engine is disturbed inside its own actor with Ray's ``__ray_call__`` (a closure run on the
actor's instance): no test hook lives in the product."""

import os
import sys

import pytest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")
pytest.importorskip("vllm", reason="vLLM is not installed: see docs/vllm.md")

from golden_outcome import outcome  # noqa: E402

from chatlearn_mem_ray import WeightSyncError, load_grpo_config, run_grpo  # noqa: E402

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the closures below run in the actors
SHORT = ["grpo.iterations=4", "memory.compare_iterations=0", "ray.phase_timeout_s=180"]
WIDER = [  # 46 MiB of fp32 weights: 46 buckets of 1 MiB, far above allocator noise
    "policy.hidden_size=512",
    "policy.num_attention_heads=8",
    "policy.num_query_groups=2",
    "policy.ffn_hidden_size=1536",
    "policy.num_layers=4",
    "rollout.sync_bucket_mb=1",
]


def test_grpo_with_vllm_learns_and_every_sync_is_verified_before_sampling(local_ray, tmp_path):
    lines = []
    log = run_grpo(load_grpo_config("cpu_grpo_vllm", [f"output_dir={tmp_path}"]), progress=lines.append)
    its = [m for m in log["iterations"] if m["manager_on"]]
    first, last = its[:5], its[-5:]
    mean = lambda ms: sum(m["reward"] for m in ms) / len(ms)  # noqa: E731
    assert mean(last) > mean(first) + 0.2, [round(m["reward"], 3) for m in its]
    syncs = [c for c in log["sync_checks"] if c["manager_on"]]
    assert [c["iteration"] for c in syncs] == list(range(1, 21))  # the policy trained every iteration
    assert all(c["verified"] and len(c["digest"]) == 64 for c in syncs)
    assert len({c["digest"] for c in syncs}) == 20  # a new policy each time, and the engine holds it
    assert all(m["logprob_mismatch"]["max"] < 1e-4 for m in its)  # fp32: the engine computes as the policy
    assert (tmp_path / "rollout_vllm.log").stat().st_size > 0  # the engine's own log, not the console
    assert not any("Reloading" in line or "Failed to load weights" in line for line in lines)


def test_a_sync_that_does_not_take_stops_the_run_before_the_engine_samples(local_ray, tmp_path):
    """The engine's load is made to drop a bias element's update (its reload writes every tensor but
    one element): the digest of the engine's parameters differs from the stream's, and the run stops
    with a WeightSyncError naming the parameter, in the generate phase, before any sampling."""

    def tamper(svc, index, phase):
        if (index, phase) == (1, "generate"):

            def break_the_engine(actor):
                engine = actor.engine
                real = engine._llm.collective_rpc

                def rpc(method, *args, **kwargs):
                    out = real(method, *args, **kwargs)
                    if method == "reload_weights":  # after the load: one weight is not what was sent

                        def bump(worker):
                            w = dict(worker.model_runner.model.named_parameters())["model.norm.weight"]
                            w.data[0] += 1.0

                        real(bump)
                    return out

                engine._llm.collective_rpc = rpc
                return True

            assert ray.get(svc.actors("rollout")[0].__ray_call__.remote(break_the_engine))

    cfg = load_grpo_config("cpu_grpo_vllm", [*SHORT, f"output_dir={tmp_path}"])
    with pytest.raises(WeightSyncError, match="model.norm.weight") as e:
        run_grpo(cfg, progress=lambda line: None, on_phase=tamper)
    assert "iteration 2" in str(e.value) and "did not take" in str(e.value)
    import json

    log = json.loads((tmp_path / "log.json").read_text())
    assert log["status"] == "failed" and [m["iteration"] for m in log["iterations"]] == [1]
    assert log["sync_checks"][-1]["verified"] is False and log["sync_checks"][-1]["param"] == "model.norm.weight"


def test_host_memory_during_a_sync_stays_within_a_few_buckets(local_ray, tmp_path):
    """46 buckets of weights; after the first sync (the engine's and the object store's first
    allocations) the policy's process grows by less than one bucket of private memory (its weights
    leave as views of its host store, straight into Ray's object store) and the engine's by at most
    two layers' weights and four buckets (the bucket it merges and the allocator's slack; vLLM's CPU
    build repacks a layer's linear weights once they are loaded, the old and the new packing side by
    side, and the old packing of one layer is sometimes still held while the next repacks): neither
    holds a second copy of the model (46 MiB, four layers). Measured on syncs 2-4 of 3 + 3 runs:
    the engine 0.03-6.1 MiB and 0.03-15.1 MiB; one CI run saw 24.2 MiB, two layers (11.5 MiB
    each) and 1.2 MiB, which one layer's bound failed."""
    import math

    from chatlearn_mem.models import hf

    cfg = load_grpo_config(
        "cpu_grpo_vllm", ["grpo.iterations=4", "memory.compare_iterations=0", *WIDER, f"output_dir={tmp_path}"]
    )
    log = run_grpo(cfg, progress=lambda line: None)
    syncs = [m["weight_sync"] for m in log["iterations"]]
    bucket = syncs[0]["bucket_bytes"]
    layer = 4 * sum(math.prod(s) for n, s in hf.hf_shapes(cfg.policy).items() if ".layers.0." in n)  # fp32
    assert syncs[0]["bytes"] > 40 * bucket and syncs[0]["bytes"] > 3 * layer
    assert 2 * layer + 4 * bucket < 0.6 * syncs[0]["bytes"]  # the bound: well under a second copy of the model
    for s in syncs[1:]:
        assert s["policy_peak_rss_bytes"] < bucket, s
        assert s["engine_peak_rss_bytes"] <= 2 * layer + 4 * bucket, (s["engine_peak_rss_bytes"], layer, bucket, syncs)
    summary = log["summary"]["weight_sync"]
    assert summary["policy_peak_rss_bytes"] < bucket and summary["bucket_bytes"] == bucket


@pytest.fixture(scope="module")
def undisturbed(local_ray, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_vllm")
    return run_grpo(load_grpo_config("cpu_grpo_vllm", [*SHORT, f"output_dir={out}"]), progress=lambda line: None)


def _dies_in(method: str):
    """An on_phase hook that makes the engine's process exit inside its next ``method`` call, once."""
    fired = []

    def hook(svc, index, phase):
        if (index, phase) == (2, "generate") and not fired:

            def die_inside(actor, method):
                engine = actor.engine
                real = getattr(engine, method)

                def dying(*args, **kwargs):
                    if method == "sync_weights":  # half way through the stream
                        stream = iter(args[0])
                        next(stream)
                        os._exit(1)
                    os._exit(1)

                setattr(engine, method, dying)
                return real is not None

            assert ray.get(svc.actors("rollout")[0].__ray_call__.remote(die_inside, method))
            fired.append(index)

    return hook, fired


@pytest.mark.parametrize("method", ["sync_weights", "generate_rows"], ids=["during-a-sync", "during-a-generate"])
def test_an_engine_killed_during_a_sync_or_a_generate_is_restarted_bit_exact(undisturbed, tmp_path, method):
    hook, fired = _dies_in(method)
    cfg = load_grpo_config(
        "cpu_grpo_vllm", [*SHORT, f"output_dir={tmp_path}", "checkpoint.every=1", "checkpoint.max_restarts=1"]
    )
    log = run_grpo(cfg, progress=lambda line: None, on_phase=hook)
    assert fired and log["status"] == "completed", log.get("error")
    [restart] = log["restarts"]
    assert (restart["actor"], restart["phase"], restart["iteration"]) == ("rollout", "generate", 3)
    assert "died" in restart["error"]
    assert outcome(log) == outcome(undisturbed)


def test_both_rollouts_give_the_same_tokens_stops_and_text_for_the_same_prompts(local_ray, tmp_path):
    """cpu_grpo_text's first iteration through the megatron loop and through vLLM, both from the
    same checkpoint and sampling near-greedily (temperature 1e-4): the same responses, cut at the
    same EOS or stop string, decoded to the same text, scored the same."""
    base = [
        "grpo.iterations=1",
        "memory.compare_iterations=0",
        "grpo.temperature=0.0001",
        "grpo.prompts_per_iteration=8",
        "grpo.minibatch_size=16",
        "tokenizer.log_samples=8",
        "rollout.mismatch_warn=1.0",  # log-probs at 1e-4 scale every logit difference by 10^4
    ]
    logs = {
        e: run_grpo(
            load_grpo_config("cpu_grpo_text", [*base, f"rollout.engine={e}", f"output_dir={tmp_path / e}"]),
            progress=lambda line: None,
        )
        for e in ("megatron", "vllm")
    }
    got = {e: log["iterations"][0] for e, log in logs.items()}
    assert len(got["megatron"]["samples"]) == 8
    assert got["megatron"]["samples"] == got["vllm"]["samples"]
    assert got["megatron"]["response_tokens"] == got["vllm"]["response_tokens"]
    assert got["megatron"]["reward"] == got["vllm"]["reward"]


SERVE = """
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], enforce_eager=True, max_model_len=16, seed=0)  # the directory alone says the rest
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=5, stop=["."]), use_tqdm=False)
print("RESULT " + json.dumps([o.outputs[0].text for o in outs]))
"""


def test_the_exported_policy_serves_in_vllm_as_it_stands(local_ray, tmp_path):
    """cpu_grpo_text's Hugging Face export (issue 58) loaded by vLLM from the directory alone, in a
    process of its own as a user serving it would: its config.json, tokenizer and generation config
    (EOS) suffice, and its greedy responses to the held-out prompts are the trainer's (the run's
    greedy validation after its last iteration)."""
    import json
    import subprocess
    from pathlib import Path

    args = ["grpo.iterations=20", "memory.compare_iterations=0", "tokenizer.log_samples=16", f"output_dir={tmp_path}"]
    log = run_grpo(load_grpo_config("cpu_grpo_text", args), progress=lambda line: None)
    export = Path(log["exports"][-1]["path"])
    assert export.name == "iter_00000020"
    samples = log["iterations"][-1]["validations"][-1]["samples"]
    print("greedy responses after 20 iterations:", [(s["prompt"], s["response"]) for s in samples])
    assert sum(bool(s["response"]) for s in samples) >= 4  # responses, not only EOS: a comparison that can fail
    prompts = [s["prompt"] for s in samples]
    done = subprocess.run(
        [sys.executable, "-c", SERVE, str(export), json.dumps(prompts)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    served = json.loads(line[len("RESULT ") :])
    assert served == [s["response"] for s in samples], list(zip(prompts, served))
