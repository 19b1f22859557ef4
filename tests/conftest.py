"""Shared fixtures: a tiny model folder built once per session with cohort's own factory, and a peaked in-memory model
(rollout/ and fastpath/ sample from it)."""

from __future__ import annotations

import os

import pytest
from _tiny import single_thread, tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ONE_VERSION = {
    "tests/algo/": "pure tensor functions: torch only, the same torch in both runs",
    "tests/sandbox/": "bubblewrap and processes: no floored library in the path",
    "tests/train/test_resume.py::test_kill_at_random_moments": "kill -9 timing; its checkpoint I/O is test_checkpoint's",
    "tests/commands/test_demo.py": "the demo's pieces (model, tokenizer, SFT, GRPO, report) each run in their own tests",
    "tests/serve/test_serve_torchrun.py": "torch.distributed between processes; serve and zmq run in tests/serve",
    "tests/runtime/test_distributed.py::test_": "torch.distributed + checkpoints: one fsdp run stays (test_torchrun_two_processes)",
    "tests/runtime/test_distributed_exact.py": "exactness across processes: torch.distributed, the same torch in both runs",
    "tests/runtime/test_collectives.py": "counts torch.distributed calls: the same torch in both runs",
}
"""Tests marked `one_version` (their path starts with a key): what they prove does not change with the floors of
.ci/oldest.txt (torch is 2.13.0 in both of CI's runs), so the oldest-versions run skips them and spends its time
where versions matter; every library surface they touch is also run there by other tests (the reason given)."""
KEEP_ON_OLDEST = ("tests/runtime/test_distributed.py::test_torchrun_two_processes",)


def pytest_collection_modifyitems(config, items):
    """Marks the tests of ONE_VERSION `one_version` (CI's oldest-versions run deselects them)."""
    for item in items:
        node = item.nodeid
        if any(node.startswith(k) for k in ONE_VERSION) and not node.startswith(KEEP_ON_OLDEST):
            item.add_marker(pytest.mark.one_version)


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread in every test, reset each time in case a test (a trainer's `threads`) changed it."""
    with single_thread():
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Return the folder of a ~40 k-parameter Qwen2 model + char tokenizer saved with save_pretrained."""
    from cohort.models import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "model", hidden_size=32, num_layers=2, num_heads=4, seed=0
    )


@pytest.fixture(scope="module")
def peaky_model():
    """A model with peaked next-token distributions, so temperature / top-k / top-p visibly matter.

    EOS gets a -1e4 bias: it is never sampled, so every row has exactly max_completion_length tokens.
    """
    return tiny_model(seed=1, logit_scale=6.0, eos_bias=-1e4)


@pytest.fixture(scope="session")
def rm_dir(tiny_model_dir, tmp_path_factory):
    """Return the folder of a reward model: the tiny causal LM with a fresh one-output score head."""
    import torch

    from cohort.commands.rm import load_reward_model_for_training

    torch.manual_seed(0)
    model, tok = load_reward_model_for_training(tiny_model_dir)
    out = tmp_path_factory.mktemp("rm") / "rm"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
