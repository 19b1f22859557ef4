"""cohort: GRPO-family reinforcement learning for Hugging Face causal language models.

The common entry points are importable from the top level; they load lazily so that
``import cohort.algo`` stays light (no transformers import).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "GRPOTrainer": "cohort.trainer",
    "GRPOConfig": "cohort.compat.drop_in",
    "TrainConfig": "cohort.config",
    "load_config": "cohort.config",
    "ConfigError": "cohort.errors",
    "TrainingError": "cohort.errors",
    "NonFiniteError": "cohort.errors",
    "SFTConfig": "cohort.commands.sft",
    "sft_train": "cohort.commands.sft",
    "evaluate": "cohort.commands.evaluation",
    "build_tiny_model": "cohort.models",
    "load_model": "cohort.models",
    "load_tokenizer": "cohort.models",
    "make_task": "cohort.data",
    "load_rows": "cohort.data",
    "run_demo": "cohort.commands.demo",
}

__all__ = sorted(_EXPORTS)

#: Import paths of 0.1.0 that moved when the modules were grouped into wings, and where each lives now. The old
#: path still imports (the same module object, so patches and isinstance checks agree) with a
#: DeprecationWarning, for one release.
MOVED_MODULES = {
    "cohort.arguments": "cohort.commands.arguments",
    "cohort.callbacks": "cohort.compat.callbacks",
    "cohort.checkpoint": "cohort.runtime.checkpoint_files",
    "cohort.curriculum": "cohort.train.curriculum",
    "cohort.demo": "cohort.commands.demo",
    "cohort.distributed": "cohort.runtime.distributed",
    "cohort.doctor": "cohort.commands.doctor",
    "cohort.evaluation": "cohort.commands.evaluation",
    "cohort.generation": "cohort.commands.generate",
    "cohort.health": "cohort.train.health",
    "cohort.iterative": "cohort.train.iterative",
    "cohort.optim": "cohort.runtime.optim",
    "cohort.pipeline": "cohort.commands.pipeline",
    "cohort.plugins": "cohort.runtime.plugins",
    "cohort.presets": "cohort.config.presets",
    "cohort.rm": "cohort.commands.rm",
    "cohort.rundir": "cohort.runtime.rundir",
    "cohort.seeds": "cohort.runtime.seeds",
    "cohort.sft": "cohort.commands.sft",
    "cohort.sharding": "cohort.runtime.sharding",
    "cohort.trl_fields": "cohort.compat.fields",
    "cohort.train.advantages": "cohort.train.advantage_step",
    "cohort.train.sampling": "cohort.train.prompt_order",
    "cohort.train.scoring": "cohort.train.scorer",
    "cohort.rewards.builtin": "cohort.rewards.rules",
    "cohort.rewards.models": "cohort.rewards.reward_models",
    "cohort.rewards.process": "cohort.rewards.process_rewards",
    "cohort.data.loading": "cohort.data.sources",
    "cohort.episodes.loop": "cohort.episodes.multiturn",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Answers an old import path with the module that now lives at its new one."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: Any) -> Any:
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}; the old path is kept for one release: import {new} instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return importlib.import_module(new)

    def exec_module(self, module: Any) -> None:
        """The module was run under its new name; nothing is left to run."""


if not any(isinstance(f, _MovedModuleFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedModuleFinder())


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cohort' has no attribute {name!r}")
