"""The new GPT trainer options on one rank (no spawn): frozen params, MoE without expert
parallelism, megatron's no-pipelining schedule, config checks."""

import pytest
import torch
from trainer_runs import STEPS, TRANSITIONS, bit_equal, slow_lanes, train

from chatlearn_mem import TrainerMemoryManager
from chatlearn_mem.mcore import layout
from chatlearn_mem.models import gpt


@pytest.mark.parametrize("transitions", list(TRANSITIONS))
@pytest.mark.parametrize(
    "cfg",
    [
        dict(frozen_params=("embedding", "final_layernorm")),
        dict(frozen_params=("layernorm",), precision="fp32", use_distributed_optimizer=False),
        dict(num_moe_experts=4, moe_router_topk=2),
        dict(num_moe_experts=2, moe_router_topk=1, overlap_grad_reduce=True, ddp_bucket_size=2000),
    ],
    ids=["frozen-bf16-distopt", "frozen-fp32-fp32opt", "moe4-top2", "moe2-top1-overlap"],
)
def test_new_options_are_bit_exact_under_full_cycles(dist1, cfg, transitions):
    cfg = gpt.GPTTrainerConfig(**cfg)
    base_losses, base_state, _, _ = train(cfg)
    between, config = TRANSITIONS[transitions]
    losses, state, mm, trainer = train(cfg, between=between, config=config)
    assert len(losses) == STEPS and losses == base_losses
    assert bit_equal(state, base_state)
    assert len(set(losses)) > 1


def test_frozen_params_are_released_and_restored(dist1):
    cfg = gpt.GPTTrainerConfig(frozen_params=("embedding",))
    _, _, mm, trainer = train(cfg, steps=2)
    frozen = [p for p in trainer.model.parameters() if not p.requires_grad]
    assert frozen
    in_buffers = {p for b in layout.ddp_buffers(trainer.model) for p in b.param_offsets}
    assert not any(p in in_buffers for p in frozen)  # outside DDP's buffers and the optimizer
    values = [p.detach().clone() for p in frozen]
    mm.offload()
    assert all(p.untyped_storage().nbytes() == 0 for p in frozen)
    mm.onload()
    assert all(torch.equal(p, v) for p, v in zip(frozen, values))
    assert mm.audit().ok


@pytest.mark.parametrize("transitions", list(TRANSITIONS))
def test_pipeline_trainer_without_pipelining_matches_itself_under_cycles(dist1, transitions):
    cfg = gpt.GPTTrainerConfig(num_microbatches=2)
    between, config = TRANSITIONS[transitions]

    def run(cycle):
        trainer = gpt.build_gpt_pipeline_trainer(cfg)
        assert isinstance(trainer.model, list) and len(trainer.model) == 1
        mm = TrainerMemoryManager(trainer.model, trainer.optimizer, config)
        losses = []
        with slow_lanes():
            for step in range(4):
                losses.append(trainer.train_step(gpt.synthetic_batch(cfg, step)))
                if cycle:
                    between(mm, trainer, step)
        mm.residency()  # waits for what is in flight before reading the weights directly
        return losses, [p.detach().clone() for p in trainer.model[0].parameters()]

    base_losses, base_weights = run(False)
    losses, weights = run(True)
    assert losses == base_losses and bit_equal(weights, base_weights)
    assert len(set(losses)) > 1


def test_config_checks():
    with pytest.raises(ValueError, match="overlap_param_gather needs use_distributed_optimizer"):
        gpt.GPTTrainerConfig(overlap_param_gather=True, use_distributed_optimizer=False)
    with pytest.raises(ValueError):
        gpt.GPTTrainerConfig(num_moe_experts=1)
    with pytest.raises(ValueError):
        gpt.GPTTrainerConfig(num_microbatches=0)


def test_batch_must_split_into_micro_batches(dist1):
    trainer = gpt.build_gpt_pipeline_trainer(gpt.GPTTrainerConfig(num_microbatches=3))
    with pytest.raises(ValueError, match="does not split into 3 equal micro batches"):
        trainer.train_step(gpt.synthetic_batch(trainer.config, 0, batch_size=4))
