"""cohort.episodes.environments: the gym-like text environment protocol (what step() and reset() may return, and
the clear error for anything else), the factory check before any model loads, and the GuessNumber game with a
state that a resumed run restores."""

from __future__ import annotations

import functools
import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest

from cohort.episodes.environments import (
    EnvironmentProtocolError,
    EnvStep,
    GuessNumber,
    TextEnvironment,
    check_environment_factory,
    env_reset,
    env_step,
    is_text_environment,
    last_integer,
)
from cohort.errors import ConfigError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "environments.md"


class Echo(TextEnvironment):
    """Says back each action; done after two turns."""

    def __init__(self) -> None:
        self.turns = 0
        self.closed = 0

    def reset(self, **row):
        self.turns = 0
        return row.get("question")

    def step(self, action):
        self.turns += 1
        return action, 0.5, self.turns >= 2

    def close(self):
        self.closed += 1


class TrlStyle:
    """A TRL environment_factory class: reset plus public methods as tools, no step."""

    def reset(self, **row):
        return None

    def add(self, a: int, b: int) -> int:
        """Adds.

        Args:
            a: One.
            b: Two.
        """
        return a + b


class Registered:
    """Registered as a TextEnvironment without inheriting from it."""

    def reset(self, **row):
        return "hi"

    def step(self, action):
        return EnvStep("ok")


TextEnvironment.register(Registered)


class RegisteredWithoutStep:
    def reset(self, **row):
        return None


TextEnvironment.register(RegisteredWithoutStep)


# -- env_step: the forms step() may return -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (EnvStep("obs", 1.0, True), EnvStep("obs", 1.0, True)),
        (EnvStep("obs"), EnvStep("obs", 0.0, False)),
        (("obs", 1, False), EnvStep("obs", 1.0, False)),
        (("obs", 0.25, True), EnvStep("obs", 0.25, True)),
        (("obs", None, False), EnvStep("obs", 0.0, False)),  # OpenEnv leaves a reward unset as None
        (("obs", True, False), EnvStep("obs", 1.0, False)),  # OpenEnv allows bool rewards
        (("obs", np.float32(0.5), np.bool_(True)), EnvStep("obs", 0.5, True)),
        (("obs", np.array(2.0), False), EnvStep("obs", 2.0, False)),  # a 0-d array converts
        (("obs", 1.0, False, {"info": 1}), EnvStep("obs", 1.0, False)),  # gym's (obs, reward, done, info)
        (("obs", 1.0, False, False, {}), EnvStep("obs", 1.0, False)),  # gymnasium's 5-tuple
        (("obs", 1.0, True, False, {}), EnvStep("obs", 1.0, True)),
        (("obs", 1.0, False, True, {}), EnvStep("obs", 1.0, True)),  # truncated ends the episode too
        ((None, 1.0, True), EnvStep("", 1.0, True)),  # gym leaves the last observation unused
    ],
)
def test_env_step_normalises_every_accepted_form(result, expected):
    step = env_step(result, env_label=Echo)
    assert step == expected
    assert type(step.reward) is float and type(step.done) is bool


@pytest.mark.parametrize(
    ("result", "names"),
    [
        (None, ["NoneType", "EnvStep(observation, reward, done)"]),
        ("just text", ["str", "EnvStep("]),
        (["obs", 1.0, False], ["list", "tuple (observation, reward, done)"]),
        (("obs", 1.0), ["a tuple of 2", "EnvStep("]),
        (("obs", 1.0, False, False, {}, 0), ["a tuple of 6"]),
        ((3, 1.0, False), ["observation 3", "return a str"]),
        ((None, 1.0, False), ["observation None", "return a str"]),
        (({"board": 1}, 1.0, False), ["dict", "return a str"]),
        (("obs", "1.0", False), ["reward '1.0'", "must be a number"]),
        (("obs", [1.0], False), ["reward [1.0]", "must be a number"]),
        (("obs", float("nan"), False), ["reward nan", "must be finite"]),
        (("obs", math.inf, False), ["reward inf", "must be finite"]),
        (("obs", np.array([1.0, 2.0]), False), ["not one number"]),
        (("obs", 1.0, 1), ["done=1", "True or False"]),
        (("obs", 1.0, None), ["done=None", "True or False"]),
        (("obs", False, 0.5), ["done=0.5"]),  # (observation, done, reward) swapped
        (("obs", 1.0, "no", False, {}), ["terminated='no'"]),
        (("obs", 1.0, False, 0, {}), ["truncated=0"]),
        (EnvStep("obs", float("nan")), ["must be finite"]),
        (EnvStep(b"obs"), ["observation b'obs'"]),  # type: ignore[arg-type]
    ],
)
def test_env_step_refuses_anything_else_naming_the_class_and_the_fix(result, names):
    with pytest.raises(EnvironmentProtocolError) as info:
        env_step(result, env_label=Echo)
    message = str(info.value)
    assert message.startswith("Echo.step() returned")
    for name in names:
        assert name in message
    assert isinstance(info.value, TypeError)


@pytest.mark.parametrize("label", [Echo, Echo(), "Echo"])
def test_env_label_may_be_a_class_an_instance_or_a_string(label):
    with pytest.raises(EnvironmentProtocolError, match=r"^Echo\.step\(\)"):
        env_step(None, env_label=label)


def test_env_reset_takes_text_or_none_and_refuses_the_rest():
    assert env_reset("first", env_label=Echo) == "first"
    assert env_reset(None, env_label=Echo) is None
    for bad in ({"obs": 1}, 3, ("obs", 0.0, False)):
        with pytest.raises(
            EnvironmentProtocolError, match=r"^Echo\.reset\(\) returned .*must return a str .* or None"
        ):
            env_reset(bad, env_label=Echo)


# -- is_text_environment ---------------------------------------------------------------------------------------


def test_is_text_environment_knows_instances_classes_and_registered_classes():
    assert is_text_environment(Echo) and is_text_environment(Echo())
    assert is_text_environment(GuessNumber) and is_text_environment(GuessNumber())
    assert is_text_environment(Registered) and is_text_environment(Registered())
    assert not is_text_environment(TrlStyle) and not is_text_environment(TrlStyle())
    assert not is_text_environment(None) and not is_text_environment(3) and not is_text_environment(EnvStep)


def test_a_text_environment_is_a_context_manager_that_closes():
    with Echo() as env:
        assert env.reset(question="q?") == "q?"
        assert env_step(env.step("a"), env_label=env) == EnvStep("a", 0.5, False)
        assert env_step(env.step("b"), env_label=env) == EnvStep("b", 0.5, True)
    assert env.closed == 1


# -- check_environment_factory ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory",
    [
        Echo,
        GuessNumber,
        functools.partial(GuessNumber, hi=10),
        lambda: GuessNumber(seed=1),
        TrlStyle,
        Registered,
    ],
)
def test_check_environment_factory_accepts_working_factories(factory):
    assert check_environment_factory(factory) is None


def test_check_environment_factory_closes_the_instance_it_makes():
    made = []

    def factory():
        made.append(Echo())
        return made[-1]

    check_environment_factory(factory)
    assert len(made) == 1 and made[0].closed == 1


def test_an_instance_instead_of_a_factory_is_named_with_the_fix():
    with pytest.raises(
        ConfigError, match=r"must be callable .* got Echo .*pass the class itself \(Echo\), not an"
    ):
        check_environment_factory(Echo())


def test_a_value_that_is_no_factory_is_refused():
    with pytest.raises(ConfigError, match=r"must be callable .* got int 3; pass a class or a function"):
        check_environment_factory(3)


def test_a_factory_that_raises_is_named_with_its_error():
    def make_board():
        raise FileNotFoundError("no board file at /tmp/board.txt")

    with pytest.raises(ConfigError) as info:
        check_environment_factory(make_board)
    message = str(info.value)
    assert "make_board raised on construction: FileNotFoundError: no board file at /tmp/board.txt" in message
    assert "called with no arguments once per rollout" in message
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_a_class_needing_arguments_is_a_construction_error():
    class Needs(Echo):
        def __init__(self, board: str) -> None:
            super().__init__()

    with pytest.raises(ConfigError, match=r"Needs raised on construction: TypeError: .*functools.partial"):
        check_environment_factory(Needs)


def test_an_instance_without_reset_is_named():
    class NoReset:
        def play(self, move: str) -> str:
            return move

    with pytest.raises(
        ConfigError, match=r"made a .*NoReset with no reset method: .*reset\(\*\*row\) -> str \| None"
    ):
        check_environment_factory(NoReset)
    with pytest.raises(ConfigError, match=r"no reset method"):
        check_environment_factory(lambda: object())


def test_a_text_environment_without_step_is_named():
    class Half(TextEnvironment):
        def reset(self, **row):
            return None

    with pytest.raises(
        ConfigError, match=r"factory .*Half does not define step\(\): a TextEnvironment implements"
    ):
        check_environment_factory(Half)
    with pytest.raises(
        ConfigError, match=r"made a TextEnvironment .*RegisteredWithoutStep with no step method"
    ):
        check_environment_factory(RegisteredWithoutStep)


def test_a_close_that_raises_is_named():
    class BadClose(Echo):
        def close(self):
            raise OSError("socket already gone")

    with pytest.raises(
        ConfigError, match=r"closing the .*BadClose it made raised OSError: socket already gone"
    ):
        check_environment_factory(BadClose)


# -- GuessNumber -----------------------------------------------------------------------------------------------


def _play(env: GuessNumber, row: dict | None = None) -> tuple[list[EnvStep], int]:
    """Plays one game by bisection; returns the steps and the number guessed last."""
    env.reset(**(row or {}))
    lo, hi, steps = env.lo, env.hi, []
    while True:
        guess = (lo + hi) // 2
        step = env_step(env.step(f"My guess is {guess}."), env_label=env)
        steps.append(step)
        if step.done:
            return steps, guess
        lo, hi = (guess + 1, hi) if step.observation == "higher" else (lo, guess - 1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("I guess 42.", 42),
        ("between 1 and 100: 50", 50),
        ("-3", -3),
        ("x1y22", 22),
        ("no idea", None),
        ("", None),
    ],
)
def test_last_integer(text, expected):
    assert last_integer(text) == expected


def test_guess_number_answers_higher_lower_and_correct_over_several_turns():
    env = GuessNumber(lo=1, hi=100, max_turns=7, seed=0)
    first = env.reset()
    assert "between 1 and 100" in first and "7 guesses" in first
    steps, guess = _play(env)
    assert guess == env.target
    assert steps[-1] == EnvStep("correct", reward=1.0, done=True)
    assert all(step.observation in ("higher", "lower") and step.reward == 0.0 for step in steps[:-1])
    assert len(steps) > 1  # bisection over 100 numbers needs several turns for this seed


def test_guess_number_reads_the_last_integer_and_says_when_there_is_none():
    env = GuessNumber(lo=1, hi=10, max_turns=3)
    env.reset(seed=5)
    target = env.target
    assert target is not None
    step = env.step("Hmm, let me think.")
    assert "no number" in step.observation and "between 1 and 10" in step.observation
    assert (step.reward, step.done) == (0.0, False)
    assert env.step(f"Not 1 or 2, I say {target}") == EnvStep("correct", 1.0, True)


def test_guess_number_ends_after_max_turns_and_names_the_number():
    env = GuessNumber(lo=1, hi=100, max_turns=2)
    env.reset(seed="row-7")
    wrong = 1 if env.target != 1 else 2
    assert env.step(str(wrong)).done is False
    last = env.step(str(wrong))
    assert last.done and last.reward == 0.0
    word = "higher" if wrong < env.target else "lower"
    assert last.observation == f"{word} (no guesses left; the number was {env.target})"


def test_guess_number_refuses_a_step_outside_a_game():
    env = GuessNumber()
    with pytest.raises(RuntimeError, match=r"no game under way; call reset\(\) first"):
        env.step("5")
    env.reset(seed=1)
    env.step(str(env.target))
    with pytest.raises(RuntimeError, match="no game under way"):
        env.step("5")


def test_a_seeded_row_is_the_same_game_and_leaves_the_environment_rng_alone():
    a, b = GuessNumber(seed=11), GuessNumber(seed=11)
    a.reset(seed=123)
    b.reset(seed=123)
    assert a.target == b.target == random.Random(123).randint(1, 100)
    a.reset(seed=124)  # b draws nothing here: the seeded rows must not have moved a's own RNG
    a.reset()
    b.reset()
    assert a.target == b.target


def test_guess_number_state_restores_the_games_to_come_and_the_game_under_way():
    env = GuessNumber(lo=1, hi=1000, max_turns=10, seed=3)
    for _ in range(4):
        _play(env)
    env.reset()
    env.step("500")
    state = env.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain Python values only
    resumed = GuessNumber()
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert (resumed.lo, resumed.hi, resumed.max_turns, resumed.target, resumed.turns) == (
        1,
        1000,
        10,
        env.target,
        1,
    )
    assert resumed.step("500") == env.step("500")
    assert [_play(env)[1] for _ in range(5)] == [_play(resumed)[1] for _ in range(5)]


def test_guess_number_refuses_bad_settings():
    with pytest.raises(ConfigError, match="lo <= hi"):
        GuessNumber(lo=5, hi=1)
    with pytest.raises(ConfigError, match="max_turns must be a positive integer"):
        GuessNumber(max_turns=0)
    with pytest.raises(ConfigError, match=r"row\['seed'\] must be an int or a str, got 1.5"):
        GuessNumber().reset(seed=1.5)


# -- the documented example ------------------------------------------------------------------------------------


def test_the_example_in_the_docs_runs_as_documented():
    text = DOCS.read_text()
    example = re.search(r"## The protocol.*?```python\n(.*?)```", text, re.S)
    assert example, "docs/environments.md lost its example class"
    namespace: dict = {}
    exec(compile(example.group(1), str(DOCS), "exec"), namespace)
    env = namespace["Countdown"]()
    assert env.reset(start=2) == "Count down from 2 to 0, one number per reply."
    steps = [env_step(env.step(reply), env_label=env) for reply in ("2", "1", "0")]
    assert [(s.reward, s.done) for s in steps] == [(1.0, False), (1.0, False), (1.0, True)]
    env.reset(start=3)
    assert env_step(env.step("2"), env_label=env) == EnvStep("No: the next number was 3.", 0.0, True)
    check_environment_factory(namespace["Countdown"])
