"""Your reward: ``reward.function``, called with the prompts' texts, the responses' texts and each row's
other fields, returning one score per response.

A reward function is any Python callable::

    def my_reward(prompts: list[str], responses: list[str], **fields) -> list[float] | dict[str, list[float]]:
        # fields: every other field of the rows, one list each (answer=[...], ground_truth=[...])
        return [1.0 if r.strip() == a.strip() else 0.0 for r, a in zip(responses, fields["answer"])]

named ``"package.module:function"`` or ``"path/to/file.py:function"`` (the same names TRL's
``reward_funcs`` and verl's ``custom_reward_function`` take). A dict return holds the reward under
``"reward"`` and more named scores to log (their means go in ``log.json``). Built in:

- ``exact_match``: 1 when the response, stripped, equals the row's ``answer`` (or ``ground_truth``);
- ``math``: 1 when the response's final answer (GSM8K's ``#### 42``, or the last ``\\boxed{...}``)
  equals the row's as a number (``1,234`` = ``1234``, ``0.50`` = ``0.5``, ``3/4`` = ``0.75``);
- ``token_range``: the toy rule on random token ids, for runs without ``data`` (its reward is the
  fraction of response tokens in ``task``'s range).

The function is imported and its signature checked before Ray starts; it runs in a Ray task beside
the phases that follow generation (:func:`score_remote`), and its seconds are logged. A function
that cannot be imported or called with ``(prompts, responses, **fields)`` is a
:class:`RewardConfigError` (exit code 2); one that raises (the sample named), returns another count
or a non-finite score is a :class:`RewardError` that stops the run (its checkpoints intact).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from pydantic import BaseModel, ConfigDict

from chatlearn_mem import ConfigError
from chatlearn_mem_ray.errors import RunError

__all__ = [
    "BUILTIN",
    "RewardConfig",
    "RewardConfigError",
    "RewardError",
    "exact_match",
    "final_answer",
    "load_reward_function",
    "math_answer",
    "score",
    "score_remote",
]


class RewardConfig(BaseModel):
    """How responses are scored (see this module)."""

    model_config = ConfigDict(extra="forbid")

    function: str = "token_range"
    """``token_range`` (the toy rule on random token ids, runs without ``data``), ``exact_match``,
    ``math``, or your own: ``"package.module:function"`` or ``"path/to/file.py:function"``, called
    with ``(prompts, responses, **fields)`` (the texts and each row's other fields) and returning one
    float per response, or a dict with them under ``"reward"`` and more named scores to log."""


class RewardConfigError(ConfigError):
    """``reward.function`` cannot be imported or called as a reward (exit code 2, before Ray starts)."""


class RewardError(RunError):
    """The reward function raised, returned another count of scores, or a non-finite score; the
    message names the function and the sample."""


# -- the built-ins ----------------------------------------------------------------------------
def _truth(fields: Mapping[str, Sequence], n: int) -> list[str]:
    for key in ("answer", "ground_truth"):
        if key in fields:
            return [str(v) for v in fields[key]]
    raise RewardError(
        f"this reward compares with each row's 'answer' or 'ground_truth' field; the rows have {sorted(fields)}"
    )


def exact_match(prompts: list[str], responses: list[str], **fields) -> list[float]:
    """1.0 when the response, stripped, equals the row's ``answer`` (or ``ground_truth``), else 0.0."""
    return [float(r.strip() == a.strip()) for r, a in zip(responses, _truth(fields, len(responses)))]


_NUMBER = r"-?[\d,]*\.?\d+(?:/\d+)?"


def final_answer(text: str) -> Optional[str]:
    """The final answer of a math response: after GSM8K's last ``####``, else the last
    ``\\boxed{...}``, else None."""
    hashes = re.findall(r"####\s*([^\n]*)", text)
    if hashes:
        return hashes[-1].strip()
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return boxed[-1].strip() if boxed else None


def _number(text: Optional[str]) -> Optional[Fraction]:
    if text is None:
        return None
    m = re.search(_NUMBER, text.replace("$", ""))
    if m is None:
        return None
    try:
        return Fraction(m.group(0).replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def math_answer(prompts: list[str], responses: list[str], **fields) -> list[float]:
    """1.0 when the response's :func:`final_answer` equals the row's as a number, else 0.0. The
    row's ``answer`` may be a whole GSM8K solution (its ``#### 42`` is taken) or the number alone."""
    out = []
    for r, a in zip(responses, _truth(fields, len(responses))):
        want = _number(final_answer(a) or a)
        got = _number(final_answer(r))
        out.append(float(want is not None and got is not None and got == want))
    return out


BUILTIN: dict[str, Callable] = {"exact_match": exact_match, "math": math_answer}
"""The built-in text rewards by name (``token_range`` scores token ids: see :mod:`chatlearn_mem_ray.inputs.tasks`)."""


# -- loading ------------------------------------------------------------------------------------
def load_reward_function(spec: str, fields: Sequence[str] = (), sys_path: Sequence[str] = ()) -> Callable:
    """The callable ``spec`` names (a built-in, ``package.module:function`` or ``file.py:function``),
    checked to accept ``(prompts, responses, **fields)`` with ``fields`` the rows' other fields.

    Args:
        sys_path: Directories put on ``sys.path`` first (the driver's, in a Ray task).

    Raises:
        RewardConfigError: Naming the function and what is wrong.
    """
    if spec in BUILTIN:
        return BUILTIN[spec]
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        raise RewardConfigError(
            f"reward.function={spec!r}: give 'package.module:function', 'path/to/file.py:function' or a built-in "
            f"({', '.join(BUILTIN)})"
        )
    for p in sys_path:
        if p not in sys.path:
            sys.path.append(p)
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise RewardConfigError(f"reward.function={spec!r}: {path} does not exist")
            module_spec = importlib.util.spec_from_file_location(f"chatlearn_reward_{path.stem}", path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except RewardConfigError:
        raise
    except Exception as e:  # ImportError, SyntaxError, anything the module raises on import
        raise RewardConfigError(f"reward.function={spec!r} cannot be imported: {type(e).__name__}: {e}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardConfigError(f"reward.function={spec!r}: {where} has no function {name!r}")
    try:
        inspect.signature(fn).bind(["prompt"], ["response"], **{k: ["value"] for k in fields})
    except TypeError as e:
        raise RewardConfigError(
            f"reward.function={spec!r} must accept (prompts, responses, **fields) with the rows' fields "
            f"{list(fields)}: {e}"
        ) from None
    except ValueError:  # a builtin without a signature: let the first call tell
        pass
    return fn


# -- scoring --------------------------------------------------------------------------------------
def _sample(prompts: Sequence[str], responses: Sequence[str], i: int) -> str:
    return f"sample {i} (prompt {prompts[i][:60]!r}, response {responses[i][:60]!r})"


def score(
    fn: Callable, spec: str, prompts: list[str], responses: list[str], fields: Mapping[str, list]
) -> tuple[list[float], dict[str, float]]:
    """``fn``'s scores of ``responses``, checked: one finite float each; and the means of any
    other named scores it returned.

    Raises:
        RewardError: It raised (the first sample it raises on alone is named), returned another
            count, or a non-finite score (the sample named).
    """
    n = len(responses)
    try:
        out = fn(list(prompts), list(responses), **{k: list(v) for k, v in fields.items()})
    except Exception as e:
        for i in range(n):  # which sample? one at a time
            try:
                fn([prompts[i]], [responses[i]], **{k: [v[i]] for k, v in fields.items()})
            except Exception as one:
                raise RewardError(
                    f"reward.function {spec} raised on {_sample(prompts, responses, i)}: {type(one).__name__}: {one}"
                ) from one
        raise RewardError(f"reward.function {spec} raised on the batch of {n}: {type(e).__name__}: {e}") from e
    extra: dict[str, float] = {}
    if isinstance(out, Mapping):
        if "reward" not in out:
            raise RewardError(f"reward.function {spec} returned a dict without 'reward' (keys: {sorted(out)})")
        for k, v in out.items():
            if k != "reward":
                vs = [float(x) for x in v]
                extra[k] = sum(vs) / len(vs) if vs else float("nan")
        out = out["reward"]
    try:
        scores = [float(x) for x in (out.tolist() if hasattr(out, "tolist") else out)]
    except (TypeError, ValueError) as e:
        raise RewardError(
            f"reward.function {spec} must return a list of floats, got {type(out).__name__}: {e}"
        ) from None
    if len(scores) != n:
        raise RewardError(f"reward.function {spec} returned {len(scores)} score(s) for {n} responses")
    for i, s in enumerate(scores):
        if not math.isfinite(s):
            raise RewardError(f"reward.function {spec} returned {s} for {_sample(prompts, responses, i)}")
    return scores, extra


def _score_task(spec: str, prompts, responses, fields, sys_path) -> dict:
    t0 = time.perf_counter()
    fn = load_reward_function(spec, list(fields), sys_path)
    scores, extra = score(fn, spec, prompts, responses, fields)
    return {"scores": scores, "extra": extra, "seconds": time.perf_counter() - t0}


def score_remote(spec: str, prompts: list[str], responses: list[str], fields: Mapping[str, list]) -> Any:
    """Start scoring in a Ray task (no CPU reserved: it runs beside the phases that follow), so the
    devices' work goes on meanwhile; ``ray.get`` of the returned ref gives ``{"scores", "extra",
    "seconds"}`` or raises (:func:`unwrap` turns a task's :class:`RewardError` back into one)."""
    import ray

    task = ray.remote(num_cpus=0, max_retries=0)(_score_task)
    return task.remote(spec, list(prompts), list(responses), dict(fields), [p for p in sys.path if p])


def unwrap(error: BaseException) -> BaseException:
    """The :class:`RewardError` (or :class:`RewardConfigError`) a Ray task raised, else ``error``."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, (RewardError, RewardConfigError)) else error
