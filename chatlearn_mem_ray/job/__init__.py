"""Any loop on the service as a job: :func:`run_loop` (:mod:`.run`), with what it does before Ray
starts (:mod:`.prepare`), the log and the console (:mod:`.output`), run checkpoints
(:mod:`.checkpoints`) and how a run stops or goes on (:mod:`.stops`: SIGTERM, restarts)."""

from chatlearn_mem_ray.job.run import run_loop

__all__ = ["run_loop"]
