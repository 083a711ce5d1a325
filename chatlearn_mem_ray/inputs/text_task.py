"""Text tasks a tiny model learns from scratch by RL on a CPU: copy a short string, or reverse it.

``cpu_grpo_text`` writes, under its output directory and only when they are missing, a prompt file
(``data.create: copy`` or ``reverse``) and a held-out one for validation (:data:`HELD_OUT` strings
never trained on) and a character-level tokenizer (a real ``tokenizer.json``
made with the ``tokenizers`` library: a few dozen symbols, an EOS and a padding token) into the
policy's Hugging Face directory, beside the random checkpoint ``policy.create_hf`` writes. Each
prompt is a string of ``LETTERS`` ended by ``.``, then ``=`` (``"abd.="``); the answer is the
string (``"abd"``) or the string reversed (``"dba"``), stored in the row's ``answer`` field.
:func:`position_reward` gives partial credit: the share of positions the response gets right,
over the longer of the two, so a response must stop (at EOS, or at the stop string ``.``) to
score 1.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Union

__all__ = ["HELD_OUT", "LETTERS", "SYMBOLS", "TASKS", "position_reward", "write_task", "write_tokenizer"]

LETTERS = "abcd"
"""The alphabet of the prompts."""
SYMBOLS = "abcdefghijklmnopqrstuvwxyz=+-*.0123456789 "
"""What the tokenizer knows beside its special tokens (a random policy samples all of them)."""
SPECIAL = ("<pad>", "</s>")
EXTRA_COST = 0.25
"""What :func:`position_reward` takes off per character past the answer."""
END = "."
"""Ends each prompt's string (``"abd.="``): a response that copies it stops there, as ``cpu_grpo_text``
makes ``.`` a stop string (``tokenizer.stop``)."""


def write_tokenizer(directory: Union[str, Path]) -> None:
    """A character-level tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
    ``special_tokens_map.json``) in ``directory``: ``<pad>`` 0, ``</s>`` (EOS) 1, then
    :data:`SYMBOLS` one token each; decoding joins the characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIAL, *SYMBOLS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # every character a token
    tok.decoder = decoders.Fuse()  # and back without spaces between them
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")
    fast.save_pretrained(str(directory))


TASKS = {"copy": lambda s: s, "reverse": lambda s: s[::-1]}
"""The built-in tasks: the answer to a string."""


HELD_OUT = 16
"""Strings the built-in tasks keep out of their training prompts, for validation (of the 84 strings of
1 to 3 letters)."""


def write_task(
    task: str,
    path: Union[str, Path],
    rows: int = 256,
    length: int = 3,
    seed: int = 0,
    held_out: int = HELD_OUT,
    split: str = "train",
) -> None:
    """Prompts ``<string>.=`` of 1 to ``length`` letters of :data:`LETTERS` with their answers
    (:data:`TASKS`), as JSONL at ``path``. The strings are shuffled by ``seed``; the first
    ``held_out`` of them are the validation's (``split="val"``: each once), the others the training
    prompts' (``split="train"``: ``rows`` rows, every string in a shuffled cycle). Strings of several
    lengths put the ``.`` where a letter stands in longer ones: copying it (and so stopping) is then
    part of copying."""
    strings = ["".join(s) for n in range(1, length + 1) for s in itertools.product(LETTERS, repeat=n)]
    random.Random(seed).shuffle(strings)
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    chosen = strings[:held_out] if split == "val" else strings[held_out:]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(len(chosen) if split == "val" else rows):
            s = chosen[i % len(chosen)]
            f.write(json.dumps({"prompt": f"{s}{END}=", "answer": TASKS[task](s)}) + "\n")


def position_reward(prompts: list[str], responses: list[str], answer: list[str], **fields) -> dict[str, list[float]]:
    """The share of the answer's positions a response gets right, less ``EXTRA_COST`` for every
    character past the answer's length (so a response scores 1 only when it stops there, and a
    long one cannot win by chance); and ``exact``, 1 for a response that is the answer."""
    scores, exact = [], []
    for r, a in zip(responses, answer):
        right = sum(x == y for x, y in zip(r, a))
        scores.append(right / max(len(a), 1) - EXTRA_COST * max(0, len(r) - len(a)))
        exact.append(float(r == a))
    return {"reward": scores, "exact": exact}
