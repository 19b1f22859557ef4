"""Environment factories the episode tests name by 'module:function' (tests/ is on the import path)."""

from __future__ import annotations

from cohort.episodes.environments import GuessNumber


def small_game() -> GuessNumber:
    """Returns a guessing game over 1..9 with 3 guesses (its secret from its own seeded RNG unless the row seeds it)."""
    return GuessNumber(lo=1, hi=9, max_turns=3, seed=0)
