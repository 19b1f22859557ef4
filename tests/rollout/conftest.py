"""Fixtures for the rollout-engine tests: tiny deterministic Qwen2 models built in memory."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# tests/_tiny.py is shared with tests/test_logprobs.py; make it importable from this sub-folder.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _tiny import tiny_model  # noqa: E402


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


@pytest.fixture(autouse=True)
def _share_every_prompt(monkeypatch):
    """Tiny prompts fall under the builtin engine's size threshold for shared-prefix decoding; these tests
    lower it to 0 so every builtin rollout here goes through the shared path (the plain path is compared
    against it explicitly)."""
    from cohort.rollout import builtin

    monkeypatch.setattr(builtin, "PREFIX_SHARING_MIN", 0)


@pytest.fixture(autouse=True)
def _pack_every_weight(monkeypatch):
    """The tiny models' weights are below the size from which the builtin engine packs them for oneDNN,
    and their rollouts shorter than the steps it waits before packing; these tests lower both to 0 so
    every builtin decode step here runs on packed weights on a CPU (test_packed_linear.py compares)."""
    from cohort.rollout import builtin, packed_linear

    monkeypatch.setattr(packed_linear, "PACK_MIN_ELEMENTS", 0)
    monkeypatch.setattr(builtin, "PACK_AFTER_STEPS", 0)
    monkeypatch.setattr(builtin, "PACK_MIN_REMAINING", 0)
