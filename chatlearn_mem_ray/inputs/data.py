"""Your prompts: ``data.train_files`` (JSONL or Parquet), tokenized, shuffled by seed, batched, with a
position that run checkpoints keep.

Each row holds a prompt in ``data.prompt_key``: plain text, or a list of chat messages
(``{"role", "content"}``) rendered with the tokenizer's chat template. Every other field of the row
(``answer``, ``ground_truth``, ...) goes to the reward function beside the response. Rows whose
prompt is longer than ``data.max_prompt_tokens`` are dropped (and counted) or refused, as
``data.too_long`` says. The order is a permutation per epoch drawn from ``data.seed``; a batch is
the next ``n`` rows of it (wrapping into the next epoch), and the position (epoch, row) is part of
the loop's state, so a resumed or restarted run continues with exactly the prompts the run left
alone would have seen.

Bad input is one :class:`DataError` (a :class:`chatlearn_mem.ConfigError`) naming the file and row:
a missing file, an unknown format, a row without the prompt field or whose prompt is neither text
nor messages, a file with no rows, and nothing left after filtering.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from chatlearn_mem import ConfigError

__all__ = ["DataConfig", "DataError", "Prompt", "PromptData", "TokenizerConfig", "load_tokenizer", "read_rows"]

INSTALL_PARQUET = "pip install pyarrow (or chatlearn-mem's [text] extra)"


class DataError(ConfigError):
    """A prompt file or row is unusable; the message names the file and row (exit code 2)."""


class TokenizerConfig(BaseModel):
    """The tokenizer of a run on text (``data`` set): prompts encoded, responses decoded."""

    model_config = ConfigDict(extra="forbid")

    path: Optional[Path] = None
    """A Hugging Face tokenizer directory (``AutoTokenizer``, local files only); None: the policy's
    ``from_hf`` directory. ``{output_dir}`` stands for the run's ``output_dir``."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings: a response ends at the first (its text cut there, its tokens after it masked),
    as it ends at the tokenizer's EOS token."""
    log_samples: int = Field(2, ge=0)
    """Sample texts (prompt, response, reward) kept per iteration in ``log.json``; the console shows
    the first one every fifth iteration."""


class DataConfig(BaseModel):
    """Where the prompts come from (``data.*``)."""

    model_config = ConfigDict(extra="forbid")

    train_files: list[Path] = Field(min_length=1)
    """One or more ``.jsonl`` (one JSON object per line) or ``.parquet`` files of prompts."""
    val_files: list[Path] = Field(default_factory=list)
    """Held-out prompts for validation (the ``validation`` section), in the same formats, read and
    checked as ``train_files`` are (every row, in file order, never shuffled); empty: none."""
    prompt_key: str = "prompt"
    """The field holding each prompt: text, or a list of chat messages ``{"role", "content"}``."""
    max_prompt_tokens: int = Field(64, ge=1)
    """Prompts longer than this many tokens (after the chat template) are dropped or refused."""
    too_long: Literal["drop", "error"] = "drop"
    """``drop``: leave such rows out (the count is said at the start and logged); ``error``: stop,
    naming the first such row."""
    shuffle: bool = True
    """A new permutation of the rows every epoch, drawn from ``seed``; False: the files' order."""
    seed: int = 0
    """The shuffle's seed."""
    create: Optional[Literal["copy", "reverse"]] = None
    """Write a built-in task's prompts to the first of ``train_files`` (and its tokenizer into the
    tokenizer's directory) when they do not exist yet: ``reverse`` (see
    :mod:`chatlearn_mem_ray.inputs.text_task`; the ``cpu_grpo_text`` preset); ``copy`` the same strings,
    answered as they are."""

    @field_validator("train_files", "val_files", mode="before")
    @classmethod
    def _one_or_more(cls, v):
        return [v] if isinstance(v, (str, Path)) else v


def load_tokenizer(path: Union[str, Path], vocab_size: Optional[int] = None):
    """The Hugging Face tokenizer in ``path`` (``AutoTokenizer``, local files only).

    Args:
        vocab_size: The policy's; a tokenizer with more tokens is refused.

    Raises:
        DataError: No such directory, no tokenizer in it, or more tokens than the policy has.
    """
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"tokenizer: {path} is not a directory (tokenizer.path, or policy.from_hf)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError("a run on text needs transformers: pip install 'chatlearn-mem[text]'") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # OSError, ValueError: transformers' words for "no tokenizer here"
        found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
        raise DataError(
            f"tokenizer: {path} holds no tokenizer (no tokenizer.json / tokenizer_config.json; it has {found}): "
            f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        ) from None
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise DataError(
            f"tokenizer: {path} has {len(tokenizer)} tokens, more than policy.vocab_size={vocab_size}; "
            "the policy must embed every token"
        )
    return tokenizer


def read_rows(path: Union[str, Path], what: str = "data.train_files") -> list[dict]:
    """The rows of one ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file; ``what``
    names the key it came from in the messages.

    Raises:
        DataError: The file is missing, of another format, a line is not a JSON object, or Parquet
            is asked for without pyarrow.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what}: {path} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        rows = []
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise DataError(f"{path}, line {number}: not JSON ({e})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}, line {number}: a row must be a JSON object, got {type(row).__name__}")
                rows.append(row)
        return rows
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow: {INSTALL_PARQUET}") from None
        return pq.read_table(path).to_pylist()
    raise DataError(f"{what}: {path} is neither .jsonl nor .parquet")


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
        )
    )


@dataclass(frozen=True)
class Prompt:
    """One usable row: its text as the model sees it (the chat template applied), its tokens, and
    the row's other fields (for the reward)."""

    text: str
    tokens: tuple[int, ...]
    fields: dict
    where: str  # "file, row N": for messages that name it


class PromptData:
    """Every usable prompt of ``cfg.train_files`` (or ``cfg.val_files``), tokenized, and the order
    they are served in.

    Args:
        cfg: The ``data`` section.
        tokenizer: A Hugging Face tokenizer (``encode``; ``apply_chat_template`` for messages).
        held_out: Read ``cfg.val_files`` instead (the validation's prompts).

    Attributes:
        prompts: The usable rows, in file order.
        dropped: How many rows were longer than ``max_prompt_tokens`` (``too_long: drop``).
        fields: The fields every usable row has beside the prompt (passed to the reward).

    Raises:
        DataError: See the module's docstring.
    """

    def __init__(self, cfg: DataConfig, tokenizer, held_out: bool = False):
        self.cfg = cfg
        self.prompts: list[Prompt] = []
        self.dropped = 0
        key = cfg.prompt_key
        what, files = ("data.val_files", cfg.val_files) if held_out else ("data.train_files", cfg.train_files)
        for path in files:
            rows = read_rows(path, what)
            if not rows:
                raise DataError(f"{what}: {path} has no rows")
            for number, row in enumerate(rows, 1):
                where = f"{path}, row {number}"
                if key not in row:
                    raise DataError(
                        f"{where} has no field {key!r} (data.prompt_key); its fields: {', '.join(sorted(row)) or 'none'}"
                    )
                value = row[key]
                if isinstance(value, str):
                    text = value
                elif _is_messages(value):
                    text = _render(tokenizer, value, where)
                else:
                    raise DataError(
                        f"{where}: the prompt ({key!r}) must be text or a list of chat messages "
                        f"({{'role', 'content'}}), got {type(value).__name__} {str(value)[:60]!r}"
                    )
                tokens = tuple(tokenizer.encode(text, add_special_tokens=False))
                if not tokens:
                    raise DataError(f"{where}: the prompt is empty once tokenized")
                if len(tokens) > cfg.max_prompt_tokens:
                    if cfg.too_long == "error":
                        raise DataError(
                            f"{where}: the prompt has {len(tokens)} tokens, more than data.max_prompt_tokens="
                            f"{cfg.max_prompt_tokens} (data.too_long=error; drop=leave such rows out)"
                        )
                    self.dropped += 1
                    continue
                fields = {k: v for k, v in row.items() if k != key}
                self.prompts.append(Prompt(text, tokens, fields, where))
        if not self.prompts:
            raise DataError(
                f"no prompt is left: all {self.dropped} row(s) of {what} {', '.join(map(str, files))} are longer "
                f"than data.max_prompt_tokens={cfg.max_prompt_tokens}; raise it"
            )
        common = set(self.prompts[0].fields)
        for p in self.prompts[1:]:
            common &= set(p.fields)
        self.fields = sorted(common)

    def __len__(self) -> int:
        return len(self.prompts)

    def order(self, epoch: int) -> list[int]:
        """The rows' order in ``epoch`` (from 0)."""
        if not self.cfg.shuffle:
            return list(range(len(self.prompts)))
        g = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def batch(self, n: int, cursor: Optional[dict] = None) -> tuple[list[Prompt], dict]:
        """The next ``n`` prompts from ``cursor`` (``{"epoch", "row"}``; None: the start), and the
        cursor after them; a batch that runs past an epoch's end continues in the next one."""
        epoch, row = (cursor or {}).get("epoch", 0), (cursor or {}).get("row", 0)
        out: list[Prompt] = []
        order = self.order(epoch)
        while len(out) < n:
            if row >= len(order):
                epoch, row = epoch + 1, 0
                order = self.order(epoch)
            take = order[row : row + n - len(out)]
            out += [self.prompts[i] for i in take]
            row += len(take)
        return out, {"epoch": epoch, "row": row}


def _render(tokenizer, messages: Sequence[dict], where: str) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            f"{where}: the prompt is a list of chat messages, and the tokenizer has no chat template; "
            "give the prompts as text, or use a tokenizer with one (tokenizer_config.json's chat_template)"
        )
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)
