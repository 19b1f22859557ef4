"""An easy, dense reward for end-to-end tests: the fraction of characters of a completion that are digits."""


def digit_fraction(completions, **kwargs):
    """Return, per completion, the share of its characters that are digits (0 for an empty one)."""
    return [sum(c.isdigit() for c in text) / len(text) if text else 0.0 for text in completions]


def any_digit(completions, **kwargs):
    """Return 1.0 for a completion containing a digit, else 0.0 (binary: many groups are all-equal)."""
    return [float(any(c.isdigit() for c in text)) for text in completions]


def first_char_parity(completions, **kwargs):
    """1.0 when the completion's first character has an odd code point: varies even for a random model."""
    return [float(ord(c[0]) % 2) if c else 0.0 for c in completions]


def constant(completions, **kwargs):
    """1.0 for every completion: every group's rewards are equal, so no completion has an advantage."""
    return [1.0] * len(completions)
