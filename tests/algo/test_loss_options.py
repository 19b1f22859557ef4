"""The loss's settings checked once per update (check_loss_options) and the loss parameters' one table."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch

from cohort.algo import LOSS_PARAMETERS, LOSS_TYPES, POLICY_LOSSES, check_loss_options, policy_loss
from cohort.algo import losses as losses_module
from cohort.config import AlgoConfig, field_docs

Z = torch.zeros(2, 3)
M = torch.ones(2, 3, dtype=torch.bool)
A = torch.zeros(2)


def test_the_loss_functions_take_their_defaults_from_the_table():
    for loss_type, params in LOSS_PARAMETERS.items():
        signature = inspect.signature(POLICY_LOSSES[loss_type].fn).parameters
        assert {k: signature[k].default for k in params} == {k: p.default for k, p in params.items()}


def test_the_documented_defaults_are_the_tables():
    config_doc = field_docs(AlgoConfig)["loss_kwargs"]
    table = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    for loss_type, params in LOSS_PARAMETERS.items():
        written = ", ".join(f"{k}: {'null' if p.default is None else p.default}" for k, p in params.items())
        assert f"{loss_type} {{{written}}}" in " ".join(config_doc.split())
        row = next(line for line in table.splitlines() if line.startswith(f"| `{loss_type}` |"))
        for key, p in params.items():
            assert re.search(rf"`{key}`[^|,]*\b{p.default}\b", row), (loss_type, key, row)


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(4, 5, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(4, 5, generator=g)
    mask = torch.rand(4, 5, generator=g) > 0.2
    return logp, old, torch.randn(4, generator=g), mask, logp.detach() - 0.1


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_checked_options_give_the_same_loss_gradient_and_metrics(loss_type):
    settings = dict(loss_type=loss_type, beta=0.05, max_completion_length=5, eps_high=0.28)
    if loss_type not in ("grpo", "bnpo", "dapo", "dr_grpo"):
        settings.pop("eps_high")
    if loss_type == "dro":
        settings["kl_tau"] = 1e-3  # dro is refused without its penalty
    logp, old, adv, mask, ref = _inputs(3)
    results = []
    for options in (None, check_loss_options(**settings)):
        kwargs = settings if options is None else {"options": options}
        loss, metrics = policy_loss(logp, old, adv, mask, ref_logp=ref, num_items=17, **kwargs)
        (grad,) = torch.autograd.grad(loss, logp)
        results.append((loss, grad, metrics))
    (loss_a, grad_a, m_a), (loss_b, grad_b, m_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert m_a.keys() == m_b.keys() and all(torch.equal(m_a[k], m_b[k]) for k in m_a)


def test_a_call_with_checked_options_does_not_check_them_again(monkeypatch):
    options = check_loss_options(loss_type="cispo", loss_kwargs={"max_ratio": 3.0})

    def checked_again(*args, **kwargs):
        raise AssertionError("the settings were checked again")

    monkeypatch.setattr(losses_module, "check_loss_kwargs", checked_again)
    monkeypatch.setattr(losses_module, "aggregation_of", checked_again)
    policy_loss(Z, None, A, M, options=options)


@pytest.mark.parametrize(
    "settings",
    [
        {"loss_type": "ppo"},
        {"importance": "seq"},
        {"kl_kind": "k9"},
        {"delta": 1.1},
        {"eps_low": 1.0},
        {"eps_low": -0.1},
        {"eps_high": -1.0},
        {"beta": -0.5},
        {"aggregation": "mean"},
        {"loss_type": "cispo", "loss_kwargs": {"max_ratio": 0.5}},
        {"loss_type": "grpo", "loss_kwargs": {"clip": 0.2}},
        {"loss_type": "gmpo", "importance": "sequence"},
    ],
)
def test_check_loss_options_raises_what_policy_loss_raises(settings):
    with pytest.raises(Exception) as by_call:
        policy_loss(Z, None, A, M, **settings)
    with pytest.raises(type(by_call.value)) as by_check:
        check_loss_options(**settings)
    assert str(by_check.value) == str(by_call.value)


def test_the_checks_that_need_the_tensors_still_run_on_every_call():
    with pytest.raises(ValueError, match="max_completion_length must be an int >= T=3"):
        policy_loss(Z, None, A, M, options=check_loss_options(max_completion_length=2))
    with pytest.raises(ValueError, match="beta=0.1 > 0 needs ref_logp"):
        policy_loss(Z, None, A, M, options=check_loss_options(beta=0.1))
    with pytest.raises(ValueError, match="aggregation 'dr_grpo' divides by N \\* max_completion_length"):
        policy_loss(Z, None, A, M, options=check_loss_options(loss_type="dr_grpo"))


def test_options_and_settings_keywords_are_not_mixed():
    with pytest.raises(TypeError, match=r"got options and the settings \['beta'\] as keywords"):
        policy_loss(Z, None, A, M, beta=0.1, ref_logp=Z, options=check_loss_options())
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['ref_logp'\]"):
        check_loss_options(ref_logp=Z)
