"""The run's experiment trackers (``logger``): TensorBoard, Weights & Biases and MLflow, each through
its own library, fed by the job (:class:`Trackers`)."""

from chatlearn_mem_ray.job.trackers.fanout import Trackers, check_trackers, flat_metrics

__all__ = ["Trackers", "check_trackers", "flat_metrics"]
