"""Fixtures for the rollout-engine tests: tiny deterministic Qwen2 models built in memory."""

from __future__ import annotations

import pytest
from _tiny import tiny_model


@pytest.fixture(scope="module")
def eos_model():
    """A model whose greedy rows end with EOS at various steps (some never within 20 tokens)."""
    return tiny_model(eos_bias=0.7, logit_scale=4.0)


@pytest.fixture(scope="module")
def peaky_model():
    """A model with peaked next-token distributions, so temperature / top-k / top-p visibly matter.

    EOS gets a -1e4 bias: it is never sampled, so every row has exactly max_completion_length tokens.
    """
    return tiny_model(seed=1, logit_scale=6.0, eos_bias=-1e4)
