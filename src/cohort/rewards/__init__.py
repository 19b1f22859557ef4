"""Reward functions (TRL calling convention), built-ins, reward models, spec resolution and scoring into [N, R]
tensors."""

from cohort.rewards.answers import answers_match, extract_answer, extract_boxed, last_number, parse_number
from cohort.rewards.code import (
    check_code_rows,
    check_reward_rows,
    code_reward,
    extract_code,
    make_code_reward,
)
from cohort.rewards.registry import BUILTIN_REWARDS, REWARD_FACTORIES, resolve_reward_funcs
from cohort.rewards.reward_models import RewardModel
from cohort.rewards.rules import (
    accuracy_reward,
    completion_text,
    final_text,
    format_reward,
    make_length_reward,
    make_overlong_reward,
)
from cohort.rewards.scoring import (
    EXTRA_ARGUMENTS,
    REWARD_ARGUMENTS,
    RewardFunctionError,
    RewardLogs,
    RewardSignature,
    StepRewards,
    check_reward_columns,
    reward_name,
    reward_signature,
    reward_weights,
    run_awaitables,
    score,
)

__all__ = [
    "BUILTIN_REWARDS",
    "EXTRA_ARGUMENTS",
    "REWARD_ARGUMENTS",
    "REWARD_FACTORIES",
    "RewardFunctionError",
    "RewardLogs",
    "RewardModel",
    "RewardSignature",
    "StepRewards",
    "accuracy_reward",
    "answers_match",
    "check_code_rows",
    "check_reward_rows",
    "check_reward_columns",
    "code_reward",
    "completion_text",
    "extract_answer",
    "extract_boxed",
    "extract_code",
    "final_text",
    "format_reward",
    "last_number",
    "make_code_reward",
    "make_length_reward",
    "make_overlong_reward",
    "parse_number",
    "resolve_reward_funcs",
    "reward_name",
    "reward_signature",
    "reward_weights",
    "run_awaitables",
    "score",
]
