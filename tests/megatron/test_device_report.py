"""What stays on the device after a full offload (chatlearn_mem.device_report), on the CPU backend:
the walk of every tensor reachable from the model and optimizer, attributed to its holder."""

import torch
from trainer_runs import reachable_bytes, train

from chatlearn_mem import DeviceReport, device_report
from chatlearn_mem.models import gpt


def _report(mm, trainer) -> DeviceReport:
    return device_report(trainer.model, trainer.optimizer, managers=[mm])


def test_full_offload_leaves_no_manager_residue_and_the_walk_accounts_for_every_byte(dist1):
    _, _, mm, trainer = train(gpt.GPTTrainerConfig(), steps=2)
    before = _report(mm, trainer)
    assert before.by_holder["manager_residue"] == mm.residency().device_bytes > 0
    mm.offload()
    after = _report(mm, trainer)
    assert after.by_holder["manager_residue"] == 0
    assert after.cuda is None and "allocator_cache" not in after.by_holder  # CPU: the walk is the report
    # Every byte still reachable from the model and optimizer is in the report, nothing twice; so
    # is megatron's global memory buffer (reachable from neither: megatron keeps a bf16 'mpu'
    # scratch tensor there after a training step, even at TP=1).
    assert after.total_bytes == sum(after.by_holder.values())
    gmb = after.by_holder["megatron_global_memory_buffer"]
    assert after.total_bytes - gmb == reachable_bytes(trainer)[0]
    assert after.total_bytes - gmb < 0.01 * before.total_bytes, after.format()
    mm.onload()
    assert _report(mm, trainer).by_holder == before.by_holder


def test_a_retained_tensor_shows_under_model_other_with_its_exact_bytes(dist1):
    _, _, mm, trainer = train(gpt.GPTTrainerConfig(), steps=1)
    mm.offload()
    base = _report(mm, trainer)
    kept = torch.empty(3 * 2**20 + 5, dtype=torch.uint8)
    trainer.model.module.decoder.my_cache = kept  # what user code might leave on a module
    try:
        report = _report(mm, trainer)
    finally:
        del trainer.model.module.decoder.my_cache
    assert report.by_holder["model_other"] - base.by_holder["model_other"] == 3 * 2**20 + 5
    assert report.total_bytes - base.total_bytes == 3 * 2**20 + 5
    path, nbytes = report.largest["model_other"][0]
    assert nbytes == 3 * 2**20 + 5 and path.endswith("decoder.my_cache"), report.largest
    text = report.format()
    assert "model_other" in text and "3.00 MiB" in text and "decoder.my_cache" in text
    mm.onload()


def test_megatron_global_memory_buffer_is_named(dist1):
    from megatron.core import parallel_state

    _, _, mm, trainer = train(gpt.GPTTrainerConfig(), steps=1)
    mm.offload()
    base = _report(mm, trainer).by_holder["megatron_global_memory_buffer"]
    buf = parallel_state.get_global_memory_buffer()
    buf.get_tensor((1000,), torch.float32, "device-report-test")
    try:
        report = _report(mm, trainer)
    finally:
        buf.buffer.pop(("device-report-test", torch.float32))
    assert report.by_holder["megatron_global_memory_buffer"] - base == 4000
    assert any("device-report-test" in p for p, _ in report.largest["megatron_global_memory_buffer"])
    mm.onload()


def test_moe_dispatcher_tensors_are_named(dist1):
    _, _, mm, trainer = train(gpt.GPTTrainerConfig(num_moe_experts=4), steps=1)
    mm.offload()
    report = _report(mm, trainer)
    assert report.by_holder["manager_residue"] == 0
    # The all-gather dispatcher keeps the last batch's routing tensors (see the README).
    assert report.by_holder["moe_dispatcher"] > 0, report.format()
    assert all("token_dispatcher" in p for p, _ in report.largest["moe_dispatcher"]), report.largest
    assert report.to_dict()["by_holder"] == report.by_holder
    mm.onload()
    assert mm.audit().ok
