"""Final-answer extraction and comparison for math rewards.

The answer of a completion is the content of its last ``\\boxed{...}``, or else its last number.
Numbers compare exactly as fractions, so ``0.75``, ``3/4``, ``\\frac{3}{4}`` and ``0.750`` are equal
and ``1,000`` equals ``1000``. A minus sign right after a digit, letter or closing bracket is read as
subtraction, not as a sign: the last number of ``"11-5"`` is ``5``, of ``"=-13"`` it is ``-13``.
"""

from __future__ import annotations

import re
from fractions import Fraction
from functools import lru_cache

__all__ = ["answers_match", "extract_answer", "extract_boxed", "last_number", "parse_number"]

_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_NUMBER = re.compile(rf"(?:(?<![\w)\]}}])-)?(?:{_UNSIGNED})(?:\s*/\s*(?:{_UNSIGNED}))?")
_WHOLE_NUMBER = re.compile(rf"(?:{_UNSIGNED})")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_boxed(text: str) -> str | None:
    """Returns the content of the last ``\\boxed{...}`` (nested braces allowed), or None if there is none."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def _delatex(text: str) -> str:
    """Returns ``text`` with ``\\frac{a}{b}`` rewritten as ``a/b`` and math-mode decoration removed."""
    text = _FRAC.sub(r"(\1)/(\2)", text)
    for junk in ("$", "\\!", "\\,", "\\left", "\\right", "\\%", "%"):
        text = text.replace(junk, "")
    return text


def last_number(text: str) -> str | None:
    """Returns the last number in ``text`` (thousands commas removed, ``a/b`` kept whole), or None."""
    text = _delatex(text).replace("(", "").replace(")", "")
    matches = _NUMBER.findall(text)
    return re.sub(r"[,\s]", "", matches[-1]) if matches else None


@lru_cache(maxsize=65536)  # rewards parse the same few strings for every completion of a group
def parse_number(text: str) -> Fraction | None:
    """Returns the exact value of a string that is one number (int, decimal, ``a/b``, ``\\frac``), else None."""
    s = _delatex(str(text)).strip().rstrip(".").replace(" ", "")
    sign = 1
    if s.startswith("-"):
        sign, s = -1, s[1:]
    elif s.startswith("+"):
        s = s[1:]
    parts = [re.sub(r"^\((.*)\)$", r"\1", p) for p in s.split("/")]
    if len(parts) > 2 or not all(_WHOLE_NUMBER.fullmatch(p) for p in parts):
        return None
    values = [Fraction(p.replace(",", "")) for p in parts]
    if len(values) == 2:
        if values[1] == 0:
            return None
        return sign * values[0] / values[1]
    return sign * values[0]


def extract_answer(text: str) -> str | None:
    """Returns a completion's final answer: the last ``\\boxed{}`` content, else the last number, else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    return last_number(text)


@lru_cache(maxsize=65536)
def _gold_value(answer: str) -> Fraction | None:
    """Returns the numeric value of a reference answer ("46", "#### 72", "\\boxed{3/4}"), or None."""
    if "####" in answer:  # GSM8K-style "reasoning #### final"
        answer = answer.rsplit("####", 1)[1]
    boxed = extract_boxed(answer)
    return parse_number(boxed if boxed is not None else answer)


def _normalise(text: str) -> str:
    """Returns ``text`` without whitespace, dollar signs and a trailing period, for string comparison."""
    return re.sub(r"\s+", "", text.replace("$", "")).rstrip(".")


@lru_cache(maxsize=65536)  # pure in its two strings; policies repeat their answers as training converges
def answers_match(completion: str, answer: str) -> bool:
    """Returns True when the completion's final answer equals the reference answer.

    Numeric references compare exactly (as fractions). Other references go through ``math_verify``
    when it is installed (symbolic equivalence), else through whitespace-insensitive string equality
    with the last ``\\boxed{}`` content, or with the whole completion when there is no box.
    """
    gold = _gold_value(answer)
    predicted = extract_answer(completion)
    if gold is not None:
        if predicted is None:
            return False
        value = parse_number(predicted)
        if value is None:  # e.g. \boxed{46 apples}: fall back to the last number inside the box
            inner = last_number(predicted)
            value = parse_number(inner) if inner is not None else None
        return value == gold
    try:
        import math_verify
    except ImportError:
        # a symbolic answer is not a "last number": compare the box, else the whole completion
        boxed = extract_boxed(completion)
        return _normalise(completion if boxed is None else boxed) == _normalise(answer)
    gold_parsed = math_verify.parse(answer if "\\boxed" in answer or "$" in answer else f"${answer}$")
    return bool(math_verify.verify(gold_parsed, math_verify.parse(completion)))
