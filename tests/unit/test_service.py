"""The colocation service without Ray: what a loop may declare and call, what a phase moves, the
ordering it keeps (a save completed before a saved model changes, nothing called after a failed
phase, a clean sleep after it), and a loop's own state through a checkpoint and a resume.

The actors are stand-ins that record every call; the service, the phase runner and the job's loop
are the real ones."""

import json

import pytest
from pydantic import BaseModel, ConfigDict

from chatlearn_mem import ConfigError, Part
from chatlearn_mem_ray import (
    EVERYTHING,
    WEIGHTS,
    DeclarationError,
    Loop,
    LoopConfig,
    LoopUsageError,
    Model,
    Phase,
    RunInterrupted,
    load_config,
    run_loop,
)
from chatlearn_mem_ray.config import TrainerModelConfig
from chatlearn_mem_ray.service import service
from chatlearn_mem_ray.service.declare import check_declarations, phase_demands

POLICY = TrainerModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=16, seq_length=8)


class Ref:
    def __init__(self, value):
        self.value = value


class Method:
    def __init__(self, actor, name):
        self.actor, self.name = actor, name

    def remote(self, *args, **kwargs):
        self.actor.log.append((self.actor.name, self.name, args))
        return Ref(self.actor.answer(self.name, args))


class FakeActor:
    """Answers every call from its model's parts, and records it in the shared log."""

    def __init__(self, name, log, parts):
        self.name, self.log, self.parts, self.resident = name, log, parts, set()

    def __getattr__(self, method):
        return Method(self, method)

    def answer(self, method, args):
        if method in ("onload", "offload"):
            parts = set(Part(p) for p in (args[0] if args and args[0] is not None else self.parts))
            (self.resident.update if method == "onload" else self.resident.difference_update)(parts)
            return []
        if method == "residency":
            held = {p.value: 100 for p in self.resident}
            return {"device_bytes": sum(held.values()), "by_part": held, "resident_by_part": held}
        if method in ("audit",):
            return []
        if method == "settle":
            return {"seconds": 0.0, "stats": []}
        return f"{self.name}.{method}"


class RecordingColocation:
    """Stands in for :class:`Colocation`: one fake actor per declared actor, every call logged."""

    made: list = []

    def __init__(self, cfg, models=(), progress=None, wait_s=0.0):
        ws = cfg.parallel.world_size
        self.cfg, self.log, self.use_gpu, self.closed = cfg, [], False, False
        self.actors_of, self.names, self.bundle_of, self.ranks, self.nodes = {}, {}, {}, {}, {}
        for m in models:
            parts = list(Part) if m.kind == "trainer" else [Part.WEIGHTS]
            self.actors_of[m.name] = []
            for rank, (a, b) in enumerate(zip(m.actor_names(ws), m.bundles(ws))):
                actor = FakeActor(a, self.log, parts)
                self.actors_of[m.name].append(actor)
                self.names[actor], self.bundle_of[a] = a, b
                self.ranks[a] = {"dp_rank": rank, "tp_rank": 0}
        RecordingColocation.made.append(self)

    @property
    def all_actors(self):
        return [a for group in self.actors_of.values() for a in group]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True

    def call(self, phase, refs, timeout_s=None):
        return {a: r.value for a, r in refs.items()}

    def check_shared_dir(self, directory):
        pass


@pytest.fixture
def fake(monkeypatch):
    RecordingColocation.made = []
    monkeypatch.setattr(service, "Colocation", RecordingColocation)
    monkeypatch.setattr(
        "chatlearn_mem_ray.job.run.plot_timeline", lambda timeline, path, title, mismatch=None: path.write_bytes(b"")
    )
    return RecordingColocation


def cfg_of(tmp_path, *overrides):
    base = ["counter.iterations=3", "memory.compare_iterations=0", f"output_dir={tmp_path}"]
    return load_config(None, [*base, *overrides], CounterConfig)


class CounterSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    iterations: int = 3
    prompt_length: int = 2
    response_length: int = 2
    seed: int = 0


class CounterConfig(LoopConfig):
    loop_section = "counter"
    counter: CounterSection = CounterSection()


class Counter(Loop):
    """Two models, two phases; its own state counts what it saw."""

    name = title = "counter"

    def __init__(self, cfg):
        super().__init__(cfg)
        self.seen = 0

    def models(self):
        return [Model.trainer("policy", POLICY, saved=False), Model.inference("scorer", POLICY)]

    def phases(self):
        return [Phase("score", needs={"scorer": WEIGHTS}), Phase("train", needs={"policy": EVERYTHING})]

    def step(self, svc, index):
        with svc.phase("score") as p:
            p.call("scorer", "logprobs", index)
        with svc.phase("train") as p:
            p.call("policy", "forward", index)
        self.seen += index + 1
        return {"reward": float(self.seen)}

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


# -- declarations --------------------------------------------------------------------------
def test_bad_declarations_are_named_all_at_once():
    models = [Model.trainer("policy", POLICY), Model.engine("rollout", POLICY, follows="critic")]
    phases = [
        Phase("generate", needs={"rollout": WEIGHTS, "reward_model": WEIGHTS}),
        Phase("generate", needs={"rollout": EVERYTHING}),
        Phase("train", needs={"policy": "weights"}, writes={"policy": "all"}),
    ]
    with pytest.raises(DeclarationError) as e:
        check_declarations(models, phases, 1)
    msg = str(e.value)
    assert isinstance(e.value, ConfigError)  # the command line exits 2
    for said in (
        "engine 'rollout' follows 'critic', which is not a declared trainer",
        "phase 'generate' needs model 'reward_model', which the loop never declared ('policy', 'rollout')",
        "phase 'generate' is declared twice",
        "phase 'generate' needs ['weights', 'grads', 'main_weights', 'optimizer_states'] of engine 'rollout'",
        "phase 'train' writes ['grads', 'main_weights', 'optimizer_states'] of 'policy' without needing them",
    ):
        assert said in msg, msg
    with pytest.raises(DeclarationError, match="declares no phase"):
        check_declarations(models[:1], [], 1)
    with pytest.raises(DeclarationError, match="bundle 3, but the run has 2"):
        check_declarations([Model.inference("ref", POLICY, bundle=3)], [Phase("x", needs={"ref": WEIGHTS})], 2)


def test_a_models_backend_is_a_plain_value():
    """Model.engine is a constructor: it once shadowed the dataclass field of the same name, whose
    default then became the classmethod itself."""
    from chatlearn_mem_ray.config import RolloutConfig

    assert Model.trainer("policy", POLICY).backend == "megatron"
    assert Model.engine("rollout", POLICY, follows="policy").backend == "megatron"
    assert Model.engine("rollout", POLICY, follows="policy", rollout=RolloutConfig(engine="vllm")).backend == "vllm"


def test_writes_are_derived_from_needs():
    models = [
        Model.trainer("policy", POLICY),
        Model.engine("rollout", POLICY, follows="policy"),
        Model.inference("reference", POLICY),
    ]
    phases = [
        Phase("generate", needs={"rollout": WEIGHTS}),
        Phase("reference", needs={"reference": WEIGHTS}),
        Phase("logprobs", needs={"policy": WEIGHTS}),
        Phase("train", needs={"policy": EVERYTHING}),
    ]
    ds = phase_demands(models, phases, 2)
    assert [d.writes for d in ds] == [
        {"rollout": (Part.WEIGHTS,)},  # a weight sync writes the engine
        {},
        {},  # a forward pass changes nothing
        {a: (Part.WEIGHTS, Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES) for a in ("policy_0", "policy_1")},
    ]


def test_a_loop_with_bad_declarations_stops_before_anything_starts(fake, tmp_path):
    class Broken(Counter):
        def phases(self):
            return [Phase("score", needs={"judge": WEIGHTS})]

    with pytest.raises(DeclarationError, match="model 'judge', which the loop never declared"):
        run_loop(Broken, cfg_of(tmp_path))
    assert fake.made == [] and not (tmp_path / "log.json").exists()


# -- calls inside a phase ------------------------------------------------------------------
def _service(fake, tmp_path, loop=Counter):
    cfg = cfg_of(tmp_path)
    lp = loop(cfg)
    svc = service.Service(cfg, lp.models(), lp.phases(), progress=lambda line: None)
    return svc.__enter__(), fake.made[-1]


def test_a_phase_reaches_only_the_models_it_declared(fake, tmp_path):
    svc, colo = _service(fake, tmp_path)
    with pytest.raises(LoopUsageError, match="ran outside an iteration"):
        with svc.phase("score"):
            pass
    svc.begin_iteration(0)
    with pytest.raises(LoopUsageError, match=r"phase 'training' was not declared \(declared: score, train\)"):
        svc.phase("training")
    with svc.phase("score") as p:
        assert p.call("scorer", "logprobs", 1) == ["scorer.logprobs"]
        with pytest.raises(LoopUsageError, match="phase 'score' calls 'policy', which it does not need"):
            p.call("policy", "forward", 1)
        with pytest.raises(LoopUsageError, match="phases do not nest"):
            with svc.phase("train"):
                pass
    with pytest.raises(LoopUsageError, match="'critic' is not a model of this loop"):
        svc.actors("critic")


def test_each_phase_onloads_what_it_needs_records_and_offloads_it(fake, tmp_path):
    svc, colo = _service(fake, tmp_path)
    svc.begin_iteration(0)
    with svc.phase("train") as p:
        assert colo.actors_of["policy"][0].resident == set(Part)  # woken before the block
        assert colo.actors_of["scorer"][0].resident == set()
        p.call("policy", "forward", 0)
    assert colo.actors_of["policy"][0].resident == set()  # asleep after it
    [record] = svc.timeline.records
    assert record.phase == "train" and record.device_bytes == {"policy_0": 400, "scorer": 0}
    calls = [(a, m) for a, m, _ in colo.log]
    assert (
        calls.index(("policy_0", "onload"))
        < calls.index(("policy_0", "audit"))
        < calls.index(("policy_0", "forward"))
        < calls.index(("policy_0", "offload"))
    )


def test_a_failed_phase_calls_no_actor_on_the_way_out_and_the_next_starts_asleep(fake, tmp_path):
    svc, colo = _service(fake, tmp_path)
    svc.begin_iteration(0)
    boom = RuntimeError("the reward function raised")
    with pytest.raises(RuntimeError) as e:
        with svc.phase("train"):
            colo.log.clear()
            raise boom
    assert e.value is boom and colo.log == []  # re-raised as it was; no actor called (one may be dead)
    assert colo.actors_of["policy"][0].resident == set(Part)  # left as the failure left it
    with svc.phase("score"):
        pass
    assert ("policy_0", "offload", ()) in colo.log  # every model put to sleep first
    assert colo.actors_of["policy"][0].resident == set()


def test_an_engine_is_stale_until_synced_and_again_after_its_trainer_trains(fake, tmp_path):
    class Rollout(Counter):
        def models(self):
            return [Model.trainer("policy", POLICY), Model.engine("rollout", POLICY, follows="policy")]

        def phases(self):
            return [Phase("generate", needs={"rollout": WEIGHTS}), Phase("train", needs={"policy": EVERYTHING})]

    svc, colo = _service(fake, tmp_path, Rollout)
    svc.sync_checks = []
    svc.begin_iteration(0)
    assert svc.stale("rollout")  # nothing synced yet
    with svc.phase("generate"):
        svc._synced["rollout"] = svc._versions["policy"]  # as p.sync does once the weights are in
    assert not svc.stale("rollout")
    with svc.phase("train"):
        pass
    assert svc.stale("rollout")  # the policy trained
    with pytest.raises(LoopUsageError, match="'policy' is a trainer, not an engine"):
        svc.stale("policy")
    assert "onload rollout: weights" in svc.explain("generate")


def test_a_phase_that_changes_a_saved_model_completes_the_open_save_first(fake, tmp_path):
    svc, colo = _service(fake, tmp_path)
    svc.models["policy"] = Model.trainer("policy", POLICY)  # saved
    order = []

    class Checkpointer:
        def complete(self):
            order.append(("complete", svc.where))
            return 0.25

    svc.checkpointer = Checkpointer()
    svc.on_phase = lambda s, index, phase: order.append(("phase", phase))
    svc.begin_iteration(4)
    with svc.phase("score"):  # reads only the scorer: the save stays open behind it
        pass
    with svc.phase("train"):
        pass
    assert order == [("phase", "score"), ("complete", (4, "checkpoint")), ("phase", "train")]
    assert svc.end_iteration({})["checkpoint_seconds"] == 0.25


# -- the loop's own state --------------------------------------------------------------------
def test_a_loops_own_state_is_saved_and_taken_back_on_resume(fake, tmp_path):
    """Ctrl-C after iteration 2 of 3 with a checkpoint every iteration; the resumed run hands the
    loop the state the checkpoint saved and ends as the run left alone."""
    whole = run_loop(Counter, cfg_of(tmp_path / "whole"), progress=lambda line: None)
    args = ["checkpoint.every=1", "checkpoint.async_save=false"]

    def ctrl_c(svc, it):
        if it == 1:
            raise KeyboardInterrupt

    with pytest.raises(RunInterrupted):
        run_loop(Counter, cfg_of(tmp_path / "cut", *args), progress=lambda line: None, on_iteration=ctrl_c)
    saved = json.loads((tmp_path / "cut" / "checkpoints" / "iter_00000002" / "run.json").read_text())
    assert saved["loop"] == {"seen": 3} and saved["models"] == []  # 1 + 2; the policy is not saved here
    log = run_loop(Counter, cfg_of(tmp_path / "cut", *args, "checkpoint.resume=true"), progress=lambda line: None)
    assert [m["reward"] for m in log["iterations"]] == [m["reward"] for m in whole["iterations"]] == [1.0, 3.0, 6.0]
