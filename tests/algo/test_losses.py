"""policy_loss: the seed's worked example, a plain-loop reference over a grid, gradient accumulation,
skipping zero-advantage rows, and properties (finite, clip fractions, exactly-zero masked gradients)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cohort.algo import AGGREGATIONS, LOSS_TYPES, POLICY_LOSSES, group_advantages, kl_estimate, policy_loss

F64 = torch.float64


# ---------------------------------------------------------------------------------------------------------
# Plain-loop reference: one Python loop over rows and tokens, written from the formulas, with torch scalars
# so that autograd gives the reference gradient too.
# ---------------------------------------------------------------------------------------------------------


def loop_policy_loss(
    logp,
    old_logp,
    adv,
    mask,
    *,
    loss_type,
    eps_low=0.2,
    eps_high=None,
    delta=None,
    beta=0.0,
    ref_logp=None,
    max_completion_length=None,
    num_items=None,
    num_sequences=None,
    importance="token",
    gspo_form="paper",
):
    n, t_len = logp.shape
    eps_high = eps_low if eps_high is None else eps_high
    old = logp.detach() if old_logp is None else old_logp
    rows = []
    low = high = region = tokens = 0
    ratio_sum = kl_sum = 0.0
    for i in range(n):
        toks = [t for t in range(t_len) if mask[i, t]]
        if importance == "sequence" and toks:
            # GSPO: s_i = (pi_theta(y_i) / pi_old(y_i))^(1/|y_i|) = exp(mean_t log-ratio).
            s = torch.exp(sum(logp[i, t] - old[i, t] for t in toks) / len(toks))
        terms = []
        for t in toks:
            if importance == "sequence":
                rho = s if gspo_form == "paper" else s.detach() * torch.exp(logp[i, t] - logp[i, t].detach())
            else:
                rho = torch.exp(logp[i, t] - old[i, t])
            a = float(adv[i]) if adv.dim() == 1 else float(adv[i, t])
            unclipped = (torch.clamp(rho, max=delta) if delta is not None else rho) * a
            clipped = torch.clamp(rho, 1 - eps_low, 1 + eps_high) * a
            objective = torch.minimum(unclipped, clipped)
            if ref_logp is not None:
                r = ref_logp[i, t] - logp[i, t]
                k3 = torch.exp(r) - r - 1
                kl_sum += k3.item()
                if beta > 0:
                    objective = objective - beta * k3
            terms.append(-objective)
            tokens += 1
            ratio_sum += rho.item()
            is_low = rho.item() < 1 - eps_low and a < 0
            is_high = rho.item() > 1 + eps_high and a > 0
            low += is_low
            high += is_high
            region += is_low or is_high
        rows.append(terms)
    zero = logp.sum() * 0
    n_seq = n if num_sequences is None else num_sequences
    n_tok = max(tokens, 1) if num_items is None else num_items
    all_terms = [x for terms in rows for x in terms]
    if loss_type == "grpo":
        loss = sum((sum(terms) / len(terms) for terms in rows if terms), zero) / n_seq
    elif loss_type in ("bnpo", "dapo"):
        loss = sum(all_terms, zero) / n_tok
    elif loss_type == "luspo":
        loss = sum(all_terms, zero) / n_seq
    else:
        loss = sum(all_terms, zero) / (n_seq * max_completion_length)
    denom = max(tokens, 1)
    metrics = {
        "clip_ratio/low_mean": low / denom,
        "clip_ratio/high_mean": high / denom,
        "clip_ratio/region_mean": region / denom,
        "ratio/mean": ratio_sum / denom,
    }
    if ref_logp is not None:
        metrics["kl"] = kl_sum / denom
    return loss, metrics


def make_case(n, t_len, seed, *, per_token_adv=False, dtype=F64, garbage=True):
    """Random log-probs with ragged lengths; masked positions hold garbage the loss must never read."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t_len + 1, (n,), generator=g)
    lengths[0] = max(int(lengths[0]), 1)  # at least one token in the batch
    mask = torch.arange(t_len)[None, :] < lengths[:, None]  # [N, T]
    logp = -3 * torch.rand(n, t_len, generator=g, dtype=dtype)
    old = logp + 0.3 * torch.randn(n, t_len, generator=g, dtype=dtype)
    ref = logp + 0.3 * torch.randn(n, t_len, generator=g, dtype=dtype)
    shape = (n, t_len) if per_token_adv else (n,)
    adv = torch.randn(*shape, generator=g, dtype=dtype)
    if garbage:
        logp = torch.where(mask, logp, 50.0)
        old = torch.where(mask, old, float("-inf"))
        ref = torch.where(mask, ref, float("nan"))
        if per_token_adv:
            adv = torch.where(mask, adv, float("nan"))
    return logp.requires_grad_(), old, ref, adv, mask


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


# ---------------------------------------------------------------------------------------------------------
# The seed's worked example (seed 002, "What is 7 x 8?")
# ---------------------------------------------------------------------------------------------------------

RATIOS = [1.05, 1.30, 0.85, 1.10]


def _seed_example(beta=0.0):
    adv = group_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0], dtype=F64), 4, std="population", eps=0.0)
    logp = torch.tensor([[math.log(r)] for r in RATIOS], dtype=F64)  # one token per completion
    old = torch.zeros(4, 1, dtype=F64)
    # The seed evaluates KL_i = rho_i - log rho_i - 1, i.e. k3 with ref_logp - logp = log rho_i: ref = 2 log rho.
    ref = 2 * logp
    mask = torch.ones(4, 1, dtype=torch.bool)
    return logp, old, adv, mask, ref


def test_seed_example_per_row_surrogate():
    # A = [1/sqrt3, 1/sqrt3, -sqrt3, 1/sqrt3] = [0.57735, 0.57735, -1.73205, 0.57735]; clip range [0.8, 1.2]:
    #   row 0: min(1.05 * 0.57735, 1.05 * 0.57735) = 0.606218
    #   row 1: min(1.30 * 0.57735, 1.20 * 0.57735) = 0.692820 (clipped)
    #   row 2: min(0.85 * -1.73205, 0.85 * -1.73205) = -1.472243 (0.85 is inside [0.8, 1.2])
    #   row 3: min(1.10 * 0.57735, 1.10 * 0.57735) = 0.635085
    logp, old, adv, mask, _ = _seed_example()
    s3 = math.sqrt(3)
    expected = [1.05 / s3, 1.2 / s3, -0.85 * s3, 1.1 / s3]
    for i in range(4):
        loss, _ = policy_loss(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1])
        assert abs(-loss.item() - expected[i]) < 1e-12
    # The seed prints [0.606, 0.692, -1.472, 0.635], computed from A rounded to 0.577 (1.2 * 0.577 = 0.6924).
    for got, printed in zip(expected, [0.606, 0.692, -1.472, 0.635]):
        assert abs(got - printed) < 1e-3


def test_seed_example_objective_and_metrics():
    # J = (0.606218 + 0.692820 - 1.472243 + 0.635085) / 4 = 0.461880 / 4 = 0.115470 (seed: J ~ 0.115).
    logp, old, adv, mask, ref = _seed_example()
    loss, metrics = policy_loss(logp, old, adv, mask, loss_type="grpo")
    s3 = math.sqrt(3)
    j = (1.05 / s3 + 1.2 / s3 - 0.85 * s3 + 1.1 / s3) / 4
    assert abs(-loss.item() - j) < 1e-12 and abs(j - 0.115) < 1e-3
    # Only row 1 is clipped, from above with A > 0: high = region = 1/4, low = 0.
    assert metrics["clip_ratio/high_mean"].item() == 0.25
    assert metrics["clip_ratio/low_mean"].item() == 0.0
    assert metrics["clip_ratio/region_mean"].item() == 0.25
    assert "kl" not in metrics

    # With beta = 1e-3, k3_i = rho_i - log rho_i - 1 = [0.001209, 0.037636, 0.012519, 0.004690]; mean 0.014014,
    # J = 0.115470 - 1e-3 * 0.014014 = 0.115456.
    loss_kl, metrics_kl = policy_loss(logp, old, adv, mask, beta=1e-3, ref_logp=ref)
    k3 = [r - math.log(r) - 1 for r in RATIOS]
    assert [round(x, 4) for x in k3] == [0.0012, 0.0376, 0.0125, 0.0047]
    assert abs(metrics_kl["kl"].item() - sum(k3) / 4) < 1e-12
    assert abs(-loss_kl.item() - (j - 1e-3 * sum(k3) / 4)) < 1e-12


# ---------------------------------------------------------------------------------------------------------
# Against the loop reference over a grid of shapes, ragged lengths, seeds and options
# ---------------------------------------------------------------------------------------------------------

SHAPES = [(1, 1), (2, 3), (4, 5), (6, 9)]


@pytest.mark.parametrize("loss_type", AGGREGATIONS)  # the clip loss under each aggregation
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_policy_loss_matches_loop_reference(loss_type, importance, per_token_adv):
    rng = random.Random(f"{loss_type}-{importance}-{per_token_adv}")  # str seeds are deterministic
    for n, t_len in SHAPES:
        for seed in range(3):
            logp, old, ref, adv, mask = make_case(n, t_len, seed, per_token_adv=per_token_adv)
            opts = dict(
                loss_type=loss_type,
                eps_low=rng.choice([0.2, 0.1]),
                eps_high=rng.choice([None, 0.28]),
                delta=rng.choice([None, 1.5]),
                beta=rng.choice([0.0, 0.04]),
                max_completion_length=t_len + rng.choice([0, 3]),
                num_items=rng.choice([None, int(mask.sum()) + 5]),
                num_sequences=rng.choice([None, n + 2]),
                importance=importance,
            )
            old_arg = None if rng.random() < 0.2 else old
            ref_arg = ref if opts["beta"] > 0 or rng.random() < 0.5 else None
            loss, metrics = policy_loss(logp, old_arg, adv, mask, ref_logp=ref_arg, **opts)
            # Per-token advantages with sequence importance only exist in GSPO-token form.
            form = "token" if per_token_adv else "paper"
            want, want_metrics = loop_policy_loss(
                logp, old_arg, adv, mask, ref_logp=ref_arg, gspo_form=form, **opts
            )
            context = (n, t_len, seed, opts, old_arg is None)
            torch.testing.assert_close(
                loss, want, rtol=1e-10, atol=1e-12, msg=lambda m, c=context: f"{c}: {m}"
            )
            grad, want_grad = _grad(loss, logp), _grad(want, logp)
            torch.testing.assert_close(
                grad, want_grad, rtol=1e-9, atol=1e-12, msg=lambda m, c=context: f"{c}: {m}"
            )
            assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
            assert set(metrics) == set(want_metrics)
            for key, value in want_metrics.items():
                assert not metrics[key].requires_grad
                assert abs(metrics[key].item() - value) < 1e-10, (key, context)


def test_sequence_importance_with_per_token_advantages_uses_gspo_token_gradient():
    # GSPO-token: d/dlogp_it of the token term is s_i * A_it (unclipped region), s_i = exp(mean log-ratio).
    logp = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -0.45]], dtype=F64)
    adv = torch.tensor([[0.5, -1.0, 2.0]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, _ = policy_loss(logp, old, adv, mask, importance="sequence", loss_type="bnpo", eps_low=0.5)
    s = math.exp(((-1.0 + 1.1) + (-2.0 + 1.9) + (-0.5 + 0.45)) / 3)  # exp(-0.05/3) = 0.98347
    torch.testing.assert_close(_grad(loss, logp), -s * adv / 3, rtol=0, atol=1e-12)
    assert abs(loss.item() - (-s * adv.sum().item() / 3)) < 1e-12


def test_on_policy_gradient_is_reinforce():
    # old_logp=None: ratio = 1 in value, gradient = A * grad log pi; with grpo aggregation each token of row i
    # gets -A_i / (|o_i| * N).
    logp, _, _, adv, mask = make_case(4, 6, 7)
    loss, metrics = policy_loss(logp, None, adv, mask)
    lengths = mask.sum(-1).clamp(min=1).to(F64)
    expected = torch.where(mask, -adv[:, None] / (lengths[:, None] * 4), 0)
    torch.testing.assert_close(_grad(loss, logp), expected, rtol=0, atol=1e-14)
    assert metrics["ratio/mean"].item() == 1.0 and metrics["clip_ratio/region_mean"].item() == 0.0


def test_delta_caps_ratio_for_negative_advantages():
    # A = -1, rho = 3: PPO's min(3 * -1, 1.2 * -1) = -3 (unbounded); with delta = 2: min(2 * -1, -1.2) = -2,
    # and the capped token gets no gradient. Loss = -objective.
    logp = torch.tensor([[math.log(3.0)]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=F64)
    adv = torch.tensor([-1.0], dtype=F64)
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, _ = policy_loss(logp, old, adv, mask)
    assert abs(loss.item() - 3.0) < 1e-12
    loss_d, _ = policy_loss(logp, old, adv, mask, delta=2.0)
    assert abs(loss_d.item() - 2.0) < 1e-12 and _grad(loss_d, logp).item() == 0.0


def test_eps_high_widens_upper_clip_only():
    # rho = 1.25, A = +1: eps_high = 0.28 -> 1.25 (not clipped, gradient flows); eps_high = None (= 0.2) -> 1.2.
    logp = torch.tensor([[math.log(1.25)], [math.log(0.75)]], dtype=F64, requires_grad=True)
    old = torch.zeros(2, 1, dtype=F64)
    mask = torch.ones(2, 1, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0], dtype=F64)
    # Row 1: rho = 0.75 < 0.8 with A < 0 -> clipped to 0.8 either way: objective -0.8.
    loss, m = policy_loss(logp, old, adv, mask, eps_high=0.28, loss_type="bnpo")
    assert abs(loss.item() - (-(1.25 - 0.8) / 2)) < 1e-12
    assert m["clip_ratio/high_mean"].item() == 0.0 and m["clip_ratio/low_mean"].item() == 0.5
    loss, m = policy_loss(logp, old, adv, mask, loss_type="bnpo")
    assert abs(loss.item() - (-(1.2 - 0.8) / 2)) < 1e-12
    assert m["clip_ratio/high_mean"].item() == 0.5 and m["clip_ratio/region_mean"].item() == 1.0


def test_per_token_advantages_equal_broadcast_sequence_advantages():
    logp, old, _, adv, mask = make_case(5, 7, 3)
    for loss_type in set(LOSS_TYPES) - {"gmpo"}:  # gmpo is defined for per-completion advantages only
        opts = dict(loss_type=loss_type, max_completion_length=7, kl_tau=1e-3 if loss_type == "dro" else 0.0)
        a, _ = policy_loss(logp, old, adv, mask, **opts)
        b, _ = policy_loss(logp, old, adv[:, None].expand(5, 7), mask, **opts)
        assert a.item() == b.item()


def test_aggregations_by_hand():
    # Two rows, per-token loss -A * rho with rho = 1 (on-policy) and A = [1, 2]; lengths 1 and 3, T = 3.
    # Per-token losses: row 0: [-1], row 1: [-2, -2, -2]. Token sum = -7, 4 tokens.
    #   grpo:    (-1/1 + -6/3) / 2 = -1.5      bnpo/dapo: -7 / 4 = -1.75      dr_grpo (L=5): -7 / (2 * 5) = -0.7
    logp = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[True, False, False], [True, True, True]])
    adv = torch.tensor([1.0, 2.0], dtype=F64)
    expected = {"grpo": -1.5, "bnpo": -1.75, "dapo": -1.75, "dr_grpo": -0.7}
    for loss_type, value in expected.items():
        loss, _ = policy_loss(logp, None, adv, mask, loss_type=loss_type, max_completion_length=5)
        assert abs(loss.item() - value) < 1e-12, loss_type
    # Explicit normalisers: grpo with num_sequences=4 -> -3 / 4; dapo with num_items=10 -> -0.7.
    assert abs(policy_loss(logp, None, adv, mask, num_sequences=4)[0].item() + 0.75) < 1e-12
    assert abs(policy_loss(logp, None, adv, mask, loss_type="dapo", num_items=10)[0].item() + 0.7) < 1e-12


# ---------------------------------------------------------------------------------------------------------
# Gradient accumulation and skipping zero-advantage rows
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_micro_batches_sum_to_the_full_batch_gradient(loss_type, importance, beta):
    if POLICY_LOSSES[loss_type].token_importance and importance == "sequence":
        pytest.skip(f"{loss_type} is built on token-level ratios (refused with importance='sequence')")
    n, t_len, max_len = 8, 10, 12
    logp, old, ref, adv, mask = make_case(n, t_len, seed=11)
    opts = dict(loss_type=loss_type, importance=importance, beta=beta, max_completion_length=max_len)
    if loss_type == "dro":
        opts["kl_tau"] = 1e-3  # dro is refused without its penalty
    full, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, **opts)
    full_grad = _grad(full, logp)

    total_tokens = int(mask.sum())
    summed = torch.zeros((), dtype=F64)
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        # Each micro-batch is padded only to its own longest completion, as the trainer does.
        t_mb = max(int(mask[rows].sum(-1).max()), 1)
        part, _ = policy_loss(
            logp[rows, :t_mb],
            old[rows, :t_mb],
            adv[rows],
            mask[rows, :t_mb],
            ref_logp=ref[rows, :t_mb],
            num_items=total_tokens,
            num_sequences=n,
            **opts,
        )
        summed = summed + part
    torch.testing.assert_close(summed, full, rtol=0, atol=1e-6)
    torch.testing.assert_close(_grad(summed, logp), full_grad, rtol=0, atol=1e-6)
    assert full_grad.abs().sum() > 0  # the comparison is not between two zero gradients


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_dropping_zero_advantage_rows_keeps_loss_and_gradient(loss_type):
    if loss_type == "dro":
        pytest.skip(
            "dro needs kl_tau > 0, whose penalty has a gradient on zero-advantage rows (never skipped)"
        )
    # Groups 0 and 2 have all-equal rewards, so their advantages are exactly 0; with beta = 0 and token-level
    # ratios they carry no gradient, and the trainer may skip them if it keeps the full-batch normalisers.
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 0.0, 0.5, 1.0, 0.0])
    adv = group_advantages(rewards, 4).to(F64)
    logp, old, _, _, mask = make_case(16, 9, seed=5)
    opts = dict(loss_type=loss_type, max_completion_length=9)
    full, full_metrics = policy_loss(logp, old, adv, mask, **opts)
    full_grad = _grad(full, logp)

    keep = adv != 0
    assert keep.sum() == 8
    part, _ = policy_loss(
        logp[keep], old[keep], adv[keep], mask[keep], num_items=int(mask.sum()), num_sequences=16, **opts
    )
    torch.testing.assert_close(part, full, rtol=0, atol=1e-12)
    part_grad = torch.zeros_like(full_grad)
    part_grad[keep] = _grad(part, logp)[keep]
    torch.testing.assert_close(part_grad, full_grad, rtol=0, atol=1e-12)
    assert torch.equal(full_grad[~keep], torch.zeros_like(full_grad[~keep]))


# ---------------------------------------------------------------------------------------------------------
# Properties
# ---------------------------------------------------------------------------------------------------------

LOGP = st.floats(-1e4, 0.0)


@st.composite
def batches(draw, low=-1e4):
    n = draw(st.integers(1, 4))
    t_len = draw(st.integers(1, 6))
    cells = n * t_len
    values = st.floats(low, 0.0)
    logp = torch.tensor(draw(st.lists(values, min_size=cells, max_size=cells))).view(n, t_len)
    old = torch.tensor(draw(st.lists(values, min_size=cells, max_size=cells))).view(n, t_len)
    ref = torch.tensor(draw(st.lists(values, min_size=cells, max_size=cells))).view(n, t_len)
    adv = torch.tensor(draw(st.lists(st.floats(-5, 5), min_size=n, max_size=n)))
    mask = torch.tensor(draw(st.lists(st.booleans(), min_size=cells, max_size=cells))).view(n, t_len)
    return logp, old, ref, adv, mask


OPTIONS = st.fixed_dictionaries(
    {
        "loss_type": st.sampled_from(LOSS_TYPES),
        "importance": st.sampled_from(["token", "sequence"]),
        "beta": st.sampled_from([0.0, 0.04, 1.0]),
        "eps_high": st.sampled_from([None, 0.28]),
        "delta": st.sampled_from([None, 2.0]),
        "kl_tau": st.sampled_from([0.0, 1e-3]),
    }
).filter(
    lambda o: (
        not (POLICY_LOSSES[o["loss_type"]].token_importance and o["importance"] == "sequence")
        and not (o["loss_type"] == "dro" and o["kl_tau"] == 0)
    )
)


@settings(max_examples=80, deadline=None)
@given(batch=batches(), opts=OPTIONS)
def test_property_finite_loss_and_gradient_down_to_minus_1e4(batch, opts):
    logp, old, ref, adv, mask = batch
    logp.requires_grad_()
    loss, metrics = policy_loss(logp, old, adv, mask, ref_logp=ref, max_completion_length=8, **opts)
    assert torch.isfinite(loss)
    assert torch.isfinite(_grad(loss, logp)).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@settings(max_examples=80, deadline=None)
@given(batch=batches(low=-5.0), opts=OPTIONS)
def test_property_clip_fractions_are_fractions(batch, opts):
    logp, old, ref, adv, mask = batch
    _, m = policy_loss(logp, old, adv, mask, ref_logp=ref, max_completion_length=8, **opts)
    low, high, region = (m[f"clip_ratio/{k}_mean"].item() for k in ("low", "high", "region"))
    for value in (low, high, region):
        assert 0.0 <= value <= 1.0
    # low needs A < 0 and high needs A > 0, so a token is never both: region = low + high.
    assert abs(region - (low + high)) < 1e-6
    assert m["kl"].item() >= 0.0


@settings(max_examples=80, deadline=None)
@given(
    batch=batches(low=-20.0),
    opts=OPTIONS,
    junk=st.sampled_from([float("inf"), float("-inf"), float("nan"), 1e4, -1e4]),
)
def test_property_masked_tokens_get_exactly_zero_gradient(batch, opts, junk):
    logp, old, ref, adv, mask = batch
    logp = torch.where(mask, logp, junk).requires_grad_()
    old, ref = torch.where(mask, old, junk), torch.where(mask, ref, junk)
    loss, _ = policy_loss(logp, old, adv, mask, ref_logp=ref, max_completion_length=8, **opts)
    grad = _grad(loss, logp)
    assert torch.isfinite(loss)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))


def test_float32_and_bfloat16_inputs_give_finite_loss():
    for dtype in (torch.float32, torch.bfloat16):
        logp = torch.full((2, 3), -1e4, dtype=dtype, requires_grad=True)
        old = torch.zeros(2, 3, dtype=dtype)
        ref = torch.zeros(2, 3, dtype=dtype)
        adv = torch.tensor([1.0, -1.0])
        loss, _ = policy_loss(logp, old, adv, torch.ones(2, 3, dtype=torch.bool), beta=0.04, ref_logp=ref)
        assert torch.isfinite(loss) and torch.isfinite(_grad(loss, logp)).all()


def test_kl_metric_is_masked_mean_of_k3():
    logp, old, ref, adv, mask = make_case(3, 4, 2, garbage=False)
    _, m = policy_loss(logp, old, adv, mask, ref_logp=ref)
    k3 = kl_estimate(logp.detach(), ref, "k3")
    assert abs(m["kl"].item() - k3[mask].mean().item()) < 1e-12


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------

Z = torch.zeros(2, 3)
M = torch.ones(2, 3, dtype=torch.bool)
A = torch.zeros(2)


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        ({"loss_type": "ppo"}, ["'ppo'", "'grpo'", "'bnpo'", "'dapo'", "'dr_grpo'"]),
        ({"importance": "seq"}, ["'seq'", "'token'", "'sequence'"]),
        ({"loss_type": "dr_grpo"}, ["max_completion_length", "None"]),
        ({"max_completion_length": 2}, ["max_completion_length", "T=3", "2"]),
        ({"beta": 0.1}, ["beta=0.1", "ref_logp"]),
        ({"delta": 1.1}, ["delta", "1.2", "1.1"]),
        ({"eps_low": 1.0}, ["eps_low", "1.0"]),
        ({"eps_low": -0.1}, ["eps_low", "-0.1"]),
        ({"num_items": 0}, ["num_items", "0"]),
        ({"num_sequences": -3}, ["num_sequences", "-3"]),
        ({"ref_logp": torch.zeros(2, 4)}, ["ref_logp", "(2, 4)", "(2, 3)"]),
    ],
)
def test_bad_options_raise_value_error(kwargs, fragments):
    with pytest.raises(ValueError) as info:
        policy_loss(Z, None, A, M, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize(
    "args, fragments",
    [
        ((Z, torch.zeros(2, 4), A, M), ["old_logp", "(2, 4)", "(2, 3)"]),
        ((Z, None, A, torch.ones(3, 3, dtype=torch.bool)), ["mask", "(3, 3)"]),
        ((Z, None, torch.zeros(3), M), ["advantages", "(3,)"]),
        ((Z, None, torch.zeros(2, 4), M), ["advantages", "(2, 4)"]),
        ((torch.zeros(6), None, A, M), ["logp", "(6,)"]),
    ],
)
def test_shape_mismatch_raises_value_error(args, fragments):
    with pytest.raises(ValueError) as info:
        policy_loss(*args)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_metrics_are_float32_for_bfloat16_inputs():
    # Metrics are computed in float32 even for bf16 log-probs (bf16 represents integers exactly only to 256).
    logp = torch.full((3, 100), math.log(2.0), dtype=torch.bfloat16)
    old = torch.zeros(3, 100, dtype=torch.bfloat16)
    ref = torch.zeros(3, 100, dtype=torch.bfloat16)
    _, m = policy_loss(logp, old, torch.ones(3), torch.ones(3, 100, dtype=torch.bool), ref_logp=ref)
    assert all(v.dtype == torch.float32 for v in m.values())
    assert m["clip_ratio/high_mean"].item() == 1.0


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_the_kl_estimator_is_a_choice(kind):
    # One token, logp = -1.0, ref = -1.5: r = ref - logp = -0.5.
    # k1 = -r = 0.5; k2 = r^2 / 2 = 0.125; k3 = exp(r) - r - 1 = 0.60653 + 0.5 - 1 = 0.10653.
    expected = {"k1": 0.5, "k2": 0.125, "k3": math.exp(-0.5) + 0.5 - 1}[kind]
    logp = torch.tensor([[-1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5]])
    loss, metrics = policy_loss(
        logp, None, torch.tensor([0.0]), torch.tensor([[True]]), beta=0.5, ref_logp=ref, kl_kind=kind
    )
    assert metrics["kl"].item() == pytest.approx(expected, rel=1e-6)
    assert loss.item() == pytest.approx(0.5 * expected, rel=1e-6)  # zero advantage: only beta * KL remains
    with pytest.raises(ValueError, match="kl_kind"):
        policy_loss(logp, None, torch.tensor([0.0]), torch.tensor([[True]]), kl_kind="k4")
