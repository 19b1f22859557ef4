"""The built-in ``multiply`` task: products of large numbers, which a small model can only get right with a tool.

Each row asks for ``a * b`` as a chat conversation (one user message) that offers the ``multiply`` tool
(``cohort.episodes.catalog``) and asks for the number only. The ``answer`` column is the exact product (the
``accuracy`` reward reads it, from the last assistant message of an episode), ``factors`` is ``[a, b]``
(what a correct tool call passes). By default ``a`` has 3-4 digits and ``b`` 2-4, products of 4-8 digits:
far beyond what a tiny model computes in its head, copied from the tool's reply by one that calls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cohort.data.tasks import Task

__all__ = ["MAX_DIGITS", "MultiplyTask", "multiply_prompt"]

MAX_DIGITS = 9
"""The most digits a factor may have (the ``multiply`` tool accepts up to 12)."""


def multiply_prompt(a: int, b: int) -> list[dict[str, str]]:
    """Returns the task's conversational prompt for ``a * b``: one user message."""
    return [
        {
            "role": "user",
            "content": f"What is {a} * {b}? You may call the multiply tool. Reply with the number only.",
        }
    ]


def _digit_range(key: str, value: Any) -> tuple[int, int]:
    """Returns (fewest, most) digits from ``value``: a number of digits or a ``[min, max]`` pair."""
    pair = (value, value) if isinstance(value, int) and not isinstance(value, bool) else value
    ok = (
        isinstance(pair, Sequence)
        and not isinstance(pair, str)
        and len(pair) == 2
        and all(isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= MAX_DIGITS for d in pair)
        and pair[0] <= pair[1]
    )
    if not ok:
        raise ValueError(
            f"multiply task: {key}={value!r} must be a number of digits in 1..{MAX_DIGITS} or a [min, max] pair "
            f"with 1 <= min <= max <= {MAX_DIGITS}, e.g. {key}: [3, 4]"
        )
    return pair[0], pair[1]


class MultiplyTask(Task):
    """``a * b`` with ``a`` of ``digits_a`` digits and ``b`` of ``digits_b`` digits (each a count or a
    ``[min, max]`` range); rows are ``{"prompt": [user message], "answer": str(a * b), "factors": [a, b]}``."""

    name = "multiply"
    grows_with = ("digits_a", "digits_b")

    def __init__(self, digits_a: int | Sequence[int] = (3, 4), digits_b: int | Sequence[int] = (2, 4)):
        lo_a, hi_a = _digit_range("digits_a", digits_a)
        lo_b, hi_b = _digit_range("digits_b", digits_b)
        # a factor of d digits lies in [10**(d-1), 10**d); one digit starts at 1 (0 needs no tool)
        self.start_a, self.start_b = 10 ** (lo_a - 1), 10 ** (lo_b - 1)
        self.n_a, self.n_b = 10**hi_a - self.start_a, 10**hi_b - self.start_b

    @property
    def size(self) -> int:
        """Returns the number of distinct (a, b) pairs."""
        return self.n_a * self.n_b

    def factors(self, index: int) -> tuple[int, int]:
        """Returns (a, b) of problem number ``index``."""
        if not 0 <= index < self.size:
            raise IndexError(f"multiply task: problem {index} is out of range 0..{self.size - 1}")
        i, j = divmod(index, self.n_b)
        return self.start_a + i, self.start_b + j

    def problem(self, index: int) -> dict[str, Any]:
        """Returns the row of problem number ``index`` (prompt, answer, factors)."""
        a, b = self.factors(index)
        return {"prompt": multiply_prompt(a, b), "answer": str(a * b), "factors": [a, b]}
