"""The TRL layer: TRL's `GRPOConfig` as a dataclass and its mapping onto cohort's config (`trl_config`), TRL's
keyword forms (`drop_in`), TRL's field names (`fields`, data only), transformers' callback contract
(`callbacks`) and the Trainer methods TRL scripts call (`trainer_api`).

`cohort.compat.<name>` reaches `drop_in`'s names lazily, so that the config can read `fields` without loading
the trainer.
"""

from __future__ import annotations

import importlib
from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    module = importlib.import_module("cohort.compat.drop_in")
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(f"module 'cohort.compat' has no attribute {name!r}") from None
