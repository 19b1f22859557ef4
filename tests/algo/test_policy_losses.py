"""CISPO, SAPO, GMPO and dual-clip PPO: hand-computed cases, plain-loop references over a grid, token weights,
KL-Cov's penalty, user losses and the parameter ranges."""

from __future__ import annotations

import math
import random

import pytest
import torch

from cohort.algo import LossInputs, LossTerms, check_loss_kwargs, policy_loss, register_loss

F64 = torch.float64


def _grad(loss, logp):
    (g,) = torch.autograd.grad(loss, logp)
    return g


def _leaf(values):
    return torch.tensor(values, dtype=F64, requires_grad=True)


# --------------------------------------------------------------------------------------------------- by hand


def test_cispo_by_hand():
    # One completion of 2 tokens, A = 2, ratios 2 and 8 against pi_old, max_ratio 5 -> weights 2 and 5.
    # Per-token loss -w * A * r (r = 1 in value): -4 and -10; dapo aggregation over 2 tokens: -7.
    # Gradient wrt logp_t: -w_t * A / 2 = -2 and -5. Clipped high: token 2 (8 > 5, A > 0) -> 1/2.
    old = torch.zeros(1, 2, dtype=F64)
    logp = _leaf([[math.log(2.0), math.log(8.0)]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = policy_loss(logp, old, torch.tensor([2.0], dtype=F64), mask, loss_type="cispo")
    assert abs(loss.item() + 7.0) < 1e-12
    torch.testing.assert_close(_grad(loss, logp), torch.tensor([[-2.0, -5.0]], dtype=F64))
    assert m["clip_ratio/high_mean"].item() == 0.5 and m["clip_ratio/low_mean"].item() == 0.0
    # A ratio far above the cap still carries gradient (CISPO's point): PPO's clip would zero it.
    ppo, _ = policy_loss(logp, old, torch.tensor([2.0], dtype=F64), mask, loss_type="dapo")
    assert _grad(ppo, logp)[0, 1].item() == 0.0


def test_sapo_by_hand():
    # On-policy (rho = 1), A = +1 with tau_pos = 1: gate sigma(0) * 4 / 1 = 2 -> loss -2; the gate's slope at
    # rho = 1 is sigma'(0) * 4 = 1, so the gradient is the plain policy gradient -1 per token / T=1.
    mask = torch.ones(1, 1, dtype=torch.bool)
    logp = _leaf([[-0.5]])
    loss, _ = policy_loss(logp, None, torch.tensor([1.0], dtype=F64), mask, loss_type="sapo")
    assert abs(loss.item() + 2.0) < 1e-12
    assert abs(_grad(loss, logp).item() + 1.0) < 1e-12
    # A = -1 (tau_neg = 1.05): loss +2 / 1.05, gradient still +1.
    loss, _ = policy_loss(logp, None, torch.tensor([-1.0], dtype=F64), mask, loss_type="sapo")
    assert abs(loss.item() - 2.0 / 1.05) < 1e-12
    assert abs(_grad(loss, logp).item() - 1.0) < 1e-12
    # rho = 2, A = +1: gate sigma(1) * 4 = 2.92423; d gate / d logp = sigma(1)(1 - sigma(1)) * 4 * rho = 1.57290.
    logp = _leaf([[math.log(2.0)]])
    loss, _ = policy_loss(
        logp, torch.zeros(1, 1, dtype=F64), torch.tensor([1.0], dtype=F64), mask, loss_type="sapo"
    )
    s = 1 / (1 + math.exp(-1))
    assert abs(loss.item() + 4 * s) < 1e-12
    assert abs(_grad(loss, logp).item() + s * (1 - s) * 4 * 2) < 1e-12


def test_gmpo_by_hand():
    # One completion, log-ratios 0.1 and 0.6, clip 0.4. A = +1: pessimistic per token min(lr, clip(lr)) =
    # [0.1, 0.4], mean 0.25, R = e^0.25 -> loss -e^0.25 (grpo: one sequence). Gradient: token 1 -R/2, token 2
    # (clipped, constant) 0.
    mask = torch.ones(1, 2, dtype=torch.bool)
    old = torch.zeros(1, 2, dtype=F64)
    logp = _leaf([[0.1, 0.6]])
    loss, m = policy_loss(logp, old, torch.tensor([1.0], dtype=F64), mask, loss_type="gmpo")
    r = math.exp(0.25)
    assert abs(loss.item() + r) < 1e-12
    torch.testing.assert_close(_grad(loss, logp), torch.tensor([[-r / 2, 0.0]], dtype=F64))
    assert m["clip_ratio/high_mean"].item() == 0.5
    # A = -1: pessimistic is max(lr, clip(lr)) = [0.1, 0.6], mean 0.35, R = e^0.35 -> loss +R, gradient R/2 each.
    loss, m = policy_loss(logp, old, torch.tensor([-1.0], dtype=F64), mask, loss_type="gmpo")
    r = math.exp(0.35)
    assert abs(loss.item() - r) < 1e-12
    torch.testing.assert_close(_grad(loss, logp), torch.tensor([[r / 2, r / 2]], dtype=F64))
    assert m["clip_ratio/region_mean"].item() == 0.0  # a large ratio is not clipped when A < 0


# ------------------------------------------------------------------------------------------ loop references


def loop_loss(logp, old, adv, mask, loss_type, **kw):
    """The loss from the papers' formulas, one token at a time, with each loss type's own aggregation."""
    n, t_len = logp.shape
    per_seq, token_sum, tokens = [], 0.0, 0
    for i in range(n):
        toks = [t for t in range(t_len) if mask[i, t]]
        a = float(adv[i])
        if loss_type == "gmpo":
            c = kw.get("clip", 0.4)
            pess = []
            for t in toks:
                lr = logp[i, t] - old[i, t]
                lc = lr.clamp(-c, c)
                pess.append(torch.minimum(lr, lc) if a > 0 else torch.maximum(lr, lc))
            value = -torch.exp(sum(pess) / max(len(toks), 1)) * a if toks else torch.zeros((), dtype=F64)
            per_seq.append(value)
            continue
        row = []
        for t in toks:
            rho = torch.exp(logp[i, t] - old[i, t])
            if loss_type == "cispo":
                w = min(float(rho.detach()), kw.get("max_ratio", 5.0))
                row.append(-w * a * torch.exp(logp[i, t] - logp[i, t].detach()))
            else:  # sapo
                tau = kw.get("tau_pos", 1.0) if a > 0 else kw.get("tau_neg", 1.05)
                row.append(-torch.sigmoid(tau * (rho - 1)) * 4 / tau * a)
        token_sum = token_sum + sum(row, torch.zeros((), dtype=F64))
        tokens += len(toks)
        per_seq.append(sum(row, torch.zeros((), dtype=F64)) / max(len(toks), 1))
    if loss_type == "cispo":  # dapo aggregation
        return token_sum / max(tokens, 1)
    return sum(per_seq, torch.zeros((), dtype=F64)) / n  # grpo aggregation


@pytest.mark.parametrize(
    "loss_type, kwargs",
    [
        ("cispo", {}),
        ("cispo", {"max_ratio": 1.5}),
        ("sapo", {}),
        ("sapo", {"tau_pos": 2.0, "tau_neg": 0.5}),
        ("gmpo", {}),
        ("gmpo", {"clip": 0.1}),
    ],
)
def test_against_the_loop_reference(loss_type, kwargs):
    rng = random.Random(f"{loss_type}{kwargs}")
    for n, t_len in [(1, 1), (2, 3), (4, 5), (6, 9)]:
        for _ in range(3):
            old = torch.tensor([[rng.uniform(-3, 0) for _ in range(t_len)] for _ in range(n)], dtype=F64)
            logp = (
                old + torch.tensor([[rng.uniform(-1, 1) for _ in range(t_len)] for _ in range(n)])
            ).requires_grad_()
            adv = torch.tensor([rng.choice([-1.5, -0.3, 0.0, 0.7, 2.0]) for _ in range(n)], dtype=F64)
            mask = torch.tensor([[t < rng.randint(1, t_len) for t in range(t_len)] for _ in range(n)])
            got, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, loss_kwargs=kwargs)
            want = loop_loss(logp, old, adv, mask, loss_type, **kwargs)
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(_grad(got, logp), _grad(want, logp), rtol=1e-12, atol=1e-12)


def test_delta_is_dual_clip_ppo():
    # Dual-clip PPO (Ye et al. 2020): for A < 0, objective max(min(rho A, clip(rho) A), c A); for A >= 0 the
    # usual min. policy_loss's delta = c must give the same value and gradient everywhere.
    rng = random.Random(0)
    c = 3.0
    n, t_len = 6, 5
    old = torch.tensor([[rng.uniform(-3, 0) for _ in range(t_len)] for _ in range(n)], dtype=F64)
    logp = (
        old + torch.tensor([[rng.uniform(-2, 2) for _ in range(t_len)] for _ in range(n)])
    ).requires_grad_()
    adv = torch.tensor([-2.0, -0.5, 0.0, 0.5, 1.0, -1.0], dtype=F64)
    mask = torch.ones(n, t_len, dtype=torch.bool)
    got, _ = policy_loss(logp, old, adv, mask, loss_type="bnpo", delta=c)
    terms = []
    for i in range(n):
        for t in range(t_len):
            rho = torch.exp(logp[i, t] - old[i, t])
            a = adv[i]
            obj = torch.minimum(rho * a, rho.clamp(0.8, 1.2) * a)
            if a < 0:
                obj = torch.maximum(obj, c * a)
            terms.append(-obj)
    want = torch.stack(terms).mean()
    assert (torch.exp(logp - old) > c).any()  # the dual clip is exercised
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(_grad(got, logp), _grad(want, logp), rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- weights, KL-Cov, user losses


def test_token_weights_scale_the_policy_term_only():
    # Weights multiply the policy loss per token before the KL term: weight 0 removes a token's policy
    # gradient but keeps its KL gradient.
    logp = _leaf([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    w = torch.tensor([[1.0, 0.0]], dtype=F64)
    loss, _ = policy_loss(
        logp, None, torch.tensor([1.0], dtype=F64), mask, beta=0.1, ref_logp=ref, token_weights=w
    )
    g = _grad(loss, logp)
    # Token 2: only beta * d k3 / d logp = beta * (1 - exp(ref - logp)) / 2 = 0.1 * (1 - e^1) / 2.
    assert abs(g[0, 1].item() - 0.1 * (1 - math.e) / 2) < 1e-12
    # Token 1: -A / 2 + 0.1 * (1 - e^-0.5) / 2.
    assert abs(g[0, 0].item() - (-0.5 + 0.1 * (1 - math.exp(-0.5)) / 2)) < 1e-12


def test_kl_cov_penalty_is_abs_log_ratio_on_selected_tokens():
    # Tokens with log-ratios 0.3 and -0.2; KL-Cov on token 2 with coef 2: adds 2 * 0.2 = 0.4 to its loss
    # (dapo over 2 tokens: +0.2) and 2 * sign(-0.2) = -2 to its gradient (/2: -1).
    old = torch.zeros(1, 2, dtype=F64)
    logp = _leaf([[0.3, -0.2]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    sel = torch.tensor([[False, True]])
    adv = torch.zeros(1, dtype=F64)
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="dapo", kl_cov_mask=sel, kl_cov_coef=2.0)
    assert abs(loss.item() - 0.2) < 1e-12
    torch.testing.assert_close(_grad(loss, logp), torch.tensor([[0.0, -1.0]], dtype=F64))


def test_a_registered_user_loss_is_masked_and_aggregated():
    def reinforce(inputs: LossInputs, scale: float = 1.0) -> torch.Tensor:
        return -scale * inputs.advantages * inputs.policy_gradient_term()

    register_loss("test_reinforce", reinforce, "grpo")
    logp = _leaf([[-1.0, -2.0], [-0.5, 123.0]])
    mask = torch.tensor([[True, True], [True, False]])
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    loss, _ = policy_loss(logp, None, adv, mask, loss_type="test_reinforce", loss_kwargs={"scale": 3.0})
    # grpo: ((-3 - 3) / 2 + 6 / 1) / 2 = 1.5
    assert abs(loss.item() - 1.5) < 1e-12
    torch.testing.assert_close(_grad(loss, logp), torch.tensor([[-0.75, -0.75], [3.0, 0.0]], dtype=F64))
    with pytest.raises(ValueError, match="Expected signature"):
        check_loss_kwargs("test_reinforce", {"nope": 1})

    register_loss("test_bad_shape", lambda inputs: inputs.advantages.sum(), "dapo")
    with pytest.raises(ValueError, match=r"per-token loss as a tensor of shape \[N, T\]"):
        policy_loss(logp, None, adv, mask, loss_type="test_bad_shape")

    register_loss("test_terms", lambda inputs: LossTerms(-inputs.advantages * inputs.policy_gradient_term()))
    loss, m = policy_loss(logp, None, adv, mask, loss_type="test_terms")
    assert m["clip_ratio/region_mean"].item() == 0.0


@pytest.mark.parametrize(
    "loss_type, kwargs, fragment",
    [
        ("cispo", {"max_ratio": 1.0}, "max_ratio must be > 1"),
        ("cispo", {"min_ratio": 1.0}, r"min_ratio must be in \[0, 1\)"),
        ("sapo", {"tau_pos": 0.0}, "tau_pos must be > 0"),
        ("gmpo", {"clip": -0.1}, "clip must be > 0"),
        ("gmpo", {"eps": 0.1}, "no parameter 'eps'"),
        ("grpo", {"clip": 0.1}, "takes no parameters"),
        ("sapo", {"tau_neg": "1"}, "must be a number"),
    ],
)
def test_parameters_outside_the_papers_range(loss_type, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        check_loss_kwargs(loss_type, kwargs)


def test_gmpo_refuses_per_token_advantages_and_sequence_importance():
    z = torch.zeros(2, 3, dtype=F64)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="one advantage per completion"):
        policy_loss(z, None, z, m, loss_type="gmpo")
    with pytest.raises(ValueError, match="token-level ratios"):
        policy_loss(z, None, torch.zeros(2, dtype=F64), m, loss_type="gmpo", importance="sequence")


def test_on_policy_the_off_policy_losses_give_the_plain_gradient():
    # With one optimizer step per batch every ratio is 1: CISPO's weight is 1 (dapo's gradient), SAPO's gate
    # has slope 1 (grpo's), GMPO's geometric mean is 1 (grpo's). They differ only once the policy has moved.
    rng = random.Random(7)
    logp0 = torch.tensor([[rng.uniform(-3, 0) for _ in range(6)] for _ in range(4)], dtype=F64)
    adv = torch.tensor([1.0, -0.5, 0.3, -2.0], dtype=F64)
    mask = torch.tensor([[t < k for t in range(6)] for k in (6, 3, 1, 5)])
    for mine, plain in (("cispo", "dapo"), ("sapo", "grpo"), ("gmpo", "grpo")):
        a, b = logp0.clone().requires_grad_(), logp0.clone().requires_grad_()
        ga = _grad(policy_loss(a, None, adv, mask, loss_type=mine)[0], a)
        gb = _grad(policy_loss(b, None, adv, mask, loss_type=plain)[0], b)
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12)
