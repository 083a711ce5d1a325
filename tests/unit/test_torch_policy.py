"""A torch-native policy on the colocation service (``policy.backend: torch``), without Ray: its
config and declarations refuse what it cannot do, and its actors, run in this process, build a
Hugging Face Llama, train it under the torch-native manager, hand its weights to the rollout copy
from the host store, and never import megatron (checked in a fresh interpreter)."""

import subprocess
import sys

import pytest
import torch

from chatlearn_mem import ConfigError, Part
from chatlearn_mem_ray import load_grpo_config
from chatlearn_mem_ray.config import TrainerModelConfig
from chatlearn_mem_ray.service.declare import EVERYTHING, DeclarationError, Model, Phase, check_declarations

LLAMA = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=64,
    seq_length=16,
    precision="fp32",
    normalization="RMSNorm",
    activation="swiglu",
    position_embedding="rope",
    add_bias_linear=False,
)


def test_the_preset_is_a_torch_llama():
    cfg = load_grpo_config("cpu_grpo_torch", [])
    assert cfg.policy.backend == "torch" and cfg.parallel.tensor_model_parallel_size == 1


def test_what_a_torch_policy_cannot_do_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(
        ConfigError, match="backend: torch builds a Hugging Face Llama or Qwen2: a Llama or Qwen2 model needs"
    ):
        load_grpo_config("cpu_grpo", ["policy.backend=torch"])  # a GPT: LayerNorm, gelu, learned positions
    with pytest.raises(ConfigError, match="policy.backend is torch, which trains in data parallel only"):
        load_grpo_config("cpu_grpo_torch", ["parallel.world_size=2", "parallel.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match="rollout.engine: vllm starts the engine from the policy's Hugging Face"):
        load_grpo_config("cpu_grpo_torch", ["rollout.engine=vllm"])  # vLLM, yes, but from a checkpoint
    vllm = ["rollout.engine=vllm", f"policy.from_hf={tmp_path / 'hf'}", "policy.create_hf=true"]
    assert load_grpo_config("cpu_grpo_torch", vllm).rollout.engine == "vllm"


def test_declarations_keep_a_torch_trainer_and_its_copies_together():
    torch_cfg = TrainerModelConfig(backend="torch", **LLAMA)
    megatron_cfg = TrainerModelConfig(**LLAMA)
    assert Model.trainer("policy", torch_cfg).backend == "torch"
    given = Model.trainer("policy", megatron_cfg, backend="torch")
    assert given.backend == "torch" and given.config.backend == "torch"
    phases = [Phase("train", needs={"policy": EVERYTHING, "critic": EVERYTHING})]
    models = [
        Model.trainer("policy", torch_cfg),
        Model.trainer("critic", torch_cfg, head="value"),
        Model.engine("rollout", megatron_cfg, follows="policy"),
    ]
    with pytest.raises(DeclarationError) as e:
        check_declarations(models, phases + [Phase("generate", needs={"rollout": "weights"})], 1)
    assert "trainer 'critic' is torch-native, which has an lm head only" in str(e.value)
    assert "engine 'rollout' copies the model of trainer 'policy', but its config says backend 'megatron'" in str(
        e.value
    )


def test_the_actors_train_sleep_and_sync_a_torch_policy_in_process():
    from chatlearn_mem_ray.actors import TorchInferenceActor, TorchTrainerActor
    from chatlearn_mem_ray.loops.grpo.losses import grpo_loss

    config = TrainerModelConfig(backend="torch", **LLAMA).model_dump()
    policy = TorchTrainerActor("policy_0", "lm", config, {})
    assert policy.setup(0, 1, 1, "") == {"rank": 0, "dp_rank": 0, "dp_size": 1, "tp_rank": 0}
    rollout = TorchInferenceActor("rollout", config, {})
    rollout.setup("")
    assert policy.weights_digest() == rollout.weights_digest()[0]  # the same seed, the same init
    sizes = policy.part_sizes()  # before the first step: what AdamW's will allocate
    params = sum(p.numel() * p.element_size() for p in policy.trainer.lm.parameters())
    assert sizes["optimizer_states"] == 2 * params and sizes["main_weights"] == 0

    tokens, old, lengths = rollout.generate_rows([[1, 2, 3, 4]] * 8, 6, 1.0, seed=0)
    mask = torch.zeros(8, tokens.shape[1] - 1)
    mask[:, 3:] = 1
    batch = {"tokens": tokens, "old_logprobs": old, "advantages": torch.linspace(-1, 1, 8), "mask": mask}
    loss = lambda out, mb: grpo_loss(  # noqa: E731
        out, mb, clip_low=0.2, clip_high=0.28, kl_coef=0.0, token_sum=False, response_length=6
    )
    metrics = policy.train(batch, loss, epochs=1, minibatch_size=4, seed=0, entropy=True)
    assert metrics["skipped_steps"] == 0 and metrics["grad_norm"] > 0 and metrics["entropy"] > 0
    assert policy.residency()["by_part"]["other"] == 0  # the step's gradients dropped with it

    policy.offload()  # asleep: the weights go to the rollout from the host store
    assert policy.residency()["device_bytes"] == 0
    state, dims, digest = policy.weights_for_sync(with_digest=True)
    assert set(dims.values()) == {-1} and "lm_head.weight" in state
    rollout.load_weights(dims, state)
    assert rollout.weights_digest() == [digest]
    policy.onload()
    with torch.no_grad():
        assert torch.equal(policy.forward(tokens), rollout.logprobs(tokens))  # the same numbers
    assert policy.audit() == [] and rollout.audit() == []
    policy.offload([Part.WEIGHTS, "main_weights"])  # the service's "every part": one it has not is skipped
    policy.onload()


def test_the_actors_modules_never_import_megatron():
    code = "\n".join(
        [
            "import sys",
            f"sys.path[:0] = {sys.path!r}",
            "from chatlearn_mem_ray.actors import TorchInferenceActor, TorchTrainerActor",
            "from chatlearn_mem_ray.config import TrainerModelConfig",
            f"c = TrainerModelConfig(backend='torch', **{LLAMA!r}).model_dump()",
            "a = TorchTrainerActor('p', 'lm', c, {}); a.setup(0, 1, 1, ''); a.offload(); a.onload()",
            "r = TorchInferenceActor('r', c, {}); r.setup(''); r.generate_rows([[1, 2]], 3, 1.0, 0)",
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))",
        ]
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_torch_policy_streams_its_host_store_in_hugging_face_naming_as_an_export_would(tied, tmp_path):
    """What the vLLM rollout takes from a torch-native policy (``hf_weight_buckets``): every tensor of
    the model once, in Hugging Face naming (a tied head's second name left out, as a checkpoint
    leaves it), in buckets, as views of the host store while the policy sleeps; the same tensors
    a Hugging Face export of the same weights holds."""
    from chatlearn_mem.models import hf
    from chatlearn_mem_ray.actors import TorchTrainerActor
    from chatlearn_mem_ray.actors.wire import from_wire

    config = TrainerModelConfig(backend="torch", share_embeddings_and_output_weights=tied, **LLAMA)
    policy = TorchTrainerActor("policy_0", "lm", config.model_dump(), {})
    policy.setup(0, 1, 1, "")
    policy.offload()
    streamed = [pair for bucket in policy.hf_weight_buckets(4096) for pair in from_wire(bucket)]
    names = [n for n, _ in streamed]
    assert names == list(hf.hf_shapes(config)) and len(set(names)) == len(names)
    assert ("lm_head.weight" in names) is not tied
    assert max(len(b) for b in policy.hf_weight_buckets(4096)) < len(names)  # in buckets, not one
    policy.onload()  # the host store stays as it was: the streamed views still hold the weights sent
    own = dict(policy.trainer.lm.state_dict())
    assert all(torch.equal(t, own[n]) for n, t in streamed)
    assert hf.hf_digest(streamed) == hf.hf_digest((n, own[n]) for n in names)
    private, _ = policy.stream_peak_rss_bytes()
    assert private >= 0
    with pytest.raises(TypeError, match="hf_weight_buckets"):
        next(policy.megatron_weight_buckets(1, 4096))


def test_hf_named_buckets_refuses_weights_of_another_model():
    from chatlearn_mem.models import hf

    config = TrainerModelConfig(backend="torch", **LLAMA)
    good = {n: torch.zeros(s) for n, s in hf.hf_shapes(config).items()}
    assert sum(len(b) for b in hf.hf_named_buckets(good, config, 2**20)) == len(good)
    with pytest.raises(ValueError, match="lacks model.norm.weight"):
        hf.hf_named_buckets({k: v for k, v in good.items() if k != "model.norm.weight"}, config, 2**20)
    with pytest.raises(ValueError, match="has model.extra.weight, which the model does not have"):
        hf.hf_named_buckets({**good, "model.extra.weight": torch.zeros(1)}, config, 2**20)
    with pytest.raises(ValueError, match="model.norm.weight: .*bfloat16"):
        hf.hf_named_buckets({**good, "model.norm.weight": good["model.norm.weight"].bfloat16()}, config, 2**20)
    with pytest.raises(ValueError, match="bucket_bytes must be positive"):
        hf.hf_named_buckets(good, config, 0)


def test_a_torch_policy_without_transformers_is_one_error_line_before_ray(tmp_path, monkeypatch):
    """backend: torch builds a Hugging Face model: without transformers the run stops before Ray,
    naming the model and the extra (it failed in the actors' setup, Ray started, before)."""
    import importlib.util

    from typer.testing import CliRunner

    from chatlearn_mem_cli.app import app

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else find_spec(name, *a)
    )
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["grpo", "--config", "cpu_grpo_torch", f"output_dir={out}"])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: policy is a torch-native model (backend: torch), built with transformers")
    assert "pip install 'chatlearn-mem[hf]'" in result.output and "actors" not in result.output
