"""Shared fixtures: a tiny model folder built once per session with cohort's own factory."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models run fastest on one thread, and two busy-waiting pools on two cores slow everything."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Return the folder of a ~40 k-parameter Qwen2 model + char tokenizer saved with save_pretrained."""
    from cohort.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, num_layers=2, num_heads=4, seed=0)
