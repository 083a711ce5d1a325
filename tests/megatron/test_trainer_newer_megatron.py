"""What megatron-core 0.17 to 0.19 added that the manager touches: HybridModel (0.18+), which 0.19
recommends over GPTModel, and fp32 local gradient accumulation (0.17+), whose separate fp32
``main_grad`` s live outside the DDP grad buffer. Skipped, with the reason, on older releases."""

import pytest
import torch
from trainer_runs import BATCH, STEPS, TRANSITIONS, bit_equal, train

from chatlearn_mem import ChatlearnMemError, Part
from chatlearn_mem.mcore import layout
from chatlearn_mem.models import gpt

needs_018 = pytest.mark.skipif(
    layout.megatron_core_release() < (0, 18), reason="HybridModel is in megatron-core 0.18 and newer"
)
needs_017 = pytest.mark.skipif(
    layout.megatron_core_release() < (0, 17),
    reason="fp32 local accumulation (param_name_patterns_for_fp32_local_accumulation) "
    "is in megatron-core 0.17 and newer",
)


@needs_018
@pytest.mark.parametrize("transitions", list(TRANSITIONS))
@pytest.mark.parametrize("precision,distributed", [("bf16", True), ("bf16", False), ("fp32", True), ("fp32", False)])
def test_hybrid_model_is_exact_under_full_cycles(dist1, precision, distributed, transitions):
    cfg = dict(model_class="hybrid", num_layers=4, precision=precision, use_distributed_optimizer=distributed)
    losses, weights, _, trainer = train(cfg)
    assert type(trainer.model.module).__name__ == "HybridModel"
    names = [n for n, _ in trainer.model.module.named_parameters()]
    assert any(".self_attention." in n for n in names) and any(".mlp." in n for n in names)
    between, config = TRANSITIONS[transitions]
    cycled_losses, cycled, mm, _ = train(cfg, between=between, config=config)  # audits after onloads
    assert cycled_losses == losses and len(losses) == STEPS
    assert bit_equal(cycled, weights)
    mm.offload()
    assert mm.residency().device_bytes == 0
    mm.onload()
    assert mm.audit().ok


FP32_LOCAL = dict(grad_reduce_in_fp32=False, fp32_accumulation_params=("*linear_fc1*",))


@needs_017
@pytest.mark.parametrize("transitions", list(TRANSITIONS))
@pytest.mark.parametrize("distributed", [True, False])
def test_fp32_local_accumulation_main_grads_are_released_and_exact(dist1, distributed, transitions):
    cfg = dict(FP32_LOCAL, use_distributed_optimizer=distributed)
    losses, weights, mm, trainer = train(cfg)
    extra = [g for b in trainer.model.buffers for g in b.extra_main_grads]
    assert len(extra) == 4 and all(g.dtype == torch.float32 for g in extra)  # fc1 weight + bias, 2 layers
    assert mm.audit().ok, mm.audit()  # main_grad is not a view of grad_data for these, by design
    mm.offload()
    assert all(g.untyped_storage().nbytes() == 0 for g in extra)
    assert mm.residency().device_bytes == 0
    mm.onload()
    assert all(g.untyped_storage().nbytes() == g.numel() * 4 and not g.any() for g in extra)
    between, config = TRANSITIONS[transitions]
    cycled_losses, cycled, _, _ = train(cfg, between=between, config=config)
    assert cycled_losses == losses and bit_equal(cycled, weights)


@needs_017
def test_fp32_local_accumulation_audit_names_a_replaced_main_grad(dist1):
    _, _, mm, trainer = train(dict(FP32_LOCAL), steps=1)
    name, p = next((n, p) for n, p in trainer.model.named_parameters() if layout.local_main_grad(p) is not None)
    p.main_grad = p.main_grad.clone()
    problems = mm.audit().problems
    assert len(problems) == 1 and name in problems[0] and "extra_main_grads" in problems[0], problems


@needs_017
def test_unconsumed_fp32_local_grads_block_offload(dist1):
    """Gradients accumulated only in an extra fp32 main_grad still count as unconsumed."""
    cfg = dict(FP32_LOCAL)
    _, _, mm, trainer = train(cfg, steps=1)
    trainer.model.zero_grad_buffer()
    trainer.loss(gpt.synthetic_batch(gpt.GPTTrainerConfig(**cfg), 7, batch_size=BATCH)).backward()
    for b in trainer.model.buffers:
        b.grad_data.zero_()  # leave gradients in the extra fp32 main_grads only
        assert any(bool(g.any()) for g in b.extra_main_grads)
    with pytest.raises(ChatlearnMemError, match="no optimizer step has consumed"):
        mm.offload(Part.GRADS)
    assert not mm.is_offloaded(Part.GRADS)
