"""What the trainer and inference managers share: which tensors make up each part, and the calls.

A part (:class:`~chatlearn_mem.parts.Part`) is a named :class:`~chatlearn_mem.storage.StorageGroup`;
it is resident or offloaded, and moves between the two through the copy engine (submitted,
settled, rolled back on failure). Everything that changes as parts move is owned by the manager's
:class:`~chatlearn_mem.parts_state.PartsState` (``manager.state``), which asks the manager about
its model through :class:`~chatlearn_mem.parts_state.ModelHooks`. The guards that keep calls away
from released memory live in :mod:`chatlearn_mem.guards`, the one-manager-per-model registry in
:mod:`chatlearn_mem.owners`.
"""

from __future__ import annotations

import warnings
from typing import Hashable, Iterable, Iterator, Optional

import torch

from chatlearn_mem import owners, transitions
from chatlearn_mem.config import MemoryConfig
from chatlearn_mem.debug_guard import ReleasedTensorGuard
from chatlearn_mem.device_memory import check_device_slab, storage_key
from chatlearn_mem.group_transfer import GroupTransfer
from chatlearn_mem.guards import ModelGuards, serialized
from chatlearn_mem.parts import Part
from chatlearn_mem.parts_state import ModelHooks, PartsState, weak

__all__ = ["MemoryManagerBase"]


class MemoryManagerBase(ModelGuards):
    """Parts (named :class:`StorageGroup` s), their offload/onload with no-op warnings, and guards.

    Subclasses say which tensors make up each part (:meth:`_part_tensors`) and which token
    describes a part's current contents (:meth:`_part_token`). The parts' state (storage groups,
    transitions in flight, placements, the lock) is owned by :attr:`state`, a
    :class:`~chatlearn_mem.parts_state.PartsState`.
    """

    def __init__(self, parts: dict[Part, bool], device: torch.device, config: Optional[MemoryConfig]):
        if config is not None and not isinstance(config, MemoryConfig):
            raise TypeError(f"config must be a chatlearn_mem.MemoryConfig, got {type(config).__name__}")
        self.config = config or MemoryConfig()
        check_device_slab(self.config.cuda_contiguous, device)
        self.device = device
        self._active_call: Optional[tuple[str, int]] = None  # (method, thread id) of the call in progress
        self._hook_handles: list = []  # anything with .remove(): torch hook handles, method guards
        self._claimed: list[int] = []
        self._claim_what = ""
        hooks = ModelHooks(
            part_tensors=weak(self._part_tensors),
            part_slots=weak(self._part_slots),
            part_token=weak(self._part_token),
            named_weights=weak(self._named_weights),
            check_offload=weak(self._before_offload_checks),
            before_release=weak(self._before_release),
            offload_started=weak(self._offload_started),
            retake=weak(self._retake),
        )
        self.state = PartsState(
            type(self).__name__,
            parts,
            device,
            self.config,
            hooks,
            self._OFFLOAD_ORDER,
            self._ONLOAD_ORDER,
            owners.caller_site(),
            self._CONTIGUOUS,
            self._HINTS,
        )
        self._debug_guard = ReleasedTensorGuard(self._released_message) if self.config.resolved_debug_guard() else None

    _OFFLOAD_ORDER: tuple[Part, ...] = (Part.WEIGHTS,)
    _ONLOAD_ORDER: tuple[Part, ...] = (Part.WEIGHTS,)
    # parts whose storages are laid out in a slab (storage.StorageGroup's ``contiguous``; on a CPU
    # device with MemoryConfig.cpu_contiguous, on CUDA with cuda_contiguous): those nothing but
    # the manager resizes
    _CONTIGUOUS: frozenset = frozenset()
    # how changes made behind the manager's back are explained (None: megatron-core's own calls)
    _HINTS = None

    # -- to be provided by subclasses -------------------------------------------------------
    def _part_tensors(self, part: Part) -> Iterable[torch.Tensor]:
        raise NotImplementedError

    def _part_token(self, part: Part) -> Optional[Hashable]:
        return None

    def _named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the weights whose storage the audit follows."""
        raise NotImplementedError

    def _state_dict_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of what :meth:`weights_state_dict` exports, in state-dict naming."""
        raise NotImplementedError

    def _part_slots(self, part: Part) -> Iterable[tuple[Hashable, torch.Tensor]]:
        """``(slot, tensor)`` for each tensor of ``part``: a slot names where the tensor is held,
        so that a tensor rebound or replaced in place is recognised (default: the tensor itself)."""
        return ((id(t), t) for t in self._part_tensors(part) if t is not None)

    def _follow_layout(self) -> None:
        """Take the model's tensors as they are now when its framework itself rebuilt them since
        the last call (subclasses; see the trainer's)."""

    # -- shared mechanics --------------------------------------------------------------------
    @property
    def parts(self) -> tuple[Part, ...]:
        """The parts this manager moves."""
        return self.state.parts

    def is_offloaded(self, part: Part | str) -> bool:
        """Whether ``part`` is currently offloaded (released from the device).

        Raises:
            ValueError: ``part`` is not one of :attr:`parts`.
        """
        (part,) = self.state.parse([part])
        self.state.settle([part])
        return self.state.offloaded(part)

    # -- the registry, and what the state asks (ModelHooks) ------------------------------------------------------
    def _claim(self, what: str) -> None:
        """Become the manager of every storage this manager moves (see :mod:`chatlearn_mem.owners`);
        call once the parts are known, before any hook."""
        self._claim_what = what
        self._claimed = owners.claim(self, self.state.storage_keys(), what)

    def _release_claim(self, blocking: bool = True) -> None:
        if owners.release(self, self._claimed, blocking):
            self._claimed = []

    def _retake(self) -> None:
        """After a checkpoint load: claim the model's tensors as they are now."""
        self._release_claim()
        self._claim(self._claim_what)
        self._remember_weight_storages()

    def _offload_started(self, part: Part) -> None:
        if part is Part.WEIGHTS:
            self._remember_weight_storages()

    def _remember_weight_storages(self) -> None:
        """Record the storage of each weight: the ones the manager releases and restores."""
        self._weight_storages = {name: storage_key(t) for name, t in self._named_weights()}

    def _check_rebinds(self, report, skip: frozenset = frozenset()) -> None:
        """Report weights whose ``.data`` now lives in a storage the manager does not restore.

        Args:
            skip: Names already reported for a worse reason (the tensor itself was replaced).
        """
        for name, t in self._named_weights():
            if name in skip:
                continue
            report.checked += 1
            if name in self._weight_storages and storage_key(t) != self._weight_storages[name]:
                report.add(
                    f"{name} .data was rebound to a new tensor since the manager last "
                    "offloaded it; the manager would restore the old storage"
                )

    def _before_offload_checks(self, todo: list[Part], force: bool) -> None:
        """Refuse an offload of ``todo`` that is unsafe now (subclasses); nothing has changed yet."""

    def _before_release(self, part: Part) -> None:
        """Drop what hangs off ``part`` just before its release is submitted (subclasses)."""

    def _run(self, kind: str, started: list[tuple[Part, GroupTransfer]], blocking: bool, after_settled=()):
        """Submit started transitions as one job: the stats when ``blocking``, else the handle.
        ``after_settled``: callables run once the job has settled, after the parts' own."""
        if not started:
            return [] if blocking else transitions.run(kind, [], blocking=False)
        on_settled = [self.state.after_offload_settled] if kind == "offload" else []
        on_settled += list(after_settled)
        return transitions.run(kind, [(self, p, gt) for p, gt in started], blocking, on_settled)

    @serialized
    def offload_weights(self, *, blocking: bool = True):
        """Copy the weights to the host store (unless the copy there is current) and free them.

        Args:
            blocking: Wait and return the :class:`TransferStats` (None when already offloaded), or
                return a :class:`~chatlearn_mem.Transfer` at once.
        """
        self._follow_layout()
        out = self._run("offload", self.state.begin_offload([Part.WEIGHTS]), blocking)
        return (out[0] if out else None) if blocking else out

    @serialized
    def onload_weights(self, *, blocking: bool = True):
        """Reallocate the weights on the device and copy them back from the host store.

        Args:
            blocking: Wait and return the :class:`TransferStats` (None when already resident), or
                return a :class:`~chatlearn_mem.Transfer` at once; a forward pass may start right
                away and each module waits for its own weights only.
        """
        self._follow_layout()
        out = self._run("onload", self.state.begin_onload([Part.WEIGHTS], use_order=not blocking), blocking)
        return (out[0] if out else None) if blocking else out

    @serialized
    def weights_state_dict(self) -> dict[str, torch.Tensor]:
        """A host copy of every weight, named as in the model's ``state_dict()``.

        While the weights are offloaded they are read from the host store, so a sleeping model
        can send its weights (for example to a rollout engine) without being woken up. While
        resident they are copied from the device.
        """
        self.state.settle()  # R5: the host copy is read only once written
        group = self.state.group(Part.WEIGHTS)
        out = {}
        for name, t in self._state_dict_tensors():
            if group.offloaded:
                out[name] = group.read_host(t)
            else:
                out[name] = t.detach().to("cpu", copy=True)
        return out

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight, named as in the model's ``state_dict()``, one at a time: what
        :meth:`weights_state_dict` holds, without a host copy of the whole model.

        While the weights are offloaded each is a view of the host store (no copy; a copy of that
        tensor alone where its bytes span two host buffers), and the store is held for reading
        until the iterator is exhausted or closed (an offload waits). While resident each is a
        host copy of that tensor alone, made as the iterator reaches it. For streaming a model's
        weights (a weight sync) with at most a bucket of them in flight. The views are the host
        store's memory: use them before the next offload, and never write them.
        """
        named, group = self._weights_to_read()
        if group.offloaded:
            with group.reading():
                views = [(n, group.host_view(t)) for n, t in named]  # at once: views cost nothing
                yield from views
        else:
            for n, t in named:
                yield n, t.detach().to("cpu", copy=True)

    @serialized
    def _weights_to_read(self) -> tuple[list[tuple[str, torch.Tensor]], object]:
        """The weights in state-dict naming and their storage group, under the lock."""
        self.state.settle()  # R5: the host copy is read only once written
        return list(self._state_dict_tensors()), self.state.group(Part.WEIGHTS)

    def mark_weights_dirty(self) -> None:
        """Declare that the weights changed in a way the manager cannot see.

        Writes through ``param.data`` bypass PyTorch's version counter, which is how the manager
        tells unchanged weights (see ``MemoryConfig.skip_unchanged_weights``); call this after
        such a write so the next offload copies the weights again.
        """
        self.state.mark_dirty()

    def close(self) -> None:
        """Detach the manager from its model and free its host store.

        Removes every hook and method guard it installed, frees the host buffers and lets another
        manager take the model. The storages it laid out in a slab (``MemoryConfig.cpu_contiguous``,
        ``cuda_contiguous``) get memory of their own again (one copy of their bytes),
        so that other code may resize them. The manager must not be used afterwards (its calls raise). Calling
        it again is a no-op.

        Raises:
            ChatlearnMemError: A part is offloaded. Closing would strand it (its storages stay at 0
                bytes with nothing left to restore them); call ``onload()`` first. The manager
                does not onload by itself: the device may be in use by another model.
        """
        with self.state.lock:
            self.state.close(self._detach)

    def _detach(self) -> None:
        for h in reversed(self._hook_handles):
            h.remove()
        self._hook_handles.clear()
        if self._debug_guard is not None:
            self._debug_guard.update(frozenset())
        self._release_claim()

    def __del__(self) -> None:
        # A sleeping manager dies only with its model (its hooks keep it alive), but the host copy
        # is then the only copy of the state; say so instead of losing it silently.
        try:
            state = getattr(self, "state", None)
            if state is None or state.closed:
                return
            offloaded = [p.value for p in state.offloaded_parts()]
            if offloaded:
                warnings.warn(
                    f"{type(self).__name__} (created at {state.created_at}) was garbage collected while "
                    f"{', '.join(offloaded)} were offloaded: their host copies are freed with it and the "
                    "model's storages stay released. Call onload() (chatlearn_mem.manager_of(model) finds "
                    "the manager) before dropping a model you still need",
                    UserWarning,
                    stacklevel=2,
                )
            self._release_claim(blocking=False)
        except Exception:  # noqa: BLE001 - never raise from a finaliser (interpreter shutdown)
            pass
