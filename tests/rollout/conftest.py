"""Fixtures for the rollout-engine tests: a tiny deterministic Qwen2 model built in memory.

peaky_model, also used by tests/fastpath, is in tests/conftest.py.
"""

from __future__ import annotations

import pytest
from _tiny import tiny_model


@pytest.fixture(scope="module")
def eos_model():
    """A model whose greedy rows end with EOS at various steps (some never within 20 tokens)."""
    return tiny_model(eos_bias=0.7, logit_scale=4.0)
