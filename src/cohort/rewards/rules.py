"""Built-in reward functions, in TRL's calling convention.

Each is called as ``f(prompts=..., completions=..., completion_ids=..., **dataset_columns)`` and
returns one ``float | None`` per completion (None = not applicable to that row). Completions may be
strings or conversational lists ``[{"role": "assistant", "content": ...}]``; a multi-turn episode's
completion is TRL's list of its assistant turns and tool messages, whose answer is its last assistant
message (``final_text``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from cohort.rewards.answers import answers_match

__all__ = [
    "accuracy_reward",
    "completion_text",
    "final_text",
    "format_reward",
    "make_length_reward",
    "make_overlong_reward",
]

RewardFunc = Callable[..., list[float | None]]


def completion_text(completion: Any) -> str:
    """Returns the text of a completion given as a string, a message dict or a list of messages."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        content = completion.get("content")
        if content is None:  # an assistant message that only calls tools may carry content None
            return ""
        if isinstance(content, list):  # multimodal-style content parts
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return str(content)
    if isinstance(completion, (list, tuple)):
        return "".join(completion_text(m) for m in completion)
    raise TypeError(
        f"a completion must be a string or a list of {{'role', 'content'}} messages, got "
        f"{type(completion).__name__}: {str(completion)[:80]}"
    )


def final_text(completion: Any) -> str:
    """Returns the text a completion answers with: for a conversation (messages with roles) the content of its
    last assistant message, "" when it has none; else the whole completion's text (completion_text).

    In a multi-turn episode the tool results are messages too: their text (the product a tool returned) is
    never the policy's answer, and an episode that ends on a tool call answers with what it wrote last.
    """
    if isinstance(completion, (list, tuple)) and any(
        isinstance(message, dict) and "role" in message for message in completion
    ):
        for message in reversed(completion):
            if isinstance(message, dict) and message.get("role") == "assistant":
                return completion_text(message)
        return ""
    return completion_text(completion)


def accuracy_reward(
    completions: Sequence[Any],
    answer: Sequence[Any] | None = None,
    solution: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Returns 1.0 where the completion's final answer (last ``\\boxed{}``, else last number) equals
    the reference, else 0.0; None where the row's reference is None.

    The answer is read from the completion's text, or from its last assistant message when it is a
    conversation (``final_text``): a multi-turn episode's tool results never count as its answer.

    The reference is the ``answer`` column, or TRL's ``solution`` column when there is no ``answer``.
    Numbers compare exactly (``46`` = ``46.0``, ``3/4`` = ``0.75``, ``1,000`` = ``1{,}000`` = ``1000``,
    ``-7``), other answers as text; what that rejects goes through ``math_verify`` when installed.
    """
    column, gold_answers = ("answer", answer) if answer is not None else ("solution", solution)
    if gold_answers is None:
        raise ValueError(
            "accuracy_reward needs the reference answers in an `answer` (or TRL's `solution`) dataset column; "
            f"besides completions it received {sorted(kwargs)}"
        )
    if len(gold_answers) != len(completions):
        raise ValueError(
            f"accuracy_reward: {len(completions)} completions but {len(gold_answers)} answers; the `{column}` "
            "column must hold one entry per completion"
        )
    return [
        None if gold is None else float(answers_match(final_text(c), str(gold)))
        for c, gold in zip(completions, gold_answers)
    ]


accuracy_reward.needs_one_of_columns = ("answer", "solution")  # type: ignore[attr-defined]


_INNER = r"(?:(?!</?(?:think|answer)>).)*"  # any text without another think/answer tag
_FORMAT = re.compile(rf"\s*<think>{_INNER}</think>\s*<answer>{_INNER}</answer>\s*", re.DOTALL)


def format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float | None]:
    """Returns 1.0 where the whole completion is ``<think>...</think><answer>...</answer>`` (whitespace
    allowed around and between the blocks, no repeated or nested tags), else 0.0."""
    return [1.0 if _FORMAT.fullmatch(completion_text(c)) else 0.0 for c in completions]


def _lengths(completion_ids: Sequence[Sequence[int]] | None, who: str, n: int) -> list[int]:
    """Returns the token count of each completion, checking that the ids were passed."""
    if completion_ids is None:
        raise ValueError(f"{who} measures length in tokens and needs completion_ids; pass them to score()")
    if len(completion_ids) != n:
        raise ValueError(f"{who}: {len(completion_ids)} completion_ids rows for {n} completions")
    return [len(ids) for ids in completion_ids]


def make_overlong_reward(max_length: int, buffer: int | None = None) -> RewardFunc:
    """Returns DAPO's soft overlong punishment as a reward function named ``overlong_reward``.

    With L = completion length in tokens, L_max = ``max_length`` and L_cache = ``buffer``
    (default ``max_length // 5``, DAPO's 4096 / 20480): 0 when L <= L_max - L_cache,
    ((L_max - L_cache) - L) / L_cache inside the buffer (linear from 0 down to -1), -1 beyond L_max.
    """
    if not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"overlong reward: max_length={max_length!r} must be a positive integer (tokens)")
    buffer = max(1, max_length // 5) if buffer is None else buffer
    if not isinstance(buffer, int) or not 0 < buffer <= max_length:
        raise ValueError(
            f"overlong reward: buffer={buffer!r} must be an integer in 1..max_length ({max_length})"
        )
    start = max_length - buffer

    def overlong_reward(completions: Sequence[Any], completion_ids=None, **kwargs: Any) -> list[float | None]:
        """Returns DAPO's soft overlong penalty per completion (0, linear to -1 in the buffer, -1 beyond)."""
        lengths = _lengths(completion_ids, "overlong_reward", len(completions))
        return [0.0 if n <= start else -1.0 if n > max_length else (start - n) / buffer for n in lengths]

    overlong_reward.max_length, overlong_reward.buffer = max_length, buffer  # type: ignore[attr-defined]
    return overlong_reward


def make_length_reward(max_length: int) -> RewardFunc:
    """Returns a reward function named ``length_reward``: ``-min(L, max_length) / max_length`` (brevity)."""
    if not isinstance(max_length, int) or max_length <= 0:
        raise ValueError(f"length reward: max_length={max_length!r} must be a positive integer (tokens)")

    def length_reward(completions: Sequence[Any], completion_ids=None, **kwargs: Any) -> list[float | None]:
        """Returns minus the completion's length as a fraction of max_length, in [-1, 0]."""
        lengths = _lengths(completion_ids, "length_reward", len(completions))
        return [-min(n, max_length) / max_length for n in lengths]

    length_reward.max_length = max_length  # type: ignore[attr-defined]
    return length_reward
