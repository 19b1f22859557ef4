"""kl_estimate: the seed's values, the gradient each estimator gives (checked exactly on a small categorical
distribution), and the clamp that keeps extreme log-ratios finite."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cohort.algo import LOG_RATIO_CLAMP, kl_estimate

F64 = torch.float64


def test_seed_k3_values():
    # Seed 002 evaluates KL_i = rho_i - log rho_i - 1, i.e. k3 with r = ref_logp - logp = log rho_i:
    # 1.05 - 0.048790 - 1 = 0.001210; 1.30 - 0.262364 - 1 = 0.037636; 0.85 + 0.162519 - 1 = 0.012519;
    # 1.10 - 0.095310 - 1 = 0.004690.
    rho = torch.tensor([1.05, 1.30, 0.85, 1.10], dtype=F64)
    k3 = kl_estimate(torch.zeros(4, dtype=F64), rho.log(), "k3")
    torch.testing.assert_close(k3, rho - rho.log() - 1, rtol=0, atol=1e-15)
    torch.testing.assert_close(
        k3, torch.tensor([0.0012, 0.0376, 0.0125, 0.0047], dtype=F64), rtol=0, atol=5e-5
    )


def test_k1_k2_by_hand():
    # logp = -1, ref = -1.5: r = -0.5; k1 = -r = 0.5; k2 = 0.25 / 2 = 0.125; k3 = e^-0.5 + 0.5 - 1 = 0.106531.
    logp, ref = torch.tensor([-1.0], dtype=F64), torch.tensor([-1.5], dtype=F64)
    assert kl_estimate(logp, ref, "k1").item() == 0.5
    assert kl_estimate(logp, ref, "k2").item() == 0.125
    assert abs(kl_estimate(logp, ref).item() - (math.exp(-0.5) - 0.5)) < 1e-15


def _categorical(seed, v=6):
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(v, generator=g, dtype=F64, requires_grad=True)
    ref_logp = torch.log_softmax(torch.randn(v, generator=g, dtype=F64), -1)
    return theta, ref_logp


@pytest.mark.parametrize("seed", range(3))
def test_expected_values_and_gradients_match_the_docstring(seed):
    # Exact expectation over y ~ pi_theta (sampling probabilities held fixed, as for sampled tokens):
    # E[k] = sum_y sg(p_y) k(y).
    theta, ref_logp = _categorical(seed)
    logp = torch.log_softmax(theta, -1)
    p, q = logp.exp(), ref_logp.exp()
    reverse_kl = (p * (logp - ref_logp)).sum()  # KL(pi_theta || pi_ref)
    forward_kl = (q * (ref_logp - logp)).sum()  # KL(pi_ref || pi_theta)

    def expected(kind):
        return (p.detach() * kl_estimate(logp, ref_logp, kind)).sum()

    def grad(value):
        (g,) = torch.autograd.grad(value, theta, retain_graph=True)
        return g

    # Values: k1 and k3 are unbiased for the reverse KL; k2 is biased.
    assert abs(expected("k1").item() - reverse_kl.item()) < 1e-12
    assert abs(expected("k3").item() - reverse_kl.item()) < 1e-12
    assert abs(expected("k2").item() - reverse_kl.item()) > 1e-6
    # Gradients: k1 -> 0; k2 -> grad of the reverse KL; k3 -> grad of the forward KL.
    torch.testing.assert_close(grad(expected("k1")), torch.zeros_like(theta), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad(expected("k2")), grad(reverse_kl), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad(expected("k3")), grad(forward_kl), rtol=0, atol=1e-12)
    assert (grad(forward_kl) - grad(reverse_kl)).abs().max() > 1e-3  # the two claims are distinguishable


def test_clamp_keeps_extremes_finite():
    logp = torch.tensor([-1e4, 0.0, float("-inf")], requires_grad=True)
    ref = torch.tensor([0.0, -1e4, 0.0])
    for kind in ("k1", "k2", "k3"):
        value = kl_estimate(logp, ref, kind)
        assert torch.isfinite(value).all(), kind
        (g,) = torch.autograd.grad(value.sum(), logp)
        assert torch.isfinite(g).all() and (g == 0).all(), kind  # beyond the clamp the gradient is 0
    c = LOG_RATIO_CLAMP
    assert abs(kl_estimate(logp, ref, "k3")[0].item() - (math.exp(c) - c - 1)) / math.exp(c) < 1e-6


@settings(max_examples=60, deadline=None)
@given(st.floats(-1e4, 0.0), st.floats(-1e4, 0.0))
def test_property_k2_k3_non_negative_and_zero_at_agreement(a, b):
    logp, ref = torch.tensor([a, a], dtype=F64), torch.tensor([b, a], dtype=F64)
    for kind in ("k2", "k3"):
        value = kl_estimate(logp, ref, kind)
        assert (value >= 0).all() and torch.isfinite(value).all()
        assert value[1].item() == 0.0


def test_bad_input():
    with pytest.raises(ValueError, match=r"unknown kind 'k4'; valid options: 'k1', 'k2', 'k3'"):
        kl_estimate(torch.zeros(2), torch.zeros(2), "k4")
    with pytest.raises(ValueError, match=r"\(3,\).*\(2,\)"):
        kl_estimate(torch.zeros(2), torch.zeros(3))
    with pytest.raises(TypeError, match="logp must be a torch.Tensor"):
        kl_estimate([0.0], torch.zeros(1))


def test_k3_is_accurate_for_small_log_ratios_in_float32():
    # k3 = exp(r) - r - 1 = r^2/2 + r^3/6 + ...; for r = 1e-4 that is 5.0002e-9. Computed naively in float32,
    # exp(1e-4) rounds to a multiple of 1.2e-7 and the result is 0 or off by 100%.
    r = torch.tensor([1e-4, -1e-3, 3e-3])
    got = kl_estimate(torch.zeros(3), r, "k3")
    want = torch.tensor([x * x / 2 + x**3 / 6 for x in (1e-4, -1e-3, 3e-3)], dtype=F64)
    torch.testing.assert_close(got.to(F64), want, rtol=1e-3, atol=0)
