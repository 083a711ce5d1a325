"""What a loop declares to the colocation service: its models and its phases.

A :class:`Model` is one model of the loop (a megatron-core trainer, a frozen inference model, or a
rollout engine that serves a trainer's weights); a :class:`Phase` names the parts of the models it
needs resident while it runs (and, derived or given, the parts it changes). The service checks the
declarations before anything starts (:func:`check_declarations`), names each model's actors, and
turns the phases into what the residency planner works on (:func:`phase_demands`).

Actors are named after their model: a trainer has one actor per rank (``policy_0``, ``policy_1``,
...; rank ``r`` on placement-group bundle ``r``), an inference model or engine one actor named as
the model, on bundle ``bundle`` (0 by default).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from chatlearn_mem import ConfigError, Part
from chatlearn_mem_ray.service.schedule import TRAINED, PhaseDemand

__all__ = [
    "EVERYTHING",
    "DeclarationError",
    "Model",
    "Phase",
    "WEIGHTS",
    "check_declarations",
    "phase_demands",
]

WEIGHTS: tuple[Part, ...] = (Part.WEIGHTS,)
"""The weights alone: what a forward pass, a generate or a weight sync needs."""
EVERYTHING: tuple[Part, ...] = tuple(Part)
"""Every part of a trainer: what a training step needs."""

PartsSpec = Union[str, Part, Sequence[Union[str, Part]]]
"""Parts as a loop writes them: ``WEIGHTS``, ``EVERYTHING``, ``"weights"``, ``"all"``, a ``Part``
or a sequence of them."""


class DeclarationError(ConfigError):
    """A loop's models or phases are inconsistent (checked before Ray starts); the message lists
    every problem. A :class:`chatlearn_mem.ConfigError`: the command line exits 2."""


def parts_of(spec: PartsSpec) -> tuple[Part, ...]:
    """``spec`` as a tuple of parts in :class:`~chatlearn_mem.Part` order (``"all"``: every part).

    Raises:
        ValueError: An unknown part name.
    """
    if isinstance(spec, (str, Part)):
        spec = [spec]
    out: set[Part] = set()
    for s in spec:
        if s == "all":
            out.update(Part)
            continue
        try:
            out.add(Part(s))
        except ValueError:
            raise ValueError(f"{s!r} is not a part: use 'all' or one of {[p.value for p in Part]}") from None
    return tuple(p for p in Part if p in out)


@dataclass(frozen=True)
class Model:
    """One model of a loop.

    Build one with :meth:`trainer`, :meth:`inference` or :meth:`engine`.

    Attributes:
        name: The loop's name for it (``policy``); its actors are named after it.
        kind: ``trainer`` (megatron-core DDP + optimizer, one actor per rank, under a
            :class:`~chatlearn_mem.TrainerMemoryManager`), ``inference`` (a GPT without optimizer,
            one actor, under an :class:`~chatlearn_mem.InferenceMemoryManager`), or ``engine`` (a
            rollout that generates and serves a trainer's weights: the megatron loop or vLLM).
        config: The model's :class:`~chatlearn_mem_ray.config.TrainerModelConfig` (an engine or
            inference model: the config of the trainer it copies).
        head: A trainer's output: ``lm`` (next-token log-probs) or ``value`` (a scalar per token).
        follows: An engine: the trainer whose weights it serves (``Phase`` code syncs it with
            ``p.sync(follows, name)``; :meth:`Service.stale` says when it needs one).
        backend: A trainer's framework: ``megatron`` or ``torch`` (its config's ``backend``). An
            engine's implementation: ``megatron`` (the policy's own model and sampling loop, of the
            policy's framework) or ``vllm``.
        engine_config: The engine's :class:`~chatlearn_mem_ray.config.RolloutConfig` (vLLM).
        saved: Whether run checkpoints save it (default: trainers yes; an inference model is
            rebuilt from its config, an engine takes its weights from the trainer it follows).
        bundle: The placement-group bundle (device) of a one-actor model.
    """

    name: str
    kind: Literal["trainer", "inference", "engine"]
    config: Any
    head: Literal["lm", "value"] = "lm"
    follows: Optional[str] = None
    backend: Literal["megatron", "torch", "vllm"] = "megatron"
    engine_config: Any = None
    saved: Optional[bool] = None
    bundle: int = 0

    @classmethod
    def trainer(
        cls,
        name: str,
        config,
        *,
        head: Literal["lm", "value"] = "lm",
        saved: bool = True,
        backend: Optional[Literal["megatron", "torch"]] = None,
    ) -> "Model":
        """A trainer, one actor per rank of the run's ``parallel`` layout: megatron-core's, or a
        torch-native one (a Hugging Face causal LM in torch's DDP, never importing megatron).

        Args:
            backend: ``megatron`` or ``torch``; default: the config's ``backend``. Given, it is
                written into the config, so that the models copied from it (a rollout, a
                reference) are built the same way.
        """
        if backend is not None and getattr(config, "backend", backend) != backend:
            config = config.model_copy(update={"backend": backend})
        return cls(name, "trainer", config, head=head, saved=saved, backend=getattr(config, "backend", "megatron"))

    @classmethod
    def inference(cls, name: str, config, *, bundle: int = 0) -> "Model":
        """A frozen model for forward passes (a reference), one actor."""
        return cls(name, "inference", config, bundle=bundle)

    @classmethod
    def engine(cls, name: str, config, *, follows: str, rollout=None, bundle: int = 0) -> "Model":
        """A rollout engine serving the weights of the trainer ``follows``; ``rollout`` (a
        :class:`~chatlearn_mem_ray.config.RolloutConfig`) picks megatron or vLLM."""
        backend = getattr(rollout, "engine", "megatron")
        return cls(name, "engine", config, follows=follows, backend=backend, engine_config=rollout, bundle=bundle)

    @property
    def is_saved(self) -> bool:
        return self.kind == "trainer" if self.saved is None else bool(self.saved)

    def actor_names(self, world_size: int) -> list[str]:
        """Its actors' names: ``name_<rank>`` per rank for a trainer, else ``name``."""
        return [f"{self.name}_{r}" for r in range(world_size)] if self.kind == "trainer" else [self.name]

    def bundles(self, world_size: int) -> list[int]:
        """The bundle of each of its actors, in rank order."""
        return list(range(world_size)) if self.kind == "trainer" else [self.bundle]


@dataclass(frozen=True)
class Phase:
    """One phase of a loop: what it needs resident while it runs.

    Attributes:
        name: The phase's name (on the console, in the log, the timeline and the plan).
        needs: Model name -> the parts the phase uses (``WEIGHTS`` for a forward pass or a
            generate, ``EVERYTHING`` to train).
        writes: Model name -> the parts the phase changes. Default: a trainer it needs whole is
            trained (weights, main weights, optimizer states); an engine it needs takes a weight
            sync (its weights). Written parts are copied back to the host when they move out;
            unwritten ones are dropped (their host copy is still current).
    """

    name: str
    needs: Mapping[str, PartsSpec] = field(default_factory=dict)
    writes: Optional[Mapping[str, PartsSpec]] = None


def check_declarations(models: Sequence[Model], phases: Sequence[Phase], world_size: int) -> None:
    """Every problem of a loop's declarations, at once.

    Raises:
        DeclarationError: No phase; a name declared twice; a phase that names a model the loop
            never declared, or a part the model does not have; an engine following anything but
            a declared trainer; a bundle outside the run's; two actors of the same name.
    """
    problems = []
    names = [m.name for m in models]
    by_name = {m.name: m for m in models}
    for n in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"model {n!r} is declared twice")
    actors = [a for m in models for a in m.actor_names(world_size)]
    for a in sorted({a for a in actors if actors.count(a) > 1}):
        problems.append(f"two models have an actor named {a!r}; rename one")
    for m in models:
        if m.kind == "trainer" and m.backend == "torch" and m.head != "lm":
            problems.append(f"trainer {m.name!r} is torch-native, which has an lm head only (a critic stays megatron)")
        if m.kind == "engine":
            lead = by_name.get(m.follows or "")
            if lead is None or lead.kind != "trainer" or lead.head != "lm":
                problems.append(
                    f"engine {m.name!r} follows {m.follows!r}, which is not a declared trainer with an lm head"
                )
            elif m.backend != "vllm" and getattr(m.config, "backend", "megatron") != lead.backend:
                problems.append(
                    f"engine {m.name!r} copies the model of trainer {lead.name!r}, but its config says backend "
                    f"{getattr(m.config, 'backend', 'megatron')!r} and the trainer's {lead.backend!r}: build both "
                    "from one config"
                )
        if m.kind != "trainer" and not 0 <= m.bundle < world_size:
            problems.append(f"model {m.name!r} is placed on bundle {m.bundle}, but the run has {world_size}")
    if not phases:
        problems.append("the loop declares no phase; declare at least one Phase(name, needs={model: parts})")
    phase_names = [p.name for p in phases]
    for n in sorted({n for n in phase_names if phase_names.count(n) > 1}):
        problems.append(f"phase {n!r} is declared twice")
    for p in phases:
        for what, spec in (("needs", p.needs), ("writes", p.writes or {})):
            for model, parts in spec.items():
                m = by_name.get(model)
                if m is None:
                    known = ", ".join(repr(n) for n in names) or "none"
                    problems.append(f"phase {p.name!r} {what} model {model!r}, which the loop never declared ({known})")
                    continue
                try:
                    ps = parts_of(parts)
                except ValueError as e:
                    problems.append(f"phase {p.name!r} {what} {model!r}: {e}")
                    continue
                if m.kind != "trainer" and set(ps) - {Part.WEIGHTS}:
                    problems.append(
                        f"phase {p.name!r} {what} {[x.value for x in ps]} of {m.kind} {model!r}, which has weights only"
                    )
                if what == "writes" and model in p.needs:
                    try:
                        missing = set(ps) - set(parts_of(p.needs[model]))
                    except ValueError:
                        missing = set()
                    if missing:
                        problems.append(
                            f"phase {p.name!r} writes {sorted(x.value for x in missing)} of {model!r} without "
                            "needing them; add them to its needs"
                        )
                elif what == "writes":
                    problems.append(f"phase {p.name!r} writes {model!r} without needing it; add it to its needs")
    if problems:
        raise DeclarationError("the loop's declarations are inconsistent: " + "; ".join(problems))


def phase_writes(phase: Phase, models: Mapping[str, Model]) -> dict[str, tuple[Part, ...]]:
    """Model name -> the parts ``phase`` changes: as declared, else derived (see :class:`Phase`)."""
    if phase.writes is not None:
        return {m: parts_of(p) for m, p in phase.writes.items()}
    out = {}
    for name, spec in phase.needs.items():
        m, parts = models[name], parts_of(spec)
        if m.kind == "trainer" and Part.OPTIMIZER_STATES in parts:
            out[name] = tuple(p for p in TRAINED if p in parts)
        elif m.kind == "engine":
            out[name] = (Part.WEIGHTS,)
    return out


def phase_demands(models: Sequence[Model], phases: Sequence[Phase], world_size: int) -> list[PhaseDemand]:
    """Each phase's needs and writes per actor (every rank of a trainer), in declared order."""
    by_name = {m.name: m for m in models}
    out = []
    for p in phases:
        needs = {a: parts_of(spec) for model, spec in p.needs.items() for a in by_name[model].actor_names(world_size)}
        writes = {
            a: parts
            for model, parts in phase_writes(p, by_name).items()
            for a in by_name[model].actor_names(world_size)
        }
        out.append(PhaseDemand(p.name, needs, writes))
    return out
