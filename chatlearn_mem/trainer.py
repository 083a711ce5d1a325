"""Offload and onload of a trainer: weights, grads, fp32 main weights, optimizer state.

The manager knows no framework: what the trainer's parts are made of, which aliases the audit
checks and which calls are guarded it asks the trainer's backend (:mod:`chatlearn_mem.backend`:
megatron-core in :mod:`chatlearn_mem.mcore`, plain PyTorch in :mod:`chatlearn_mem.torchnative`).
"""

from __future__ import annotations

from typing import Any, Hashable, Iterable, Optional

import torch

from chatlearn_mem import guards
from chatlearn_mem.audit import AuditReport
from chatlearn_mem.backend import SUPPORTED_TRAINERS, TrainerBackend, is_megatron_chunk, unsupported_wrapper
from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.device_memory import parks_cpu_memory
from chatlearn_mem.errors import ChatlearnMemError, OffloadedError, UnsupportedLayoutError
from chatlearn_mem.guards import serialized
from chatlearn_mem.manager import MemoryManagerBase
from chatlearn_mem.parts import OTHER, Part, PartsArg
from chatlearn_mem.residency import Residency, measure

__all__ = ["TrainerMemoryManager", "trainer_backend"]


def trainer_backend(model: Any, optimizer: Any) -> TrainerBackend:
    """The backend for ``(model, optimizer)``, chosen by the model's type: megatron-core's DDP
    chunks (:mod:`chatlearn_mem.mcore`), any other ``nn.Module`` (:mod:`chatlearn_mem.torchnative`).

    Raises:
        UnsupportedLayoutError: A wrapper the manager does not support (FSDP1, a DeepSpeed engine),
            or a megatron-core outside the supported range.
        TypeError: ``model`` is none of the supported kinds (the message lists them).
    """
    unsupported_wrapper(model)
    first = model[0] if isinstance(model, (list, tuple)) and model else model
    if isinstance(model, (list, tuple)) or is_megatron_chunk(first):
        from chatlearn_mem.mcore.backend import MegatronTrainer

        return MegatronTrainer(model, optimizer)
    if isinstance(model, torch.nn.Module):
        from chatlearn_mem.torchnative.backend import TorchTrainer

        return TorchTrainer(model, optimizer)
    raise TypeError(
        f"model is a {type(model).__name__}, not a model the trainer manager supports. Supported: {SUPPORTED_TRAINERS}"
    )


class TrainerMemoryManager(MemoryManagerBase):
    """Puts a trainer to sleep and wakes it up, bit-exactly: megatron-core, or plain PyTorch.

    The manager never replaces a tensor. It frees a part by resizing the part's storages to 0
    bytes (after copying them into a bucketed host store when their contents must survive) and
    restores it by growing the same storages back and copying the bytes in. Every alias the
    framework built therefore survives untouched, and :meth:`audit` proves it: megatron's
    ``param.data`` and ``main_grad`` views into the DDP buffers, bucket views, cached shards, the
    distributed optimizer's shard groups and the grad-accumulator hooks; torch DDP's gradient
    bucket views and hooked accumulators, ``ZeroRedundancyOptimizer``'s bucket views and
    partition, FSDP2's sharded parameters; the optimizers' ``param_groups`` and ``state`` keys.

    Parts (megatron-core; plain PyTorch in ``docs/torch-native.md``):
        weights: every DDP param buffer, parameters outside the buffers (frozen ones) and module
            buffers on the device. Copied to the host.
        grads: the DDP grad buffers (and a param buffer sharing their storage, and the separate
            fp32 ``main_grad`` s of fp32 local accumulation, megatron-core 0.17+). Dropped, never
            copied; rebuilt zeroed. Dropping them also drops the ``.grad`` tensors derived from
            them and the activation the pipeline schedule left on each chunk (its last micro
            batch's input from the previous stage, reset before every forward).
        main_weights: the optimizers' fp32 main weights. Copied to the host.
        optimizer_states: the torch optimizers' state tensors (Adam ``exp_avg`` ...). Copied.

    Unchanged parts are not copied again: a part's host copy stays current until an optimizer
    step runs or one of its tensors is written in place (PyTorch's per-tensor version counter),
    so offloading again after a forward-only phase only releases memory. Writes through
    ``param.data`` are invisible to the version counter: call :meth:`mark_weights_dirty`.

    Args:
        model: A megatron ``DistributedDataParallel`` chunk or a list of them (virtual pipeline);
            or a torch ``nn.Module``: plain, in ``torch.nn.parallel.DistributedDataParallel``, or
            sharded by FSDP2's ``fully_shard``.
        optimizer: What ``megatron.core.optimizer.get_megatron_optimizer`` returned, for a
            megatron model; a ``torch.optim.Optimizer`` or a ``ZeroRedundancyOptimizer`` for a
            torch one.
        config: Host store settings; defaults to ``MemoryConfig()``.

    Raises:
        UnsupportedLayoutError: megatron-core outside the supported range, a layout whose model
            weights share storage with gradients, or an unsupported wrapper (FSDP1, DeepSpeed).
        TypeError: ``model`` or ``optimizer`` are not objects of one supported framework.
        ValueError: A torch trainer that cannot be managed as it is (parameters on two devices, an
            optimizer holding parameters the model does not); the message says which.
    """

    # grads first: dropped for free, and a training step zeroes them before its forward; the
    # weights then come in the order the forward reads them, the optimizer's parts behind them
    _OFFLOAD_ORDER = (Part.GRADS, Part.OPTIMIZER_STATES, Part.MAIN_WEIGHTS, Part.WEIGHTS)
    _ONLOAD_ORDER = (Part.GRADS, Part.WEIGHTS, Part.MAIN_WEIGHTS, Part.OPTIMIZER_STATES)

    def __init__(self, model: Any, optimizer: Any, config: Optional[MemoryConfig] = None):
        self.backend: TrainerBackend = trainer_backend(model, optimizer)
        backend = self.backend
        self._CONTIGUOUS = backend.contiguous  # this trainer's: before the state is made
        self._HINTS = backend.hints
        super().__init__(backend.parts, backend.device, config)
        self._steps = 0
        self._forward_since_step = False
        self._in_backward = False
        self._check_layout()
        self._layout_epoch = backend.layout_epoch()
        self._remember_weight_storages()
        self._claim(backend.what)
        plan = backend.guard_plan()
        self._guards = plan
        if plan.weight_users is not None:
            self._hook_handles += self.state.register_weight_users(plan.weight_users)
        for outer, inner in plan.modules:
            self._guard_module(outer, inner)
        for obj, table in plan.methods:
            self._hook_handles += guards.guard_methods(obj, table, self._require)
        for opt in plan.optimizers:
            self._hook_handles.append(opt.register_step_pre_hook(self._before_step))
            self._hook_handles.append(opt.register_step_post_hook(self._after_step))
        self._hook_handles += backend.install()
        self.state.record_placement()

    @property
    def checkpoint_parts(self) -> tuple[list, Any, list]:
        """megatron-core: ``(model chunks, optimizer, leaf optimizers)``, what a checkpoint of
        this model reads (see :mod:`chatlearn_mem.checkpoint`)."""
        return self.backend.checkpoint_parts

    # -- which tensors make up each part: the backend's answers ---------------------------------
    def _part_tensors(self, part: Part) -> Iterable[torch.Tensor]:
        return self.backend.part_tensors(part)

    def _named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.backend.named_weights()

    def _part_slots(self, part: Part) -> Iterable[tuple[Hashable, torch.Tensor]]:
        slots = self.backend.part_slots(part)
        return super()._part_slots(part) if slots is None else slots

    def _state_dict_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.backend.state_dict_tensors()

    def _stale_grads(self) -> Iterable[torch.Tensor]:
        return self.backend.transient_tensors()

    def _part_token(self, part: Part) -> Optional[Hashable]:
        if part is Part.GRADS:
            return None
        versions = tuple(t._version for t in self._part_tensors(part))
        return (self._steps, self.state.dirty_epoch, versions)

    def _check_layout(self) -> None:
        self.backend.check_layout()
        for part in self.parts:
            for s in self.state.storages(part):
                # a CPU storage's memory is moved out and back (device_memory), never resized:
                # one in a slab of an earlier manager (MemoryConfig.cpu_contiguous) is fine
                if not s.resizable() and not (s.device.type == "cpu" and parks_cpu_memory()):
                    raise UnsupportedLayoutError(
                        f"a {part} storage of {s.nbytes()} bytes cannot be resized "
                        "(created from external memory), so it cannot be released"
                    )

    def _follow_layout(self) -> None:
        """Take the trainer's tensors as they are now when the framework itself rebuilt them since
        the manager's last call (ZeroRedundancyOptimizer's buckets for DDP's overlap, built after
        DDP's first iterations): not a change behind the manager's back."""
        epoch = self.backend.layout_epoch()
        if epoch != self._layout_epoch:
            assert not self.state.offloaded_parts(), "the layout changed while a part was offloaded"
            self._layout_epoch = epoch
            self.state.retake()

    # -- guards --------------------------------------------------------------------------------
    def _before_forward(self, module, args) -> None:
        self._check_no_concurrent_call("forward pass")
        self._check_weights_resident("forward pass")
        if torch.is_grad_enabled():
            if self.state.offloaded(Part.GRADS):
                raise OffloadedError(
                    f"training forward pass while the grad buffers are released: call "
                    f"{guards.onload_call([Part.GRADS])} (or onload()) first, or run forward-only passes under "
                    "torch.no_grad()"
                )
            self._forward_since_step = True

    def _before_step(self, optimizer, args, kwargs) -> None:
        # megatron's own step() is guarded before it starts (its method table); this pre-hook of
        # the torch step catches a torch step called directly (and is a torch trainer's guard)
        self._require("optimizer step", self.backend.step_parts())

    def _backward_parts(self) -> tuple[Part, ...]:
        return self._guards.backward_parts

    def _before_backward(self, grad) -> None:
        super()._before_backward(grad)
        if self._guards.step_in_backward and not self._in_backward:
            # the optimizer steps inside this backward (ZeRO overlapped with DDP): count it as a
            # step once the backward is done
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._in_backward = False
        self._after_step(None, (), {})

    def _guard_names(self) -> Iterable[tuple[str, torch.Tensor]]:
        return self.backend.guard_names()

    def _after_step(self, optimizer, args, kwargs) -> None:
        self._steps += 1
        self._forward_since_step = False
        self.state.record_placement([Part.OPTIMIZER_STATES])  # the first step creates the states

    def _before_offload_checks(self, todo: list[Part], force: bool) -> None:
        self._check_no_pending_communication("offload" if len(todo) > 1 else f"offload {todo[0]}")
        if Part.GRADS in todo and not force:
            self._check_grads_consumed()

    def _before_release(self, part: Part) -> None:
        if part is Part.GRADS:
            self.backend.drop_transient()
        self.backend.before_release(part)

    def _check_no_pending_communication(self, what: str) -> None:
        pending = self.backend.pending_work()
        if pending:
            raise ChatlearnMemError(self.backend.pending_message(what, pending))

    # -- public API ----------------------------------------------------------------------------
    @serialized
    def offload(
        self,
        parts: PartsArg = None,
        *,
        force: bool = False,
        blocking: bool = True,
        release_idle_memory: Optional[bool] = None,
    ):
        """Offload the chosen parts (all by default) in a safe order: grads, states, main weights, weights.

        Everything that can refuse or fail (unconsumed grads, in-flight communication, host
        allocation) is checked before any memory is released, so a refusal changes nothing. The
        copies run on the device's copy engine: each storage is released as soon as its own bytes
        are on the host, and the call waits once, at the end.

        Args:
            parts: A :class:`~chatlearn_mem.Part`, a part name, or a list of them; None: all.
            force: Drop gradients that no optimizer step consumed (else such gradients make the
                offload refuse, changing nothing).
            blocking: True (default): wait, return the stats. False: return a
                :class:`~chatlearn_mem.Transfer` at once; the parts count as offloaded from now on.
            release_idle_memory: On CUDA, once the offload has settled, also give back what the
                process keeps for compute (:func:`chatlearn_mem.process_memory.release_idle_memory`:
                the cuBLAS/cuBLASLt workspaces, then, with ``MemoryConfig.empty_cache``, the
                allocator's free blocks). None (default): when the offload leaves every part
                offloaded, the trainer asleep; True: after any offload; False: never. The
                workspaces are stateless scratch the next matmul
                allocates again (one allocation per stream), and they are the process's, not the
                model's: pass False when another model of this process computes while this one
                sleeps and should keep them. Ignored off CUDA.

        Returns:
            One :class:`TransferStats` per part that was offloaded (parts already offloaded are
            skipped; when every chosen part is, a warning says so), or the ``Transfer``.

        Raises:
            ValueError: An unknown part name.
            Whatever a copy raises, once the parts are rolled back (with ``blocking=False``: from
            ``Transfer.wait()``).
        """
        self._follow_layout()
        started = self.state.begin_offload(parts, force=force)
        return self._run("offload", started, blocking, self._idle_release(release_idle_memory))

    def _idle_release(self, wanted: Optional[bool]) -> list:
        """The callable that releases the process's idle memory once an offload settles (see
        :meth:`offload`), in a list; empty when there is nothing to do."""
        if wanted is False or self.device.type != "cuda":
            return []

        def release() -> None:
            if wanted or all(self.state.offloaded(p) for p in self.parts):
                from chatlearn_mem.process_memory import release_idle_memory

                release_idle_memory(self.device, measure=False, empty_cache=self.config.empty_cache)

        return [release]

    @serialized
    def onload(self, parts: PartsArg = None, *, blocking: bool = True):
        """Onload the chosen parts (all by default): grads, weights, main weights, then states.

        For a forward-only phase, ``onload(Part.WEIGHTS)`` brings back the weights alone. The
        weights come in the order the forward reads them: with ``blocking=False`` a forward pass
        can start at once and each module waits only for its own weights. If a device
        allocation fails, the parts restored so far stay restored and the others stay offloaded;
        call again once memory is available.

        Args:
            parts: A :class:`~chatlearn_mem.Part`, a part name, or a list of them; None: all.
            blocking: True (default): wait, return the stats. False: return a
                :class:`~chatlearn_mem.Transfer` at once; every guarded call waits for what it needs.

        Raises:
            ValueError: An unknown part name.
            Whatever a device allocation or copy raises, once the failed part is rolled back (with
            ``blocking=False``: from ``Transfer.wait()``).
        """
        self._follow_layout()
        return self._run("onload", self.state.begin_onload(parts, use_order=not blocking), blocking)

    @serialized
    def residency(self) -> Residency:
        """Device bytes held per part (each storage once) and host store bytes, once the transitions
        in flight have finished."""
        self.state.settle()
        return measure(
            {p.value: (self._part_tensors(p) if p in self.parts else ()) for p in Part} | {OTHER: self._stale_grads()},
            self.device,
            self.state.host_bytes(),
            self.state.released_bytes(),
        )

    @serialized
    def audit(self) -> AuditReport:
        """Check every alias and residency invariant; see :class:`AuditReport`.

        Checks, for every trainer: each weight's ``.data`` still lives in the storage the manager
        restores; offloaded parts hold no device memory and resident parts all of it; nothing
        else (megatron-core's own offload calls, ``model.cpu()``, ``param.data = ...``) released,
        regrew, moved or replaced the manager's memory since its last call (see
        :mod:`chatlearn_mem.external`). Then the backend's aliases. megatron-core: each param
        ``.data`` and ``main_grad`` is a view of its DDP buffer at the offset in megatron's
        ``param_index_map``; bucket views and cached bucket-group shards view their buffers; the
        distributed optimizer's shard groups view the params; each torch ``param_group`` holds
        exactly the live shard / main tensors and ``state`` is keyed by them; each trainable
        parameter has exactly one grad-accumulator hook and one entry in DDP's ``grad_accs``.
        Plain PyTorch: see :mod:`chatlearn_mem.torchnative.checks`.
        """
        self.state.settle()
        self._follow_layout()
        report = AuditReport()
        self._check_rebinds(report)
        self.backend.audit(report)
        for part in self.parts:
            self.state.check_storage_state(report, part)
        report.checked += 1
        for sentence in self.state.external_changes():
            report.add(sentence)
        return report

    # -- internals -----------------------------------------------------------------------------
    def _check_grads_consumed(self) -> None:
        if not self._forward_since_step:
            return
        dirty = self.backend.unconsumed_grads()
        if dirty:
            raise ChatlearnMemError(self.backend.unconsumed_message(dirty))
