"""The trainer manager on plain PyTorch trainers without a process group: a small model of our own
and Hugging Face Llama / Qwen2 built from a config, with AdamW.

Exactness against a twin never put to sleep (all parts, weights only, non-blocking, the
optimizer's parts alone, a train step between each), what each part holds and releases, the
guards, changes made behind the manager's back refused with what happened, bad input refused
with one clear error and nothing changed, host copies of a sleeping trainer, checkpoints and the
residency planner. DDP, ZeroRedundancyOptimizer and FSDP2 need a process group: their tests are
in tests/multirank/test_torch_trainers.py.
"""

import json
import os
import sys
import types

import pytest
import torch
from torch import nn
from torch_runs import TinyLM, batch, exactness, loss_of

from chatlearn_mem import (
    ChatlearnMemError,
    ExternalChangeError,
    OffloadedError,
    Part,
    TrainerMemoryManager,
    UnsupportedLayoutError,
    latest_checkpoint,
    load_checkpoint,
    manager_of,
    plan_residency,
    save_checkpoint,
)
from chatlearn_mem.checkpoint_format import METADATA_FILE, CheckpointError


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def trained(steps: int = 2, **kw):
    """A TinyLM with AdamW after ``steps`` steps, and its manager."""
    torch.manual_seed(0)
    model = TinyLM(**kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mm = TrainerMemoryManager(model, opt)
    for s in range(steps):
        loss_of(model, batch(s)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt, mm


def bits(model: nn.Module, opt) -> dict:
    out = {f"p {n}": p.detach().clone() for n, p in model.named_parameters()}
    out.update({f"b {n}": b.clone() for n, b in model.named_buffers()})
    for i, s in enumerate(opt.state.values()):
        out.update({f"s {i} {k}": v.clone() for k, v in s.items()})
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- exactness ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [dict(model="tiny"), dict(model="tiny", tied=False), dict(model="llama"), dict(model="qwen2", tied=True)],
    ids=["tiny-tied", "tiny-untied", "hf-llama", "hf-qwen2-tied"],
)
def test_training_across_every_kind_of_transition_is_bit_identical_to_a_twin(spec):
    r = exactness(spec)
    assert r["losses_equal"], r["losses"]
    assert r["forwards_equal"]  # the weights-only phase computes what the twin computes
    assert r["differ"] == [] and r["compared"] > 20, r["differ"]
    assert len(r["released"]) == 3 and all(n > 0 for n in r["released"])  # three full cycles


def test_parts_are_weights_grads_and_optimizer_states_only():
    _, _, mm = trained()
    assert mm.parts == (Part.WEIGHTS, Part.GRADS, Part.OPTIMIZER_STATES)
    with pytest.raises(ValueError, match="'main_weights' is not a part of this manager"):
        mm.offload(Part.MAIN_WEIGHTS)
    assert mm.residency().by_category["main_weights"] == 0


def test_each_part_holds_its_bytes_and_a_full_offload_releases_all_of_them():
    model, opt, mm = trained()
    weights = sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )
    states = sum(2 * p.numel() * 4 for p in model.parameters())  # exp_avg, exp_avg_sq; step stays on the host
    res = mm.residency()
    assert res.by_category["weights"] == weights  # the tied head counts once
    assert res.by_category["optimizer_states"] == states
    mm.offload()
    res = mm.residency()
    assert res.device_bytes == 0 and res.host_bytes >= weights + states
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    assert all(b.untyped_storage().nbytes() == 0 for b in model.buffers())
    # what stays: AdamW's step counters (4 bytes each), kept on the host by design
    for state in opt.state.values():
        assert state["step"].untyped_storage().nbytes() == 4 and state["step"].device.type == "cpu"
        assert state["exp_avg"].untyped_storage().nbytes() == 0
    assert {float(s["step"]) for s in opt.state.values()} == {2.0}  # readable while asleep
    mm.onload()
    assert mm.audit().ok


def test_grads_are_dropped_as_zero_grad_drops_them_and_unconsumed_ones_are_refused():
    model, opt, mm = trained()
    loss_of(model, batch(5)).backward()  # a backward no step consumed
    before = bits(model, opt)
    with pytest.raises(ChatlearnMemError, match=r"refusing to drop the gradients of param embed.weight.*force=True"):
        mm.offload()
    assert not any(mm.is_offloaded(p) for p in mm.parts) and same(bits(model, opt), before)
    assert all(p.grad is not None for p in model.parameters())  # nothing lost
    assert mm.residency().by_category["other"] > 0  # the .grads
    mm.offload(force=True)
    assert all(p.grad is None for p in model.parameters())
    mm.onload()
    opt.zero_grad()
    loss_of(model, batch(6)).backward()
    opt.step()
    assert mm.audit().ok


def test_weights_unchanged_since_onload_are_released_without_a_copy():
    model, _, mm = trained()
    mm.offload()
    mm.onload(Part.WEIGHTS)
    with torch.no_grad():
        model(batch(0))
    (stats,) = mm.offload(Part.WEIGHTS)
    assert stats.copied_bytes == 0 and stats.nbytes > 0
    mm.onload()


# -- the guards ------------------------------------------------------------------------------------------
def test_forward_step_and_state_dicts_refuse_while_their_parts_are_offloaded():
    model, opt, mm = trained()
    mm.offload()
    with pytest.raises(OffloadedError, match=r"forward pass while the weights are offloaded: call onload_weights\(\)"):
        model(batch(0))
    with pytest.raises(OffloadedError, match="state_dict"):
        model.state_dict()
    with pytest.raises(OffloadedError, match=r"AdamW.state_dict\(\) while optimizer_states are offloaded"):
        opt.state_dict()
    mm.onload(Part.WEIGHTS)
    with pytest.raises(OffloadedError, match="training forward pass while the grad buffers are released"):
        model(batch(0))
    mm.onload(Part.GRADS)
    loss_of(model, batch(0)).backward()
    with pytest.raises(OffloadedError, match="optimizer step while optimizer_states are offloaded"):
        opt.step()
    mm.onload()
    opt.step()
    assert mm.audit().ok


# -- changes behind the manager's back --------------------------------------------------------------------
def test_param_data_replaced_behind_the_manager_is_refused_naming_it():
    model, opt, mm = trained()
    model.blocks[0].fc1.weight.data = torch.randn_like(model.blocks[0].fc1.weight)
    report = mm.audit()
    assert any("param blocks.0.fc1.weight .data was rebound" in p for p in report.problems), report
    with pytest.raises(
        ExternalChangeError, match=r"weights: 1 tensor\(s\) \(param blocks.0.fc1.weight\).*param.data = "
    ):
        mm.offload()
    assert not any(mm.is_offloaded(p) for p in mm.parts)  # refused before anything moved


def test_model_moved_by_to_behind_the_manager_is_refused_naming_what_happened():
    """``model.cpu()`` on a GPU replaces every parameter's ``.data`` (the GPU tier runs it); on a CPU
    "device" ``model.cpu()`` is a no-op, and ``model.double()`` replaces ``.data`` the same way."""
    model, opt, mm = trained()
    model.double()
    with pytest.raises(ExternalChangeError) as e:
        mm.offload(Part.WEIGHTS)
    msg = str(e.value)
    assert "param embed.weight" in msg and "model.to(dtype)" in msg and "close() this manager" in msg, msg


def test_a_parameter_object_replaced_is_named_by_the_audit():
    model, opt, mm = trained()
    model.norm.weight = nn.Parameter(model.norm.weight.detach().clone())
    report = mm.audit()
    assert any("param norm.weight was replaced by a new Parameter object" in p for p in report.problems), report
    with pytest.raises(ExternalChangeError, match=r"\(param norm.weight\) on cpu use new memory"):
        mm.offload()  # the new Parameter's memory would stay behind


# -- bad input: one clear error, nothing changed ---------------------------------------------------------
def test_parameters_on_two_devices_are_refused_naming_both():
    model = TinyLM()
    model.blocks[1].to("meta")  # a second device on a CPU-only machine (cuda:0 and cpu on a GPU)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"live on 2 devices \(cpu: param embed.weight.*meta: param blocks.1"):
        TrainerMemoryManager(model, opt)
    assert manager_of(model.embed) is None


def test_meta_model_is_refused():
    # .to("meta"), not a torch.device("meta") block: after transformers' from_pretrained (another
    # test's) torch's cached table of factory functions can miss torch.linspace, which then builds
    # this model's buffer on the CPU inside such a block
    model = TinyLM().to("meta")
    with pytest.raises(UnsupportedLayoutError, match="meta device.*materialise"):
        TrainerMemoryManager(model, torch.optim.AdamW(model.parameters()))


def test_an_optimizer_holding_parameters_the_model_does_not_is_refused():
    model = TinyLM()
    stray = nn.Parameter(torch.zeros(3, 5))
    opt = torch.optim.AdamW([*model.parameters(), stray])
    with pytest.raises(
        ValueError, match=r"holds 1 of its \d+ parameter\(s\) that are not parameters of the model \(shapes \(3, 5\)\)"
    ):
        TrainerMemoryManager(model, opt)
    mm = TrainerMemoryManager(model, torch.optim.AdamW(model.parameters()))  # nothing was claimed
    mm.close()


def test_not_an_optimizer_and_a_megatron_optimizer_are_refused():
    model = TinyLM()
    with pytest.raises(TypeError, match="not a torch.optim.Optimizer"):
        TrainerMemoryManager(model, object())
    megatron_like = types.SimpleNamespace(optimizer=torch.optim.SGD(model.parameters(), lr=1))
    with pytest.raises(TypeError, match="megatron-core's.*not megatron.core.distributed.DistributedDataParallel"):
        TrainerMemoryManager(model, megatron_like)


def _stand_in(module: str, name: str) -> nn.Module:
    """An instance of a class with the qualified name ``module.name`` (the real one's type check)."""
    cls = type(name, (nn.Module,), {"__module__": module})
    return cls()


@pytest.mark.parametrize(
    "module, name, why",
    [
        ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel", "FSDP1"),
        ("deepspeed.runtime.engine", "DeepSpeedEngine", "DeepSpeed engine"),
    ],
)
def test_unsupported_wrappers_are_refused_naming_what_is_supported(module, name, why):
    """FSDP1 and DeepSpeed are recognised by their classes' qualified names (DeepSpeed is not
    installed here, and FSDP1 is refused before it is touched): stand-ins with those names."""
    wrapper = _stand_in(module, name)
    with pytest.raises(
        UnsupportedLayoutError, match=rf"{why}.*Supported: megatron-core.*fully_shard.*ZeroRedundancyOptimizer"
    ):
        TrainerMemoryManager(wrapper, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1))


def test_a_real_fsdp1_class_is_refused():
    from torch.distributed.fsdp import FullyShardedDataParallel

    fake = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # never initialised: refused first
    with pytest.raises(UnsupportedLayoutError, match="FSDP1.*use FSDP2"):
        TrainerMemoryManager(fake, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1))


# -- host copies, checkpoints, the planner -------------------------------------------------------------------
def test_a_sleeping_trainer_hands_out_its_weights_from_the_host_store():
    model, opt, mm = trained()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    mm.offload()
    got = mm.weights_state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    streamed = dict(mm.iter_weights())
    assert all(torch.equal(streamed[k], want[k]) for k in want)
    assert mm.residency().device_bytes == 0  # nothing was woken
    mm.onload()


def test_checkpoint_of_a_sleeping_trainer_resumes_bit_identically(tmp_path):
    model, opt, mm = trained(3)
    mm.offload()
    handle = save_checkpoint(mm, str(tmp_path), step=3, async_=True, metadata={"run": "a"})
    mm.onload()  # the next phase runs while the save writes
    handle.wait()
    assert sorted(os.listdir(handle.path)) == [".metadata", "__0_0.distcp", METADATA_FILE]
    meta = json.loads(open(os.path.join(handle.path, METADATA_FILE)).read())
    assert meta["backend"] == "torch" and meta["parallel"] == {"dp": 1} and meta["metadata"] == {"run": "a"}
    expected = []
    for s in range(3, 6):
        loss = loss_of(model, batch(s))
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())

    torch.manual_seed(123)  # another initialisation: the checkpoint must overwrite it
    fresh = TinyLM()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh_mm = TrainerMemoryManager(fresh, fresh_opt)
    load_checkpoint(fresh_mm, latest_checkpoint(str(tmp_path)))
    assert fresh_opt.param_groups[0]["lr"] == 1e-2  # the saved settings
    got = []
    for s in range(3, 6):
        loss = loss_of(fresh, batch(s))
        loss.backward()
        fresh_opt.step()
        fresh_opt.zero_grad()
        got.append(loss.item())
    assert got == expected and same(bits(fresh, fresh_opt), bits(model, opt))
    assert fresh_mm.audit().ok


def test_a_checkpoint_of_another_backend_or_shape_is_refused(tmp_path):
    model, opt, mm = trained(1)
    path = save_checkpoint(mm, str(tmp_path), step=1).path
    small = TinyLM(hidden=16)
    small_mm = TrainerMemoryManager(small, torch.optim.AdamW(small.parameters()))
    with pytest.raises(CheckpointError, match=r"does not fit this model: model.blocks.0.fc1.bias: checkpoint \(64,\)"):
        load_checkpoint(small_mm, path)
    meta_path = os.path.join(path, METADATA_FILE)
    meta = json.loads(open(meta_path).read())
    meta["backend"] = "megatron-core"
    open(meta_path, "w").write(json.dumps(meta))
    with pytest.raises(CheckpointError, match="holds a megatron-core trainer.*torch one"):
        load_checkpoint(mm, path, verify=False)


def test_the_residency_planner_plans_a_torch_trainer():
    model, opt, mm = trained()
    res = mm.residency().resident_by_category
    policy = {f"policy/{p.value}": res[p.value] for p in mm.parts}
    states = policy["policy/optimizer_states"]
    assert states > 0 and policy["policy/weights"] > 0
    sizes = {**policy, "rollout/weights": states}  # a rollout engine as large as the states
    phases = [{"policy/weights", "rollout/weights"}, set(policy)]  # generate, then train
    written = [set(), {"policy/weights", "policy/optimizer_states"}]
    roomy = plan_residency(sizes, phases, budget_bytes=sum(sizes.values()), written=written, scratch={"policy/grads"})
    assert roomy.bytes_moved == 0  # it all fits: nothing moves
    tight = plan_residency(sizes, phases, budget_bytes=sum(policy.values()), written=written, scratch={"policy/grads"})
    # every iteration: the rollout's weights in, the states out (written by the step) and back in
    assert "policy/optimizer_states" not in tight.resident[0] and tight.bytes_moved == 3 * states


def test_manager_of_finds_a_torch_trainer_and_a_second_manager_is_refused():
    model, opt, mm = trained()
    assert manager_of(model) is mm and manager_of(model.blocks[0].fc1.weight) is mm
    with pytest.raises(ChatlearnMemError, match="already managed by TrainerMemoryManager"):
        TrainerMemoryManager(model, opt)


def test_the_torch_backend_never_imports_megatron():
    import subprocess

    code = "\n".join(
        [
            "import sys, torch",
            f"sys.path[:0] = {sys.path!r}",
            "import torch_runs",
            "from chatlearn_mem import TrainerMemoryManager",
            "m = torch_runs.TinyLM(); o = torch.optim.AdamW(m.parameters())",
            "mm = TrainerMemoryManager(m, o); mm.offload(); mm.onload(); assert mm.audit().ok",
            "print(sorted(k for k in sys.modules if k.split('.')[0] == 'megatron'))",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
