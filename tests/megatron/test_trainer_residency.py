"""Guarantee 3: a full offload frees the device; cycles grow neither device nor host memory."""

import pytest
from trainer_runs import train

from chatlearn_mem import Part
from chatlearn_mem.mcore import layout
from chatlearn_mem.models import gpt


@pytest.mark.parametrize("distopt", [True, False], ids=["distopt", "float16opt"])
def test_full_offload_frees_the_device(dist1, distopt):
    cfg = gpt.GPTTrainerConfig(use_distributed_optimizer=distopt)
    _, _, mm, trainer = train(cfg, steps=2)
    before = mm.residency()
    buffers = layout.ddp_buffers(trainer.model)
    assert before.by_category["grads"] == sum(b.grad_data.untyped_storage().nbytes() for b in buffers)
    n_params = sum(p.numel() for p in trainer.model.parameters())
    assert before.by_category["main_weights"] == 4 * n_params  # one fp32 copy (DP=1)
    assert before.by_category["optimizer_states"] >= 8 * n_params  # exp_avg + exp_avg_sq
    assert before.by_category["weights"] >= 2 * n_params
    mm.offload()
    after = mm.residency()
    assert after.device_bytes <= 0.01 * before.device_bytes, str(after)
    assert after.host_bytes >= (
        before.by_category["weights"] + before.by_category["main_weights"] + before.by_category["optimizer_states"]
    )
    assert after.host_by_category["grads"] == 0  # grads are dropped, never copied
    mm.onload()
    assert mm.residency().device_bytes == before.device_bytes


def test_fifty_cycles_grow_neither_device_nor_host(dist1):
    cfg = gpt.GPTTrainerConfig()
    _, _, mm, trainer = train(cfg, steps=1)
    mm.offload()
    mm.onload()
    stores = {name: g.store for name, g in mm.state.groups().items()}
    resident, host = mm.residency().device_bytes, mm.residency().host_bytes
    for step in range(50):
        trainer.train_step(gpt.synthetic_batch(cfg, step))
        mm.offload()
        r = mm.residency()
        assert r.device_bytes == 0 and r.host_bytes == host
        mm.onload()
        assert mm.residency().device_bytes == resident
    assert {name: g.store for name, g in mm.state.groups().items()} == stores  # allocated once, reused
    assert mm.audit().ok


def test_resident_bytes_are_known_while_offloaded(dist1):
    """What a residency plan needs: each part's resident size, whatever its state now."""
    from trainer_runs import train

    _, _, mm, _ = train(gpt.GPTTrainerConfig(), steps=1)
    before = mm.residency()
    assert before.resident_by_category == before.by_category
    mm.offload([Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES])
    during = mm.residency()
    assert during.by_category[Part.OPTIMIZER_STATES] == 0
    for p in Part:
        assert during.resident_by_category[p.value] == before.by_category[p.value] > 0
    mm.onload()


@pytest.mark.parametrize(
    "cfg,value_head",
    [
        (dict(num_layers=2, hidden_size=64, vocab_size=64, seq_length=16), False),
        (dict(num_layers=2, hidden_size=64, vocab_size=64, seq_length=16), True),
        (
            dict(
                num_layers=3,
                hidden_size=128,
                vocab_size=512,
                seq_length=32,
                precision="fp32",
                use_distributed_optimizer=False,
            ),
            True,
        ),
        (dict(num_layers=2, hidden_size=64, grad_reduce_in_fp32=False), False),
    ],
    ids=["policy", "critic", "critic-fp32", "bf16-grads"],
)
def test_estimated_part_bytes_match_the_built_trainer(dist1, cfg, value_head):
    """The config-only estimate a budget is checked with before anything starts (PPO driver)."""
    from chatlearn_mem import TrainerMemoryManager

    config = gpt.GPTTrainerConfig(**cfg)
    trainer = gpt.build_gpt_trainer(config, value_head=value_head)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    trainer.train_step(gpt.synthetic_batch(config, 0, batch_size=2))
    measured = mm.residency().by_category
    estimated = gpt.estimate_part_bytes(config, value_head)
    for part, nbytes in estimated.items():
        assert abs(nbytes - measured[part]) <= 0.001 * measured[part] + 256, (part, nbytes, measured[part])
    mm.close()
