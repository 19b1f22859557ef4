"""algo/estimators.py: each built-in estimator declares the config fields it reads; the config agrees."""

from __future__ import annotations

import inspect

import pytest
import torch

from cohort.algo import ADVANTAGE_TYPES, ESTIMATOR_FIELDS, advantage_arguments, estimate_advantages
from cohort.algo import estimators as est
from cohort.config import AlgoConfig, TrainConfig
from cohort.config.inert import INERT_OPTIONS


def test_every_built_in_estimator_declares_exactly_its_keywords():
    assert set(ESTIMATOR_FIELDS) == set(ADVANTAGE_TYPES)
    for name in ADVANTAGE_TYPES:
        fn = est.ADVANTAGE_ESTIMATORS[name]
        keywords = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is p.KEYWORD_ONLY]
        assert sorted(keywords) == sorted(ESTIMATOR_FIELDS[name]), name
        assert all(hasattr(AlgoConfig(), field) for field in ESTIMATOR_FIELDS[name].values())


def test_a_declaration_that_differs_from_the_function_is_refused(monkeypatch):
    def scaled(rewards, group_size, lengths, *, std="sample"):
        return rewards

    # The declaration lives in cohort.algo.options (what the config reads); the function must match it.
    monkeypatch.setitem(est.ESTIMATOR_FIELDS, "test_scaled", {"std": "std", "eps": "adv_eps"})
    with pytest.raises(TypeError, match=r"takes \['std'\] but declares \['eps', 'std'\]"):
        est._builtin("test_scaled", scaled)
    assert "test_scaled" not in est.ADVANTAGE_ESTIMATORS


@pytest.mark.parametrize("name", ADVANTAGE_TYPES)
def test_the_config_passes_each_estimator_the_fields_it_declares(name):
    algo = AlgoConfig(advantage=name, std="population", adv_eps=1e-3)
    expected = {
        "grpo": {"scale": "group", "std": "population", "eps": 1e-3},
        "rloo": {},
        "max_rl": {},
        "optimal_token_baseline": {},
    }
    assert advantage_arguments(name, algo) == expected.get(name, {"std": "population", "eps": 1e-3})
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 1.0])
    estimate_advantages(name, rewards, 3, **advantage_arguments(name, algo))  # the call the trainer makes


def test_a_user_estimator_reads_its_own_keywords():
    algo = AlgoConfig(advantage="my_pkg.adv:mine", advantage_kwargs={"k": 2})
    assert advantage_arguments(algo.advantage, algo) == {"k": 2}


@pytest.mark.parametrize("name", ADVANTAGE_TYPES)
@pytest.mark.parametrize(("field", "value"), [("std", "population"), ("adv_eps", 1e-3)])
def test_the_config_calls_a_field_inert_exactly_when_the_estimator_does_not_declare_it(name, field, value):
    cfg = TrainConfig()
    cfg.algo.advantage = name
    setattr(cfg.algo, field, value)
    rule = next(r for r in INERT_OPTIONS if r.key == f"algo.{field}")
    assert (rule.why(cfg, 1) is None) == (field in ESTIMATOR_FIELDS[name].values())
