"""The entropy GRPO logs, on a policy whose vocabulary two tensor-parallel ranks split: each rank's
max, normaliser and expectation all-reduced give the whole vocabulary's entropy (to float32
rounding), on every rank."""

from trainer_runs import layout_spec, spawn


def test_the_split_vocabularys_entropy_is_the_whole_ones():
    [(name, results)] = spawn([layout_spec("entropy", 2, tp=2)], fn_name="vocab_parallel_entropy").items()
    assert len(results) == 2
    for r in results:
        assert "error" not in r, r.get("error")
        assert r["tp"] == 2 and r["entropy_mean"] > 0.5  # a split of 2, distributions far from uniform
        assert r["max_abs_diff"] < 1e-5, r
        assert r["logprob_max_abs_diff"] < 1e-5, r  # the log-probs beside it, for comparison
