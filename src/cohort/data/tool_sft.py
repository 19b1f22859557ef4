"""SFT pairs from tool-calling conversations, tokenized exactly as a multi-turn episode's tokens are.

A conversation ``user -> assistant (tool call) -> tool -> assistant (answer)`` becomes one
``(prompt_ids, completion_ids)`` pair per assistant turn: the prompt is everything before the turn (the
chat template's rendering with ``tools=``, up to the assistant header), the completion is the turn through
its end-of-turn token. Pair k + 1's prompt is pair k's prompt and completion followed by the tool turn
that ``render_tool_turn`` gives, the same ids the episode loop appends after a tool call, so a warm start
trains on the sequences GRPO will sample from.

``multiply_sft_pairs`` does this for rows of the built-in ``multiply`` task, with the ``multiply`` tool's
own schema and result text.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from cohort.episodes.catalog import multiply
from cohort.episodes.execution import render_result
from cohort.episodes.templates import render_tool_turn
from cohort.episodes.tools import make_tool
from cohort.errors import ConfigError

__all__ = ["conversation_pairs", "multiply_conversation", "multiply_sft_pairs", "multiply_tool_schemas"]

Pair = tuple[list[int], list[int]]
Messages = Sequence[Mapping[str, Any]]


def multiply_tool_schemas() -> list[dict[str, Any]]:
    """Returns the tool list (``tools=``) of the multiply task: the built-in ``multiply`` tool's JSON schema."""
    return [make_tool(multiply).schema]


def multiply_conversation(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Returns the worked conversation of a ``multiply`` task row: its prompt, a ``multiply`` call with the row's
    factors, the tool's result and the product as the final answer."""
    try:
        a, b = row["factors"]
        prompt = list(row["prompt"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"a multiply task row needs 'prompt' (a list of messages) and 'factors' ([a, b]), got {dict(row)!r}; "
            "make the rows with make_task('multiply', ...)"
        ) from None
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    result = render_result(multiply(a, b))  # the text the episode loop shows the model
    return [
        *prompt,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": result},
        {"role": "assistant", "content": result},
    ]


def _render_ids(tokenizer: Any, messages: Messages, tools: Any, *, add_generation_prompt: bool) -> list[int]:
    """Returns the ids of the chat template's rendering of `messages` (no special tokens added on top)."""
    text = tokenizer.apply_chat_template(
        [dict(m) for m in messages], tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _end_of_turn(tokenizer: Any, end_of_turn: Sequence[int] | None) -> set[int]:
    """Returns the ids that end an assistant turn: `end_of_turn`, else the tokenizer's EOS."""
    if end_of_turn is not None:
        return set(end_of_turn)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(
            "the tokenizer has no EOS token to end an assistant turn; install a tool format "
            "(cohort.episodes.install_tool_format) or pass end_of_turn=[id]"
        )
    return {eos} if isinstance(eos, int) else set(eos)


def _assistant_turn(
    tokenizer: Any, messages: Messages, tools: Any, before: list[int], ends: set[int]
) -> list[int]:
    """Returns the ids of the last message of `messages` (an assistant turn), through its end-of-turn id, given
    the ids `before` it."""
    full = _render_ids(tokenizer, messages, tools, add_generation_prompt=False)
    if full[: len(before)] != before:
        raise ConfigError(
            "the chat template renders the conversation before an assistant turn differently once the turn "
            "follows (it is not prefix-preserving); use a prefix-preserving tool template such as "
            "install_tool_format(tokenizer, 'hermes')"
        )
    cut = next((i + 1 for i in range(len(full) - 1, len(before) - 1, -1) if full[i] in ends), None)
    if cut is None:
        raise ValueError(
            "an assistant turn rendered without an end-of-turn token; pass end_of_turn=[id] with the id the "
            "template ends an assistant turn with"
        )
    return full[len(before) : cut]


def conversation_pairs(
    tokenizer: Any,
    messages: Messages,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    end_of_turn: Sequence[int] | None = None,
) -> list[Pair]:
    """Returns one (prompt ids, completion ids) pair per assistant message of a conversation, tokenized as the
    episode loop tokenizes an episode (tool turns by render_tool_turn).

    `messages` starts with the prompt (system / user messages); each assistant message after it may be
    followed by tool messages (or other non-assistant messages) before the next assistant message. `tools`:
    the JSON schemas the prompt lists. Each completion ends with its end-of-turn id (`end_of_turn`, default
    the tokenizer's EOS), where the loop stops sampling a turn.
    """
    roles = [m.get("role") for m in messages]
    if "assistant" not in roles:
        raise ValueError("conversation_pairs needs a conversation with at least one assistant message")
    first = roles.index("assistant")
    if first == 0:
        raise ValueError("conversation_pairs: the conversation must start with the prompt (a user message)")
    schemas = [dict(t) for t in tools] if tools else None
    ends = _end_of_turn(tokenizer, end_of_turn)
    sequence = _render_ids(tokenizer, messages[:first], schemas, add_generation_prompt=True)
    pairs: list[Pair] = []
    k = first
    while k < len(messages):  # k is an assistant message
        turn = _assistant_turn(tokenizer, messages[: k + 1], schemas, sequence, ends)
        pairs.append((list(sequence), turn))
        sequence = sequence + turn
        following = k + 1
        while following < len(messages) and roles[following] != "assistant":
            following += 1
        if following == k + 1 and following < len(messages):
            raise ValueError(
                f"conversation_pairs: messages {k} and {following} are consecutive assistant turns; put the "
                "tool (or user) messages between them"
            )
        if following < len(messages):  # results that reach the model before its next turn
            sequence = sequence + render_tool_turn(
                tokenizer,
                messages[: k + 1],
                messages[k + 1 : following],
                tools=schemas,
                end_of_turn=list(ends),
            )
        k = following
    return pairs


def multiply_sft_pairs(
    tokenizer: Any,
    rows: Iterable[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    end_of_turn: Sequence[int] | None = None,
) -> list[Pair]:
    """Returns the SFT pairs of ``multiply`` task rows: per row, (prompt -> the tool call turn) and (prompt, call,
    tool result -> the answer turn). `tools` defaults to the multiply tool's schema alone."""
    schemas = multiply_tool_schemas() if tools is None else list(tools)
    pairs: list[Pair] = []
    for row in rows:
        pairs += conversation_pairs(
            tokenizer, multiply_conversation(row), tools=schemas, end_of_turn=end_of_turn
        )
    return pairs
