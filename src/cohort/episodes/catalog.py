"""Built-in tools by name: `multiply` (the tool of the built-in `multiply` task) and the sandboxed `python`.

Each entry is a plain function with type hints and a Google-style docstring, so `make_tool` (transformers'
`get_json_schema`) describes it to the model like any user's tool. A bad argument raises ValueError: the
episode loop returns the error's text to the model as the tool result, so each message says what a valid
call looks like.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cohort.errors import ConfigError
from cohort.sandbox.tool import python

__all__ = ["BUILTIN_TOOLS", "MAX_FACTOR", "builtin_tool", "multiply"]

MAX_FACTOR = 10**12
"""`multiply` takes factors of absolute value below this (12 digits): larger ones are no task of ours, and
a model that writes hundreds of digits should learn from an error, not get a page of digits back."""


def _check_factor(name: str, value: Any) -> int:
    """Returns `value` when it is an integer factor `multiply` accepts; raises ValueError saying why not."""
    # bool is an int subclass, but a model writing `true` has not written a number
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(
            f"multiply takes two whole numbers, but {name}={value!r} is a {type(value).__name__}; "
            f'call it with JSON integers, e.g. {{"a": 4821, "b": 37}}'
        )
    if abs(value) >= MAX_FACTOR:
        raise ValueError(
            f"multiply takes factors of at most 12 digits, but {name} has {len(str(abs(value)))} digits"
        )
    return value


def multiply(a: int, b: int) -> int:
    """Multiplies two integers exactly.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return _check_factor("a", a) * _check_factor("b", b)


BUILTIN_TOOLS: dict[str, Callable[..., Any]] = {
    "multiply": multiply,
    # a fresh sandboxed interpreter per call; for state across calls build a PythonSession and pass its
    # bound `session.python` instead (cohort.sandbox.tool)
    "python": python,
}
"""Built-in tools by the name the model calls them with."""


def builtin_tool(name: str) -> Callable[..., Any]:
    """Returns the built-in tool function called `name`; raises ConfigError listing the names when there is none."""
    try:
        return BUILTIN_TOOLS[name]
    except (KeyError, TypeError):  # TypeError: an unhashable name such as a list
        raise ConfigError(
            f"unknown built-in tool {name!r}; the built-in tools are {sorted(BUILTIN_TOOLS)}, or pass your own "
            f"function (typed arguments and a Google-style docstring) as a tool"
        ) from None
