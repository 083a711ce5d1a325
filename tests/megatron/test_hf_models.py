"""Llama and Qwen2 trainers from Hugging Face checkpoints (one rank): the forward agrees with
``transformers``, import and export are bit-exact, the optimizer starts from the loaded weights,
offload/onload stays exact on the new architecture, and bad checkpoints are refused before any
tensor is written. Two tensor-parallel ranks: tests/multirank/test_hf_tp2.py."""

import json
import os

import pytest
import torch
from hf_checkpoints import bit_equal_dicts, files_state_dict, hf_logits, make_checkpoint, megatron_logits, tokens
from trainer_runs import TRANSITIONS, assert_exact, bit_equal, snapshot

from chatlearn_mem import TrainerMemoryManager
from chatlearn_mem.mcore import layout
from chatlearn_mem.models import gpt

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
hf = pytest.importorskip("chatlearn_mem.models.hf")

TOLERANCE = 1e-5  # fp32 logits, megatron vs transformers (measured: below 1e-6 on these models)

CASES = {
    f"{family}-{attn}-{tie}": dict(family=family, kv_heads=kv, tied=tie == "tied")
    for family in ("llama", "qwen2")
    for attn, kv in (("mha", 4), ("gqa", 2))
    for tie in ("untied", "tied")
}

ARCH = dict(
    normalization="RMSNorm",
    norm_epsilon=1e-6,
    activation="swiglu",
    ffn_hidden_size=96,
    position_embedding="rope",
    rotary_base=10000.0,
    num_query_groups=2,
    add_bias_linear=False,
    add_qkv_bias=True,
)
"""A Qwen2-shaped model with random init: the new architecture in the layout tests."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """``name -> checkpoint directory`` for every case, made once."""
    root = tmp_path_factory.mktemp("hf")
    return {name: make_checkpoint(str(root / name), **case) for name, case in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_forward_agrees_with_transformers_and_import_export_is_exact(dist1, ckpts, name):
    path = ckpts[name]
    cfg = hf.config_from_hf(path)
    assert cfg.precision == "fp32" and cfg.share_embeddings_and_output_weights == CASES[name]["tied"]
    model = gpt.build_gpt_model(cfg)
    read = hf.load_hf_weights(model, path)
    files = files_state_dict(path)
    assert read == sum(t.numel() * t.element_size() for t in files.values())  # one rank reads all of it
    x = tokens()
    diff = (megatron_logits(model, x) - hf_logits(path, x)).abs().max().item()
    print(f"{name}: max |logits diff| = {diff:.2e}")
    assert diff < TOLERANCE, f"{name}: logits differ by {diff}"
    assert bit_equal_dicts(hf.to_hf_state_dict(model, cfg), files)  # import then export: the files, bit for bit


def test_trained_model_exports_asleep_and_imports_bit_exactly(dist1, tmp_path):
    """bf16 Qwen2 GQA: load, train, sleep, export from the host store, save; transformers loads the
    directory and a fresh model imports exactly the trained weights."""
    src = make_checkpoint(str(tmp_path / "src"), family="qwen2", kv_heads=2, dtype=torch.bfloat16)
    cfg = hf.config_from_hf(src, lr=1e-2)
    assert cfg.precision == "bf16"
    trainer = gpt.build_gpt_trainer(cfg)
    hf.load_hf_weights(trainer.model, src, optimizer=trainer.optimizer)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    for step in range(2):
        trainer.train_step(gpt.synthetic_batch(cfg, step, batch_size=2))
    trained = {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()}
    mm.offload()
    exported = hf.to_hf_state_dict(mm.weights_state_dict(), cfg)  # from the host store, no onload
    assert mm.residency().device_bytes == 0
    assert not bit_equal_dicts(exported, files_state_dict(src))  # it trained
    out = tmp_path / "out"
    hf.save_hf(exported, cfg, out, source=src)
    assert bit_equal_dicts(files_state_dict(out), exported)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    fresh = gpt.build_gpt_model(hf.config_from_hf(out))
    hf.load_hf_weights(fresh, out)
    assert bit_equal([p for _, p in fresh.named_parameters()], list(trained.values()))
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
    assert torch.equal(loaded.model.layers[1].self_attn.k_proj.bias, exported["model.layers.1.self_attn.k_proj.bias"])
    mm.onload()
    mm.close()


@pytest.mark.parametrize("distopt", [True, False], ids=["distopt", "float16opt"])
def test_optimizer_starts_from_the_loaded_weights(dist1, tmp_path, distopt):
    """Two trainers of different random inits, both loaded from one checkpoint after their optimizers
    exist, train identically: nothing of the random init survives in the fp32 main weights."""
    src = make_checkpoint(str(tmp_path / "src"), family="llama", kv_heads=2, dtype=torch.bfloat16)
    data = hf.config_from_hf(src)  # the same batches for both (synthetic_batch draws from the seed)
    runs = []
    for seed in (1, 2):
        cfg = hf.config_from_hf(src, seed=seed, use_distributed_optimizer=distopt)
        trainer = gpt.build_gpt_trainer(cfg)
        hf.load_hf_weights(trainer.model, src, optimizer=trainer.optimizer)
        main = [t for leaf in layout.leaf_optimizers(trainer.optimizer) for t in layout.main_weights(leaf)]
        assert main and all(t.dtype == torch.float32 for t in main)
        losses = [trainer.train_step(gpt.synthetic_batch(data, s, batch_size=2)) for s in range(2)]
        runs.append((losses, snapshot(trainer)))
    assert runs[0][0] == runs[1][0]
    assert bit_equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("distopt", [True, False], ids=["distopt", "float16opt"])
@pytest.mark.parametrize("transitions", list(TRANSITIONS))
def test_offload_onload_is_exact_on_the_llama_architecture(dist1, transitions, distopt):
    between, config = TRANSITIONS[transitions]
    cfg = dict(precision="bf16", use_distributed_optimizer=distopt, share_embeddings_and_output_weights=True, **ARCH)
    assert_exact(cfg, steps=4, between=between, config=config)


def test_estimated_part_bytes_match_the_llama_architecture(dist1):
    config = gpt.GPTTrainerConfig(precision="bf16", **ARCH)
    trainer = gpt.build_gpt_trainer(config)
    mm = TrainerMemoryManager(trainer.model, trainer.optimizer)
    trainer.train_step(gpt.synthetic_batch(config, 0, batch_size=2))
    measured = mm.residency().by_category
    for part, nbytes in gpt.estimate_part_bytes(config).items():
        assert abs(nbytes - measured[part]) <= 0.001 * measured[part] + 256, (part, nbytes, measured[part])
    mm.close()


# -- bad input: one line naming the fix, and the model untouched -------------------------------


@pytest.fixture
def llama(tmp_path):
    return make_checkpoint(str(tmp_path / "llama"), family="llama", kv_heads=2)


def _rewrite(path, drop=(), add=None, config=None):
    """Rewrite a checkpoint in place: drop tensors, add ``{name: tensor}``, update config.json keys."""
    from safetensors.torch import save_file

    tensors = {k: v for k, v in files_state_dict(path).items() if k not in drop}
    tensors.update(add or {})
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    if config:
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg.update(config)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)


def _untouched_after(model, fn, match):
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=match) as err:
        fn()
    assert "\n" not in str(err.value)
    assert bit_equal(before, [p.detach() for p in model.parameters()]), "the model was half loaded"


def test_checkpoint_errors_name_the_tensor_and_leave_the_model_untouched(dist1, llama):
    model = gpt.build_gpt_model(hf.config_from_hf(llama))
    last = "model.layers.1.mlp.down_proj.weight"  # the last tensor the loader would write
    good = files_state_dict(llama)[last].clone()

    _rewrite(llama, drop=[last])
    _untouched_after(model, lambda: hf.load_hf_weights(model, llama), f"tensor {last} is missing")
    _rewrite(llama, add={last: good, "model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)})
    _untouched_after(model, lambda: hf.load_hf_weights(model, llama), "model.layers.2.mlp.up_proj.weight is not part")
    _rewrite(llama, drop=["model.layers.2.mlp.up_proj.weight"], add={last: torch.zeros(64, 100)})
    _untouched_after(model, lambda: hf.load_hf_weights(model, llama), rf"{last} has shape \[64, 100\].*\[64, 128\]")
    _rewrite(llama, add={last: good})
    other = gpt.build_gpt_model(hf.config_from_hf(llama).model_copy(update=dict(ffn_hidden_size=64)))
    _untouched_after(other, lambda: hf.load_hf_weights(other, llama), "ffn_hidden_size=64 .config.json: 128")
    hf.load_hf_weights(model, llama)  # repaired: it loads


def test_dtype_and_feature_errors(dist1, tmp_path):
    fp16 = make_checkpoint(str(tmp_path / "fp16"), dtype=torch.float16)
    with pytest.raises(ValueError, match="is F16; trainers train in bf16 or fp32: convert"):
        hf.config_from_hf(fp16)
    model = gpt.build_gpt_model(hf.config_from_hf(make_checkpoint(str(tmp_path / "ok"))))
    with pytest.raises(ValueError, match="is F16"):
        hf.load_hf_weights(model, fp16)


def test_a_critic_takes_the_trunk_and_keeps_a_fresh_value_head(dist1, tmp_path):
    src = make_checkpoint(str(tmp_path / "src"), family="llama", kv_heads=2, dtype=torch.bfloat16, tied=True)
    cfg = hf.config_from_hf(src)
    critic = gpt.build_gpt_trainer(cfg, value_head=True)
    head = critic.model.module.head.weight.detach().clone()
    hf.load_hf_weights(critic.model, src, optimizer=critic.optimizer)
    files = files_state_dict(src)
    trunk = critic.model.module.trunk
    assert torch.equal(trunk.embedding.word_embeddings.weight, files["model.embed_tokens.weight"])
    assert torch.equal(trunk.decoder.layers[1].mlp.linear_fc2.weight, files["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(critic.model.module.head.weight, head)


def test_weights_split_over_several_files_load_the_same(dist1, llama):
    from safetensors.torch import save_file

    files = files_state_dict(llama)
    model = gpt.build_gpt_model(hf.config_from_hf(llama))
    hf.load_hf_weights(model, llama)
    names = sorted(files)
    os.remove(os.path.join(llama, "model.safetensors"))
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        save_file({n: files[n] for n in part}, os.path.join(llama, f"model-0000{i + 1}-of-00002.safetensors"))
    other = gpt.build_gpt_model(hf.config_from_hf(llama).model_copy(update=dict(seed=9)))
    hf.load_hf_weights(other, llama)
    assert bit_equal(list(model.parameters()), list(other.parameters()))
