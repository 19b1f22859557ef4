"""Built-in synthetic arithmetic tasks with a seeded, disjoint train / held-out split.

Each task enumerates a finite space of problems; index ``i`` of that space maps to exactly one prompt,
so drawing distinct indices gives distinct prompts and the two splits can never share a problem.
The held-out rows are drawn first, so for a given seed the held-out set does not change when
``n_train`` does (runs with different training budgets evaluate on the same problems).

Prompts are short plain text ("12+34=") so that a tiny character-level model can learn them.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["TASKS", "AdditionTask", "MultistepTask", "Task", "get_task", "make_task", "sft_completion"]


class Task:
    """A finite, enumerable space of problems: ``problem(i)`` for ``0 <= i < size`` gives distinct rows."""

    name: str = ""
    grows_with: tuple[str, ...] = ()
    """The task_options that enlarge the space (named when a run asks for more problems than it has)."""

    @property
    def size(self) -> int:
        """Returns the number of distinct problems in the space."""
        raise NotImplementedError

    def problem(self, index: int) -> dict[str, Any]:
        """Returns row ``index`` of the space: ``{"prompt": str, "answer": str}``."""
        raise NotImplementedError

    def sft_completion(self, row: dict[str, Any]) -> str:
        """Returns the supervised target text for ``row`` (no EOS: the caller appends the EOS id)."""
        return str(row["answer"])


class AdditionTask(Task):
    """``a+b=`` with ``a`` of up to ``digits_a`` digits and ``b`` of up to ``digits_b`` digits; answer ``a+b``."""

    name = "addition"
    grows_with = ("digits_a", "digits_b")

    def __init__(self, digits_a: int = 2, digits_b: int = 2):
        for key, value in (("digits_a", digits_a), ("digits_b", digits_b)):
            if not isinstance(value, int) or not 1 <= value <= 9:
                raise ValueError(f"addition task: {key}={value!r} must be an integer in 1..9")
        self.n_a, self.n_b = 10**digits_a, 10**digits_b

    @property
    def size(self) -> int:
        """Returns the number of distinct (a, b) pairs."""
        return self.n_a * self.n_b

    def problem(self, index: int) -> dict[str, Any]:
        """Returns ``{"prompt": "a+b=", "answer": str(a + b)}`` for pair number ``index``."""
        a, b = divmod(index, self.n_b)
        return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


class MultistepTask(Task):
    """Chains of 3-4 single-digit operands with ``+ - *`` and the usual precedence, e.g. ``3+4*2-5=``.

    With ``worked=True`` the SFT target shows one reduction per step, multiplications first, then
    left to right: ``3+4*2-5=`` -> ``3+8-5=11-5=6``. The final answer is always the last number.
    """

    name = "multistep"
    grows_with = ("max_operands", "max_operand")

    def __init__(
        self,
        min_operands: int = 3,
        max_operands: int = 4,
        max_operand: int = 9,
        operators: str = "+-*",
        worked: bool = True,
    ):
        if not 2 <= min_operands <= max_operands <= 8:
            raise ValueError(
                f"multistep task: need 2 <= min_operands ({min_operands}) <= max_operands ({max_operands}) <= 8"
            )
        if not isinstance(max_operand, int) or not 1 <= max_operand <= 99:
            raise ValueError(f"multistep task: max_operand={max_operand!r} must be an integer in 1..99")
        if not operators or len(set(operators)) != len(operators) or set(operators) - set("+-*"):
            raise ValueError(
                f"multistep task: operators={operators!r} must be distinct characters from '+-*'"
            )
        self.min_operands, self.max_operands = min_operands, max_operands
        self.n_values = max_operand + 1  # operands 0..max_operand
        self.operators = operators
        self.worked = worked

    def _block(self, k: int) -> int:
        """Returns how many problems have exactly ``k`` operands."""
        return self.n_values**k * len(self.operators) ** (k - 1)

    @property
    def size(self) -> int:
        """Returns the number of distinct expressions over all operand counts."""
        return sum(self._block(k) for k in range(self.min_operands, self.max_operands + 1))

    def problem(self, index: int) -> dict[str, Any]:
        """Returns ``{"prompt": "3+4*2-5=", "answer": "6"}`` for expression number ``index``."""
        k = self.min_operands
        while index >= self._block(k):
            index -= self._block(k)
            k += 1
        operands = []
        for _ in range(k):
            index, v = divmod(index, self.n_values)
            operands.append(v)
        ops = []
        for _ in range(k - 1):
            index, o = divmod(index, len(self.operators))
            ops.append(self.operators[o])
        steps = reduction_steps(operands, ops)
        return {"prompt": _render(operands, ops) + "=", "answer": steps[-1]}

    def sft_completion(self, row: dict[str, Any]) -> str:
        """Returns the worked chain ``"3+8-5=11-5=6"`` (or just the answer when ``worked=False``)."""
        if not self.worked:
            return str(row["answer"])
        operands, ops = parse_expression(row["prompt"].rstrip("="))
        return "=".join(reduction_steps(operands, ops)[1:]) or str(row["answer"])


def _render(operands: list[int], ops: list[str]) -> str:
    """Returns the expression text, e.g. ``[3, 4], ['*']`` -> ``"3*4"``."""
    out = [str(operands[0])]
    for op, v in zip(ops, operands[1:]):
        out += [op, str(v)]
    return "".join(out)


def parse_expression(text: str) -> tuple[list[int], list[str]]:
    """Returns (operands, operators) of an expression like ``"-3+4*2"`` (a leading minus is a sign)."""
    operands: list[int] = []
    ops: list[str] = []
    i, n = 0, len(text)
    while i < n:
        j = i + 1 if text[i] == "-" and (i == 0 or text[i - 1] in "+-*") else i
        while j < n and text[j].isdigit():
            j += 1
        if j == i or not text[i:j].lstrip("-").isdigit():
            raise ValueError(f"cannot parse arithmetic expression {text!r} at position {i}")
        operands.append(int(text[i:j]))
        if j < n:
            if text[j] not in "+-*":
                raise ValueError(
                    f"unexpected character {text[j]!r} in expression {text!r}; only + - * allowed"
                )
            ops.append(text[j])
            j += 1
        i = j
    if len(operands) != len(ops) + 1:
        raise ValueError(f"expression {text!r} ends with an operator")
    return operands, ops


def reduction_steps(operands: list[int], ops: list[str]) -> list[str]:
    """Returns the expression after each single reduction, first the input and last the value."""
    operands, ops = list(operands), list(ops)
    steps = [_render(operands, ops)]
    while ops:
        # multiplication binds tighter; among equals, the leftmost goes first
        i = ops.index("*") if "*" in ops else 0
        a, b, op = operands[i], operands[i + 1], ops[i]
        value = a * b if op == "*" else a + b if op == "+" else a - b
        operands[i : i + 2] = [value]
        del ops[i]
        steps.append(_render(operands, ops))
    return steps


TASKS: dict[str, type[Task]] = {"addition": AdditionTask, "multistep": MultistepTask}
"""Built-in task classes by name."""


def get_task(name: str | Task, **params: Any) -> Task:
    """Returns the task object for a built-in task name (or ``name`` itself when it is already a Task)."""
    if isinstance(name, Task):
        return name
    if name not in TASKS:
        raise ValueError(
            f"unknown task {name!r}; built-in tasks are {sorted(TASKS)} (or give a JSONL dataset)"
        )
    try:
        return TASKS[name](**params)
    except TypeError as exc:
        raise ValueError(
            f"data.task_options for task {name!r}: unsupported parameters {sorted(params)} ({exc})"
        ) from None


def make_task(
    name: str | Task, *, n_train: int, n_eval: int, seed: int = 0, **params: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Returns (train rows, held-out rows) of distinct problems, reproducible from ``seed``, never overlapping."""
    task = get_task(name, **params)
    for key, value in (("n_train", n_train), ("n_eval", n_eval)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"make_task: {key}={value!r} must be a non-negative integer")
    if n_train + n_eval > task.size:
        grow = (
            f", or enlarge the task with data.task_options ({', '.join(task.grows_with)})"
            if task.grows_with
            else ""
        )
        raise ValueError(
            f"task {task.name!r} has only {task.size} distinct problems but n_train + n_eval = "
            f"{n_train + n_eval} (data.n_train={n_train}, data.n_eval={n_eval}); lower them to sum to at most "
            f"{task.size}{grow}"
        )
    rng = random.Random(seed)
    seen: set[int] = set()
    indices: list[int] = []
    while len(indices) < n_train + n_eval:
        i = rng.randrange(task.size)
        if i not in seen:
            seen.add(i)
            indices.append(i)
    rows = [task.problem(i) for i in indices]
    return rows[n_eval:], rows[:n_eval]


def sft_completion(task: str | Task, row: dict[str, Any]) -> str:
    """Returns the SFT target text of a task row (without EOS, which the encoder appends as a token id).

    A row with a ``"completion"`` column (e.g. from ``cohort sample``) keeps its own completion.
    """
    if "completion" in row:
        return str(row["completion"])
    return get_task(task).sft_completion(row)
