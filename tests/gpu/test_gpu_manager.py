"""On a GPU: exactness with NCCL, two trainers sharing the device, a device OOM during onload, the
Transformer Engine layer spec. Skipped with the reason where CUDA is not available (conftest)."""

import gc

import pytest
import torch
from trainer_runs import (
    BATCH,
    NON_BLOCKING,
    NON_BLOCKING_GPU,
    TRANSITIONS,
    assert_exact,
    bit_equal,
    full_cycle,
    snapshot,
    train,
)

from chatlearn_mem import MemoryConfig, Part, TrainerMemoryManager, device_report, swap
from chatlearn_mem.device_memory import parks_cpu_memory
from chatlearn_mem.models import gpt

# Large enough that every DDP buffer and most optimizer tensors get their own allocator segments
# (about 1.5 GB of managed state: 83 M parameters), small enough to build in seconds.
CFG = gpt.GPTTrainerConfig(num_layers=4, hidden_size=1024, num_attention_heads=16, vocab_size=32000, seq_length=128)
STEPS = 4


def _batch(cfg, step):
    return gpt.synthetic_batch(cfg, step, batch_size=BATCH)


def _host(tensors):
    return [t.cpu() for t in tensors]


@pytest.mark.parametrize("transitions", list(TRANSITIONS))
def test_full_cycles_are_exact_with_nccl(dist1, transitions):
    assert torch.distributed.get_backend() == "nccl"
    between, config = TRANSITIONS[transitions]
    config = NON_BLOCKING_GPU if config is NON_BLOCKING else config  # pieces sized for this model
    losses, _, mm, trainer = assert_exact(CFG, STEPS, between, config=config)
    assert mm.device.type == "cuda" and next(trainer.model.parameters()).is_cuda
    assert mm.audit().ok


def test_policy_and_critic_share_the_gpu_each_asleep_while_the_other_trains(dist1):
    pcfg, ccfg = CFG, CFG.model_copy(update={"seed": 4321, "lr": 5e-3})

    def alone(cfg, value_head):
        trainer = gpt.build_gpt_trainer(cfg, value_head=value_head)
        losses = [trainer.train_step(_batch(cfg, s)) for s in range(3)]
        return losses, _host(snapshot(trainer))  # on the host: the peak below counts device bytes

    base_p, base_c = alone(pcfg, False), alone(ccfg, True)
    gc.collect()
    torch.cuda.empty_cache()
    policy, critic = gpt.build_gpt_trainer(pcfg), gpt.build_gpt_trainer(ccfg, value_head=True)
    mp = TrainerMemoryManager(policy.model, policy.optimizer)
    mc = TrainerMemoryManager(critic.model, critic.optimizer)
    mc.offload()
    torch.cuda.reset_peak_memory_stats()
    lp, lc = [], []
    for step in range(3):
        if step:
            mp.onload()
        lp.append(policy.train_step(_batch(pcfg, step)))
        assert mc.residency().device_bytes == 0
        mp.offload()
        mc.onload()
        lc.append(critic.train_step(_batch(ccfg, step)))
        assert mp.residency().device_bytes == 0
        mc.offload()
    peak = torch.cuda.max_memory_allocated()
    mp.onload()
    mc.onload()
    managed = mp.residency().device_bytes + mc.residency().device_bytes
    assert (lp, lc) == (base_p[0], base_c[0])
    assert bit_equal(_host(snapshot(policy)), base_p[1]) and bit_equal(_host(snapshot(critic)), base_c[1])
    assert mp.audit().ok and mc.audit().ok
    # One trainer resident at a time: the peak is one trainer plus its activations and optimizer
    # temporaries, less than the two trainers' state together.
    assert peak < managed, f"peak {peak} bytes; the two trainers' state together is {managed}"


def _allocate_blocker(leave: int) -> torch.Tensor:
    """Take all free device memory but ``leave`` bytes (less when the driver refuses that much)."""
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    size = free - leave
    while size > 0:
        try:
            return torch.empty(size, dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            size -= 256 * 2**20
    raise AssertionError(f"could not allocate a blocker leaving {leave} of {free} free bytes")


def test_device_oom_during_onload_leaves_the_trainer_usable_and_exact(dist1):
    base = train(CFG, steps=STEPS)
    trainer = gpt.build_gpt_trainer(CFG)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    losses = [trainer.train_step(_batch(CFG, s)) for s in range(2)]
    weights = mm.residency().by_category[Part.WEIGHTS]
    mm.offload()
    # Room for the weights and a little more: main weights, states and grads cannot follow.
    blocker = _allocate_blocker(leave=weights + 64 * 2**20)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        mm.onload()
    offloaded = [p for p in mm.parts if mm.is_offloaded(p)]
    assert offloaded, "the onload did not fail"
    assert mm.audit().ok  # every part is either whole on the device or whole on the host
    del blocker
    torch.cuda.empty_cache()
    mm.onload()
    assert mm.audit().ok
    losses += [trainer.train_step(_batch(CFG, s)) for s in range(2, STEPS)]
    assert losses == base[0]
    assert bit_equal(snapshot(trainer), base[1])


def test_transformer_engine_layer_spec_is_exact_under_cycles(dist1):
    pytest.importorskip(
        "transformer_engine",
        reason="Transformer Engine is not installed here "
        "(pip install transformer-engine[pytorch]); megatron-core's TE layer spec untested",
    )
    cfg = gpt.GPTTrainerConfig(
        num_layers=2,
        hidden_size=256,
        num_attention_heads=4,
        vocab_size=1024,
        seq_length=64,
        layer_spec="transformer_engine",
    )
    _, _, mm, trainer = assert_exact(cfg, 3, full_cycle)
    assert any("transformer_engine" in type(m).__module__ for m in trainer.model.modules())
    assert mm.audit().ok
    mm.offload()
    report = device_report(trainer.model, trainer.optimizer, managers=[mm])
    assert report.by_holder["manager_residue"] == 0, report.format()
    assert "transformer_engine" in report.by_holder
    mm.onload()
    assert mm.audit().ok


def test_host_store_is_pinned(dist1):
    _, _, mm, _ = train(CFG, steps=1)
    assert mm.config.resolved_pin_memory()
    mm.offload()
    buckets = [b for g in mm.state.groups().values() if g.store is not None for b in g.store.buckets]
    assert buckets and all(b.is_pinned() for b in buckets)
    assert sum(b.numel() for b in buckets) == mm.residency().host_bytes
    mm.onload()
    assert mm.audit().ok


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_pinned_host_store_has_its_exact_size_and_goes_back_to_the_os_on_drop(dist1):
    """The store is page-locked with cudaHostRegister at its exact size (torch's pinned allocator
    would round 384 MiB up to 512 MiB and keep it cached after it is freed)."""
    _, _, mm, _ = train(CFG, steps=1, config=MemoryConfig(bucket_size_mb=384))
    cached_before = torch.cuda.memory.host_memory_stats().get("reserved_bytes.current", 0)
    rss0 = _rss()
    mm.offload()
    stores = [g.store for g in mm.state.groups().values() if g.store is not None]
    buckets = [b for st in stores for b in st.buckets]
    assert buckets and all(b.is_pinned() for b in buckets)
    host = sum(b.numel() for b in buckets)
    assert host == sum(st.planned_nbytes(list(st.sizes), mm.config.bucket_size_bytes) for st in stores)
    assert torch.cuda.memory.host_memory_stats().get("reserved_bytes.current", 0) == cached_before
    assert _rss() - rss0 >= 0.9 * host
    mm.onload()
    for g in mm.state.groups().values():
        g.drop_host_store()
    del stores, buckets
    assert _rss() - rss0 < 0.1 * host, "the pinned host store was not returned to the OS"
    assert mm.audit().ok


def test_forward_overlaps_the_weights_onload(dist1):
    """onload(WEIGHTS, blocking=False) then a forward: each module waits for its own weights on the
    stream, the host never blocks; the output is the same bits. The time is reported, the bench's
    onload_then_forward row is what checks it."""
    trainer = gpt.build_gpt_trainer(CFG)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer, MemoryConfig(copy_chunk_mb=8))
    batch = _batch(CFG, 0)
    with torch.no_grad():
        expected = trainer.loss(batch)
    mm.offload(Part.WEIGHTS)
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    handle = mm.onload(Part.WEIGHTS, blocking=False)
    with torch.no_grad():
        got = trainer.loss(batch)
    end.record()
    handle.wait()
    torch.cuda.synchronize()
    assert torch.equal(got, expected)
    print(f"onload + forward: {start.elapsed_time(end):.2f} ms")
    assert mm.audit().ok


def test_swap_moves_both_directions_and_stays_exact(dist1):
    a = gpt.build_gpt_trainer(CFG)
    b = gpt.build_gpt_trainer(CFG.model_copy(update={"seed": 99}))
    ma, mb = TrainerMemoryManager(a.model, a.optimizer), TrainerMemoryManager(b.model, b.optimizer)
    la = [a.train_step(_batch(CFG, 0))]
    mb.offload()
    sa = snapshot(a)
    torch.cuda.synchronize()
    stats = swap(out=ma, into=mb)
    assert [s.direction for s in stats] == ["offload"] * 4 + ["onload"] * 4
    assert ma.residency().device_bytes == 0
    b.train_step(_batch(CFG, 0))
    swap(out=mb, into=ma)
    assert bit_equal(snapshot(a), sa)
    la.append(a.train_step(_batch(CFG, 1)))
    assert ma.audit().ok and mb.audit().ok


def test_megatron_optimizer_offload_then_restore_is_refused_and_a_new_manager_takes_the_tensors(dist1):
    """megatron's own optimizer offload and restore, for real: restore_from_cpu() brings main
    weights and states back as new device tensors, which the manager did not notice (audit ok; its
    offload then freed its stale storages and left the live ones). It now refuses, and a new manager
    takes them and releases them."""
    from chatlearn_mem import ExternalChangeError

    trainer = gpt.build_gpt_trainer(CFG)
    trainer.train_step(_batch(CFG, 0))
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    trainer.optimizer.offload_to_cpu()
    with pytest.raises(ExternalChangeError, match="now live elsewhere"):
        mm.offload()
    trainer.optimizer.restore_from_cpu()
    with pytest.raises(ExternalChangeError, match="use new memory the manager does not manage"):
        mm.offload()
    assert not mm.audit().ok
    mm.close()
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    try:
        torch.cuda.synchronize()
        allocated, managed = torch.cuda.memory_allocated(), mm.residency().device_bytes
        mm.offload()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() <= allocated - managed + 8 * 2**20
        mm.onload()
        assert mm.audit().ok, mm.audit()
        trainer.train_step(_batch(CFG, 1))
    finally:
        mm.close()


# a DeviceSlab's pieces are put in place by UntypedStorage._swap_data_ptr_ (torch 2.13 has it, the
# 2.11 of a GPU machine does not); the manager refuses cuda_contiguous where it is missing
needs_device_slab = pytest.mark.skipif(
    not parks_cpu_memory(),
    reason=f"this torch ({torch.__version__}) has no UntypedStorage._swap_data_ptr_: no DeviceSlab (cuda_contiguous)",
)


@needs_device_slab
@pytest.mark.parametrize("transitions", list(TRANSITIONS))
def test_a_device_slab_is_exact_gives_its_memory_back_and_merges_the_copies(dist1, transitions):
    """``cuda_contiguous``: main weights and optimizer states in a DeviceSlab's segments. Bit-exact
    under cycles, the memory goes back to the allocator with the offload, and the copies of a
    step merge (a release per storage is left, not a copy per storage)."""
    from chatlearn_mem.device_memory import DeviceSlab

    between, config = TRANSITIONS[transitions]
    config = (NON_BLOCKING_GPU if config is NON_BLOCKING else MemoryConfig()).model_copy(
        update={"cuda_contiguous": True}
    )
    _, _, mm, trainer = assert_exact(CFG, STEPS, between, config=config)
    groups = {part: mm.state.group(part) for part in (Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES)}
    assert all(isinstance(g.slab, DeviceSlab) and g.slab.allocated for g in groups.values())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    stats = {s.group: s for s in mm.offload([Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES])}
    torch.cuda.synchronize()
    freed = before - torch.cuda.memory_allocated()
    released = sum(s.nbytes for s in stats.values())
    assert freed >= released, (freed, released)
    for part, g in groups.items():
        n = len(g.released)
        s = stats[part.value]
        print(f"{part}: {n} storages, {s.steps} steps, {s.actions} actions, host {s.host_seconds * 1e3:.2f} ms")
        assert g.slab.allocated == 0 and s.actions < 1.5 * n, (s.actions, n)
    mm.onload([Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES])
    assert mm.audit().ok
    storages = [s for part in groups for s in mm.state.storages(part) if s.nbytes()]
    assert not any(s.resizable() for s in storages)  # pieces of the segments
    state = snapshot(trainer)
    mm.close()  # the storages leave the slab: resizable again, the same bytes
    assert all(s.resizable() for s in storages), "a storage still in a segment after close()"
    assert bit_equal(snapshot(trainer), state)


@needs_device_slab
def test_swap_through_device_slabs_stays_exact(dist1):
    from chatlearn_mem.device_memory import DeviceSlab

    config = MemoryConfig(cuda_contiguous=True)
    a = gpt.build_gpt_trainer(CFG)
    b = gpt.build_gpt_trainer(CFG.model_copy(update={"seed": 99}))
    ma, mb = TrainerMemoryManager(a.model, a.optimizer, config), TrainerMemoryManager(b.model, b.optimizer, config)
    for _ in range(2):  # the first cycle lays the storages out in their slabs
        ma.offload()
        ma.onload()
    assert all(isinstance(ma.state.group(p).slab, DeviceSlab) for p in (Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES))
    a.train_step(_batch(CFG, 0))
    mb.offload()
    mb.onload()
    mb.offload()
    sa = snapshot(a)
    swap(out=ma, into=mb)
    assert ma.residency().device_bytes == 0
    b.train_step(_batch(CFG, 0))
    swap(out=mb, into=ma)
    assert bit_equal(snapshot(a), sa)
    a.train_step(_batch(CFG, 1))
    assert ma.audit().ok and mb.audit().ok
