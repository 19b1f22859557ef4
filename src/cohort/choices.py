"""Names that cohort.config checks but heavier modules implement, kept here free of heavy imports.

Validating a config must not import transformers, so the config reads these names instead of the
implementations; each registry that implements them checks at import time that its keys match.
"""

from __future__ import annotations

ENGINES: tuple[str, ...] = ("builtin", "hf")
"""Rollout engines, in the order error messages list them; implemented by ``cohort.rollout.ENGINES``."""
