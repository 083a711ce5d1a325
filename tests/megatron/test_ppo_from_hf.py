"""The PPO app's actors start from the policy's Hugging Face checkpoint (in this process, without
Ray): the policy, rollout and reference hold its tensors bit for bit, the critic its trunk."""

import pytest
from hf_checkpoints import bit_equal_dicts, files_state_dict

from chatlearn_mem_ray import load_config
from chatlearn_mem_ray.actors import InferenceActor, TrainerActor
from chatlearn_mem_ray.job.prepare import prepare_hf_checkpoint

pytest.importorskip("transformers", reason="the [hf] extra (transformers) is not installed")
hf = pytest.importorskip("chatlearn_mem.models.hf")


def test_the_tiny_llama_preset_starts_every_model_from_its_checkpoint(dist1, tmp_path):
    cfg = load_config("cpu_tiny_llama", [f"output_dir={tmp_path}"])
    lines = []
    prepare_hf_checkpoint(cfg, lines.append)  # what the run does first
    ckpt = tmp_path / "hf_tiny_llama"
    assert lines[0] == f"wrote a randomly initialised LlamaForCausalLM to {ckpt}"
    # then which architecture each trainer took from where (the checkpoint decides, issue 58)
    assert [line.split(":")[0] for line in lines[1:]] == ["policy", "critic"]
    assert all(f"LlamaForCausalLM from {ckpt / 'config.json'}: 2 layers, hidden 64" in line for line in lines[1:])
    files = files_state_dict(cfg.policy.from_hf)
    memory = cfg.memory.manager.model_dump()
    policy = TrainerActor("policy_0", "lm", cfg.policy.model_dump(), memory)
    critic = TrainerActor("critic_0", "value", cfg.critic.model_dump(), memory)
    reference = InferenceActor("reference", cfg.policy.model_dump(), memory)
    for trainer in (policy, critic):
        trainer.setup(0, 1, 1, "unused")  # joins the test's process group (dist1)
    reference.setup("unused")
    assert bit_equal_dicts(hf.to_hf_state_dict(policy.manager.weights_state_dict(), cfg.policy), files)
    assert bit_equal_dicts(hf.to_hf_state_dict(reference.manager.weights_state_dict(), cfg.policy), files)
    trunk = {k.removeprefix("trunk."): v for k, v in critic.manager.weights_state_dict().items() if "trunk." in k}
    assert bit_equal_dicts(
        {"model.embed_tokens.weight": trunk["embedding.word_embeddings.weight"]},
        {"model.embed_tokens.weight": files["model.embed_tokens.weight"]},
    )
    for a in (policy, critic, reference):
        a.manager.close()
