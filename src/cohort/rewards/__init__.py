"""Reward functions (TRL calling convention), built-ins, spec resolution and scoring into [N, R] tensors."""

from cohort.rewards.answers import answers_match, extract_answer, extract_boxed, last_number, parse_number
from cohort.rewards.builtin import (
    accuracy_reward,
    completion_text,
    format_reward,
    make_length_reward,
    make_overlong_reward,
)
from cohort.rewards.registry import BUILTIN_REWARDS, REWARD_FACTORIES, resolve_reward_funcs
from cohort.rewards.scoring import RewardFunctionError, reward_name, reward_weights, score

__all__ = [
    "BUILTIN_REWARDS",
    "REWARD_FACTORIES",
    "RewardFunctionError",
    "accuracy_reward",
    "answers_match",
    "completion_text",
    "extract_answer",
    "extract_boxed",
    "format_reward",
    "last_number",
    "make_length_reward",
    "make_overlong_reward",
    "parse_number",
    "resolve_reward_funcs",
    "reward_name",
    "reward_weights",
    "score",
]
