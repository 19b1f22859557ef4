"""Turn prompts into token ids: plain text as is, conversations through the tokenizer's chat template.

Special tokens are never added by the tokenizer call itself (``add_special_tokens=False``): a chat
template already writes the BOS it wants, and plain-text prompts are fed exactly as written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["as_completions", "encode_prompts", "is_conversational", "prompt_text"]

Prompt = str | list[dict[str, Any]]


def is_conversational(prompt: Any) -> bool:
    """Returns True for a list of ``{"role", "content"}`` messages, False for a plain string."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def as_completions(texts: Sequence[str], prompt: Any) -> list[str] | list[list[dict[str, str]]]:
    """Returns decoded completion texts in the format of ``prompt``'s dataset, as reward functions get them:
    one ``[{"role": "assistant", "content": text}]`` each for a conversational prompt, else the strings."""
    if is_conversational(prompt):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)


def prompt_text(tokenizer: Any, prompt: Prompt, *, chat_template: bool | None = None) -> str:
    """Returns the exact text that is tokenized for ``prompt`` (the chat-formatted text when a template applies).

    ``chat_template``: None = use the template only for conversational prompts; True = also wrap a
    plain string as one user message; False = never (conversational prompts are then an error).
    """
    if chat_template not in (None, True, False):
        raise ValueError(f"chat_template={chat_template!r} must be None (auto), True or False")
    conversational = is_conversational(prompt)
    if not conversational and not isinstance(prompt, str):
        raise TypeError(
            f"a prompt must be a string or a list of {{'role', 'content'}} messages, got "
            f"{type(prompt).__name__}: {str(prompt)[:80]}"
        )
    if chat_template is False:
        if conversational:
            raise ValueError(
                "chat_template=False but the prompt is a list of messages; set chat_template to None "
                "(auto) or True, or give plain-text prompts"
            )
        assert isinstance(prompt, str)
        return prompt
    if not conversational and chat_template is None:
        assert isinstance(prompt, str)
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"the tokenizer {type(tokenizer).__name__} has no chat template, which "
            f"{'conversational prompts need' if conversational else 'chat_template=True needs'}; use "
            "plain-text prompts with chat_template=None, or a tokenizer that ships a template "
            "(an instruct model, or set tokenizer.chat_template)"
        )
    messages = prompt if conversational else [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_prompts(
    tokenizer: Any, prompts: Sequence[Prompt], *, chat_template: bool | None = None
) -> list[list[int]]:
    """Returns one list of token ids per prompt (chat template per ``chat_template``, see :func:`prompt_text`)."""
    texts = [prompt_text(tokenizer, p, chat_template=chat_template) for p in prompts]
    if not texts:
        return []
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    for i, row in enumerate(ids):
        if not row:
            raise ValueError(
                f"prompt {i} ({texts[i]!r}) encodes to no tokens; every prompt needs at least one"
            )
    return [list(row) for row in ids]
