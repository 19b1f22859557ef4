"""Final-answer extraction and comparison for math rewards.

The answer of a completion is the content of its last ``\\boxed{...}``, or else its last number.
Numbers compare exactly as fractions, so ``0.75``, ``3/4``, ``\\frac{3}{4}`` and ``0.750`` are equal
and ``1,000``, ``1{,}000`` and ``1\\,000`` equal ``1000``. A minus sign right after a digit, letter or
closing bracket is read as subtraction, not as a sign: the last number of ``"11-5"`` is ``5``, of
``"=-13"`` it is ``-13``.

When ``math_verify`` is installed, every answer this exact comparison does not accept goes through it
(symbolic and numeric equivalence), numeric ones included. It reads the completion's LaTeX only: the last
``\\boxed{}``, else ``$...$`` / ``\\[...\\]``; plain text stays the exact comparison's, which reads
the final number strictly, where math_verify's plain-expression reading would take ``46+3`` for ``46``.
Against a numeric reference its verdict counts only when the answer it read is a number (``1.5\\times
10^{3}``, ``\\frac{3}{4}``), not arithmetic that evaluates to one: ``\\boxed{12+34}`` does not answer
``12+34=``.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Any

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
    text = _FRAC.sub(r"(\1)/(\2)", text).replace("{,}", ",")  # LaTeX's thousands separator 1{,}000
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
def _exact_match(completion: str, answer: str) -> bool:
    """Returns True when the completion's final answer equals the reference exactly: as a number for a
    numeric reference, else as whitespace-insensitive text (the last box, or the whole completion)."""
    gold = _gold_value(answer)
    if gold is not None:
        predicted = extract_answer(completion)
        if predicted is None:
            return False
        value = parse_number(predicted)
        if value is None:  # e.g. \boxed{46 apples}: fall back to the last number inside the box
            inner = last_number(predicted)
            value = parse_number(inner) if inner is not None else None
        return value == gold
    boxed = extract_boxed(completion)  # a symbolic answer is not a "last number"
    return _normalise(completion if boxed is None else boxed) == _normalise(answer)


class _Identity:
    """A hashable handle on any object, equal only to handles on the same object (a cache key for modules
    and test doubles alike; holding the object keeps its id from being reused while the key is cached)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj


def _math_verify() -> Any:
    """Returns the ``math_verify`` module, or None when it is not installed."""
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


@lru_cache(maxsize=65536)
def _verified(module: _Identity, completion: str, answer: str) -> bool:
    """Returns math_verify's verdict on the completion's final answer against the reference."""
    math_verify = module.obj
    if "####" in answer:  # GSM8K-style "reasoning #### final"
        answer = answer.rsplit("####", 1)[1].strip()
    boxed = extract_boxed(completion)
    if boxed is not None:  # the last box is the answer (math_verify would collect every box)
        completion = f"\\boxed{{{boxed}}}"
    gold_text = answer if "\\boxed" in answer or "$" in answer else f"${answer}$"
    # math_verify times out with SIGALRM, which only the main thread may set: elsewhere, without timeout
    off_main = threading.current_thread() is not threading.main_thread()
    parse_options: dict[str, Any] = {"parsing_timeout": None} if off_main else {}
    verify_options: dict[str, Any] = {"timeout_seconds": None} if off_main else {}
    gold = math_verify.parse(gold_text, **parse_options)
    # LaTeX only (a box first, then $...$ or \[...\]): plain text is the exact path's, as math_verify's
    # plain-expression reading takes "46+3" for 46 (its first number) and "12+34" for 46
    latex = math_verify.LatexExtractionConfig(boxed_match_priority=0)
    predicted = math_verify.parse(completion, extraction_config=[latex], **parse_options)
    if _gold_value(answer) is not None and not any(_is_number_literal(p) for p in predicted):
        return False  # \boxed{12+34} equals 46, but echoing the problem is no answer to "12+34="
    return bool(math_verify.verify(gold, predicted, **verify_options))


def _is_number_literal(value: Any) -> bool:
    """Returns True for a parsed (sympy) number, also in scientific notation or as a percentage; False for
    arithmetic that only evaluates to one (``12+34``, ``7*8``, ``2^10``) and for text."""
    if getattr(value, "is_Number", False):
        return True
    if not getattr(value, "is_Mul", False) or len(value.args) != 2:
        return False
    number, scale = value.args
    percent = getattr(scale, "is_Rational", False) and (scale.p, scale.q) == (1, 100)
    power_of_ten = getattr(scale, "is_Pow", False) and scale.args[0] == 10 and scale.args[1].is_Integer
    return bool(getattr(number, "is_Number", False) and (percent or power_of_ten))


def answers_match(completion: str, answer: str) -> bool:
    """Returns True when the completion's final answer equals the reference answer.

    First exactly: numeric references as fractions, others as whitespace-insensitive text against the
    last ``\\boxed{}`` content (or the whole completion when there is no box). What that rejects goes
    through ``math_verify`` when it is installed, whatever the reference: the completion's LaTeX answer
    (``\\boxed{\\sqrt{8}}`` against ``2\\sqrt{2}``, ``$\\frac{\\sqrt{2}}{2}$`` against ``1/\\sqrt{2}``);
    a numeric reference then still needs a number, not an expression.
    """
    if _exact_match(completion, answer):
        return True
    if "$" not in completion and "\\" not in completion:
        return False  # no LaTeX, nothing for math_verify to read (and no import, no parse)
    math_verify = _math_verify()
    if math_verify is None:
        return False
    return _verified(_Identity(math_verify), completion, answer)
