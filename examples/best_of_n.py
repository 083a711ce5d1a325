"""A loop of your own on the colocation service: best-of-n rejection sampling, then a supervised
step on the winners (the shape of RAFT / ReST / expert iteration), on a CPU-only machine.

Each iteration samples ``n`` responses per prompt, keeps the best-scored one of each prompt, and
trains the policy to imitate the winners (cross-entropy on their response tokens). Two models
(the policy trainer and its rollout) and two phases; the service wakes each phase's models, audits
them, records the memory timeline and puts them back to sleep, and ``run_loop`` gives the loop
checkpoints, ``--resume``, restarts and SIGTERM handling. The loop's own state (the best winners'
reward so far, the winners kept) is saved with every checkpoint.

Run it (``[ray]`` installed; about a minute on 2 cores)::

    python examples/best_of_n.py                          # 12 iterations of the built-in task
    python examples/best_of_n.py best_of_n.n=8 checkpoint.every=4 output_dir=runs/bon

It prints one line per iteration and the memory figure (peak colocated / largest phase), and
writes ``log.json`` and ``memory_timeline.png`` to ``output_dir``. See docs/service.md.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field

from chatlearn_mem_ray import EVERYTHING, TASKS, WEIGHTS, Loop, LoopConfig, Model, Phase, load_config, run_loop


class BestOfN(BaseModel):
    """The loop's own section of the config: ``best_of_n.*`` on the command line."""

    model_config = ConfigDict(extra="forbid")
    iterations: int = Field(12, ge=1)
    """Sample-and-imitate rounds."""
    prompts_per_iteration: int = Field(8, ge=1)
    """Prompts per round (random token ids on the built-in task)."""
    n: int = Field(4, ge=2)
    """Responses sampled per prompt; the best one is kept."""
    prompt_length: int = Field(4, ge=1)
    response_length: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0)
    epochs: int = Field(2, ge=1)
    """Passes over the winners."""
    minibatch_size: int = Field(4, ge=1)
    seed: int = 0


class BestOfNConfig(LoopConfig):
    """What every loop shares (policy, rollout, task, memory, Ray, checkpoints) plus ``best_of_n``."""

    loop_section = "best_of_n"
    best_of_n: BestOfN = Field(default_factory=BestOfN)
    output_dir: Path = Path("runs/best_of_n")


def sft_loss(logprobs: torch.Tensor, mb: dict, *, prompt_length: int):
    """Cross-entropy of the winners' response tokens: ``-mean log p``. ``logprobs`` (b, T-1)."""
    loss = -logprobs[:, prompt_length - 1 :].mean()
    return loss, {}


class BestOfNLoop(Loop):
    """Best-of-n sampling, then imitation of the winners."""

    name = "best_of_n"
    title = "best-of-n + SFT"
    legend = "reward: mean over all samples, best: mean of the kept winners, loss: cross-entropy on the winners"
    cfg: BestOfNConfig

    def __init__(self, cfg: BestOfNConfig):
        super().__init__(cfg)
        self.best_so_far = 0.0  # the loop's own state: saved with every checkpoint
        self.winners_kept = 0

    def models(self) -> list[Model]:
        return [
            Model.trainer("policy", self.cfg.policy),
            Model.engine("rollout", self.cfg.policy, follows="policy", rollout=self.cfg.rollout),
        ]

    def phases(self) -> list[Phase]:
        return [
            Phase("generate", needs={"rollout": WEIGHTS}),
            Phase("train", needs={"policy": EVERYTHING}),
        ]

    def step(self, svc, index: int) -> dict:
        b, task = self.cfg.best_of_n, self.cfg.task
        P, n = b.prompt_length, b.n
        g = torch.Generator().manual_seed(b.seed * 7919 + index)
        prompts = torch.randint(0, self.cfg.policy.vocab_size, (b.prompts_per_iteration, P), generator=g)

        with svc.phase("generate") as p:
            if svc.stale("rollout"):  # the policy trained since the last sync
                p.sync("policy", "rollout")
            batch = prompts.repeat_interleave(n, dim=0)  # (prompts * n, P)
            tokens, _ = p.call("rollout", "generate", batch, b.response_length, b.temperature, index)[0]

        scores = TASKS[task.name](tokens[:, P:], task).view(-1, n)  # (prompts, n)
        best = scores.argmax(dim=1)  # the first of the best, per prompt
        winners = tokens.view(-1, n, tokens.shape[1])[torch.arange(len(best)), best]  # (prompts, P + R)

        with svc.phase("train") as p:
            metrics = p.train(
                "policy",
                {"tokens": winners},
                functools.partial(sft_loss, prompt_length=P),
                epochs=b.epochs,
                minibatch_size=b.minibatch_size,
                seed=b.seed + index,
                temperature=b.temperature,
            )
        kept = scores.max(dim=1).values.mean().item()
        self.best_so_far = max(self.best_so_far, kept)
        self.winners_kept += len(best)
        return {"reward": scores.mean().item(), "best": kept, "loss": metrics["loss"], "best_so_far": self.best_so_far}

    def state_dict(self) -> dict:
        return {"best_so_far": self.best_so_far, "winners_kept": self.winners_kept}

    def load_state_dict(self, state: dict) -> None:
        self.best_so_far = state.get("best_so_far", 0.0)
        self.winners_kept = state.get("winners_kept", 0)

    def progress_line(self, m: dict) -> str:
        return f"reward {m['reward']:.3f} best {m['best']:.3f} loss {m['loss']:.4f}"


def main(argv: list[str]) -> int:
    from chatlearn_mem import ConfigError
    from chatlearn_mem_ray import RunError

    try:
        cfg = load_config(
            None, [*argv, *(["ray.num_cpus=2"] if not any(a.startswith("ray.") for a in argv) else [])], BestOfNConfig
        )
        run_loop(BestOfNLoop, cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
