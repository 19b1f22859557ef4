"""The loss's settings checked once per distinct settings (policy_loss remembers them; check_loss_options is the
pre-check) and the loss parameters' one table."""

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


@pytest.fixture
def checks(monkeypatch):
    """Returns the list of the settings checked by policy_loss from now on (one entry per check run)."""
    seen: list[dict] = []
    check = losses_module._checked_options

    def counted(**settings):
        seen.append(settings)
        return check(**settings)

    monkeypatch.setattr(losses_module, "_CHECKED_SETTINGS", {})  # what earlier tests remembered is forgotten
    monkeypatch.setattr(losses_module, "_checked_options", counted)
    return seen


def test_policy_loss_has_one_calling_convention():
    assert "options" not in inspect.signature(policy_loss).parameters
    with pytest.raises(TypeError, match="options"):
        policy_loss(Z, None, A, M, options=check_loss_options())  # type: ignore[call-arg]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_remembered_settings_give_the_same_loss_gradient_and_metrics(loss_type, checks):
    settings = dict(loss_type=loss_type, beta=0.05, max_completion_length=5, eps_high=0.28)
    if loss_type not in ("grpo", "bnpo", "dapo", "dr_grpo"):
        settings.pop("eps_high")
    if loss_type == "dro":
        settings["kl_tau"] = 1e-3  # dro is refused without its penalty
    logp, old, adv, mask, ref = _inputs(3)
    results = []
    for _ in range(2):  # checked, then remembered
        loss, metrics = policy_loss(logp, old, adv, mask, ref_logp=ref, num_items=17, **settings)
        (grad,) = torch.autograd.grad(loss, logp)
        results.append((loss, grad, metrics))
    assert len(checks) == 1
    (loss_a, grad_a, m_a), (loss_b, grad_b, m_b) = results
    assert torch.equal(loss_a, loss_b) and torch.equal(grad_a, grad_b)
    assert m_a.keys() == m_b.keys() and all(torch.equal(m_a[k], m_b[k]) for k in m_a)


def test_the_same_settings_are_checked_once_and_a_changed_one_again(checks):
    settings = dict(loss_type="cispo", loss_kwargs={"max_ratio": 3.0}, eps_low=0.2)
    for _ in range(5):
        policy_loss(Z, None, A, M, **settings)
    assert len(checks) == 1
    policy_loss(Z, None, A, M, **{**settings, "loss_kwargs": {"max_ratio": 4.0}})
    policy_loss(Z, None, A, M, **{**settings, "eps_low": 0.1})
    policy_loss(Z, None, A, M, **{**settings, "loss_kwargs": {"max_ratio": 4.0}})
    assert len(checks) == 3
    # Equal but not the same: True == 1, yet use_bias_correction_kl=1 is refused, on every call.
    policy_loss(Z, None, A, M, use_bias_correction_kl=True)
    for _ in range(2):
        with pytest.raises(TypeError, match="use_bias_correction_kl must be True or False"):
            policy_loss(Z, None, A, M, use_bias_correction_kl=1)
    assert len(checks) == 6
    policy_loss(Z, None, A, M, kl_tau=0.0)
    policy_loss(Z, None, A, M, kl_tau=-0.0)  # equal, but a loss could tell the zeros apart
    assert len(checks) == 8


def test_unhashable_settings_are_checked_on_every_call(checks):
    kwargs = {"max_ratio": [3.0]}  # a list: no memo key, the checks' own error each time
    for _ in range(2):
        with pytest.raises(Exception) as raised:
            policy_loss(Z, None, A, M, loss_type="cispo", loss_kwargs=kwargs)
    assert len(checks) == 2
    with pytest.raises(type(raised.value)) as direct:
        check_loss_options(loss_type="cispo", loss_kwargs=kwargs)
    assert str(direct.value) == str(raised.value)


def test_a_loss_registered_again_is_checked_again(checks, monkeypatch):
    def mine(inputs, *, scale=1.0):
        return -inputs.advantages * scale

    def other(inputs):
        return -inputs.advantages

    name = "test_registered_again"
    for table in (POLICY_LOSSES, losses_module.LOSS_KINDS):  # both forget it after the test
        monkeypatch.setitem(table, name, table["grpo"])
    losses_module.register_loss(name, mine)
    policy_loss(Z, None, A, M, loss_type=name, loss_kwargs={"scale": 2.0})
    losses_module.register_loss(name, other)
    with pytest.raises(ValueError, match="cannot be called as fn"):
        policy_loss(Z, None, A, M, loss_type=name, loss_kwargs={"scale": 2.0})
    assert len(checks) == 2


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


def test_the_checks_that_need_the_tensors_still_run_on_every_call(checks):
    for _ in range(2):  # the second call's settings are remembered; its tensors are checked all the same
        with pytest.raises(ValueError, match="max_completion_length must be an int >= T=3"):
            policy_loss(Z, None, A, M, max_completion_length=2)
        with pytest.raises(ValueError, match="beta=0.1 > 0 needs ref_logp"):
            policy_loss(Z, None, A, M, beta=0.1)
        with pytest.raises(ValueError, match="aggregation 'dr_grpo' divides by N \\* max_completion_length"):
            policy_loss(Z, None, A, M, loss_type="dr_grpo")
    assert len(checks) == 3


def test_check_loss_options_takes_the_settings_only():
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['ref_logp'\]"):
        check_loss_options(ref_logp=Z)
