"""Every example config in examples/configs loads and validates, as `cohort train FILE` would check it.

`cohort train` builds its config with `cohort.config.load_config(FILE, overrides)` and the trainer calls
`validate()` before loading anything. Validation reads no model or data file (a hub name or a missing
folder is the loader's concern), so the examples validate here with the default flags, although their
models (Qwen/..., runs/tiny) and data files (data/train.jsonl) are not on this machine.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from cohort.cli import build_parser
from cohort.config import TrainConfig, load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples" / "configs").glob("*.yaml"))


def test_the_examples_are_found():
    assert {p.name for p in EXAMPLES} >= {"addition.yaml", "dapo_lora.yaml", "r1_math_jsonl.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_config_loads_and_validates(path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # out_dir (runs/...) is checked against a fresh, writable folder
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an example sets no option that changes nothing
        cfg = load_config(path).validate()
    assert isinstance(cfg, TrainConfig)
    assert cfg.model.name_or_path and (cfg.data.task or cfg.data.path)
    # The command line reads the same file to the same config (validated alike: validation derives fields).
    args = build_parser().parse_args(["train", str(path)])
    assert load_config(args.config, args.overrides).validate() == cfg


def test_an_example_takes_overrides_on_top(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = next(p for p in EXAMPLES if p.name == "dapo_lora.yaml")
    cfg = load_config(path, ["rollout.group_size=8", "model.name_or_path=runs/tiny"]).validate()
    assert (cfg.preset, cfg.rollout.group_size, cfg.model.name_or_path) == ("dapo", 8, "runs/tiny")
    assert cfg.algo.eps_high == 0.28  # the preset's value, under the file and the overrides
