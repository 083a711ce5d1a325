"""The run's Hugging Face exports (the ``export`` section): the policy after every
``export.hf_every`` iterations and after the last, under ``<output_dir>/hf/iter_<K>/``, each listed
in ``log.json``'s ``exports`` (and kept in every run checkpoint, so a resumed run's list goes on)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from chatlearn_mem_ray.config import LoopConfig
from chatlearn_mem_ray.config.model import export_problem
from chatlearn_mem_ray.service.service import Service

__all__ = ["RunExports", "export_dir"]


def export_dir(output_dir, iteration: int) -> Path:
    """Where the export after ``iteration`` goes: ``<output_dir>/hf/iter_<K>`` (K zero-padded to 8
    digits, as the run checkpoints)."""
    return Path(output_dir) / "hf" / f"iter_{iteration:08d}"


class RunExports:
    """When and where a run exports its policy.

    Args:
        cfg: The run's config (``export``, ``output_dir``, the policy; a ``tokenizer_dir`` when the
            loop has one, else the policy's ``from_hf``).
        progress: Receives a line per export, and once a line saying why a policy does not export.
        exports: The list each export's entry is appended to (``log.json``'s ``exports``).
    """

    def __init__(self, cfg: LoopConfig, progress: Callable[[str], None], exports: list):
        self.cfg, self.progress, self.exports = cfg, progress, exports
        self.why_not = export_problem(cfg.policy)

    def due(self, iteration: int, total: int) -> bool:
        """Whether to export after ``iteration`` of ``total`` (a main iteration)."""
        e = self.cfg.export
        if self.why_not is not None:
            if iteration == total and e.at_end:
                self.progress(f"no Hugging Face export at the end: {self.why_not}")
            return False
        return bool(e.hf_every and iteration % e.hf_every == 0) or (e.at_end and iteration == total)

    def export(self, svc: Service, iteration: int) -> dict:
        """Export the policy as it is after ``iteration``; its entry (also appended to the list)."""
        model = "policy" if "policy" in svc.models else self._first_policy(svc)
        tokenizer = getattr(self.cfg, "tokenizer_dir", None)
        path = export_dir(self.cfg.output_dir, iteration)
        out = svc.export_hf(model, path, tokenizer, int(self.cfg.export.max_shard_mb * 2**20))
        entry = {"iteration": iteration, "model": model, **out}
        self.exports[:] = [e for e in self.exports if e["iteration"] != iteration] + [entry]
        self.progress(
            f"exported {model} after iteration {iteration} to {path}: {out['tensors']} tensors in {out['files']} "
            f"file(s), {out['bytes'] / 2**20:.1f} MiB, {out['seconds']:.2f}s"
        )
        return entry

    @staticmethod
    def _first_policy(svc: Service) -> Optional[str]:
        return next(m.name for m in svc.models.values() if m.kind == "trainer" and m.head == "lm")
