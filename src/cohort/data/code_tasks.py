"""The built-in ``code`` task: one-line Python functions (and stdin programs) a tiny model can learn to write.

Written for cohort. Each problem is a template with a number in it, e.g. ``# add 7 to x`` whose solution is
``def f(x):\\n    return x+7``; the row's ``tests`` are assert statements on ``f`` (or, for the two
stdin/stdout templates, ``{"input", "output"}`` cases of a program reading a number). The prompt is the spec
as a comment line; the completion is the whole program, run by the ``code`` reward against the tests. There
are 16 templates and 1,170 problems; train and held-out problems are disjoint (``make_task``), so held-out
problems pair a template with numbers the model has not seen with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cohort.data.tasks import Task

__all__ = ["CODE_TEMPLATES", "CodeTask", "CodeTemplate"]


@dataclass(frozen=True)
class CodeTemplate:
    """One family of problems: a spec and a solution with a number ``{a}`` in them, and how to test them."""

    spec: str
    """The task in words, with ``{a}``; the prompt is ``# <spec>\\n``."""
    solution: str
    """The reference program, with ``{a}``."""
    values: range
    """The numbers ``a`` takes."""
    reference: Callable[[int, Any], Any]
    """``reference(a, x)``: what the solution returns for input x (or prints, for stdin templates)."""
    inputs: tuple[Any, ...] | Callable[[int], tuple[Any, ...]]
    """The test inputs (arguments of ``f``, or numbers written to stdin), or a function of ``a`` giving them
    (inputs around ``a`` tell a right comparison from a near miss)."""
    stdin: bool = False
    """Whether the program reads its input from stdin and is tested by stdin/stdout cases."""

    def tests(self, a: int) -> list[Any]:
        """Returns the row's tests for number `a`: assert statements, or stdin/stdout cases."""
        inputs = self.inputs(a) if callable(self.inputs) else self.inputs
        if self.stdin:
            return [{"input": f"{x}\n", "output": f"{self.reference(a, x)}\n"} for x in inputs]
        return [f"assert f({x!r}) == {self.reference(a, x)!r}" for x in inputs]


def _function(arg: str, body: str) -> str:
    """Returns the solution text of a one-line function ``f(arg)``."""
    return f"def f({arg}):\n    return {body}"


_NUMBERS = (0, 5, 12, -3)
_POSITIVE = (3, 10, 47, 100)
_WORDS = ("hello", "abcdefghijk", "xy")
_LISTS = ((1, 2, 3), (4, 4, 0, 4), ())

CODE_TEMPLATES: tuple[CodeTemplate, ...] = (
    CodeTemplate("add {a} to x", _function("x", "x+{a}"), range(1, 100), lambda a, x: x + a, _NUMBERS),
    CodeTemplate("subtract {a} from x", _function("x", "x-{a}"), range(1, 100), lambda a, x: x - a, _NUMBERS),
    CodeTemplate("multiply x by {a}", _function("x", "x*{a}"), range(2, 100), lambda a, x: x * a, _NUMBERS),
    CodeTemplate(
        "x modulo {a}",
        _function("x", "x%{a}"),
        range(2, 100),
        lambda a, x: x % a,
        lambda a: (*_POSITIVE, a + 5),
    ),
    CodeTemplate(
        "x squared plus {a}", _function("x", "x*x+{a}"), range(1, 100), lambda a, x: x * x + a, _NUMBERS
    ),
    CodeTemplate(
        "is x greater than {a}",
        _function("x", "x>{a}"),
        range(1, 100),
        lambda a, x: x > a,
        lambda a: (0, a, a + 1),
    ),
    CodeTemplate(
        "is x divisible by {a}",
        _function("x", "x%{a}==0"),
        range(2, 50),
        lambda a, x: x % a == 0,
        lambda a: (7, a, a + 1, 3 * a),
    ),
    CodeTemplate(
        "the larger of x and {a}", _function("x", "max(x,{a})"), range(1, 100), max, (*_NUMBERS, 150)
    ),
    CodeTemplate(
        "the smaller of x and {a}", _function("x", "min(x,{a})"), range(1, 100), min, (*_NUMBERS, 150)
    ),
    CodeTemplate("repeat s {a} times", _function("s", "s*{a}"), range(2, 10), lambda a, s: s * a, _WORDS),
    CodeTemplate(
        "first {a} letters of s", _function("s", "s[:{a}]"), range(1, 10), lambda a, s: s[:a], _WORDS
    ),
    CodeTemplate(
        "last {a} letters of s", _function("s", "s[-{a}:]"), range(1, 10), lambda a, s: s[-a:], _WORDS
    ),
    CodeTemplate(
        "add {a} to each item of xs",
        _function("xs", "[v+{a} for v in xs]"),
        range(1, 100),
        lambda a, xs: [v + a for v in xs],
        tuple(list(xs) for xs in _LISTS),
    ),
    CodeTemplate(
        "count items of xs equal to {a}",
        _function("xs", "xs.count({a})"),
        range(0, 10),
        lambda a, xs: xs.count(a),
        ([1, 2, 3], [4, 4, 0, 4], [], [0, 1, 0, 5, 9]),
    ),
    CodeTemplate(
        "read n, print n times {a}",
        "print(int(input())*{a})",
        range(2, 100),
        lambda a, x: x * a,
        (3, -4),
        True,
    ),
    CodeTemplate(
        "read n, print n plus {a}",
        "print(int(input())+{a})",
        range(1, 100),
        lambda a, x: x + a,
        (0, 17),
        True,
    ),
)
"""The code task's problem families, in index order."""


class CodeTask(Task):
    """Write ``f`` (or a stdin program) from a one-line spec; rows are ``{"prompt", "tests"}`` (module docstring).

    Args:
        stdin: include the two stdin/stdout templates (else only assert-tested functions).
    """

    name = "code"

    def __init__(self, stdin: bool = True):
        if not isinstance(stdin, bool):
            raise ValueError(f"code task: stdin={stdin!r} must be true or false")
        self.templates = tuple(t for t in CODE_TEMPLATES if stdin or not t.stdin)
        self._solutions: dict[str, str] | None = None

    @property
    def size(self) -> int:
        """Returns the number of distinct problems (every template with every one of its numbers)."""
        return sum(len(t.values) for t in self.templates)

    def _locate(self, index: int) -> tuple[CodeTemplate, int]:
        """Returns the template and number of problem `index`."""
        if not 0 <= index < self.size:
            raise IndexError(f"code task: problem {index} is out of range 0..{self.size - 1}")
        for template in self.templates:
            if index < len(template.values):
                return template, template.values[index]
            index -= len(template.values)
        raise AssertionError("unreachable: index checked against size")

    def problem(self, index: int) -> dict[str, Any]:
        """Returns ``{"prompt": "# add 7 to x\\n", "tests": [...]}`` for problem number `index`."""
        template, a = self._locate(index)
        return {"prompt": f"# {template.spec.format(a=a)}\n", "tests": template.tests(a)}

    def solution(self, index: int) -> str:
        """Returns the reference program of problem number `index`."""
        template, a = self._locate(index)
        return template.solution.format(a=a)

    def sft_completion(self, row: dict[str, Any]) -> str:
        """Returns the reference program for `row` (found by its prompt)."""
        if self._solutions is None:
            self._solutions = {self.problem(i)["prompt"]: self.solution(i) for i in range(self.size)}
        try:
            return self._solutions[row["prompt"]]
        except KeyError:
            raise ValueError(f"code task: {row.get('prompt')!r} is not one of the task's prompts") from None
