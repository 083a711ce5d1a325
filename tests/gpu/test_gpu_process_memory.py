"""On a GPU: what a full offload leaves in the process as the driver sees it. The cuBLAS workspaces
and the allocator's cache go back with a full offload (``release_idle_memory``), not with a partial
one or when asked not to; the report splits the process's bytes. Skipped without CUDA (conftest);
the logic runs against a fake device in tests/unit/test_process_memory.py."""

import torch
from trainer_runs import BATCH

from chatlearn_mem import Part, TrainerMemoryManager, device_report
from chatlearn_mem.models import gpt
from chatlearn_mem.process_memory import process_memory, release_idle_memory

CFG = gpt.GPTTrainerConfig(num_layers=2, hidden_size=1024, num_attention_heads=16, vocab_size=32000, seq_length=128)


def _trainer():
    trainer = gpt.build_gpt_trainer(CFG)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    trainer.train_step(gpt.synthetic_batch(CFG, 0, batch_size=BATCH))
    torch.cuda.synchronize()
    return trainer, mm


def test_a_full_offload_gives_back_the_workspaces_and_the_cache(dist1):
    trainer, mm = _trainer()
    mm.offload(release_idle_memory=False)
    kept = process_memory()
    rel = release_idle_memory()
    asleep = process_memory()
    print(f"kept {kept.to_dict()}\nrelease {rel.to_dict()}\nasleep {asleep.to_dict()}")
    assert rel.cleared_workspaces and rel.cublas_workspaces_bytes > 0  # the training step's matmuls made some
    assert asleep.allocated == kept.allocated - rel.cublas_workspaces_bytes
    assert asleep.reserved <= kept.reserved - rel.cublas_workspaces_bytes
    mm.onload()
    trainer.train_step(gpt.synthetic_batch(CFG, 1, batch_size=BATCH))  # the workspaces come back
    assert torch.cuda.memory_allocated() > 0
    mm.offload(Part.WEIGHTS)  # a partial offload keeps them
    partial = torch.cuda.memory_allocated()
    mm.offload()  # the rest: the trainer asleep, the default releases them
    torch.cuda.synchronize()
    now = torch.cuda.memory_allocated()
    assert abs(now - asleep.allocated) <= 2 * 2**20 and now < partial, (now, asleep.allocated, partial)
    assert torch.cuda.memory_reserved() <= asleep.reserved + 2 * 2**20
    report = device_report(trainer.model, trainer.optimizer, managers=[mm], measured={"cublas_workspaces": 0})
    assert report.by_holder["manager_residue"] == 0 and report.by_holder["cublas_workspaces"] == 0
    assert report.total_bytes == sum(report.by_holder.values())
    assert report.process["allocated"] == asleep.allocated
    print(report.format())
    mm.onload()
    assert mm.audit().ok
