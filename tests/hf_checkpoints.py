"""Tiny Hugging Face checkpoints for the adapter's tests, made with ``transformers`` (nothing is
downloaded). Importable as ``hf_checkpoints`` from every tier (the root conftest puts ``tests/`` on
sys.path) and in spawned workers."""

from __future__ import annotations

import os

import torch

FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
LLAMA_FIELDS = dict(
    normalization="RMSNorm",
    activation="swiglu",
    position_embedding="rope",
    rotary_base=10000.0,
    add_bias_linear=False,
    add_qkv_bias=False,
)
"""The ``GPTTrainerConfig`` fields that make a Llama (the tests add the shape around them)."""
ROPE_THETA = {"llama": 10000.0, "qwen2": 1000000.0}


def make_checkpoint(
    path: str,
    family: str = "llama",
    kv_heads: int = 2,
    tied: bool = False,
    dtype: torch.dtype = torch.float32,
    vocab: int = 128,
    seed: int = 0,
) -> str:
    """Save a random 2-layer, hidden-64, 4-head ``family`` model to ``path`` and return ``path``.

    Weights are drawn with std 0.1 (biases too), larger than Hugging Face's 0.02, so that a
    wrongly mapped tensor moves the logits far beyond the agreement tolerance."""
    import transformers

    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    config = config_cls(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        rope_theta=ROPE_THETA[family],
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(path)
    return path


def hf_logits(path: str, tokens: torch.Tensor) -> torch.Tensor:
    """``transformers``' logits (B, T, V) of ``tokens`` (B, T) under the checkpoint at ``path``, in fp32."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def tokens(batch: int = 2, length: int = 16, vocab: int = 128, seed: int = 7) -> torch.Tensor:
    """Deterministic token ids (B, T)."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """A megatron GPTModel's logits (B, T, V/TP on each tensor-parallel rank) of ``tokens``, in fp32."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, None).float()


def files_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file in ``path``."""
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


def bit_equal_dicts(a: dict, b: dict) -> bool:
    """Same names, dtypes and bits."""
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def tp_run(spec: dict) -> dict:
    """One spec of the tensor-parallel tests, on this rank (see tests/multirank/test_hf_tp2.py):

    ``logits``: load ``spec["path"]`` into a model of this split, gather the logits over the
    tensor-parallel group and compare with ``spec["reference"]`` (transformers' logits, saved by
    the test); gather every rank's weights and export them: the files, bit for bit?
    ``trained``: load a trainer, train, sleep, export from the host store to ``spec["out"]``, then
    import that into a fresh model: the trained weights, bit for bit?
    ``refused``: what loading ``spec["path"]`` raises.
    ``exactness``: :func:`trainer_runs.exactness`.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from trainer_runs import exactness, setup_parallel

    from chatlearn_mem import TrainerMemoryManager
    from chatlearn_mem.models import gpt, hf

    kind = spec["kind"]
    if kind == "exactness":
        return exactness(spec)
    setup_parallel(spec)
    first = parallel_state.get_tensor_model_parallel_rank() == 0
    if kind == "refused":
        cfg = hf.config_from_hf(spec["path"])
        model = gpt.build_gpt_model(cfg.model_copy(update=dict(vocab_size=128, num_query_groups=2)))
        try:
            hf.load_hf_weights(model, spec["path"])
        except ValueError as e:
            return {"error_text": str(e)}
        return {"error_text": None}
    cfg = hf.config_from_hf(spec["path"])
    if kind == "logits":
        model = gpt.build_gpt_model(cfg)
        read = hf.load_hf_weights(model, spec["path"])
        with torch.no_grad():
            local = megatron_logits(model, tokens())  # (B, T, V / TP)
            logits = gather_from_tensor_model_parallel_region(local.contiguous())
        reference = torch.load(spec["reference"])
        gathered = hf.gather_tensor_parallel({k: v for k, v in model.state_dict().items() if torch.is_tensor(v)})
        exact = bit_equal_dicts(hf.to_hf_state_dict(gathered, cfg), files_state_dict(spec["path"])) if first else None
        return dict(
            diff=(logits - reference).abs().max().item(),
            local_vocab=local.shape[-1],
            read=read,
            file_bytes=sum(t.numel() * t.element_size() for t in files_state_dict(spec["path"]).values()),
            export_exact=exact,
        )
    assert kind == "trained"
    trainer = gpt.build_gpt_trainer(cfg.model_copy(update=dict(lr=1e-2)))
    hf.load_hf_weights(trainer.model, spec["path"], optimizer=trainer.optimizer)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    for step in range(2):
        trainer.train_step(gpt.synthetic_batch(cfg, step, batch_size=2))
    trained = [p.detach().clone() for p in trainer.model.module.parameters()]
    mm.offload()
    gathered = hf.gather_tensor_parallel(mm.weights_state_dict())  # from the host store
    asleep = mm.residency().device_bytes
    if first:
        hf.save_hf(hf.to_hf_state_dict(gathered, cfg), cfg, spec["out"], source=spec["path"])
    dist.barrier()
    fresh = gpt.build_gpt_model(hf.config_from_hf(spec["out"]))
    hf.load_hf_weights(fresh, spec["out"])
    same = len(trained) == len(list(fresh.parameters())) and all(
        torch.equal(a, b) for a, b in zip(trained, fresh.parameters())
    )
    mm.onload()
    return dict(
        asleep_device_bytes=asleep,
        reimport_exact=same,
        changed=not bit_equal_dicts(files_state_dict(spec["out"]), files_state_dict(spec["path"])),
    )
