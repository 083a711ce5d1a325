"""The copy engine's ordering rules (R1-R9 in chatlearn_mem/copy_engine.py), one test each or more,
on CPU lanes: the worker thread stands in for the stream, and a gate holding it at a chosen step
forces the interleaving a GPU would produce by timing."""

import signal
import threading

import pytest
import torch

import chatlearn_mem.copy_engine as engine_mod
from chatlearn_mem import InferenceMemoryManager, MemoryConfig, Part, Transfer, TransferError, swap
from chatlearn_mem.copy_engine import Batch, CopyEngine, Job
from chatlearn_mem.storage import StorageGroup, unique_storages

CPU = torch.device("cpu")
# 4 KiB pieces and 8 KiB buckets: every storage below moves in several steps
CFG = MemoryConfig(bucket_size_mb=8 / 1024, copy_chunk_mb=4 / 1024, check_host_memory=False)


class Gate:
    """Holds a lane before the first step whose label contains ``match`` until :meth:`open`."""

    def __init__(self, monkeypatch, match: str, lane: str = ""):
        self.match, self.lane = match, lane
        self.reached, self._open = threading.Event(), threading.Event()
        self.labels: list[str] = []
        monkeypatch.setattr(engine_mod, "_before_step", self._hook)

    def _hook(self, lane: str, label: str) -> None:
        self.labels.append(label)
        if self.lane in lane and self.match in label and not self._open.is_set():
            self.reached.set()
            assert self._open.wait(30), "gate never opened"

    def open(self) -> None:
        self._open.set()


def open_when_settling(monkeypatch, mm, gate: Gate) -> None:
    """Open ``gate`` once ``mm`` settles its transitions in flight: the held lane runs on only when
    the call under test has chosen to wait for it."""
    real = mm.state.settle

    def settle(parts=None):
        gate.open()
        real(parts)

    monkeypatch.setattr(mm.state, "settle", settle)


def storages_of(n=3, size=3000, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(size, generator=gen) for _ in range(n)]
    return tensors, unique_storages(tensors, CPU)


def bits(tensors):
    return [t.clone() for t in tensors]


def run(t):
    job = Job()
    t.engine.submit(job, [t.batch])
    return job


def test_r1_offload_copies_what_was_written_before_it(monkeypatch):
    tensors, storages = storages_of()
    for t in tensors:
        t.fill_(7.0)
    group = StorageGroup("weights", True, CFG)
    gate = Gate(monkeypatch, "copy")
    t = group.start_offload(storages)
    job = run(t)
    assert gate.reached.wait(10)
    gate.open()
    job.wait()
    t.finish()
    host = [group.read_host(x) for x in tensors]
    assert all(bool((h == 7.0).all()) for h in host)
    group.onload()


def test_r2_each_storage_released_after_its_own_copies_and_before_later_ones(monkeypatch):
    tensors, storages = storages_of()
    before = bits(tensors)
    group = StorageGroup("weights", True, CFG)
    gate = Gate(monkeypatch, "copy weights[1]")
    t = group.start_offload(storages)
    job = run(t)
    assert gate.reached.wait(10)
    # held before storage 1's first copy: storage 0 is out (its copies are done), 1 and 2 still hold their bytes
    assert storages[0].nbytes() == 0
    assert storages[1].nbytes() > 0 and storages[2].nbytes() > 0
    assert not job.done() and not t.done()
    gate.open()
    job.wait()
    stats = t.finish()
    assert [s.nbytes() for s in storages] == [0, 0, 0]
    assert stats.copied_bytes == stats.nbytes == 3 * 3000 * 4
    release0 = gate.labels.index("release weights[0]")
    assert all(lb.startswith("copy weights[0]") for lb in gate.labels[:release0])
    assert gate.labels.index("copy weights[1] 0:4096") > release0
    group.onload()
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_copies_nobody_waits_on_piecewise_are_whole_per_bucket(monkeypatch):
    """An offload and an onload without a use order copy each storage's bytes in one piece per
    host bucket, not in ``copy_chunk_mb`` pieces: nothing waits for a piece, and on a CPU device
    the 64 MiB pieces made the bench's 258 MiB weights offload 15-35% slower than one copy."""
    tensors, storages = storages_of()  # 12000 bytes each; buckets of 8 KiB, chunks of 4 KiB
    before = bits(tensors)
    group = StorageGroup("weights", True, CFG)
    labels = []
    monkeypatch.setattr(engine_mod, "_before_step", lambda lane, label: labels.append(label))
    group.offload(storages)
    offload = [lb for lb in labels if lb.startswith("copy weights[0]")]
    labels.clear()
    group.onload()
    onload = [lb for lb in labels if lb.startswith("copy weights[0]")]
    assert offload == onload == ["copy weights[0] 0:8192", "copy weights[0] 8192:12000"]
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_r3_storage_regrown_just_before_its_copies(monkeypatch):
    tensors, storages = storages_of()
    before = bits(tensors)
    group = StorageGroup("weights", True, CFG)
    group.offload(storages)
    gate = Gate(monkeypatch, "regrow weights[2]")
    t = group.start_onload()
    jobs = []
    # the regrows run on the submitting thread (R3), the copies on the lane: submit from another
    submitter = threading.Thread(target=lambda: jobs.append(run(t)))
    submitter.start()
    assert gate.reached.wait(10)
    assert storages[0].nbytes() > 0 and storages[1].nbytes() > 0 and storages[2].nbytes() == 0
    gate.open()
    submitter.join(10)
    jobs[0].wait()
    t.finish()
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    labels = gate.labels
    assert labels[0] == "regrow weights[0]"
    # each storage's copies come after its own regrow
    for i in range(3):
        first_copy = next(k for k, lb in enumerate(labels) if lb.startswith(f"copy weights[{i}] 0:"))
        assert labels.index(f"regrow weights[{i}]") < first_copy


def test_r3_regrows_run_on_the_submitting_thread_and_copies_on_the_lane(monkeypatch):
    """Memory is allocated by the thread that submits (on Linux from its malloc arena, which the
    releases give memory back to); a worker allocating from its own arena faulted in fresh pages
    on every onload."""
    tensors, storages = storages_of()
    group = StorageGroup("weights", True, CFG)
    group.offload(storages)
    where = {}
    monkeypatch.setattr(
        engine_mod,
        "_before_step",
        lambda lane, label: where.setdefault(label.split()[0], set()).add(threading.get_ident()),
    )
    group.onload()
    assert where["regrow"] == {threading.get_ident()}
    assert threading.get_ident() not in where["copy"]


def make_model(n_layers=6, width=64, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(n_layers)])


def reversed_into_one_buffer(model):
    """Lay ``model``'s parameters out in one buffer in reverse order, as megatron's DDP does: the
    first parameter at the end. Returns the model."""
    params = list(model.parameters())
    flat = torch.empty(sum(p.numel() for p in params))
    end = flat.numel()
    for p in params:
        end -= p.numel()
        view = flat[end : end + p.numel()].view_as(p)
        view.copy_(p.data)
        p.data = view
    return model


def test_r4_each_module_waits_for_its_own_weights_only(monkeypatch):
    model = make_model()
    x = torch.randn(4, 64)
    with torch.no_grad():
        expected = model(x)
    mm = InferenceMemoryManager(model, CFG)
    mm.offload()
    seen = {}  # layer index -> steps completed by the lane when that layer started

    def probe(i):
        def hook(module, args):
            seen[i] = (gt.batch.completed, gt.user_fence(mm.state.weight_user_of(module)).index)
            if i == 0:
                gate.open()  # the first layer ran with the last layer's copies held back

        return hook

    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(probe(i))  # after the manager's own pre-hook
    last = 2 * len(model) - 1  # the last layer's bias: the last storage the forward reads
    # the copy that brings it ("copy weights[10..11] slab a:b": merged with its neighbours in the slab)
    gate = Gate(monkeypatch, f"{last}] slab", lane="h2d")
    handle = mm.onload(blocking=False)
    gt = mm.state.in_flight(Part.WEIGHTS)
    with torch.no_grad():
        got = model(x)
    assert torch.equal(got, expected)
    assert set(seen) == set(range(len(model)))
    for i, (completed, fence) in seen.items():
        assert completed > fence, f"layer {i} ran before its weights arrived"
    # the first layer did not wait for the last layer's weights: the forward overlapped the copies
    assert seen[0][0] < len(gt.batch.steps)
    assert handle.wait()[0].copied_bytes == sum(p.numel() * 4 for p in model.parameters())
    assert mm.audit().ok


def test_r4_blocking_onload_has_no_use_order_and_every_user_waits_for_all(monkeypatch):
    """A blocking onload queues the weights in storage order, with no per-tensor work on the host
    (no forward can overlap it: one from another thread is refused); a transition queued without a
    use order gives every user the fence of its last step."""
    model = make_model()
    x = torch.randn(4, 64)
    with torch.no_grad():
        expected = model(x)
    mm = InferenceMemoryManager(model, CFG)
    mm.offload()
    monkeypatch.setattr(mm.state, "weight_user_ranges", lambda: pytest.fail("a blocking onload computed a use order"))
    mm.onload()
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    group = StorageGroup("weights", True, CFG)
    storages = unique_storages(model.parameters(), torch.device("cpu"))
    group.offload(storages)
    gt = group.start_onload(users=None)
    assert gt.plan.user_steps == () and len(gt.batch.steps) > 1
    assert gt.user_fence(0).index == gt.user_fence(5).index == len(gt.batch.steps) - 1
    job = Job()
    gt.engine.submit(job, [gt.batch])
    job.wait()
    gt.finish()


def test_r4_weights_queued_in_forward_order():
    model = make_model(n_layers=4)
    mm = InferenceMemoryManager(model, CFG)
    mm.offload()
    handle = mm.onload(blocking=False)
    gt = mm.state.in_flight(Part.WEIGHTS)
    fences = [gt.user_fence(u).index for u in range(len(mm.state.weight_users))]
    assert fences == sorted(fences)
    handle.wait()


def test_r4_reversed_buffer_layout_still_arrives_in_forward_order():
    """megatron's DDP lays parameters out in one buffer in reverse order (the last layer first): the
    first layer's bytes are at the end. They must still be copied first."""
    model = reversed_into_one_buffer(make_model(n_layers=6, width=64))
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected = model(x)
    mm = InferenceMemoryManager(model, MemoryConfig(bucket_size_mb=1, copy_chunk_mb=8 / 1024, check_host_memory=False))
    mm.offload()
    handle = mm.onload(blocking=False)
    gt = mm.state.in_flight(Part.WEIGHTS)
    fences = [gt.user_fence(u).index for u in range(len(model))]
    assert fences == sorted(fences) and fences[0] < fences[-1]
    layer0 = sum(p.numel() * 4 for p in model[0].parameters())
    chunk = mm.config.copy_chunk_bytes
    assert fences[0] <= -(-layer0 // chunk), "the first layer waits for later layers' bytes"
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    handle.wait()


@pytest.mark.parametrize("layout", ["storage per tensor", "one reversed buffer"])
def test_r4_a_step_ends_where_a_users_bytes_end(layout):
    """An onload in use order ends a step at the end of each user's bytes once the step holds
    ``copy_chunk_bytes // USER_STEP_DIVISOR`` (on this CPU device ``CPU_USER_STEP_DIVISOR``, the
    divisor in force here): a module waits for its own weights, not for a
    chunk's worth of the next modules' (which made the forward's first module wait for a whole
    first chunk); modules smaller than that share a step. Within the first chunk the step ends
    there once it holds ``copy_chunk_bytes // FIRST_CHUNK_STEP_DIVISOR`` (the forward has done
    next to nothing yet: the position embeddings waited for a step carrying 8 MiB of the first
    layer)."""
    from chatlearn_mem.group_transfer import CPU_USER_STEP_DIVISOR, FIRST_CHUNK_STEP_DIVISOR

    model = make_model(n_layers=24, width=64)  # 16.6 KiB of weights per layer
    if layout == "one reversed buffer":
        reversed_into_one_buffer(model)
    layer = sum(p.numel() * 4 for p in model[0].parameters())
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected = model(x)

    def fences(chunk_bytes):
        cfg = MemoryConfig(bucket_size_mb=1, copy_chunk_mb=chunk_bytes / 2**20, check_host_memory=False)
        mm = InferenceMemoryManager(model, cfg)
        mm.offload()
        handle = mm.onload(blocking=False)
        gt = mm.state.in_flight(Part.WEIGHTS)
        out = [gt.user_fence(u).index for u in range(len(model))]
        with torch.no_grad():
            assert torch.equal(model(x), expected)
        handle.wait()
        assert mm.audit().ok
        mm.close()
        return out

    # a step must hold at least a layer: one step per layer
    assert fences(CPU_USER_STEP_DIVISOR * layer) == list(range(24))
    # a chunk holds 2 * CPU_USER_STEP_DIVISOR layers: one step per layer in it; past it a step must
    # hold 2 layers before it ends (the chunk's last layer's step takes the next), so that layers
    # share steps in pairs
    own = 2 * CPU_USER_STEP_DIVISOR - 1  # layers with a step of their own (the chunk's but its last)
    assert fences(2 * layer * CPU_USER_STEP_DIVISOR) == list(range(own)) + [own + j // 2 for j in range(24 - own)]
    # in the first chunk a step must hold 2 layers too when that is the chunk's 1/64: pairs throughout
    assert fences(2 * layer * FIRST_CHUNK_STEP_DIVISOR) == [k // 2 for k in range(24)]


def test_an_onload_in_use_order_takes_coarser_steps_on_a_cpu_than_on_a_gpu():
    """Past the first chunk a CPU device's steps must hold ``chunk // CPU_USER_STEP_DIVISOR``
    before they end at a user's end (a CPU lane's thread waits for the GIL after each step), a
    GPU's ``chunk // USER_STEP_DIVISOR``: the plan's own parameter, so both are checked here."""
    from chatlearn_mem.group_transfer import CPU_USER_STEP_DIVISOR, USER_STEP_DIVISOR, onload_plan

    assert CPU_USER_STEP_DIVISOR < USER_STEP_DIVISOR
    chunk, layer, n = 64 * 2**20, 2**20, 192  # 192 users of one 1 MiB storage each (zero-filled: no store)
    sizes = (layer,) * n
    users = tuple(((u, 0, layer),) for u in range(n))

    def steps(divisor):
        plan = onload_plan(sizes, None, chunk, users, None, divisor)
        return sorted(set(plan.user_steps))

    # the first chunk's 64 users take 1 MiB steps (chunk // 64) either way; the other 128 take
    # steps of chunk // divisor: 16 of 8 MiB on a GPU, 4 of 32 MiB on a CPU
    assert len(steps(USER_STEP_DIVISOR)) == 64 + 128 // (64 // USER_STEP_DIVISOR)
    assert len(steps(CPU_USER_STEP_DIVISOR)) == 64 + 128 // (64 // CPU_USER_STEP_DIVISOR)


def test_r5_offload_waits_for_host_store_readers(monkeypatch):
    tensors, storages = storages_of()
    group = StorageGroup("weights", True, CFG)
    group.offload(storages)
    group.onload()
    tensors[0].fill_(3.0)  # the host copy is stale: the next offload copies
    waiting = threading.Event()
    real_wait = group.wait_for_readers
    readers_after_wait, readers_at_steps = [], []

    def wait_for_readers():
        waiting.set()
        real_wait()
        readers_after_wait.append(group.readers)

    monkeypatch.setattr(group, "wait_for_readers", wait_for_readers)
    monkeypatch.setattr(engine_mod, "_before_step", lambda lane, label: readers_at_steps.append(group.readers))
    with group.reading():
        th = threading.Thread(target=lambda: group.offload(storages, token=None))
        th.start()
        assert waiting.wait(10)  # the offload reached the readers' wait while this reader holds the store
        assert storages[0].nbytes() > 0, "an offload overwrote the host store while a reader held it"
    th.join(10)
    assert readers_after_wait and set(readers_after_wait) == {0}, "the offload went on while a reader held the store"
    assert readers_at_steps and set(readers_at_steps) == {0}
    assert storages[0].nbytes() == 0
    assert bool((group.read_host(tensors[0]) == 3.0).all())
    group.onload()


def test_r5_host_reads_wait_for_a_pending_offload(monkeypatch):
    model = make_model(n_layers=2)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    mm = InferenceMemoryManager(model, CFG)
    gate = Gate(monkeypatch, "release weights[1]")
    handle = mm.offload(blocking=False)
    assert gate.reached.wait(10)
    open_when_settling(monkeypatch, mm, gate)
    got = mm.weights_state_dict()  # reads the host copy: must wait for the copies
    assert handle.done()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    mm.onload()


def test_r6_onload_waits_for_the_offload_of_the_same_part(monkeypatch):
    model = make_model(n_layers=3)
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected = model(x)
    mm = InferenceMemoryManager(model, CFG)
    gate = Gate(monkeypatch, "copy weights[2]")
    first = mm.offload(blocking=False)
    assert gate.reached.wait(10)
    open_when_settling(monkeypatch, mm, gate)
    mm.onload()  # settles the offload first: never regrows a storage whose release is pending
    assert first.done()
    assert gate.labels.index("release weights[5]") < gate.labels.index("regrow weights[0]")
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_r7_close_waits_for_a_transfer_in_flight(monkeypatch):
    model = make_model(n_layers=2)
    mm = InferenceMemoryManager(model, CFG)
    mm.offload()
    gate = Gate(monkeypatch, "copy weights[2")  # the second layer's weight (its bias may share the copy)
    handle = mm.onload(blocking=False)
    assert gate.reached.wait(10)
    open_when_settling(monkeypatch, mm, gate)
    mm.close()  # waits: the host store is freed only after every copy from it
    assert handle.done() and mm.state.group(Part.WEIGHTS).store is None
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())


def two_models():
    a, b = make_model(n_layers=4, width=64, seed=1), make_model(n_layers=3, width=64, seed=2)
    return a, b


def resident(model):
    return sum(s.nbytes() for s in unique_storages(list(model.parameters()) + list(model.buffers()), CPU))


@pytest.mark.parametrize("headroom", [0, 20000])
def test_r8_swap_never_holds_both_models(monkeypatch, headroom):
    a, b = two_models()
    x = torch.randn(3, 64)
    with torch.no_grad():
        ya, yb = a(x), b(x)
    ma, mb = InferenceMemoryManager(a, CFG), InferenceMemoryManager(b, CFG)
    full_a, full_b = resident(a), resident(b)
    mb.offload()
    peaks = []
    monkeypatch.setattr(engine_mod, "_before_step", lambda lane, label: peaks.append(resident(a) + resident(b)))
    stats = swap(out=ma, into=mb, headroom_bytes=headroom)
    assert [s.direction for s in stats] == ["offload", "onload"]
    assert resident(a) == 0 and resident(b) == full_b
    assert max(peaks) <= max(full_a, full_b) + headroom
    with torch.no_grad():
        assert torch.equal(b(x), yb)
    swap(out=mb, into=ma)
    with torch.no_grad():
        assert torch.equal(a(x), ya)
    mb.onload()


def test_r8_swap_overlaps_the_two_directions(monkeypatch):
    a, b = two_models()
    ma, mb = InferenceMemoryManager(a, CFG), InferenceMemoryManager(b, CFG)
    mb.offload()
    lanes = []
    h2d_ran = threading.Event()

    def hook(lane, label):
        lanes.append(lane)
        if lane == "cpu-h2d":
            h2d_ran.set()
        elif label.startswith("release"):  # hold the outgoing lane's releases until an h2d step ran
            assert h2d_ran.wait(30), "no h2d step ran while the d2h lane was held"

    monkeypatch.setattr(engine_mod, "_before_step", hook)
    swap(out=ma, into=mb, headroom_bytes=10**9)
    # the two workers interleave: an h2d step ran before the last d2h step
    first_h2d = lanes.index("cpu-h2d")
    assert "cpu-d2h" in lanes[first_h2d:]
    ma.onload()


def test_r9_failed_offload_copy_rolls_back_to_resident(monkeypatch):
    tensors, storages = storages_of()
    before = bits(tensors)
    group = StorageGroup("weights", True, CFG)

    def fail(lane, label):
        if label.startswith("copy weights[2] 0:"):  # the last storage's first copy
            raise RuntimeError("simulated copy failure")

    monkeypatch.setattr(engine_mod, "_before_step", fail)
    with pytest.raises(RuntimeError, match="simulated copy failure") as err:
        group.offload(storages)
    assert "rolled back" in "".join(getattr(err.value, "__notes__", []))
    assert not group.offloaded and group.transfer is None
    assert all(s.nbytes() > 0 for s in storages)
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))
    monkeypatch.setattr(engine_mod, "_before_step", lambda lane, label: None)
    group.offload(storages)  # usable afterwards, and the stale host token did not skip the copy
    group.onload()
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_r9_failed_onload_copy_rolls_back_to_offloaded(monkeypatch):
    tensors, storages = storages_of()
    before = bits(tensors)
    group = StorageGroup("weights", True, CFG)
    group.offload(storages)

    def fail(lane, label):
        if label.startswith("copy weights[1] 4096:"):  # the second of that storage's two copies
            raise RuntimeError("simulated copy failure")

    monkeypatch.setattr(engine_mod, "_before_step", fail)
    with pytest.raises(RuntimeError, match="simulated copy failure"):
        group.onload()
    assert group.offloaded and all(s.nbytes() == 0 for s in storages)
    monkeypatch.setattr(engine_mod, "_before_step", lambda lane, label: None)
    group.onload()
    assert all(torch.equal(a, b) for a, b in zip(tensors, before))


def test_r9_fences_of_failed_and_skipped_steps_raise(monkeypatch):
    done = []
    b = Batch("h2d", "onload test")
    b.add(lambda: done.append(0), "a")
    b.add(lambda: (_ for _ in ()).throw(RuntimeError("boom")), "b")
    b.add(lambda: done.append(2), "c")
    job = Job()
    CopyEngine.for_device(CPU).submit(job, [b])
    assert job.wait(10)
    assert done == [0]
    assert b.fence(0).wait() and b.fence(0).ok()
    for i in (1, 2):
        with pytest.raises(TransferError, match="failed at step 'b'"):
            b.fence(i).wait()


# -- the handle -------------------------------------------------------------------------------------------
def test_wait_twice_returns_the_same_stats_and_done_never_blocks(monkeypatch):
    model = make_model(n_layers=2)
    mm = InferenceMemoryManager(model, CFG)
    gate = Gate(monkeypatch, "release")
    handle = mm.offload(blocking=False)
    assert isinstance(handle, Transfer)
    assert gate.reached.wait(10)
    assert not handle.done()
    with pytest.raises(RuntimeError, match="still running: call wait"):
        handle.stats
    with pytest.raises(TimeoutError):
        handle.wait(timeout=0.05)
    gate.open()
    first = handle.wait()
    assert handle.wait() == first == handle.stats
    assert handle.done() and "settled" in repr(handle)
    mm.onload()


def test_dropped_handle_is_settled_by_the_next_call():
    model = make_model(n_layers=2)
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected = model(x)
    mm = InferenceMemoryManager(model, CFG)
    mm.offload(blocking=False)  # dropped
    assert mm.is_offloaded("weights")
    mm.onload(blocking=False)  # dropped too; the forward waits for what it reads
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert mm.residency().device_bytes == resident(model) > 0


def test_failed_unwaited_transfer_raises_once_on_the_next_call(monkeypatch):
    model = make_model(n_layers=2)
    mm = InferenceMemoryManager(model, CFG)
    mm.offload()

    def fail(lane, label):
        if label.startswith("copy weights[1]"):
            raise RuntimeError("simulated copy failure")

    monkeypatch.setattr(engine_mod, "_before_step", fail)
    mm.onload(blocking=False)  # dropped: nobody waits
    with pytest.raises(RuntimeError, match="simulated copy failure"):
        mm.residency()
    # once raised, the rolled-back state is what the manager reports
    assert mm.is_offloaded("weights")
    monkeypatch.setattr(engine_mod, "_before_step", lambda lane, label: None)
    mm.onload()
    assert mm.audit().ok


def test_forward_during_a_failing_onload_raises_transfer_error(monkeypatch):
    model = make_model(n_layers=3)
    mm = InferenceMemoryManager(model, CFG)
    mm.offload()

    def fail(lane, label):
        if label.startswith("copy weights[2]"):
            raise RuntimeError("simulated copy failure")

    monkeypatch.setattr(engine_mod, "_before_step", fail)
    handle = mm.onload(blocking=False)
    with pytest.raises(TransferError, match="failed at step 'copy weights\\[2\\]"):
        with torch.no_grad():
            model(torch.randn(2, 64))
    with pytest.raises(RuntimeError, match="simulated copy failure"):
        handle.wait()
    with pytest.raises(RuntimeError, match="simulated copy failure"):
        handle.wait()  # again: the same error
    assert mm.is_offloaded("weights")
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    monkeypatch.setattr(engine_mod, "_before_step", lambda lane, label: None)
    mm.onload()


def test_ctrl_c_while_waiting_interrupts_the_wait_not_the_copies(monkeypatch):
    model = make_model(n_layers=2)
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected = model(x)
    mm = InferenceMemoryManager(model, CFG)
    mm.offload()
    gate = Gate(monkeypatch, "copy weights[2]")
    handle = mm.onload(blocking=False)
    assert gate.reached.wait(10)
    main = threading.main_thread().ident
    # Ctrl-C as Python's own handler raises it, sent until it lands, later ones dropped: a process
    # started in the background of a non-interactive shell (a CI stream, `cmd &`) has SIGINT
    # ignored, and there the single SIGINT this test sent never raised
    landed = threading.Event()

    def on_ctrl_c(signum, frame):
        if not landed.is_set():
            landed.set()
            raise KeyboardInterrupt

    def ctrl_c():
        while not landed.wait(0.1):
            signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, on_ctrl_c)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    sender = threading.Thread(target=ctrl_c, daemon=True)
    try:
        with pytest.raises(KeyboardInterrupt):  # the interrupt lands inside this block, whenever it comes
            sender.start()
            handle.wait()  # the gate holds the lane: this waits until interrupted
    finally:
        landed.set()
        sender.join()
        signal.signal(signal.SIGINT, previous)
    assert not handle.done()
    gate.open()
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert handle.wait()[0].direction == "onload"
    assert mm.audit().ok


def test_ctrl_c_during_submission_rolls_back_and_reraises(monkeypatch):
    model = make_model(n_layers=2)
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected = model(x)
    mm = InferenceMemoryManager(model, CFG)
    real = CopyEngine.submit

    def interrupted(self, job, batches):
        raise KeyboardInterrupt

    monkeypatch.setattr(CopyEngine, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mm.offload()
    monkeypatch.setattr(CopyEngine, "submit", real)
    assert not mm.is_offloaded("weights") and not mm.state.any_in_flight()
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    mm.offload()
    mm.onload()
    assert mm.audit().ok


def test_swap_refuses_bad_arguments():
    a, b = two_models()
    ma = InferenceMemoryManager(a, CFG)
    with pytest.raises(ValueError, match="two different managers"):
        swap(out=ma, into=ma)
    mb = InferenceMemoryManager(b, CFG)
    with pytest.raises(ValueError, match="headroom_bytes must be >= 0"):
        swap(out=ma, into=mb, headroom_bytes=-1)


def test_a_cpu_lane_copies_with_the_intra_op_threads_of_the_thread_that_submitted():
    """A CPU lane's worker runs each batch with as many intra-op threads as its submitter had: a
    caller that keeps one core for its compute gets a lane on one core, not on every core (torch's
    setting is per thread once a thread has used it, so the worker keeps whatever it started with
    otherwise). The caller's own setting is left as it was."""
    engine = CopyEngine.for_device(CPU)
    seen = []

    def submit_from_a_thread_with(threads: int) -> None:
        def body():
            torch.set_num_threads(threads)
            batch = Batch("h2d", "probe")
            batch.add(lambda: seen.append(torch.get_num_threads()))
            job = Job()
            engine.submit(job, [batch])
            assert job.wait(30) and job.error is None
            seen.append(("caller", torch.get_num_threads()))

        t = threading.Thread(target=body)
        t.start()
        t.join()

    main = torch.get_num_threads()
    for n in (1, 3, 1):
        submit_from_a_thread_with(n)
    assert seen == [1, ("caller", 1), 3, ("caller", 3), 1, ("caller", 1)]
    assert torch.get_num_threads() == main


def test_an_idle_cpu_lane_starts_the_first_step_before_the_rest_is_submitted(monkeypatch):
    """The submitting thread holds the interpreter lock through its regrows (torch's storage calls
    do not release it), so a worker woken for the first step used to start only once the whole
    submission had run: on the bench's trainer 1.4 ms before the first byte moved. The submitter
    now waits for an idle worker to take its first step; later steps go on without waiting.
    Without the hand-off (``HANDOFF_S = 0``) the first step has not started when the second is
    submitted (the worker waits for the lock), unless the interpreter's switch interval passes."""
    monkeypatch.setattr(engine_mod, "HANDOFF_S", 30.0)  # however loaded the machine
    engine = CopyEngine(CPU)  # lanes of its own, idle
    started = threading.Event()
    seen = []
    batch = Batch("h2d", "probe")
    batch.add(started.set, "copy first")
    batch.add(lambda: seen.append(started.is_set()), "regrow second", on_caller_stream=True, new_step=True)
    batch.add(lambda: seen.append(started.is_set()), "regrow third", on_caller_stream=True, new_step=True)
    job = Job()
    engine.submit(job, [batch])
    assert job.wait(30) and job.error is None
    assert started.is_set()
    assert seen == [True, True]
