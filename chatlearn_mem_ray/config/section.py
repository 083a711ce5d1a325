"""The base of every config section: a pydantic model whose unknown keys are errors (a typo is one,
with its dotted key, not a setting silently ignored)."""

from pydantic import BaseModel, ConfigDict

__all__ = ["Section"]


class Section(BaseModel):
    """A config section (``ray``, ``memory``, ``grpo``, ...; a loop's own section too)."""

    model_config = ConfigDict(extra="forbid")
