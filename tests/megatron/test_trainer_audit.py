"""Guarantee 2: audit() is clean after onload and names each broken alias precisely."""

import pytest
import torch
from trainer_runs import train

from chatlearn_mem.mcore import layout
from chatlearn_mem.models import gpt


@pytest.fixture(params=["distopt", "float16opt"])
def trained(dist1, request):
    cfg = gpt.GPTTrainerConfig(use_distributed_optimizer=request.param == "distopt")
    _, _, mm, trainer = train(cfg, steps=2)
    mm.offload()
    mm.onload()
    return mm, trainer


def _named_param(trainer, fragment):
    return next((n, p) for n, p in trainer.model.named_parameters() if fragment in n)


def _problems(mm):
    report = mm.audit()
    assert not report.ok
    return "\n".join(report.problems)


def test_clean_after_onload_and_while_offloaded(trained):
    mm, _ = trained
    report = mm.audit()
    assert report.ok, str(report)
    assert report.checked > 100
    mm.offload()
    assert mm.audit().ok
    mm.onload()


def test_rebound_param_is_reported_by_name(trained):
    mm, trainer = trained
    name, p = _named_param(trainer, "linear_fc1.weight")
    p.data = p.data.clone()
    problems = _problems(mm)
    assert "linear_fc1.weight" in problems
    if trainer.config.use_distributed_optimizer:
        assert ".data is not a view of" in problems
        assert "shard_float16_groups" in problems  # the optimizer's shard no longer views the param


def test_rebound_main_grad_is_reported(trained):
    mm, trainer = trained
    name, p = _named_param(trainer, "linear_qkv.weight")
    p.main_grad = torch.zeros_like(p.main_grad)
    problems = _problems(mm)
    assert "linear_qkv.weight .main_grad is not a view of" in problems


def test_second_hook_is_reported(trained):
    mm, trainer = trained
    name, p = _named_param(trainer, "linear_proj.weight")
    node = layout.grad_accumulator(p)
    node.register_hook(lambda *a: None)
    assert "linear_proj.weight has 2 grad-accumulator hook(s) and 1 entries" in _problems(mm)


def test_hook_registered_twice_ddp_style_is_reported(trained):
    mm, trainer = trained
    name, p = _named_param(trainer, "linear_proj.bias")
    node = layout.grad_accumulator(p)
    node.register_hook(lambda *a: None)
    trainer.model.grad_accs.append(node)
    problems = _problems(mm)
    assert "linear_proj.bias has 2 grad-accumulator hook(s) and 2 entries" in problems


def test_missing_hooks_are_reported(trained):
    mm, trainer = trained
    trainer.model.grad_accs.clear()  # the accumulator nodes die with their hooks
    problems = _problems(mm)
    assert "0 grad-accumulator hook(s)" in problems
    assert "never reduced" in problems


def test_accumulator_dropped_by_a_data_move_is_reported_and_rehooked(trained):
    # ``param.data = <tensor of another device or dtype>`` makes torch drop the grad-accumulator
    # node DDP hooked: on a GPU every ``param.data = param.data.cpu()`` offload scheme does it (the
    # benchmark's replace_rebuild did, on an H200). Here a dtype round trip does the same on CPU.
    mm, trainer = trained
    chunk = layout.ddp_chunks(trainer.model)[0]
    slots = layout.grad_hook_slots(chunk)
    assert len(slots) == sum(p.requires_grad for p in chunk.module.parameters())
    name, p = _named_param(trainer, "linear_fc1.weight")
    data = p.data
    p.data = data.double()
    p.data = data  # the same storage again: only the accumulator node is new
    assert f"{name} has 0 grad-accumulator hook(s) and 0 entries" in _problems(mm)
    trainer.train_step(gpt.synthetic_batch(trainer.config, 5, batch_size=4))
    assert not p.main_grad.any()  # its gradient was never reduced
    assert layout.rehook_grad_accumulators(chunk, slots) == 1
    assert layout.rehook_grad_accumulators(chunk, slots) == 0
    assert mm.audit().ok, str(mm.audit())
    trainer.train_step(gpt.synthetic_batch(trainer.config, 6, batch_size=4))
    assert p.main_grad.any()


def test_stale_param_group_entry_is_reported(trained):
    mm, trainer = trained
    opt = layout.torch_optimizer(layout.leaf_optimizers(trainer.optimizer)[0])
    params = opt.param_groups[0]["params"]
    params[0] = params[0].detach().clone()
    problems = _problems(mm)
    assert "param_groups[0]['params'] is not the optimizer's live shard tensors" in problems
    assert "state is keyed by a tensor" in problems  # the old key is now stale


def test_broken_distributed_optimizer_shard_is_reported(dist1):
    _, _, mm, trainer = train(gpt.GPTTrainerConfig(), steps=1)
    leaf = layout.leaf_optimizers(trainer.optimizer)[0]
    leaf.shard_float16_groups[0][0] = leaf.shard_float16_groups[0][0].clone()
    assert "shard_float16_groups[0][0]" in _problems(mm)


def test_stale_bucket_group_cache_is_reported(dist1):
    _, _, mm, trainer = train(gpt.GPTTrainerConfig(), steps=1)
    group = layout.bucket_groups([trainer.model])[0]
    if not hasattr(group, "cached_grad_buffer_shard_list"):
        pytest.skip("this megatron-core release keeps no shard caches in bucket groups")
    bucket = group.buckets[0]
    group.cached_grad_buffer_shard_list[0] = [torch.zeros_like(bucket.grad_data)]
    assert "cached_grad_buffer_shard_list" in _problems(mm)


def test_storage_released_behind_the_managers_back_is_reported(trained):
    mm, trainer = trained
    grad_data = layout.ddp_buffers(trainer.model)[0].grad_data
    size = grad_data.untyped_storage().nbytes()
    grad_data.untyped_storage().resize_(0)
    try:
        assert "released and not restored" in _problems(mm)
    finally:
        grad_data.untyped_storage().resize_(size)


def test_storage_restored_behind_the_managers_back_is_reported(trained):
    mm, trainer = trained
    mm.offload()
    grad_data = layout.ddp_buffers(trainer.model)[0].grad_data
    ((storage, size),) = [
        (s, n) for s, n in mm.state.group("grads").released if s._cdata == grad_data.untyped_storage()._cdata
    ]
    storage.resize_(size)
    assert "although the part is offloaded" in _problems(mm)
    storage.resize_(0)
    mm.onload()
