"""vLLM as the rollout engine beside a megatron trainer: sampling from token ids with the engine's
log-probs, and weight updates streamed from the trainer's Hugging Face export, each one verified.

The engine runs in the caller's process (vLLM's in-process mode): a weight update is a generator of
``(Hugging Face name, tensor)`` that the engine consumes one tensor at a time
(:func:`chatlearn_mem.models.hf.iter_hf_weights` of a sleeping trainer's ``weights_state_dict()``),
so the host holds at most one converted tensor (or bucket) beside the trainer's host store::

    from chatlearn_mem.engines.vllm_rollout import VLLMRollout
    from chatlearn_mem.models import hf

    engine = VLLMRollout("/models/Qwen2-0.5B", cfg, seed=0, log_file="runs/x/vllm.log")
    tokens, logprobs = engine.generate(prompts, response_length=64, temperature=1.0, seed=step)
    ...  # train; the trainer goes to sleep
    stats = engine.sync_weights(hf.iter_hf_weights(mm.weights_state_dict(), cfg))
    stats.digest  # the weights' digest, equal on both sides (else SyncVerificationError)

Every update is verified bit for bit (:mod:`chatlearn_mem.engines.digest`): the export is hashed as
it streams and the engine's parameters are hashed as the engine computes with them; a difference
raises :class:`SyncVerificationError` and the engine refuses to sample until an update verifies.
:meth:`VLLMRollout.canary_logprobs` scores a fixed token sequence (:func:`canary_tokens`) for a
check against the trainer's log-probs within :data:`MISMATCH_BOUNDS`.

Needs vLLM (``docs/vllm.md`` has the install commands for CPU and CUDA;
:func:`~chatlearn_mem.engines.vllm_install.check_vllm_install` checks one before anything starts).
On a CPU-only machine vLLM cannot sleep: :meth:`VLLMRollout.sleep` says so once and the engine's
memory stays resident.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from chatlearn_mem.engines.digest import StreamDigest, WeightsDigest, engine_params
from chatlearn_mem.engines.vllm_install import INSTALL_CPU, INSTALL_CUDA, VLLMInstallError, check_vllm_install
from chatlearn_mem.engines.vllm_log import EngineLog
from chatlearn_mem.models.gpt import GPTTrainerConfig

__all__ = [
    "CANARY_LENGTH",
    "INSTALL_CPU",
    "INSTALL_CUDA",
    "MISMATCH_BOUNDS",
    "EngineError",
    "EngineMemory",
    "EngineWarning",
    "MismatchBound",
    "SyncStats",
    "SyncVerificationError",
    "VLLMInstallError",
    "VLLMRollout",
    "canary_tokens",
    "check_vllm_install",
    "mismatch_bound",
]

_IN_PROCESS = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "TORCH_COMPILE_DISABLE": "1"}
"""Set before vLLM starts: the engine runs in this process (a weight update is then a generator the
engine consumes, not a pickled copy), and without ``torch.compile`` (a first generate of 10-19 s
on CPU otherwise)."""


@dataclass(frozen=True)
class MismatchBound:
    """How far the engine's log-probs may be from the trainer's on the same tokens, in nats."""

    max_abs: float
    """Bound on the largest absolute difference over the tokens compared."""
    mean_abs: float
    """Bound on the mean absolute difference over the tokens compared."""


MISMATCH_BOUNDS: dict[str, MismatchBound] = {
    "fp32": MismatchBound(max_abs=1e-3, mean_abs=2e-4),
    "bf16": MismatchBound(max_abs=1.5, mean_abs=0.25),
}
"""Default bounds per precision (``GPTTrainerConfig.precision``) on the engine-vs-trainer log-prob
difference of the same tokens. Measured on vLLM 0.32.0's CPU build against ``transformers`` on
the same weights, three random Llama/Qwen2 shapes from 2 layers x 128 to 4 layers x 512, each
drawn twice (Hugging Face's initialisation and a sharper one; docs/vllm.md, "Measured"): fp32 at most 6.5e-5 (max) and 1.5e-5 (mean), bf16 at most 0.71 (max) and 0.10
(mean), both on the sharpest model (logits spread over ~20 nats); the bounds leave 2x (bf16) to 13x
(fp32) of margin. The difference grows with how sharp the model's logits are: pass your own bound
where a model is sharper. Above them the engine does not serve the trainer's weights, or computes
something else; the digest of every sync is the exact check, these catch what it cannot see."""

CANARY_LENGTH = 16
"""Tokens in the canary sequence (:func:`canary_tokens`)."""


def canary_tokens(vocab_size: int) -> torch.Tensor:
    """The fixed canary sequence (1, :data:`CANARY_LENGTH`): token ``i`` is
    ``(1 + 7 i + 3 i^2) mod vocab_size``. The trainer scores the same tokens to compare its
    log-probs with :meth:`VLLMRollout.canary_logprobs`."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be at least 2, got {vocab_size}")
    return torch.tensor([[(1 + 7 * i + 3 * i * i) % vocab_size for i in range(CANARY_LENGTH)]], dtype=torch.long)


def mismatch_bound(precision: str) -> MismatchBound:
    """:data:`MISMATCH_BOUNDS` of a precision (``"fp32"`` or ``"bf16"``).

    Raises:
        ValueError: Another precision.
    """
    if precision not in MISMATCH_BOUNDS:
        raise ValueError(f"no mismatch bound for precision {precision!r}; known: {', '.join(MISMATCH_BOUNDS)}")
    return MISMATCH_BOUNDS[precision]


class EngineError(RuntimeError):
    """The engine could not start, run this model, or take a weight update."""


class SyncVerificationError(EngineError):
    """A weight update did not give the engine the trainer's weights: a parameter's digest differs
    from the export's (``param`` names the first, in the checkpoint's order), or the canary's
    log-probs are off the trainer's. The engine refuses to sample until an update verifies."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class EngineWarning(UserWarning):
    """Something the engine logged that the caller should hear of (memory pressure, an error)."""


@dataclass(frozen=True)
class SyncStats:
    """One weight update: ``tensors`` and ``nbytes`` streamed; ``seconds`` for the whole call
    (stream, load, verification), of which ``hash_seconds`` hashing the export as it streamed and
    ``verify_seconds`` the engine's digest and the comparison. ``digest``: the model's digest that
    both sides agreed on (None when the engine was built with ``verify=False``)."""

    tensors: int
    nbytes: int
    seconds: float
    digest: Optional[str] = None
    hash_seconds: float = 0.0
    verify_seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class EngineMemory:
    """What the engine allocated, in bytes, on ``device`` (``"cpu"`` or ``"cuda"``)."""

    weights_bytes: int
    """Its parameters, plus on the CPU build the kernels' packed copy of every GEMM weight (oneDNN
    keeps its own; counted at the weight's size)."""
    kv_cache_bytes: int
    """The KV cache as allocated: on CPU ``kv_cache_gib``, on CUDA the blocks vLLM sized from
    ``gpu_memory_utilization`` (the storage behind the model runner's cache tensors)."""
    device: str

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_cache_bytes


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
        max_model_len: Longest prompt plus response, in tokens (default: the config's
            ``seq_length``). On CUDA it also bounds the KV cache vLLM must fit at start.
        max_num_seqs: Sequences the engine batches at once (default 64).
        kv_cache_gib: CPU only: the KV cache's size in GiB (``VLLM_CPU_KVCACHE_SPACE``, unless
            set; default 1). Ignored on CUDA.
        gpu_memory_utilization: CUDA only: the share of the GPU's memory, in (0, 1], vLLM may take
            for its weights, activations and KV cache (default 0.5). vLLM checks at start that
            this share is free, so start the engine while the trainers sleep. Ignored on CPU.
        enforce_eager: Run without CUDA graphs (default True: no graph capture at start and no
            graph pools left behind by sleep; False captures them, faster decoding on CUDA).
        log_file: Where vLLM's own log goes (appended), its start-up output included; the
            console then only hears what matters from it, in our words (an :class:`EngineWarning`
            for memory pressure or an error; a failed load in the update's error). None (the
            default): vLLM logs to the console as it does by default.
        verify: Verify every weight update by digest (default True; see :meth:`sync_weights`).
        engine_kwargs: Passed on to ``vllm.LLM`` (they win over the above).

    Raises:
        ValueError: ``config`` is not a Llama or Qwen2 architecture, or a setting is out of range
            (before anything starts).
        ImportError: vLLM is not installed (the message has the install command).
        EngineError: The engine did not start or cannot run this model here (its first
            generate runs in the constructor, so that this fails now, not mid-run).
    """

    _plan: Optional[list] = None
    """The engine's parameters and their pieces (``digest.engine_params``); None: updates are not
    verified."""
    _log: Optional[EngineLog] = None
    """Where the engine's output goes (None: vLLM's default, nothing watched)."""

    def __init__(
        self,
        model_dir: Union[str, os.PathLike],
        config: GPTTrainerConfig,
        *,
        seed: int = 0,
        max_model_len: Optional[int] = None,
        max_num_seqs: int = 64,
        kv_cache_gib: float = 1,
        gpu_memory_utilization: float = 0.5,
        enforce_eager: bool = True,
        log_file: Optional[Union[str, os.PathLike]] = None,
        verify: bool = True,
        **engine_kwargs: Any,
    ):
        self.names = expected_names(config)  # raises ValueError for another architecture
        self.config = config
        _check_settings(max_model_len, max_num_seqs, kv_cache_gib, gpu_memory_utilization)
        tp = engine_kwargs.get("tensor_parallel_size", 1)
        if verify and tp != 1:
            raise ValueError(
                f"verify=True needs the engine on one tensor-parallel rank (each rank holds a shard), got "
                f"tensor_parallel_size={tp}: pass verify=False and check updates with check_canary()"
            )
        self._log = EngineLog(log_file, tied=config.share_embeddings_and_output_weights)
        self._log.before_import()
        self._sleeping: set[str] = set()  # of SLEEP_TAGS: what sleep() released and no wake_up brought back
        self._stale: Optional[str] = None  # why the weights are a mix of two versions
        self._said_no_sleep = False
        self._llm = None
        t0 = time.perf_counter()
        with self._log.starting():
            vllm = _import_vllm()
            self.cuda = torch.cuda.is_available() and not _cpu_build(vllm)
            if not self.cuda:
                os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", _gib(kv_cache_gib))
            kwargs: dict[str, Any] = dict(
                model=os.fspath(model_dir),
                dtype="bfloat16" if config.precision == "bf16" else "float32",
                skip_tokenizer_init=True,
                enforce_eager=enforce_eager,
                max_model_len=max_model_len or config.seq_length,
                max_num_seqs=max_num_seqs,
                seed=seed,
                logprobs_mode="processed_logprobs",  # after temperature and top-p: like the trainer's
            )
            if self.cuda:
                kwargs.update(enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization)
            kwargs.update(self._log.llm_kwargs({f.name for f in dataclasses.fields(vllm.EngineArgs)}))
            kwargs.update(engine_kwargs)
            self._sampling = vllm.SamplingParams
            try:
                self._llm = vllm.LLM(**kwargs)
                self.generate(torch.zeros(1, 1, dtype=torch.long), 1, 1.0)  # fails now if it cannot run here
            except (RuntimeError, ValueError, NotImplementedError) as e:
                where = f" (vLLM's log: {self._log.path})" if self._log.path else ""
                self.close()
                raise EngineError(f"vLLM could not run {config_summary(config)} from {model_dir}: {e}{where}") from e
        self.start_seconds = time.perf_counter() - t0
        """Seconds the constructor took: the engine's start and its first generate."""
        if verify:
            self._plan = self._verification_plan()
        self._say("while starting")

    def _verification_plan(self) -> list:
        """The digest's plan, after checking that vLLM merges the checkpoint's modules the way the
        digest assumes (:data:`~chatlearn_mem.engines.digest.MERGED`); closes the engine if not."""
        from chatlearn_mem.engines import _vllm_worker
        from chatlearn_mem.engines.digest import MERGED

        packed = self._llm.collective_rpc(_vllm_worker.packed_modules)[0]
        ours: dict[str, list[str]] = {}
        for hf_module, (merged, _) in sorted(MERGED.items(), key=lambda item: item[1]):
            ours.setdefault(merged, []).append(hf_module)
        if packed != ours:
            self.close()
            raise EngineError(
                f"this vLLM merges the checkpoint's modules as {packed}, the digest assumes {ours}: update "
                "chatlearn_mem.engines.digest.MERGED for this vLLM version, or pass verify=False"
            )
        return engine_params(self.config)

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
            EngineError: The last weight update did not complete or did not verify.
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
        self._say("while generating")
        return torch.tensor(tokens, dtype=torch.long), torch.tensor(logprobs, dtype=torch.float32)

    def generate_rows(
        self,
        rows: Sequence[Sequence[int]],
        response_length: int,
        temperature: float,
        seed: int = 0,
        stop_token_ids: Sequence[int] = (),
        pad_id: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample up to ``response_length`` tokens after each prompt of ``rows`` (prompts of any
        length), a row stopping after its first token of ``stop_token_ids`` (kept); ``temperature``
        0 decodes greedily.

        Returns:
            ``(tokens (B, L), logprobs (B, L - 1), response_lengths (B,))``: prompt then response,
            right-padded with ``pad_id`` to the longest; the engine's log-probability of each
            sampled token at the position that predicts it (NaN elsewhere); each response's length.

        Raises:
            EngineError: As :meth:`generate`.
        """
        self._check_usable("generate")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")
        rows = [list(r) for r in rows]
        params = [
            self._sampling(
                n=1,
                temperature=temperature,
                max_tokens=response_length,
                ignore_eos=True,  # only the caller's stop tokens end a response, as in the trainer's loop
                stop_token_ids=list(stop_token_ids) or None,
                logprobs=0,
                seed=seed + i,
                detokenize=False,
            )
            for i in range(len(rows))
        ]
        outs = self._llm.generate([{"prompt_token_ids": r} for r in rows], params, use_tqdm=False)
        width = max(len(r) + len(o.outputs[0].token_ids) for r, o in zip(rows, outs))
        tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
        logprobs = torch.full((len(rows), width - 1), float("nan"))
        lengths = torch.zeros(len(rows), dtype=torch.long)
        for i, (row, out) in enumerate(zip(rows, outs)):
            o = out.outputs[0]
            ids = list(o.token_ids)
            tokens[i, : len(row) + len(ids)] = torch.tensor(row + ids, dtype=torch.long)
            lp = [step[t].logprob for step, t in zip(o.logprobs, ids)]
            logprobs[i, len(row) - 1 : len(row) - 1 + len(lp)] = torch.tensor(lp, dtype=torch.float32)
            lengths[i] = len(ids)
        self._say("while generating")
        return tokens, logprobs, lengths

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
        self._say("while scoring")
        return torch.tensor(rows, dtype=torch.float32)

    # -- weights ----------------------------------------------------------------------------
    def sync_weights(
        self, weights: Iterable[Union[tuple[str, torch.Tensor], Sequence[tuple[str, torch.Tensor]]]]
    ) -> SyncStats:
        """Load new weights into the running engine, one tensor at a time, and verify them.

        Verification (unless the engine was built with ``verify=False``): each tensor is hashed
        as it streams past (:class:`~chatlearn_mem.engines.digest.StreamDigest`: no copy is
        kept), and after the load the engine's worker hashes its parameters as its kernels use
        them (:meth:`weights_digest`); the two must be equal, parameter by parameter.

        Args:
            weights: ``(Hugging Face name, tensor)`` pairs, or buckets (lists) of them
                (:func:`~chatlearn_mem.models.hf.iter_hf_weights`,
                :func:`~chatlearn_mem.models.hf.hf_weight_buckets`): every tensor of the model once,
                in the model's precision.

        Returns:
            The update's :class:`SyncStats` (``digest``: the verified digest).

        Raises:
            SyncVerificationError: The engine's weights are not the stream's (the first differing
                engine parameter is named; vLLM's own report of a failed load is quoted).
            EngineError: The stream did not hold every tensor of the model exactly once, or the
                engine failed while loading. After any of these errors the engine holds a mix of
                two versions and refuses to generate until an update succeeds.
        """
        seen: list[str] = []
        nbytes = 0
        digest = StreamDigest(self.config) if self._plan is not None else None

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal nbytes
            for item in weights:
                pairs = [item] if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) else item
                for name, t in pairs:
                    seen.append(name)
                    nbytes += t.numel() * t.element_size()
                    if digest is not None:
                        digest.update(name, t)  # before the engine sees it: what was exported
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
        vllm_said = self._load_reports()
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
            raise EngineError(self._stale + "; sync again with every tensor of the model" + vllm_said)
        checked, verify_seconds = None, 0.0
        if digest is not None:
            t1 = time.perf_counter()
            exported, held = digest.result(), self.weights_digest(check_usable=False)
            first = exported.first_difference(held)
            verify_seconds = time.perf_counter() - t1
            if first is not None:
                self._stale = (
                    f"the last weight update did not verify: the engine's {first} is not the exported one "
                    f"(digest {held.params.get(first, 'absent')[:12]} in the engine, "
                    f"{exported.params.get(first, 'absent')[:12]} exported)"
                )
                raise SyncVerificationError(
                    self._stale + "; the engine refuses to sample until an update verifies" + vllm_said, param=first
                )
            checked = exported.hexdigest
        self._stale = None
        if vllm_said:  # verified all the same: say it, it is not silent
            warnings.warn(f"the weight update verified, but{vllm_said}", EngineWarning, stacklevel=2)
        seconds = time.perf_counter() - t0
        hashed = digest.seconds if digest is not None else 0.0
        return SyncStats(len(seen), nbytes, seconds, checked, hashed, verify_seconds)

    def weights_digest(self, check_usable: bool = True) -> WeightsDigest:
        """The digest of the engine's weights as its kernels use them, computed on its worker
        (:mod:`chatlearn_mem.engines.digest`): equal to the export's
        (:class:`~chatlearn_mem.engines.digest.StreamDigest`) when it serves the same weights.

        Raises:
            EngineError: The engine is closed or its weights are asleep (or, with
                ``check_usable``, the last update did not verify).
        """
        from chatlearn_mem.engines import _vllm_worker

        if check_usable:
            self._check_usable("weights_digest")
        elif self._llm is None or "weights" in self._sleeping:
            raise EngineError("weights_digest: the engine is closed or its weights are asleep")
        plan = self._plan if self._plan is not None else engine_params(self.config)
        return WeightsDigest(self._llm.collective_rpc(_vllm_worker.weights_digest, args=(plan,))[0])

    def canary_logprobs(self) -> torch.Tensor:
        """The engine's log-probability of each next token of :func:`canary_tokens` at
        temperature 1: (:data:`CANARY_LENGTH` - 1,). Compare with the trainer's log-probs of the
        same tokens (:meth:`check_canary`): a check of what the digest does not cover (the
        engine's kernels and the state beside its weights)."""
        return self.score(canary_tokens(self.config.vocab_size))[0]

    def check_canary(self, reference: torch.Tensor, bound: Optional[MismatchBound] = None) -> MismatchBound:
        """Compare :meth:`canary_logprobs` with the trainer's log-probs of the same tokens.

        Args:
            reference: (:data:`CANARY_LENGTH` - 1,) the trainer's log-probability of each next
                canary token at temperature 1.
            bound: The differences allowed (default: :func:`mismatch_bound` of the config's
                precision).

        Returns:
            The differences found (largest and mean absolute).

        Raises:
            SyncVerificationError: Above ``bound`` or not finite; the engine then refuses to
                sample until an update verifies.
        """
        bound = mismatch_bound(self.config.precision) if bound is None else bound
        mine = self.canary_logprobs()
        reference = torch.as_tensor(reference, dtype=torch.float32).reshape(-1)
        if reference.shape != mine.shape:
            raise ValueError(f"check_canary: reference has {reference.numel()} log-probs, expected {mine.numel()}")
        diff = (mine - reference).abs()
        found = MismatchBound(max_abs=diff.max().item(), mean_abs=diff.mean().item())
        if not (found.max_abs <= bound.max_abs and found.mean_abs <= bound.mean_abs):  # NaN fails too
            self._stale = (
                f"the canary's log-probs are off the trainer's by {found.max_abs:.3g} at most and "
                f"{found.mean_abs:.3g} on average (bounds {bound.max_abs:g} and {bound.mean_abs:g} for "
                f"{self.config.precision}): the engine does not compute what the trainer does"
            )
            raise SyncVerificationError(self._stale)
        return found

    # -- memory -----------------------------------------------------------------------------
    def memory(self) -> EngineMemory:
        """The engine's weights and KV cache as it allocated them (:class:`EngineMemory`): the
        items a device budget plans for a vLLM rollout. On CUDA the sizes hold while asleep too."""
        from chatlearn_mem.engines import _vllm_worker

        if self._llm is None:
            raise EngineError("memory: the engine is closed")
        report = self._llm.collective_rpc(_vllm_worker.memory_report)[0]
        return EngineMemory(report["weights"], report["kv_cache"], report["device"])

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

    @property
    def log_file(self) -> Optional[str]:
        """Where the engine's own log goes (None: the console)."""
        return self._log.path if self._log is not None else None

    def close(self) -> None:
        """Stop the engine, free its memory and give vLLM's logger back."""
        llm, self._llm = getattr(self, "_llm", None), None
        del llm
        gc.collect()
        if self._log is not None:
            self._log.close()

    # -- the engine's log -------------------------------------------------------------------
    def _load_reports(self) -> str:
        """vLLM's reports of weights that did not load during the update, as a clause for our
        message ("" when none); other lines that matter are said as warnings."""
        if self._log is None:
            return ""
        loads = []
        for kind, line in self._log.take():
            if kind == "load":
                loads.append(line)
            else:
                self._warn(kind, line, "while loading")
        if not loads:
            return ""
        where = f" (vLLM's log: {self._log.path})" if self._log.path else ""
        return f"; vLLM reported: {'; '.join(dict.fromkeys(loads))}{where}"

    def _say(self, when: str) -> None:
        if self._log is not None:
            for kind, line in self._log.take():
                self._warn(kind, line, when)

    def _warn(self, kind: str, line: str, when: str) -> None:
        """Say one line of vLLM's as an :class:`EngineWarning`."""
        where = f" (vLLM's log: {self._log.path})" if self._log is not None and self._log.path else ""
        if kind == "memory":
            fix = "raise kv_cache_gib" if not getattr(self, "cuda", False) else "raise gpu_memory_utilization"
            text = f"the vLLM engine is short of memory {when}: {line!r}; {fix} or lower max_num_seqs{where}"
        elif kind == "load":
            text = f"the vLLM engine failed to load weights {when}: {line!r}{where}"
        else:
            text = f"the vLLM engine logged an error {when}: {line!r}{where}"
        warnings.warn(text, EngineWarning, stacklevel=3)

    def _check_usable(self, what: str) -> None:
        if self._llm is None:
            raise EngineError(f"{what}: the engine is closed")
        if self._sleeping:
            raise EngineError(
                f"{what}: the engine's {' and '.join(sorted(self._sleeping))} are asleep: call wake_up() first"
            )
        if self._stale is not None:
            raise EngineError(f"{what}: {self._stale}")


def _check_settings(
    max_model_len: Optional[int], max_num_seqs: int, kv_cache_gib: float, gpu_memory_utilization: float
) -> None:
    if max_model_len is not None and max_model_len <= 0:
        raise ValueError(f"max_model_len must be > 0 tokens, got {max_model_len}")
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be > 0, got {max_num_seqs}")
    if kv_cache_gib <= 0:
        raise ValueError(f"kv_cache_gib must be > 0, got {kv_cache_gib}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")


def _gib(x: float) -> str:
    """``VLLM_CPU_KVCACHE_SPACE``'s value for ``x`` GiB (vLLM reads a number of GiB)."""
    return str(int(x)) if float(x).is_integer() else str(x)


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
