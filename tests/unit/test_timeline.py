"""The memory timeline without Ray: records, JSON round trip, summary and the picture."""

import json

import matplotlib.image
import pytest

from chatlearn_mem_ray.service.timeline import TRAIN_PARTS, MemoryTimeline, PhaseRecord
from chatlearn_mem_ray.service.timeline_plot import _holders, _iteration_stats, plot_timeline

MiB = 2**20
# Per actor, the device bytes of each part when fully resident (a tiny policy/critic, bf16 weights).
SIZES = {
    "policy_0": {"weights": 218624, "grads": 437248, "main_weights": 437248, "optimizer_states": 874612, "other": 0},
    "critic_0": {"weights": 210688, "grads": 421376, "main_weights": 421124, "optimizer_states": 842368, "other": 0},
    "rollout": {"weights": 218624},
    "reference": {"weights": 218624},
}
TRAIN = TRAIN_PARTS[:-1]
PHASES = [
    ("generate", {"rollout": ("weights",)}),
    ("reference", {"reference": ("weights",)}),
    ("values", {"critic_0": ("weights",)}),
    ("train_critic", {"critic_0": TRAIN}),
    ("train_policy", {"policy_0": TRAIN}),
]
MAX_PX = (1400, 1000)  # width, height


def residency(parts_on_device: dict[str, tuple[str, ...]]) -> dict[str, dict]:
    """Every actor's ``residency()`` with only ``parts_on_device`` resident."""
    out = {}
    for actor, sizes in SIZES.items():
        by_part = {p: (b if p in parts_on_device.get(actor, ()) else 0) for p, b in sizes.items()}
        out[actor] = {
            "device_bytes": sum(by_part.values()),
            "host_bytes": sum(sizes.values()) - sum(by_part.values()),
            "by_part": by_part,
            "host_by_part": {},
        }
    return out


def make_timeline(on_iterations: int, off_iterations: int) -> MemoryTimeline:
    """Iterations with the manager on (only the phase's actor resident), then with it off (all),
    numbered as a run numbers them: from 1, the manager-off ones from 1 again."""
    t = MemoryTimeline()
    everything = {a: tuple(s) for a, s in SIZES.items()}
    for it in range(on_iterations + off_iterations):
        on = it < on_iterations
        number = it + 1 if on else it - on_iterations + 1
        for phase, active in PHASES:
            t.add(
                number,
                phase,
                on,
                0.1 + 0.01 * it,
                {a: list(p) for a, p in active.items()},
                residency(active if on else everything),
            )
    return t


def png_size(path) -> tuple[int, int]:
    img = matplotlib.image.imread(path)
    return img.shape[1], img.shape[0]


def test_add_keeps_parts_and_the_existing_fields():
    t = make_timeline(2, 1)
    assert len(t.records) == 15
    last_on = [r for r in t.records if r.manager_on][-1]
    assert last_on.phase == "train_policy" and last_on.iteration == 2
    policy_train = sum(SIZES["policy_0"][p] for p in TRAIN)
    assert last_on.device_bytes == {"policy_0": policy_train, "critic_0": 0, "rollout": 0, "reference": 0}
    assert last_on.device_by_part["policy_0"] == {p: SIZES["policy_0"][p] if p in TRAIN else 0 for p in TRAIN_PARTS}
    assert last_on.device_by_part["critic_0"] == dict.fromkeys(TRAIN_PARTS, 0)
    assert last_on.need_bytes == last_on.colocated_bytes == policy_train
    for r in t.records:  # the parts add up to each actor's device bytes
        assert {a: sum(p.values()) for a, p in r.device_by_part.items()} == r.device_bytes

    everything = sum(sum(s.values()) for s in SIZES.values())
    on, off = t.summary(True), t.summary(False)
    assert on == {
        "peak_colocated_bytes": policy_train,
        "peak_phase": "train_policy",
        "largest_phase_bytes": policy_train,
        "largest_phase": "train_policy",
        "ratio": 1.0,
        "phases": 10,
    }
    assert off["peak_colocated_bytes"] == everything and off["largest_phase_bytes"] == policy_train
    assert off["ratio"] == pytest.approx(everything / policy_train) and off["phases"] == 5

    rec = t.to_json()[-1]
    for key in (
        "iteration",
        "phase",
        "manager_on",
        "seconds",
        "active",
        "device_bytes",
        "need_bytes",
        "cuda_allocated_bytes",
        "colocated_bytes",
        "device_by_part",
    ):
        assert key in rec
    assert rec["colocated_bytes"] == everything


def test_add_records_each_actors_rss_when_reported():
    t = MemoryTimeline()
    res = {"a": {"device_bytes": 1, "by_part": {"weights": 1}, "rss_bytes": 5 * 2**20}, "b": {"device_bytes": 0}}
    rec = t.add(1, "generate", True, 0.1, {"a": ["weights"]}, res)
    assert rec.rss_bytes == {"a": 5 * 2**20}  # an actor that reports none (an older one) is left out
    assert MemoryTimeline.from_json(json.loads(json.dumps(t.to_json()))).records[0].rss_bytes == {"a": 5 * 2**20}


def test_from_json_round_trip_is_exact():
    t = make_timeline(3, 2)
    records = json.loads(json.dumps(t.to_json()))  # through JSON text, as log.json
    back = MemoryTimeline.from_json(records)
    assert back.records == t.records
    assert back.to_json() == t.to_json() == records
    assert back.summary(True) == t.summary(True) and back.summary(False) == t.summary(False)


def test_from_json_loads_logs_without_parts():
    old = [{k: v for k, v in r.items() if k != "device_by_part"} for r in make_timeline(2, 1).to_json()]
    t = MemoryTimeline.from_json(old)
    assert all(r.device_by_part == {} for r in t.records)
    assert [r.colocated_bytes for r in t.records] == [r["colocated_bytes"] for r in old]


def test_iteration_stats_feed_the_peak_panel():
    """Panel 2's points: per iteration, all actors at the worst phase and the largest need."""
    stats = _iteration_stats(make_timeline(3, 2))
    assert [(s["iteration"], s["manager_on"]) for s in stats] == [
        (1, True),
        (2, True),
        (3, True),
        (1, False),
        (2, False),
    ]
    policy_train = sum(SIZES["policy_0"][p] for p in TRAIN)
    everything = sum(sum(s.values()) for s in SIZES.values())
    for s in stats:
        assert len(s["records"]) == 5 and s["largest_phase_bytes"] == policy_train
        assert s["largest_phase"] == "train_policy"
        if s["manager_on"]:
            assert s["peak_colocated_bytes"] == policy_train and s["ratio"] == 1.0
        else:  # every phase holds everything; the first such phase is reported
            assert s["peak_colocated_bytes"] == everything and s["peak_phase"] == "generate"
            assert s["ratio"] == pytest.approx(everything / policy_train) and s["ratio"] > 2


def test_the_picture_numbers_iterations_as_the_console_does():
    """Iterations 1..N in the order run, then the comparison iterations (numbered from 1 again)
    after them, labelled as on the console; a run without the manager numbers its own from 1."""
    stats = _iteration_stats(make_timeline(2, 1))
    assert [(s["x"], s["label"]) for s in stats] == [
        (1, "iteration 1"),
        (2, "iteration 2"),
        (3, "manager-off iteration 1"),
    ]
    assert [s["comparison"] for s in stats] == [False, False, True]
    assert [s["label"] for s in _iteration_stats(make_timeline(0, 2))] == ["iteration 1", "iteration 2"]


def test_holders_label():
    rec = PhaseRecord(0, "train_policy", False, 0.0, {}, {"policy_0": 1, "policy_1": 1, "critic_0": 1, "rollout": 0}, 0)
    assert _holders(rec, ["policy_0", "policy_1", "critic_0", "rollout"]) == "policy x2, critic_0"
    rec.device_bytes = {"critic_0": 5, "rollout": 0}
    assert _holders(rec, ["critic_0", "rollout"]) == "critic_0"
    rec.device_bytes = {"critic_0": 0}
    assert _holders(rec, ["critic_0"]) == "nothing resident"


@pytest.mark.parametrize(
    "on_its, off_its",
    [(20, 1), (3, 0), (0, 2), (1, 1)],
    ids=["on_and_off", "no_off_iterations", "no_on_iterations", "one_each"],
)
def test_plot_has_a_bounded_size_whatever_the_run_length(tmp_path, on_its, off_its):
    path = plot_timeline(make_timeline(on_its, off_its), tmp_path / "sub" / "timeline.png", "test run")
    assert path == tmp_path / "sub" / "timeline.png"
    assert path.read_bytes()[:4] == b"\x89PNG"
    w, h = png_size(path)
    assert 800 <= w <= MAX_PX[0] and 600 <= h <= MAX_PX[1], (w, h)


def test_plot_size_does_not_grow_with_iterations(tmp_path):
    short = png_size(plot_timeline(make_timeline(2, 1), tmp_path / "short.png"))
    long = png_size(plot_timeline(make_timeline(100, 5), tmp_path / "long.png"))
    assert short == long


def test_plot_of_an_old_log_and_of_an_empty_timeline(tmp_path):
    old = [{k: v for k, v in r.items() if k != "device_by_part"} for r in make_timeline(2, 1).to_json()]
    w, h = png_size(plot_timeline(MemoryTimeline.from_json(old), tmp_path / "old.png"))
    assert w <= MAX_PX[0] and h <= MAX_PX[1]
    w, h = png_size(plot_timeline(MemoryTimeline(), tmp_path / "empty.png", "nothing"))
    assert w <= MAX_PX[0] and h <= MAX_PX[1]


def test_plot_with_more_actors_and_a_zero_need(tmp_path):
    """Tensor-parallel ranks (more actors) and a phase that needs nothing do not break the plot."""
    t = MemoryTimeline()
    for it, on in ((0, True), (1, False)):
        for phase in ("generate", "train_policy"):
            res = {
                f"policy_{i}": {
                    "device_bytes": 0 if on else 3 * MiB,
                    "by_part": {"weights": 0 if on else MiB, "grads": 0 if on else 2 * MiB},
                }
                for i in range(12)
            }
            active = {} if phase == "generate" else {"policy_0": ["weights", "grads"]}
            if on and active:
                res["policy_0"] = {"device_bytes": 3 * MiB, "by_part": {"weights": MiB, "grads": 2 * MiB}}
            t.add(it, phase, on, 0.0, active, res)
    assert isinstance(t.records[0], PhaseRecord) and t.records[0].need_bytes == 0
    w, h = png_size(plot_timeline(t, tmp_path / "many.png"))
    assert w <= MAX_PX[0] and h <= MAX_PX[1]


def test_the_mismatch_goes_on_panel_two_on_a_log_scale(tmp_path):
    """The vLLM rollout's training-inference mismatch per iteration: green triangles on panel 2's
    right axis, log scale; an iteration without one gets no point, an exact match one at 1e-12."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from chatlearn_mem_ray.service.timeline_plot import _iteration_stats, _plot_mismatch

    timeline = make_timeline(3, 1)
    stats = _iteration_stats(timeline)
    its = [(s["iteration"], s["manager_on"]) for s in stats]
    mismatch = {its[0]: 2e-6, its[1]: 0.0, its[-1]: 5e-7}  # the third on-iteration has none
    fig, ax = plt.subplots()
    _plot_mismatch(ax, stats, mismatch)
    (right,) = [a for a in fig.axes if a is not ax]
    assert right.get_yscale() == "log"
    (points,) = right.collections
    xs = {s["x"]: (s["iteration"], s["manager_on"]) for s in stats}
    got = {xs[x]: y for x, y in points.get_offsets().tolist()}
    assert got == {its[0]: 2e-6, its[1]: 1e-12, its[-1]: 5e-7}
    assert "log-prob mismatch (right)" in [t.get_text() for t in ax.get_legend().get_texts()]
    plt.close(fig)
    w, h = png_size(plot_timeline(timeline, tmp_path / "mm.png", "vllm", mismatch=mismatch))
    assert w <= MAX_PX[0] and h <= MAX_PX[1]
