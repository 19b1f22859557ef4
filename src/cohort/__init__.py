"""cohort: GRPO-family reinforcement learning for Hugging Face causal language models.

The common entry points are importable from the top level; they load lazily so that
``import cohort.algo`` stays light (no transformers import).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "GRPOTrainer": "cohort.trainer",
    "GRPOConfig": "cohort.compat",
    "TrainConfig": "cohort.config",
    "load_config": "cohort.config",
    "ConfigError": "cohort.errors",
    "TrainingError": "cohort.errors",
    "NonFiniteError": "cohort.errors",
    "SFTConfig": "cohort.sft",
    "sft_train": "cohort.sft",
    "evaluate": "cohort.evaluation",
    "build_tiny_model": "cohort.models",
    "load_model": "cohort.models",
    "load_tokenizer": "cohort.models",
    "make_task": "cohort.data",
    "load_rows": "cohort.data",
    "run_demo": "cohort.demo",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cohort' has no attribute {name!r}")
