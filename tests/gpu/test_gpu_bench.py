"""On a GPU: the benchmark's CUDA columns are what they say. The release bound gives its device
buffer back to the driver (not to torch's cache); fresh_host_alloc pins new memory on every offload
and frees it after the onload, never touching torch's pinned cache; the ceiling pins once.
Skipped without CUDA (conftest); the same logic runs on CPU with the pinning stubbed in
tests/megatron/test_benchmarks.py."""

import torch
from trainer_runs import BATCH

from chatlearn_mem import MemoryConfig, TrainerMemoryManager
from chatlearn_mem.models import gpt

CFG = gpt.GPTTrainerConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32000, seq_length=128)
MiB = 2**20


def _host_cache_bytes() -> int:
    stats = getattr(torch.cuda.memory, "host_memory_stats", None)
    return int(stats().get("allocated_bytes.current", 0)) if stats else 0


def test_release_bound_frees_for_real_and_fresh_host_alloc_pins_anew(dist1):
    from chatlearn_mem_bench.alternatives import FreshHostAlloc
    from chatlearn_mem_bench.methods import CeilingMethod, ReleaseBound, logical_tensors

    trainer = gpt.build_gpt_trainer(CFG)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(skip_unchanged_weights=False))
    trainer.train_step(gpt.synthetic_batch(CFG, 0, batch_size=BATCH))
    try:
        ceiling = CeilingMethod(mm, trainer, pin=True)
        ceiling.prepare(device_bytes=64 * MiB, host_bytes=64 * MiB)
        ceiling.use(64 * MiB)
        assert ceiling.host.is_pinned() and not ceiling.pays_empty_cache
        bound = ReleaseBound(mm, trainer, pin=True, ceiling=ceiling)
        torch.cuda.empty_cache()  # no cached block the bound's buffer could be carved from
        bound.prepare(64 * MiB)
        reserved = torch.cuda.memory_reserved()
        assert bound.offload("weights") == 64 * MiB and bound.pays_empty_cache
        assert torch.cuda.memory_reserved() <= reserved - 64 * MiB  # back to the driver
        assert bound.onload("weights") == 64 * MiB and bool((bound._dev == 1).all())
        bound.release()
        ceiling.release()

        fresh = FreshHostAlloc(mm, trainer, pin=True)
        states = logical_tensors(mm, trainer, "optimizer_states")
        before = [t.detach().clone() for t in states]
        cached = _host_cache_bytes()
        for _ in range(2):
            n = fresh.offload("optimizer_states")
            assert fresh.host_bytes() == (n, n) and n > 0
            assert all(store.buckets[0].is_pinned() for _, size, store in fresh._state if size)
            fresh.onload("optimizer_states")
            assert fresh.host_bytes() == (0, 0)
        assert _host_cache_bytes() == cached  # torch's caching pinned allocator never used
        assert all(a.equal(b) for a, b in zip(before, states)) and mm.audit().ok
    finally:
        mm.close()


def test_megatron_builtin_full_cycle_hands_the_manager_back_its_storages(dist1):
    """megatron's MegatronOptimizer.offload_to_cpu / restore_from_cpu bring main weights and states
    back as new device tensors. The benchmark's restore copies them into the manager's storages:
    before, the manager's later full offloads left 7.3 GB of 18.4 GB allocated on an H200."""
    from chatlearn_mem_bench.alternatives import MegatronBuiltin
    from chatlearn_mem_bench.config import FULL
    from chatlearn_mem_bench.methods import logical_tensors

    trainer = gpt.build_gpt_trainer(CFG)
    trainer.train_step(gpt.synthetic_batch(CFG, 0, batch_size=BATCH))
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(skip_unchanged_weights=False))
    try:
        method = MegatronBuiltin(mm, trainer, pin=True)
        parts = ("main_weights", "optimizer_states")
        before = {p: [t.detach().cpu() for t in logical_tensors(mm, trainer, p)] for p in parts}
        method.offload(FULL)
        method.onload(FULL)
        method.restore(FULL)
        assert mm.audit().ok, mm.audit()
        for p in parts:
            assert all(a.equal(b.cpu()) for a, b in zip(before[p], logical_tensors(mm, trainer, p)))
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        managed = mm.residency().device_bytes
        mm.offload()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= allocated - managed + 8 * MiB  # all of it released
        mm.onload()
    finally:
        mm.close()
