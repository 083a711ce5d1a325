"""The colocation service a loop drives.

A loop declares its models (:class:`Model`) and phases (:class:`Phase`: what each needs resident),
and writes one iteration (:meth:`Loop.step`) as ``with svc.phase(name) as p:`` blocks; the
:class:`Service` wakes what each phase needs, audits it, records the memory timeline and puts the
models back to sleep. Inside: :mod:`.declare` (declarations and their checks), :mod:`.loop` (the
:class:`Loop` protocol), :mod:`.service` (the service and a phase's calls), :mod:`.phases` and
:mod:`.schedule` (the moves at each boundary, with or without a device budget), :mod:`.budget` (the
budget before anything starts), :mod:`.colocation` (every actor on its bundle, calls with
phase-aware waits), :mod:`.weight_sync` (a trainer's weights into an engine, verified),
:mod:`.timeline` and :mod:`.timeline_plot` (the memory record and its picture).
"""

from chatlearn_mem_ray.service.declare import EVERYTHING, WEIGHTS, DeclarationError, Model, Phase
from chatlearn_mem_ray.service.loop import Loop
from chatlearn_mem_ray.service.service import PhaseContext, Service

__all__ = ["EVERYTHING", "WEIGHTS", "DeclarationError", "Loop", "Model", "Phase", "PhaseContext", "Service"]
