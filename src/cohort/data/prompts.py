"""Turn prompts into token ids: plain text as is, conversations through the tokenizer's chat template.

Special tokens follow transformers' and TRL's defaults. A plain-text prompt is tokenized with
``add_special_tokens=True``, so it gets whatever the tokenizer adds by itself (the BOS of Llama-,
Mistral- and Gemma-family tokenizers; nothing for Qwen's or the tiny demo tokenizer). A chat-formatted
prompt is tokenized with ``add_special_tokens=False``, as ``apply_chat_template(tokenize=True)`` does:
the rendered template already holds the BOS its model wants. Either way, a BOS that would appear twice
at the start (a plain prompt that already begins with the BOS text) is kept once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["as_completions", "encode_prompts", "is_conversational", "prompt_text"]

Prompt = str | list[dict[str, Any]]

_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "tokenize", "add_generation_prompt"})
"""Arguments of ``apply_chat_template`` that cohort sets itself; chat_template_kwargs may not override them."""


def is_conversational(prompt: Any) -> bool:
    """Returns True for a list of ``{"role", "content"}`` messages, False for a plain string."""
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt)


def as_completions(texts: Sequence[str], prompt: Any) -> list[str] | list[list[dict[str, str]]]:
    """Returns decoded completion texts in the format of ``prompt``'s dataset, as reward functions get them:
    one ``[{"role": "assistant", "content": text}]`` each for a conversational prompt, else the strings."""
    if is_conversational(prompt):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)


def _template_kwargs(chat_template_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """Returns ``chat_template_kwargs`` as a dict after checking its type and keys."""
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, Mapping):
        raise TypeError(
            f"chat_template_kwargs must be a dict of template variables such as {{'enable_thinking': False}}, "
            f"got {type(chat_template_kwargs).__name__}: {str(chat_template_kwargs)[:80]}"
        )
    bad = sorted(str(k) for k in chat_template_kwargs if not isinstance(k, str))
    if bad:
        raise TypeError(f"chat_template_kwargs keys must be strings, got {bad}")
    clash = sorted(_RESERVED_TEMPLATE_KWARGS & set(chat_template_kwargs))
    if clash:
        raise ValueError(
            f"chat_template_kwargs may not set {clash}: cohort renders prompts with tokenize=False and "
            "add_generation_prompt=True itself"
        )
    return dict(chat_template_kwargs)


def _render(
    tokenizer: Any,
    prompt: Prompt,
    chat_template: bool | None,
    template_kwargs: dict[str, Any],
) -> tuple[str, bool]:
    """Returns (the text to tokenize, whether the chat template produced it)."""
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
                "(auto) or True (data.chat_template in a config, --chat-template auto or on on the command line), or "
                "give plain-text prompts"
            )
        assert isinstance(prompt, str)
        return prompt, False
    if not conversational and chat_template is None:
        assert isinstance(prompt, str)
        return prompt, False
    if getattr(tokenizer, "chat_template", None) is None and "chat_template" not in template_kwargs:
        raise ValueError(
            f"the tokenizer {type(tokenizer).__name__} has no chat template, which "
            f"{'conversational prompts need' if conversational else 'chat_template=True needs'}; use "
            "plain-text prompts with chat_template=None, or a tokenizer that ships a template "
            "(an instruct model, or set tokenizer.chat_template)"
        )
    messages = prompt if conversational else [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, **template_kwargs
    )
    return text, True


def prompt_text(
    tokenizer: Any,
    prompt: Prompt,
    *,
    chat_template: bool | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """Returns the exact text that is tokenized for ``prompt`` (the chat-formatted text when a template applies).

    ``chat_template``: None = use the template only for conversational prompts; True = also wrap a
    plain string as one user message; False = never (conversational prompts are then an error).
    ``chat_template_kwargs``: extra variables for the template, passed to ``apply_chat_template``
    (e.g. ``{"enable_thinking": False}`` for Qwen3); unused for prompts the template does not format.
    """
    return _render(tokenizer, prompt, chat_template, _template_kwargs(chat_template_kwargs))[0]


def _drop_doubled_bos(row: list[int], bos: int | None) -> list[int]:
    """Returns ``row`` without its first token when the first two are both the BOS token."""
    if bos is not None and len(row) > 1 and row[0] == bos and row[1] == bos:
        return row[1:]
    return row


def encode_prompts(
    tokenizer: Any,
    prompts: Sequence[Prompt],
    *,
    chat_template: bool | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Returns one list of token ids per prompt (chat template per ``chat_template``, see :func:`prompt_text`).

    Plain text gets the tokenizer's own special tokens (``add_special_tokens=True``), chat-formatted
    text none beyond what the template wrote; a BOS doubled at the start is kept once.
    """
    template_kwargs = _template_kwargs(chat_template_kwargs)
    rendered = [_render(tokenizer, p, chat_template, template_kwargs) for p in prompts]
    ids: list[list[int]] = [[] for _ in rendered]
    for templated in (False, True):
        index = [i for i, (_, t) in enumerate(rendered) if t is templated]
        if index:
            encoded = tokenizer([rendered[i][0] for i in index], add_special_tokens=not templated)[
                "input_ids"
            ]
            for i, row in zip(index, encoded):
                ids[i] = list(row)
    bos = getattr(tokenizer, "bos_token_id", None)
    ids = [_drop_doubled_bos(row, bos) for row in ids]
    for i, row in enumerate(ids):
        if not row:
            raise ValueError(
                f"prompt {i} ({rendered[i][0]!r}) encodes to no tokens; every prompt needs at least one"
            )
    return ids
