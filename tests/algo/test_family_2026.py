"""The GRPO family of 2026 (issue 40): LUSPO, VESPO, DPPO, DRO and kl_tau, the bias-corrected KL, DeepSeek-V3.2's
off-policy mask, top-K divergence, MaxRL and OTB. Each one on hand-computed cases (arithmetic in the comments),
against a plain loop written from the reference formula over random ragged float64 batches (both advantage
signs, off-policy enough to reach every branch, gradients too), micro-batch split invariance and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from cohort.algo import (
    estimate_advantages,
    max_rl_advantages,
    off_policy_mask,
    optimal_token_baseline,
    policy_loss,
    topk_divergence,
    topk_divergence_from_logprobs,
)
from cohort.algo.controls import ControlSettings, token_controls

F64 = torch.float64


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x, retain_graph=True)
    return g


def _case(n, t_len, seed, *, spread=0.6, per_token_adv=False):
    """Ragged float64 batch: log-probs in [-2, 0], pi_old and the sampler far enough away to trigger masks."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t_len + 1, (n,), generator=g)
    mask = torch.arange(t_len)[None, :] < lengths[:, None]
    logp = -2 * torch.rand(n, t_len, generator=g, dtype=F64)
    old = (logp + spread * torch.randn(n, t_len, generator=g, dtype=F64)).clamp(max=-1e-3)
    sampler = (logp + spread * torch.randn(n, t_len, generator=g, dtype=F64)).clamp(max=-1e-3)
    ref = logp + 0.3 * torch.randn(n, t_len, generator=g, dtype=F64)
    adv = torch.randn(*((n, t_len) if per_token_adv else (n,)), generator=g, dtype=F64)
    logp = torch.where(mask, logp, 7.0)  # garbage at padding the loss must never read
    return logp.requires_grad_(), old, sampler, ref, adv, mask


def _tokens(mask):
    return [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]


# ---------------------------------------------------------------------------------------------------------
# MaxRL
# ---------------------------------------------------------------------------------------------------------


def test_max_rl_by_hand():
    # Group 0: [1, 0, 0, 1], mean 0.5 -> (r - 0.5) / 0.5 = [1, -1, -1, 1].
    # Group 1: all 0, mean 0 <= 0 -> 0.  Group 2: all 2 (constant) -> exactly 0.
    # Group 3: [1, NaN, 0, 0]: mean over the valid three = 1/3 -> [2, 0 (NaN row), -1, -1].
    # Group 4: [-1, 1, -1, 0]: mean -0.25 <= 0 -> 0.
    r = torch.tensor([1, 0, 0, 1, 0, 0, 0, 0, 2, 2, 2, 2, 1, float("nan"), 0, 0, -1, 1, -1, 0.0])
    want = torch.tensor([1, -1, -1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, -1, -1, 0, 0, 0, 0.0])
    torch.testing.assert_close(max_rl_advantages(r, 4), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(estimate_advantages("max_rl", r, 4), want, rtol=0, atol=1e-6)
    assert max_rl_advantages(torch.full((4,), 0.3), 4).eq(0).all()  # exactly 0, no rounding residue


def test_max_rl_matches_loop_reference():
    g = torch.Generator().manual_seed(0)
    for size in (2, 3, 8):
        r = torch.randint(0, 3, (size * 6,), generator=g).to(F64) - 0.5 * (
            torch.rand(size * 6, generator=g) < 0.2
        )
        got = max_rl_advantages(r, size)
        for start in range(0, r.numel(), size):
            group = r[start : start + size].tolist()
            mean = sum(group) / size
            for j, x in enumerate(group):
                want = 0.0 if mean <= 0 or len(set(group)) == 1 else (x - mean) / mean
                assert abs(got[start + j].item() - want) < 1e-12


# ---------------------------------------------------------------------------------------------------------
# DeepSeek-V3.2's off-policy sequence mask
# ---------------------------------------------------------------------------------------------------------


def test_off_policy_mask_by_hand():
    # KL_i = mean_t (log mu - log pi). Row 0: gaps [0.5, 1.0] -> 0.75 > 0.5 with A < 0: dropped.
    # Row 1: the same gaps with A > 0: kept. Row 2: gaps [NaN -> 0, 0.2] / 2 tokens = 0.1 <= 0.5: kept.
    # Row 3: gap 0.6 over one token (T = 2, padding after) with A < 0: dropped; padding is always False.
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0], [-1.0, -2.0], [-1.0, 9.0]], dtype=F64)
    mu = torch.tensor([[-0.5, -1.0], [-0.5, -1.0], [float("nan"), -1.8], [-0.4, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]], dtype=torch.bool)
    adv = torch.tensor([-1.0, 1.0, -1.0, -2.0], dtype=F64)
    keep = off_policy_mask(adv, logp, mu, mask, 0.5)
    assert keep.tolist() == [[False, False], [True, True], [True, True], [False, False]]
    # Threshold 0.8: row 0 (0.75) is kept now, row 3 (0.6) too.
    assert off_policy_mask(adv, logp, mu, mask, 0.8).tolist() == [[True, True]] * 3 + [[True, False]]


def test_off_policy_mask_matches_loop_reference_per_token_advantages():
    logp, _, mu, _, adv, mask = _case(7, 6, seed=3, per_token_adv=True)
    for threshold in (0.0, 0.1, 0.3):
        keep = off_policy_mask(adv, logp, mu, mask, threshold)
        for i, toks in enumerate(_tokens(mask)):
            kl = sum(mu[i, t].item() - logp[i, t].item() for t in toks) / len(toks)
            for t in range(mask.shape[1]):
                want = t in toks and (adv[i, t].item() >= 0 or kl <= threshold)
                assert keep[i, t].item() == want
    assert not off_policy_mask(adv, logp, mu, mask, 0.0).all()  # the case drops something


def test_off_policy_mask_as_token_control_anchors_on_the_sampler_and_reports_the_dropped_share():
    logp, old, mu, _, adv, mask = _case(6, 5, seed=4)
    s = ControlSettings(off_policy_mask_threshold=0.1)
    assert s.active
    out = token_controls(logp.detach(), mask, adv, s, old_logp=old, sampled_logp=mu)
    keep = off_policy_mask(adv, logp, mu, mask, 0.1)
    assert torch.equal(out.weights, keep.to(F64))
    dropped = float((mask & ~keep).sum()) / float(mask.sum())
    assert out.metrics["off_policy_mask/dropped_frac"] == pytest.approx(dropped) and dropped > 0
    # Without the sampler's log-probs the anchor is pi_old (TRL's fallback).
    out = token_controls(logp.detach(), mask, adv, s, old_logp=old)
    assert torch.equal(out.weights, off_policy_mask(adv, logp, old, mask, 0.1).to(F64))


# ---------------------------------------------------------------------------------------------------------
# Bias-corrected KL and the squared log-ratio penalty (kl_tau, dro)
# ---------------------------------------------------------------------------------------------------------


def test_bias_corrected_kl_by_hand():
    # logp = -1, pi_old = -1.2, ref = -1.5, A = 0, beta = 0.1, one token (dapo: / 1).
    # r = ref - logp = -0.5; k3 = e^-0.5 + 0.5 - 1 = 0.1065307; rho = e^0.2 = 1.2214028.
    # loss = 0.1 * k3 * rho = 0.0130117; d/dlogp = 0.1 * rho * ((1 - e^-0.5) + k3) = 0.1 * 1.2214 * 0.5000
    logp = torch.tensor([[-1.0]], dtype=F64, requires_grad=True)
    old, ref = torch.tensor([[-1.2]], dtype=F64), torch.tensor([[-1.5]], dtype=F64)
    adv, mask = torch.zeros(1, dtype=F64), torch.ones(1, 1, dtype=torch.bool)
    k3, rho = math.exp(-0.5) + 0.5 - 1, math.exp(0.2)
    opts = dict(loss_type="dapo", beta=0.1, ref_logp=ref)
    loss, m = policy_loss(logp, old, adv, mask, use_bias_correction_kl=True, **opts)
    assert loss.item() == pytest.approx(0.1 * k3 * rho, abs=1e-14)
    assert _grad(loss, logp).item() == pytest.approx(0.1 * rho * ((1 - math.exp(-0.5)) + k3), abs=1e-14)
    assert m["kl"].item() == pytest.approx(k3 * rho, abs=1e-14)
    plain, _ = policy_loss(logp, old, adv, mask, **opts)
    assert plain.item() == pytest.approx(0.1 * k3, abs=1e-14)  # off by default
    # On-policy the value is unchanged and the gradient is not (the factor's gradient is grad log pi).
    on, _ = policy_loss(logp, None, adv, mask, use_bias_correction_kl=True, **opts)
    assert on.item() == pytest.approx(0.1 * k3, abs=1e-14)
    assert _grad(on, logp).item() == pytest.approx(0.1 * ((1 - math.exp(-0.5)) + k3), abs=1e-14)


def test_bias_corrected_kl_uses_the_token_ratio_at_sequence_importance():
    # Decision D1: DeepSeek's estimator weighs each token by its own ratio, also under GSPO's sequence ratio.
    logp, old, _, ref, adv, mask = _case(4, 5, seed=8)
    opts = dict(loss_type="grpo", beta=0.2, ref_logp=ref, use_bias_correction_kl=True)
    seq, _ = policy_loss(logp, old, torch.zeros_like(adv), mask, importance="sequence", **opts)
    tok, _ = policy_loss(logp, old, torch.zeros_like(adv), mask, importance="token", **opts)
    torch.testing.assert_close(seq, tok, rtol=0, atol=1e-14)  # A = 0: only the KL term is left
    torch.testing.assert_close(_grad(seq, logp), _grad(tok, logp), rtol=0, atol=1e-14)


def test_kl_tau_by_hand_and_not_scaled_by_weights():
    # Two tokens, log-ratios 0.2 and -0.1, A = 0, kl_tau = 0.5, dapo over 2 tokens:
    # loss = 0.5 * (0.04 + 0.01) / 2 = 0.0125; gradient 2 * 0.5 * lr / 2 = [0.1, -0.05].
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.2, -1.9]], dtype=F64)
    mask, adv = torch.ones(1, 2, dtype=torch.bool), torch.zeros(1, dtype=F64)
    for weights in (None, torch.zeros(1, 2, dtype=F64)):  # token and sampler weights leave it alone
        loss, m = policy_loss(
            logp, old, adv, mask, loss_type="dapo", kl_tau=0.5, token_weights=weights, sampler_weights=weights
        )
        assert loss.item() == pytest.approx(0.0125, abs=1e-14)
        torch.testing.assert_close(
            _grad(loss, logp), torch.tensor([[0.1, -0.05]], dtype=F64), rtol=0, atol=1e-14
        )
        assert m["kl_tau/penalty_mean"].item() == pytest.approx(0.025, abs=1e-14)


def test_dro_gradient_equals_verls_form():
    # verl: l = -(logp * A - beta / 2 * (logp - old)^2), beta = dro_beta = 2 * kl_tau, token-mean.
    logp, old, _, _, adv, mask = _case(6, 7, seed=9)
    kl_tau = 0.05
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="dro", kl_tau=kl_tau)
    lp = torch.where(mask, logp, 0)
    verl = -(lp * adv[:, None] - (2 * kl_tau) / 2 * (lp - torch.where(mask, old, 0)) ** 2)
    verl = torch.where(mask, verl, 0).sum() / mask.sum()
    torch.testing.assert_close(_grad(loss, logp), _grad(verl, logp), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------
# DPPO: binary TV / KL masks, top-K divergence, max_ratio
# ---------------------------------------------------------------------------------------------------------


def test_dppo_tv_by_hand():
    # p_old = 0.5 everywhere; mask_high = mask_low = 0.15; dapo over 4 tokens.
    # tok 0: p 0.7, A +1: dp = +0.2 > 0.15 and p > p_old -> dropped (pushing further up is masked).
    # tok 1: p 0.6, A +1: dp = 0.1 -> kept, weight rho = 1.2, loss -1.2.
    # tok 2: p 0.3, A -1: dp = -0.2, p < p_old -> dropped.  tok 3: p 0.7, A -1: p moved up -> kept, +1.4.
    p = torch.tensor([[0.7], [0.6], [0.3], [0.7]], dtype=F64)
    logp = p.log().requires_grad_()
    old = torch.full((4, 1), math.log(0.5), dtype=F64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=F64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    loss, m = policy_loss(logp, old, adv, mask, loss_type="dppo_tv")
    assert loss.item() == pytest.approx((-1.2 + 1.4) / 4, abs=1e-14)
    torch.testing.assert_close(_grad(loss, logp), torch.tensor([[0.0], [-0.3], [0.0], [0.35]], dtype=F64))
    assert m["clip_ratio/high_mean"].item() == 0.25 and m["clip_ratio/low_mean"].item() == 0.25
    # max_ratio = 1.3 truncates tok 3's detached weight 1.4 to 1.3.
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="dppo_tv", loss_kwargs={"max_ratio": 1.3})
    assert loss.item() == pytest.approx((-1.2 + 1.3) / 4, abs=1e-14)


def test_dppo_kl_by_hand():
    # p_old = 0.5, p = 0.7, A > 0: D = 0.5 (ln 0.5 - ln 0.7) + 0.5 ln(0.5 / 0.3) = -0.168236 + 0.255413
    # = 0.087177 > 0.05 -> dropped; with mask_high 0.1 it is kept (loss -1.4).
    logp = torch.tensor([[math.log(0.7)]], dtype=F64, requires_grad=True)
    old = torch.tensor([[math.log(0.5)]], dtype=F64)
    adv, mask = torch.ones(1, dtype=F64), torch.ones(1, 1, dtype=torch.bool)
    loss, m = policy_loss(logp, old, adv, mask, loss_type="dppo_kl")
    assert loss.item() == 0.0 and m["clip_ratio/high_mean"].item() == 1.0
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="dppo_kl", loss_kwargs={"mask_high": 0.1})
    assert loss.item() == pytest.approx(-1.4, abs=1e-12)


def _verl_dppo(logp, old, adv, mask, *, kind, low, high, cap, divergence=None):
    """verl's dppo_tv / dppo_kl (core_algos.py), as a plain loop: -A * w * logp * valid, token-mean."""
    total, count = logp.sum() * 0, 0
    for i, toks in enumerate(_tokens(mask)):
        for t in toks:
            a = float(adv[i]) if adv.dim() == 1 else float(adv[i, t])
            lp, lo = logp[i, t], float(old[i, t])
            p, p_old = math.exp(lp.item()), math.exp(lo)
            rho = math.exp(max(min(lp.item() - lo, 20.0), -20.0))
            w = rho if cap is None else min(rho, cap)
            if divergence is not None:
                d = float(divergence[i, t])
                valid = not (d > high and p > p_old) if a > 0 else not (d > low and p < p_old)
            elif kind == "tv":
                valid = (p - p_old <= high) if a > 0 else (p - p_old >= -low)
            else:
                d = p_old * (lo - lp.item()) + (1 - p_old) * math.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
                valid = (d <= high or p <= p_old) if a > 0 else (d <= low or p >= p_old)
            # cohort's value form: w * r instead of w * logp (same gradient, value without the logp factor)
            total = total - a * w * torch.exp(lp - lp.detach()) * valid
            count += 1
    return total / max(count, 1)


@pytest.mark.parametrize("loss_type", ["dppo_tv", "dppo_kl"])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_dppo_matches_verls_loop(loss_type, per_token_adv):
    kind = loss_type.split("_")[1]
    dropped = 0.0
    for seed in range(4):
        logp, old, _, _, adv, mask = _case(6, 8, seed=seed, per_token_adv=per_token_adv)
        for low, high, cap in ((0.15, 0.15, None), (0.05, 0.2, 1.5)):
            kwargs = {"mask_low": low, "mask_high": high, "max_ratio": cap}
            loss, m = policy_loss(logp, old, adv, mask, loss_type=loss_type, loss_kwargs=kwargs)
            want = _verl_dppo(logp, old, adv, mask, kind=kind, low=low, high=high, cap=cap)
            torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(_grad(loss, logp), _grad(want, logp), rtol=1e-12, atol=1e-14)
            dropped += m["clip_ratio/region_mean"].item()
    assert dropped > 0  # the masks were reached


def test_dppo_with_a_given_divergence_follows_the_top_k_rule():
    logp, old, _, _, adv, mask = _case(5, 6, seed=12)
    div = torch.rand(5, 6, generator=torch.Generator().manual_seed(1), dtype=F64) * 0.4
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="dppo_tv", divergence=div)
    want = _verl_dppo(logp, old, adv, mask, kind="tv", low=0.15, high=0.15, cap=None, divergence=div)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(_grad(loss, logp), _grad(want, logp), rtol=1e-12, atol=1e-14)
    # Divergence 0 everywhere drops nothing: DPPO is then the plain importance-weighted policy gradient.
    none, m = policy_loss(logp, old, adv, mask, loss_type="dppo_kl", divergence=torch.zeros_like(div))
    assert m["clip_ratio/region_mean"].item() == 0.0


def test_topk_divergence_by_hand():
    # Policy q = [0.5, 0.3, 0.2]; sampler top-1 = token 0 with p = 0.6. P = (0.6, rest 0.4), Q = (0.5, rest 0.5).
    # KL = 0.6 ln(0.6/0.5) + 0.4 ln(0.4/0.5) = 0.109393 - 0.089257 = 0.020136; TV = (0.1 + 0.1) / 2 = 0.1.
    logits = torch.tensor([0.5, 0.3, 0.2], dtype=F64).log().view(1, 1, 3)
    kl, tv = topk_divergence(logits, torch.tensor([[[0]]]), torch.tensor([[[math.log(0.6)]]], dtype=F64))
    assert kl.item() == pytest.approx(0.6 * math.log(1.2) + 0.4 * math.log(0.8), abs=1e-12)
    assert tv.item() == pytest.approx(0.1, abs=1e-12)


def test_topk_divergence_matches_loop_reference_and_the_full_vocabulary():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 3, 6, generator=g, dtype=F64, requires_grad=True)
    sampler = torch.log_softmax(torch.randn(2, 3, 6, generator=g, dtype=F64), -1)
    ids = sampler.topk(3, dim=-1).indices
    kl, tv = topk_divergence(logits, ids, sampler.gather(-1, ids))
    q_all = torch.softmax(logits.detach(), -1)
    for i in range(2):
        for t in range(3):
            p = [math.exp(sampler[i, t, k].item()) for k in ids[i, t].tolist()]
            q = [q_all[i, t, k].item() for k in ids[i, t].tolist()]
            pr, qr = max(1 - sum(p), 1e-12), max(1 - sum(q), 1e-12)
            want_kl = sum(a * math.log(a / b) for a, b in zip(p, q)) + pr * math.log(pr / qr)
            want_tv = 0.5 * (sum(abs(a - b) for a, b in zip(p, q)) + abs(pr - qr))
            assert kl[i, t].item() == pytest.approx(want_kl, abs=1e-12)
            assert tv[i, t].item() == pytest.approx(want_tv, abs=1e-12)
    assert torch.isfinite(_grad(kl.sum(), logits)).all()
    # K = V: no rest mass, the divergence is the full-vocabulary one.
    every = torch.arange(6).expand(2, 3, 6)
    kl, tv = topk_divergence(logits, every, sampler)
    full = (sampler.exp() * (sampler - torch.log_softmax(logits, -1))).sum(-1)
    torch.testing.assert_close(kl, full, rtol=0, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_topk_divergence_from_gathered_logprobs_is_topk_divergence_bit_for_bit(dtype):
    # The update gathers the policy's log-probs at the top-K ids in its chunked LM head and calls the helper;
    # topk_divergence gathers them from full logits and calls the same helper: the same numbers, exactly.
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 5, 11, generator=g, dtype=dtype)
    sampler = torch.log_softmax(2 * torch.randn(3, 5, 11, generator=g, dtype=dtype), -1)
    ids = sampler.topk(4, dim=-1).indices
    anchor = sampler.gather(-1, ids).float()
    kl, tv = topk_divergence(logits, ids, anchor)
    gathered = torch.log_softmax(logits.to(torch.promote_types(dtype, torch.float32)), -1).gather(-1, ids)
    kl2, tv2 = topk_divergence_from_logprobs(gathered, anchor)
    assert torch.equal(kl, kl2) and torch.equal(tv, tv2)
    assert kl.dtype == tv.dtype == torch.promote_types(dtype, torch.float32)
    # Against itself the divergence is exactly 0 (pi_old = the policy before its first step).
    zero_kl, zero_tv = topk_divergence_from_logprobs(gathered, gathered)
    assert zero_kl.eq(0).all() and zero_tv.eq(0).all()
    with pytest.raises(ValueError, match="must have one shape"):
        topk_divergence_from_logprobs(gathered, anchor[..., :3])


# ---------------------------------------------------------------------------------------------------------
# VESPO
# ---------------------------------------------------------------------------------------------------------


def test_vespo_by_hand():
    # One row, two tokens, log-ratios 0.1 and 0.2: log w = 0.3 (a sum). A = +1: k = 2, lam = 3:
    # phi = exp(3 + 2 * 0.3 - 3 * e^0.3) = exp(3.6 - 4.049576) = 0.637990. dapo over 2 tokens: loss = -phi.
    logp = torch.tensor([[-1.0, -1.0]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.1, -1.2]], dtype=F64)
    mask, adv = torch.ones(1, 2, dtype=torch.bool), torch.ones(1, dtype=F64)
    phi = math.exp(3 + 0.6 - 3 * math.exp(0.3))
    loss, m = policy_loss(logp, old, adv, mask, loss_type="vespo")
    assert loss.item() == pytest.approx(-phi, abs=1e-12)
    torch.testing.assert_close(_grad(loss, logp), torch.full((1, 2), -phi / 2, dtype=F64), rtol=0, atol=1e-12)
    assert m["vespo/phi_seq_mean"].item() == pytest.approx(phi, abs=1e-12)
    # A = -1: k = 3, lam = 2: phi = exp(2 + 0.9 - 2 e^0.3) = exp(2.9 - 2.699718) = 1.221553; loss = +phi.
    loss, _ = policy_loss(logp, old, -adv, mask, loss_type="vespo")
    assert loss.item() == pytest.approx(math.exp(2.9 - 2 * math.exp(0.3)), abs=1e-12)
    # Sampler weights [0.5, 0.5] fold into w once: log w = 0.3 + 2 ln 0.5; the tokens are not multiplied again.
    w = torch.full((1, 2), 0.5, dtype=F64)
    lw = 0.3 + 2 * math.log(0.5)
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="vespo", sampler_weights=w)
    assert loss.item() == pytest.approx(-math.exp(3 + 2 * lw - 3 * math.exp(lw)), abs=1e-12)
    # On-policy without a sampler: w = 1, phi = e^lam * 1 * e^-lam = 1: plain REINFORCE.
    loss, _ = policy_loss(logp, None, adv, mask, loss_type="vespo")
    assert loss.item() == pytest.approx(-1.0, abs=1e-12)


def _trl_vespo(logp, old, adv, mask, is_ratio, *, k_pos=2.0, lam_pos=3.0, k_neg=3.0, lam_neg=2.0):
    """TRL 1.16's get_gamma_weights and vespo loss as a plain loop (the IS ratio 1 at padding, as TRL's)."""
    total, count = logp.sum() * 0, 0
    lo, hi = math.log(1e-8), 20.0
    for i, toks in enumerate(_tokens(mask)):
        a = float(adv[i])
        s = sum(max(min(logp[i, t].item() - float(old[i, t]), 20.0), -20.0) for t in toks)
        s += sum(
            min(max(math.log(float(is_ratio[i, t])) if is_ratio[i, t] > 0 else -math.inf, lo), hi)
            for t in toks
        )
        log_w = min(max(s, lo), hi)
        k, lam = (k_pos, lam_pos) if a >= 0 else (k_neg, lam_neg)
        phi = math.exp(max(lam, 1e-4) + k * log_w - max(lam, 1e-4) * math.exp(log_w))
        for t in toks:
            total = total - phi * a * torch.exp(logp[i, t] - logp[i, t].detach())
            count += 1
    return total / count


def test_vespo_matches_trls_loop():
    for seed in range(4):
        logp, old, mu, _, adv, mask = _case(6, 7, seed=seed, spread=0.15)
        w = torch.where(mask, torch.exp(old - mu).clamp(max=2.0), 0)  # token TIS weights, 0 at padding
        for kwargs in ({}, {"k_pos": 1.0, "lambda_pos": 0.5, "k_neg": 4.0, "lambda_neg": 1.0}):
            loss, _ = policy_loss(
                logp, old, adv, mask, loss_type="vespo", loss_kwargs=kwargs, sampler_weights=w
            )
            ref_kw = {
                {"k_pos": "k_pos", "lambda_pos": "lam_pos", "k_neg": "k_neg", "lambda_neg": "lam_neg"}[k]: v
                for k, v in kwargs.items()
            }
            want = _trl_vespo(logp, old, adv, mask, w, **ref_kw)
            torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-14)
            torch.testing.assert_close(_grad(loss, logp), _grad(want, logp), rtol=1e-12, atol=1e-14)


def test_sampler_weights_multiply_every_other_loss_once_like_token_weights():
    logp, old, mu, _, adv, mask = _case(5, 6, seed=6)
    w = torch.where(mask, torch.exp(old - mu).clamp(max=2.0), 0)
    for loss_type in ("grpo", "dapo", "cispo", "dppo_tv", "luspo"):
        a, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, sampler_weights=w)
        b, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, token_weights=w)
        assert torch.equal(a, b) and torch.equal(_grad(a, logp), _grad(b, logp))
        ent = (torch.rand(5, 6, generator=torch.Generator().manual_seed(0), dtype=F64) > 0.3).to(F64)
        a, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, token_weights=ent, sampler_weights=w)
        b, _ = policy_loss(logp, old, adv, mask, loss_type=loss_type, token_weights=ent * w)
        assert torch.equal(a, b)


def test_vespo_token_controls_keep_the_sampler_weights_apart():
    logp, old, mu, _, adv, mask = _case(4, 5, seed=5, spread=0.2)
    s = ControlSettings(sampler_correction="token_tis", off_policy_mask_threshold=0.05)
    out = token_controls(logp.detach(), mask, adv, s, old_logp=old, sampled_logp=mu)
    torch.testing.assert_close(out.weights, out.unsampled_weights * out.sampler_weights, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------------------
# LUSPO
# ---------------------------------------------------------------------------------------------------------


def test_luspo_aggregation_by_hand():
    # Rows of 1 and 3 tokens, on-policy, A = [1, 2]: token losses [-1] and [-2, -2, -2]; sum -7 over 2 sequences.
    logp = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    loss, _ = policy_loss(logp, None, torch.tensor([1.0, 2.0], dtype=F64), mask, loss_type="luspo")
    assert loss.item() == -3.5
    loss, _ = policy_loss(
        logp, None, torch.tensor([1.0, 2.0], dtype=F64), mask, loss_type="luspo", num_sequences=7
    )
    assert loss.item() == -1.0


def test_luspo_at_sequence_importance_equals_trls_broadcast_sequence_ratio():
    # TRL: s_i = exp(mean_t log-ratio) broadcast to every token (gradient through the mean), clip loss, then
    # sum over tokens / B. cohort's GSPO-token form gives the same value and gradient for per-sequence A.
    logp, old, _, _, adv, mask = _case(6, 7, seed=10, spread=0.05)
    loss, _ = policy_loss(logp, old, adv, mask, loss_type="luspo", importance="sequence")
    total = logp.sum() * 0
    for i, toks in enumerate(_tokens(mask)):
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in toks) / len(toks))
        a = float(adv[i])
        term = -torch.minimum(s * a, s.clamp(0.8, 1.2) * a)
        total = total + term * len(toks)
    total = total / 6
    torch.testing.assert_close(loss, total, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(_grad(loss, logp), _grad(total, logp), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------
# Micro-batches sum to the whole batch with every new term on
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["vespo", "dppo_tv", "dppo_kl", "dro", "luspo", "dapo"])
def test_micro_batches_sum_to_the_full_batch_with_every_new_term(loss_type):
    n = 8
    logp, old, mu, ref, adv, mask = _case(n, 9, seed=21)
    w = torch.where(mask, torch.exp(old - mu).clamp(max=2.0), 0)
    div = torch.rand(n, 9, generator=torch.Generator().manual_seed(3), dtype=F64) * 0.3
    opts = dict(loss_type=loss_type, kl_tau=1e-2, beta=0.05, use_bias_correction_kl=True)
    extra = {"divergence": div} if loss_type.startswith("dppo") else {}
    full, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, sampler_weights=w, **extra, **opts)
    summed = logp.sum() * 0
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        t_mb = int(mask[rows].sum(-1).max())
        part_extra = {k: v[rows, :t_mb] for k, v in extra.items()}
        part, _ = policy_loss(
            logp[rows, :t_mb],
            old[rows, :t_mb],
            adv[rows],
            mask[rows, :t_mb],
            ref_logp=ref[rows, :t_mb],
            sampler_weights=w[rows, :t_mb],
            num_items=int(mask.sum()),
            num_sequences=n,
            **part_extra,
            **opts,
        )
        summed = summed + part
    torch.testing.assert_close(summed, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(_grad(summed, logp), _grad(full, logp), rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# OTB
# ---------------------------------------------------------------------------------------------------------


def _verl_otb(rewards, g, old_logp, sum_pi2, mask, is_weights=None, zero_tail=True, eps=1e-8):
    """verl's compute_optimal_token_baseline_advantage with the outcome reward on the last token, as loops."""
    n, t_len = mask.shape
    w_cum = []
    for i in range(n):
        acc, row = 0.0, []
        for t in range(t_len):
            w = 1 - 2 * math.exp(float(old_logp[i, t])) + float(sum_pi2[i, t])
            if is_weights is not None:
                w *= float(is_weights[i, t]) ** 2
            acc += w * bool(mask[i, t])
            row.append(acc)
        w_cum.append(row)
    adv = torch.zeros(n, t_len, dtype=F64)
    for start in range(0, n, g):
        idx = list(range(start, start + g))
        base = [[0.0] * t_len for _ in idx]
        if g > 1:
            for t in range(t_len):
                num = sum(float(rewards[i]) * w_cum[i][t] * bool(mask[i, t]) for i in idx)
                den = sum(w_cum[i][t] * bool(mask[i, t]) for i in idx) + eps
                for j in range(g):
                    base[j][t] = num / den
            if zero_tail:
                lengths = [int(mask[i].sum()) for i in idx]
                top, second = sorted(lengths)[-1], sorted(lengths)[-2]
                if lengths.count(top) == 1 and top > second:
                    j = lengths.index(top)
                    for t in range(second, t_len):
                        base[j][t] = 0.0
        for j, i in enumerate(idx):
            for t in range(t_len):
                adv[i, t] = (float(rewards[i]) - base[j][t]) * bool(mask[i, t])
    return adv


def test_otb_by_hand():
    # Group of 2, T = 3. Row 0: 2 tokens, reward 1, pi = 0.5, sum pi^2 = 0.5 -> w = 1 - 1 + 0.5 = 0.5, W = [0.5, 1].
    # Row 1: 3 tokens, reward 0, pi = 0.25, sum pi^2 = 0.25 -> w = 0.75, W = [0.75, 1.5, 2.25].
    # B_0 = 1 * 0.5 / (0.5 + 0.75) = 0.4; B_1 = 1 / (1 + 1.5) = 0.4; B_2 = 0 / 2.25 = 0, and row 1 is the
    # unique longest past the second-longest length 2: its B_2 = 0 either way.
    # A row 0 = [0.6, 0.6, 0]; row 1 = [-0.4, -0.4, 0].
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    old = torch.tensor([[0.5, 0.5, 0.9], [0.25, 0.25, 0.25]], dtype=F64).log()
    s2 = torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 0.25]], dtype=F64)
    adv = optimal_token_baseline(torch.tensor([1.0, 0.0]), 2, old_logp=old, sum_pi_squared=s2, mask=mask)
    torch.testing.assert_close(
        adv, torch.tensor([[0.6, 0.6, 0], [-0.4, -0.4, 0]], dtype=F64), rtol=0, atol=1e-7
    )
    # A lone completion has no baseline: its advantage is its return.
    alone = optimal_token_baseline(torch.tensor([1.0, 0.0]), 1, old_logp=old, sum_pi_squared=s2, mask=mask)
    torch.testing.assert_close(alone, torch.tensor([[1.0, 1, 0], [0, 0, 0]], dtype=F64))


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("with_is", [False, True])
def test_otb_matches_verls_loop(zero_tail, with_is):
    g = torch.Generator().manual_seed(5)
    n, t_len, size = 12, 7, 4
    lengths = torch.randint(1, t_len + 1, (n,), generator=g)
    mask = torch.arange(t_len)[None, :] < lengths[:, None]
    logits = torch.randn(n, t_len, 5, generator=g, dtype=F64)
    probs = torch.softmax(logits, -1)
    old = probs[..., 0].log()
    s2 = probs.square().sum(-1)
    rewards = torch.randint(0, 2, (n,), generator=g).to(F64) + 0.1 * torch.randn(n, generator=g, dtype=F64)
    isw = torch.rand(n, t_len, generator=g, dtype=F64) + 0.5 if with_is else None
    got = optimal_token_baseline(
        rewards, size, old_logp=old, sum_pi_squared=s2, mask=mask, is_weights=isw, handle_zero_tail=zero_tail
    )
    want = _verl_otb(rewards, size, old, s2, mask, is_weights=isw, zero_tail=zero_tail)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------

Z, M, A = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"kl_tau": -0.1}, "kl_tau must be >= 0"),
        ({"loss_type": "dro"}, "kl_tau > 0"),
        ({"loss_type": "vespo", "loss_kwargs": {"k": 2.0}}, "has no parameter 'k'"),
        ({"loss_type": "vespo", "loss_kwargs": {"k_pos": 0.0}}, "k_pos must be > 0"),
        ({"loss_type": "vespo", "loss_kwargs": {"lambda_neg": -1.0}}, "lambda_neg must be > 0"),
        ({"loss_type": "dppo_tv", "loss_kwargs": {"mask_low": 0.0}}, "mask_low must be > 0"),
        ({"loss_type": "dppo_kl", "loss_kwargs": {"max_ratio": 1.0}}, "max_ratio must be > 1"),
        ({"loss_type": "dppo_tv", "loss_kwargs": {"clip": 0.2}}, "has no parameter 'clip'"),
        ({"loss_type": "dro", "kl_tau": 0.1, "loss_kwargs": {"beta": 1.0}}, "takes no parameters"),
        ({"loss_type": "vespo", "importance": "sequence"}, "built on token-level ratios"),
        ({"loss_type": "dppo_tv", "importance": "sequence"}, "built on token-level ratios"),
        ({"divergence": torch.zeros(2, 3)}, "would ignore it"),
        ({"loss_type": "dppo_tv", "divergence": torch.zeros(2, 2)}, "divergence has shape"),
        ({"sampler_weights": torch.ones(2)}, "sampler_weights has shape"),
    ],
)
def test_bad_policy_loss_settings_name_the_fix(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        policy_loss(Z, None, A, M, **kwargs)


def test_bias_correction_flag_must_be_a_bool():
    with pytest.raises(TypeError, match="use_bias_correction_kl must be True or False"):
        policy_loss(Z, None, A, M, use_bias_correction_kl="yes")


@pytest.mark.parametrize("threshold", [-0.5, float("nan"), True, "0.5"])
def test_off_policy_mask_refuses_a_bad_threshold(threshold):
    with pytest.raises(ValueError, match="threshold must be a number >= 0"):
        off_policy_mask(A, Z, Z, M, threshold)


def test_max_rl_and_otb_refuse_bad_shapes():
    with pytest.raises(ValueError, match="not divisible by group_size"):
        max_rl_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="sum_pi_squared has shape"):
        optimal_token_baseline(torch.zeros(2), 2, old_logp=Z, sum_pi_squared=torch.zeros(2, 2), mask=M)
    with pytest.raises(TypeError, match="topk_ids must hold integer"):
        topk_divergence(torch.zeros(1, 1, 3), torch.zeros(1, 1, 1), torch.zeros(1, 1, 1))
