"""The public surface of cohort.algo: every export exists, is documented, and the option tuples agree with
what the functions accept."""

from __future__ import annotations

import inspect

import pytest
import torch

import cohort.algo as algo


def test_every_export_exists_and_functions_have_docstrings():
    for name in algo.__all__:
        obj = getattr(algo, name)
        if inspect.isfunction(obj):
            assert obj.__doc__ and obj.__doc__.strip().splitlines()[0].startswith("Return"), name


def test_contract_signatures():
    # The names and defaults in /work/notes/interfaces.md and DESIGN.md ("Algorithm API").
    sig = inspect.signature(algo.policy_loss)
    assert list(sig.parameters)[:4] == ["logp", "old_logp", "advantages", "mask"]
    defaults = {k: p.default for k, p in sig.parameters.items() if p.default is not inspect.Parameter.empty}
    assert defaults == {
        "loss_type": "grpo",
        "eps_low": 0.2,
        "eps_high": None,
        "delta": None,
        "beta": 0.0,
        "ref_logp": None,
        "max_completion_length": None,
        "num_items": None,
        "num_sequences": None,
        "importance": "token",
        "kl_kind": "k3",
        "aggregation": None,
        "loss_kwargs": None,
        "token_weights": None,
        "kl_cov_mask": None,
        "kl_cov_coef": 1.0,
        "kl_tau": 0.0,
        "use_bias_correction_kl": False,
        "sampler_weights": None,
        "divergence": None,
    }
    sig = inspect.signature(algo.group_advantages)
    assert {k: p.default for k, p in sig.parameters.items() if k in ("scale", "std", "eps")} == {
        "scale": "group",
        "std": "sample",
        "eps": 1e-4,
    }
    assert inspect.signature(algo.kl_estimate).parameters["kind"].default == "k3"
    assert inspect.signature(algo.combine_rewards).parameters["mode"].default == "sum"


def test_option_tuples_are_accepted():
    z, m, a = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2)
    for loss_type in algo.LOSS_TYPES:
        kl_tau = 1e-3 if loss_type == "dro" else 0.0  # dro is refused without its penalty
        algo.policy_loss(z, None, a, m, loss_type=loss_type, max_completion_length=3, kl_tau=kl_tau)
    for importance in algo.IMPORTANCE_LEVELS:
        algo.policy_loss(z, None, a, m, importance=importance)
    for scale in algo.SCALES:
        for std in algo.STD_KINDS:
            algo.group_advantages(torch.zeros(4), 2, scale=scale, std=std)
    for mode in algo.COMBINE_MODES:
        algo.combine_rewards(torch.zeros(4, 2), None, 2, mode=mode)
    for kind in algo.KL_KINDS:
        algo.kl_estimate(z, z, kind)
    assert set(algo.LOSS_AGGREGATIONS) == {"grpo", "bnpo", "dapo", "dr_grpo", "luspo"}
    assert set(algo.LOSS_TYPES) == set(algo.LOSS_AGGREGATIONS) | {
        "cispo",
        "sapo",
        "gmpo",
        "vespo",
        "dppo_tv",
        "dppo_kl",
        "dro",
    }


@pytest.mark.parametrize("bad", [2.0, "4", True])
def test_group_size_must_be_int(bad):
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        algo.group_advantages(torch.zeros(4), bad)
