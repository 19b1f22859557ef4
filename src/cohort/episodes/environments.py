"""A gym-like text environment protocol for games and simulators: `reset(**row)` gives the first observation,
`step(action)` takes the assistant turn's text and gives the next observation, a reward and whether the
episode is over.

Besides TRL's `environment_factory` contract (an object whose public methods are tools), an episode may be
driven by a `TextEnvironment`: no tool calls, the model's whole turn is the action and the environment's
answer is the next user message. `env_step` and `env_reset` check what an environment returns, so a bad
return is one clear error naming the class and the fix instead of a failure deep in the episode loop;
`check_environment_factory` checks a factory before any model loads. `GuessNumber` is a small built-in game
that needs several turns. An OpenEnv server is reached through `cohort.episodes.openenv.OpenEnvEnvironment`.
"""

from __future__ import annotations

import abc
import inspect
import math
import numbers
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from cohort.errors import ConfigError, first_line

__all__ = [
    "EnvStep",
    "EnvironmentProtocolError",
    "GuessNumber",
    "TextEnvironment",
    "check_environment_factory",
    "env_reset",
    "env_step",
    "is_text_environment",
    "last_integer",
]

_STEP_FORMS = (
    "return EnvStep(observation, reward, done), a tuple (observation, reward, done), or gym's "
    "(observation, reward, terminated, truncated, info)"
)


class EnvironmentProtocolError(TypeError):
    """An environment's reset() or step() returned something the protocol does not take; the message names the
    environment's class, what it returned and the fix."""


@dataclass(frozen=True)
class EnvStep:
    """What one step of a text environment gives: the next user message, this turn's reward, and whether the
    episode is over."""

    observation: str
    reward: float = 0.0
    done: bool = False


class TextEnvironment(abc.ABC):
    """A gym-like text environment; one instance drives one episode at a time.

    `reset(**row)` starts an episode and returns the first observation (appended to the prompt's last user
    message) or None; `row` is the dataset row, empty when the environment samples its own task. `step(action)`
    takes the text of the assistant's turn and returns `EnvStep(observation, reward, done)` or the tuple
    `(observation, reward, done)`: the observation becomes the next user message, the reward is this turn's,
    and done ends the episode. `close()` frees what the environment holds (a connection, a process).
    Environments whose randomness cohort should checkpoint also define `state_dict()` / `load_state_dict()`.
    """

    @abc.abstractmethod
    def reset(self, **row: Any) -> str | None:
        """Returns the first observation of a new episode (None for none), the task taken from `row` where given."""

    @abc.abstractmethod
    def step(self, action: str) -> EnvStep | tuple[str, float, bool]:
        """Returns the observation, reward and done flag that follow the assistant turn `action`."""

    def close(self) -> None:
        """Frees what the environment holds; the default holds nothing."""
        return None

    def __enter__(self) -> TextEnvironment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_text_environment(obj_or_cls: Any) -> bool:
    """Returns whether `obj_or_cls` is a TextEnvironment instance or class (registered virtual subclasses too)."""
    if inspect.isclass(obj_or_cls):
        return issubclass(obj_or_cls, TextEnvironment)
    return isinstance(obj_or_cls, TextEnvironment)


def _class_name(env_label: Any) -> str:
    """Returns how an error names an environment given as a label, an instance or a class."""
    if isinstance(env_label, str):
        return env_label
    cls = env_label if inspect.isclass(env_label) else type(env_label)
    return cls.__qualname__


def _reward(value: Any, label: str) -> float:
    """Returns a step's reward as a finite float (None counts as 0.0, as OpenEnv leaves rewards unset)."""
    if value is None:
        return 0.0
    # a 0-d numpy array or torch tensor converts through __float__; a string would parse, so it is refused first
    if isinstance(value, (str, bytes)) or not (
        isinstance(value, numbers.Real) or hasattr(value, "__float__")
    ):
        raise EnvironmentProtocolError(
            f"{label}.step() returned the reward {value!r} ({type(value).__name__}); the reward must be a number; "
            f"{_STEP_FORMS}"
        )
    try:
        reward = float(value)
    except (TypeError, ValueError) as exc:
        raise EnvironmentProtocolError(
            f"{label}.step() returned the reward {value!r}, which is not one number ({first_line(exc)}); "
            f"return a Python float"
        ) from exc
    if not math.isfinite(reward):
        raise EnvironmentProtocolError(
            f"{label}.step() returned the reward {reward}; a reward must be finite (a NaN or infinite reward would "
            f"make every advantage of its group NaN); return a finite float"
        )
    return reward


def _flag(value: Any, name: str, label: str) -> bool:
    """Returns a step's done (or terminated / truncated) flag; only bools are taken, so a swapped tuple is caught."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise EnvironmentProtocolError(
        f"{label}.step() returned {name}={value!r} ({type(value).__name__}); {name} must be True or False; "
        f"{_STEP_FORMS}"
    )


def _observation(value: Any, done: bool, label: str, method: str) -> str:
    """Returns a step's observation as text; None is taken as "" when the episode is over (gym leaves it unused)."""
    if isinstance(value, str):
        return value
    if value is None and done:
        return ""
    raise EnvironmentProtocolError(
        f"{label}.{method}() returned the observation {value!r} ({type(value).__name__}); an observation is the "
        f"text of the next user message: return a str (render structured state into text yourself)"
    )


def env_step(result: Any, *, env_label: Any) -> EnvStep:
    """Returns a step() result as an EnvStep: an EnvStep, `(observation, reward, done)`, gym's
    `(observation, reward, done, info)` or `(observation, reward, terminated, truncated, info)`.

    `env_label` names the environment in errors: a class, an instance or a string."""
    label = _class_name(env_label)
    if isinstance(result, EnvStep):
        observation, reward, done = result.observation, result.reward, result.done
    elif isinstance(result, tuple) and len(result) in (3, 4):
        observation, reward, done = result[0], result[1], result[2]
    elif isinstance(result, tuple) and len(result) == 5:
        observation, reward = result[0], result[1]
        done = _flag(result[2], "terminated", label) | _flag(result[3], "truncated", label)
    else:
        shape = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise EnvironmentProtocolError(f"{label}.step() returned {shape} ({result!r:.200}); {_STEP_FORMS}")
    done = _flag(done, "done", label)
    return EnvStep(
        observation=_observation(observation, done, label, "step"), reward=_reward(reward, label), done=done
    )


def env_reset(result: Any, *, env_label: Any) -> str | None:
    """Returns a reset() result as the first observation: a str, or None when the environment adds nothing."""
    if result is None or isinstance(result, str):
        return result
    raise EnvironmentProtocolError(
        f"{_class_name(env_label)}.reset() returned {result!r:.200} ({type(result).__name__}); reset() must "
        f"return a str (appended to the prompt's last user message) or None"
    )


def _factory_name(factory: Any) -> str:
    """Returns how an error names a factory: its qualified name, or its repr."""
    return str(getattr(factory, "__qualname__", None) or getattr(factory, "__name__", None) or repr(factory))


def _construct(factory: Callable[[], Any]) -> Any:
    """Returns `factory()`; anything it raises becomes a ConfigError naming the factory."""
    name = _factory_name(factory)
    abstract = sorted(getattr(factory, "__abstractmethods__", ())) if inspect.isclass(factory) else []
    if abstract:  # say which methods are missing rather than Python's "can't instantiate abstract class"
        raise ConfigError(
            f"environment factory {name} does not define {', '.join(m + '()' for m in abstract)}: a TextEnvironment "
            f"implements reset(**row) -> str | None and step(action) -> EnvStep"
        )
    try:
        return factory()
    except Exception as exc:
        raise ConfigError(
            f"environment factory {name} raised on construction: {type(exc).__name__}: {first_line(exc)}; it is "
            f"called with no arguments once per rollout, so it must build a ready environment (bind its settings "
            f"with functools.partial or a lambda, and make sure any server it talks to is running)"
        ) from exc


def _check_instance(instance: Any, name: str) -> None:
    """Raises ConfigError when `instance` lacks the methods its protocol needs."""
    cls = type(instance).__qualname__
    if not callable(getattr(instance, "reset", None)):
        raise ConfigError(
            f"environment factory {name} made a {cls} with no reset method: an environment needs reset(**row) -> "
            f"str | None (TRL's environment_factory contract, its public methods the tools) or is a "
            f"cohort.episodes.TextEnvironment with reset and step(action)"
        )
    if is_text_environment(instance) and not callable(getattr(instance, "step", None)):
        raise ConfigError(
            f"environment factory {name} made a TextEnvironment {cls} with no step method: define "
            f"step(action: str) -> EnvStep, taking the assistant turn's text"
        )


def check_environment_factory(factory: Any) -> None:
    """Returns None when `factory` builds a usable environment; else raises ConfigError naming it and the fix.

    It is called once (the instance built is closed again), so a factory that raises, or an instance without
    `reset` (or, for a TextEnvironment, `step`), is an error before any model loads."""
    if not callable(factory):
        hint = (
            f"pass the class itself ({type(factory).__qualname__}), not an instance"
            if callable(getattr(factory, "reset", None))
            else "pass a class or a function that returns a new environment"
        )
        raise ConfigError(
            f"an environment factory must be callable (it is called once per rollout), got "
            f"{type(factory).__name__} {factory!r:.120}; {hint}"
        )
    name = _factory_name(factory)
    instance = _construct(factory)
    try:
        _check_instance(instance, name)
    finally:
        close = getattr(instance, "close", None)
        if callable(close):
            try:
                close()
            except Exception as exc:
                raise ConfigError(
                    f"environment factory {name}: closing the {type(instance).__qualname__} it made raised "
                    f"{type(exc).__name__}: {first_line(exc)}; close() must succeed on a fresh instance"
                ) from exc


_INTEGER = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """Returns the last integer written in `text` (a leading minus counts), or None when there is none."""
    found = _INTEGER.findall(text)
    return int(found[-1]) if found else None


def _plain_rng_state(state: tuple[Any, ...]) -> list[Any]:
    """Returns a random.Random state as lists and ints (JSON- and safetensors-metadata-friendly)."""
    version, internal, gauss_next = state
    return [version, list(internal), gauss_next]


def _rng_state(plain: list[Any]) -> tuple[Any, ...]:
    """Returns the random.Random state that `_plain_rng_state` turned into lists."""
    version, internal, gauss_next = plain
    return (version, tuple(internal), gauss_next)


class GuessNumber(TextEnvironment):
    """Guess an integer in [lo, hi]: each turn's last integer is the guess, answered "higher", "lower" or
    "correct"; reward 1.0 and the end on the correct guess, the end with reward 0.0 after `max_turns` guesses.

    The secret comes from `row["seed"]` when the row has one (the same row, the same game), otherwise from the
    environment's own random.Random, whose state `state_dict()` gives so a resumed run draws the same games."""

    def __init__(self, lo: int = 1, hi: int = 100, max_turns: int = 7, seed: int | None = None) -> None:
        if not (isinstance(lo, int) and isinstance(hi, int) and lo <= hi):
            raise ConfigError(f"GuessNumber needs integers lo <= hi, got lo={lo!r}, hi={hi!r}")
        if not (isinstance(max_turns, int) and max_turns >= 1):
            raise ConfigError(f"GuessNumber's max_turns must be a positive integer, got {max_turns!r}")
        self.lo, self.hi, self.max_turns = lo, hi, max_turns
        self._rng = random.Random(seed)
        self.target: int | None = None
        self.turns = 0
        self.done = True  # no episode until reset()

    def reset(self, **row: Any) -> str:
        """Returns the task text of a new game, its secret drawn from `row["seed"]` or the environment's RNG."""
        seed = row.get("seed")
        if seed is None:
            self.target = self._rng.randint(self.lo, self.hi)
        elif isinstance(seed, (int, str)) and not isinstance(seed, bool):
            # a Random of its own: a seeded row must not advance (or depend on) the environment's RNG
            self.target = random.Random(seed).randint(self.lo, self.hi)
        else:
            raise ConfigError(f"GuessNumber: row['seed'] must be an int or a str, got {seed!r}")
        self.turns, self.done = 0, False
        return (
            f"I am thinking of an integer between {self.lo} and {self.hi}. You have {self.max_turns} guesses; after "
            f"each I say higher, lower or correct. Reply with your guess."
        )

    def step(self, action: str) -> EnvStep:
        """Returns the answer to the guess in `action`: higher, lower or correct (reward 1.0, done)."""
        if self.done or self.target is None:
            raise RuntimeError("GuessNumber.step() was called with no game under way; call reset() first")
        self.turns += 1
        guess = last_integer(action)
        if guess == self.target:
            self.done = True
            return EnvStep("correct", reward=1.0, done=True)
        if guess is None:
            answer = (
                f"I found no number in your reply. Reply with one integer between {self.lo} and {self.hi}."
            )
        else:
            answer = "higher" if guess < self.target else "lower"
        if self.turns >= self.max_turns:
            self.done = True
            return EnvStep(f"{answer} (no guesses left; the number was {self.target})", reward=0.0, done=True)
        return EnvStep(answer)

    def state_dict(self) -> dict[str, Any]:
        """Returns the RNG state and the game under way as plain Python values (ints, lists, None)."""
        return {
            "rng": _plain_rng_state(self._rng.getstate()),
            "lo": self.lo,
            "hi": self.hi,
            "max_turns": self.max_turns,
            "target": self.target,
            "turns": self.turns,
            "done": self.done,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores what state_dict() returned: the next games drawn are the ones the saved environment would draw."""
        self._rng.setstate(_rng_state(state["rng"]))
        self.lo, self.hi, self.max_turns = int(state["lo"]), int(state["hi"]), int(state["max_turns"])
        self.target = None if state["target"] is None else int(state["target"])
        self.turns, self.done = int(state["turns"]), bool(state["done"])
