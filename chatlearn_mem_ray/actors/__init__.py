"""The actors the colocation service runs, and the Ray cluster under them.

- :class:`TrainerActor` (:mod:`.trainer`): one rank of a megatron-core trainer, :class:`TorchTrainerActor`
  one of a torch-native one (``backend: torch``, its model from :mod:`.causal_lm`); :class:`InferenceActor`
  (:mod:`.inference`): a model with no optimizer (the policy's own rollout, a reference), and
  :class:`TorchInferenceActor` for a torch-native policy;
  :class:`~chatlearn_mem_ray.actors.vllm.VLLMRolloutActor` (:mod:`.vllm`): a vLLM engine. What they
  share is :class:`~chatlearn_mem_ray.actors.managed.ManagedActor`. Plain classes: the service
  makes them Ray actors; tests use them in-process too.
- :mod:`.modeling`: what the actors compute (log-probs, values, sampling, tensor-parallel merges).
- The cluster: :mod:`.connect` (start or join Ray, check its resources), :mod:`.nodes` (nodes,
  versions, shared directories), :mod:`.wire` (tensors between processes as their bytes).
"""

from chatlearn_mem_ray.actors.inference import InferenceActor, TorchInferenceActor
from chatlearn_mem_ray.actors.trainer import TorchTrainerActor, TrainerActor

__all__ = ["InferenceActor", "TorchInferenceActor", "TorchTrainerActor", "TrainerActor"]
