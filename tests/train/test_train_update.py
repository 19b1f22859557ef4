"""PolicyUpdater: the fast paths and the micro-batch split change the speed of an update, never its gradient.

Checked in float64, where two orders of summation agree to ~1e-15, so a relative tolerance of 1e-9 leaves
no room for a path that is only approximately right. The model is a tiny GPT-2: Qwen2's RMSNorm computes
in float32 whatever the weights' dtype, so a float64 Qwen2 agrees with itself across layouts only to
float32 rounding (the float32 tests in test_logprobs.py cover Qwen2 at that precision).

plan_micro_batches (the last tests): whole groups, token budget respected, every row exactly once.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
import transformers as tf
from _tiny import EOS, PAD, make_test_engine, random_prompts, tiny_model

from cohort.algo import LOSS_TYPES, loss_normalisers
from cohort.config import AlgoConfig
from cohort.fastpath import FastConfig, FastPathError
from cohort.models import checkpoint_activations
from cohort.rollout import SamplingParams
from cohort.train.update import PolicyBatch, PolicyUpdater, UpdateStats, plan_micro_batches

G = 4


def _combinations() -> list[FastConfig]:
    """Returns every on/off combination of the update's switches (segments only with the grouped layout)."""
    out = []
    for grouped, segments, head, skip in itertools.product(("on", "off"), repeat=4):
        if grouped == "off" and segments == "on":
            continue
        out.append(
            FastConfig(grouped=grouped, segments=segments, chunked_head=head, skip_zero_advantage=skip)
        )
    return out


def gpt2_64(seed: int = 0, eos_bias: float = 0.0) -> torch.nn.Module:
    """Returns a tiny float64 GPT-2 (every computation in float64) over the tests' 40-token vocabulary."""
    config = tf.GPT2Config(
        vocab_size=40,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=EOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    torch.manual_seed(seed)
    model = tf.GPT2LMHeadModel(config).double().eval()
    with torch.no_grad():  # peaked distributions, so sampling is not decided by rounding
        model.transformer.wte.weight.mul_(3.0)
        model.transformer.wte.weight[EOS] += eos_bias
    return model


@pytest.fixture(scope="module")
def model64():
    return gpt2_64(seed=11)


@pytest.fixture(scope="module")
def batch():
    """Three groups: one with all-equal rewards (zero advantages), one with a row out of the loss, ragged lengths."""
    prompts = random_prompts(3, seed=31, min_len=2, max_len=9)
    g = torch.Generator().manual_seed(32)
    comps = [
        torch.randint(2, 40, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 14, (3 * G,), generator=g)
    ]
    adv = torch.randn(3 * G, generator=g, dtype=torch.float64).float()
    adv[:G] = 0.0  # an all-equal group
    in_loss = torch.ones(3 * G, dtype=torch.bool)
    in_loss[G + 1] = False  # e.g. truncated under mask_truncated
    return PolicyBatch(prompts, comps, G, adv, in_loss)


def _gradient(
    model, batch, loss_type, fast, micro_batch_tokens, beta=0.0, kl_tau=0.0
) -> tuple[dict, UpdateStats]:
    """Returns ({name: gradient} of one update, its stats); the optimizer does not move the weights (lr 0)."""
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = None
    reference = None
    if beta > 0:
        frozen = gpt2_64(seed=12)

        def reference():
            import contextlib

            return contextlib.nullcontext(frozen)

    updater = PolicyUpdater(
        model,
        torch.optim.SGD(params, lr=0.0),
        None,
        AlgoConfig(loss_type=loss_type, beta=beta, eps_high=0.28, kl_tau=kl_tau),
        temperature=0.9,
        max_completion_length=16,
        micro_batch_tokens=micro_batch_tokens,
        max_grad_norm=0.0,
        reference=reference,
        fast=fast,
    )
    stats = updater.update(batch)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats


def _assert_same(got: dict, ref: dict, what) -> None:
    for name, r in ref.items():
        err = (got[name] - r).abs().max().item()
        assert err <= 1e-9 * r.abs().max().item() + 1e-15, (what, name, err)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_fast_path_combination_and_split_gives_the_same_gradient(model64, batch, loss_type):
    plain = FastConfig.all("off")
    # dro needs its penalty, which has a gradient on zero-advantage rows: they are never skipped.
    kl_tau = 1e-3 if loss_type == "dro" else 0.0
    ref, ref_stats = _gradient(model64, batch, loss_type, plain, 10**6, kl_tau=kl_tau)
    assert ref_stats.paths["padded"] == 1.0 and ref_stats.paths["chunked_head"] == 0.0
    assert any(g.abs().max() > 0 for g in ref.values())
    seen_paths = set()
    for fast in _combinations():
        if kl_tau and fast.skip_zero_advantage == "on":
            continue
        for tokens in (10**6, 40, 12):  # one micro-batch, a few, one group piece at a time
            got, stats = _gradient(model64, batch, loss_type, fast, tokens, kl_tau=kl_tau)
            _assert_same(got, ref, (fast, tokens))
            # The path switched on is the path reported.
            expected = (
                "padded" if fast.grouped == "off" else ("segments" if fast.segments == "on" else "dense_mask")
            )
            assert stats.paths[expected] == 1.0, (fast, stats.paths)
            assert stats.paths["chunked_head"] == (1.0 if fast.chunked_head == "on" else 0.0)
            skipped = fast.skip_zero_advantage == "on"
            assert stats.paths["skip_zero_advantage"] == float(skipped)
            assert (stats.rows_computed_frac < (3 * G - 1) / (3 * G)) == skipped
            seen_paths.add(expected)
    assert seen_paths == {"segments", "dense_mask", "padded"}


def test_the_kl_term_is_also_path_invariant(model64, batch):
    plain = FastConfig.all("off")
    ref, stats = _gradient(model64, batch, "grpo", plain, 10**6, beta=0.1)
    assert stats.kl is not None and stats.kl > 0
    for fast in _combinations():
        if fast.skip_zero_advantage == "on":
            continue
        got, _ = _gradient(model64, batch, "grpo", fast, 40, beta=0.1)
        _assert_same(got, ref, fast)


@pytest.mark.parametrize(
    ("algo", "match"),
    [
        (AlgoConfig(beta=0.1), "skip_zero_advantage=on.*beta=0.1"),  # a KL term
        (AlgoConfig(entropy_coef=0.01), "skip_zero_advantage=on.*entropy"),  # an entropy bonus
    ],
    ids=["kl_term", "entropy_bonus"],
)
def test_skipping_zero_advantage_rows_is_refused_when_zero_rows_still_count(model64, algo, match):
    with pytest.raises(FastPathError, match=match):
        PolicyUpdater(
            model64,
            torch.optim.SGD(model64.parameters(), lr=0.0),
            None,
            algo,
            temperature=1.0,
            max_completion_length=8,
            micro_batch_tokens=100,
            max_grad_norm=0.0,
            fast=FastConfig(skip_zero_advantage="on"),
        )


def test_loss_normalisers_own_the_meaning_of_each_loss_type():
    # Two processes whose token counts are 7 and 5 (the fake all-reduce adds the other process's).
    other = {"tokens": 5, "rows": 2}

    def all_sum(x: int) -> int:
        return x + (other["tokens"] if x > 2 else other["rows"])

    assert loss_normalisers("dapo", [3, 4], all_sum) == (12, 4)  # every token of the batch on every process
    assert loss_normalisers("bnpo", [3, 4], all_sum) == (7, 4)  # this process's tokens (one process)
    # With two processes the per-process token mean is halved: summed gradients then average the processes'
    # means (DDP's averaging in TRL), instead of doubling them.
    assert loss_normalisers("bnpo", [3, 4], all_sum, world_size=2) == (14, 4)
    assert loss_normalisers("dapo", [3, 4], all_sum, world_size=2) == (12, 4)
    assert loss_normalisers("grpo", [3, 4]) == (7, 2)
    assert loss_normalisers("dr_grpo", []) == (1, 1)  # an empty minibatch: no division by zero
    with pytest.raises(ValueError, match="loss_type"):
        loss_normalisers("ppo", [1])


def test_sampled_completions_do_not_depend_on_the_decoding_paths():
    """Sampling (not greedy) with one seed: the same tokens with shared-prefix decoding and the preallocated
    cache on or off (float64), and with packed weights on or off (float32: oneDNN packs float32 only)."""
    model = tiny_model(seed=13, logit_scale=3.0, eos_bias=0.8)
    prompts = random_prompts(5, seed=14, min_len=1, max_len=12)
    params = SamplingParams(max_completion_length=14, temperature=0.9, top_k=20)

    def run(m, **switches):
        engine = make_test_engine("builtin", fast=FastConfig(**switches))
        return engine.generate(m, prompts, G, params, torch.Generator().manual_seed(5))

    model64 = gpt2_64(seed=13, eos_bias=2.0)
    base = run(model64, shared_prefix="off", preallocated_kv="off", packed_weights="off")
    assert base.paths == {
        "shared_prefix": False,
        "preallocated_kv": False,
        "packed_weights": False,
        "graph_decode": False,  # auto: CUDA only
        "compile_decode": False,  # it compiles the captured step
        "cast_once": False,  # auto: under autocast only
    }
    lengths = {len(c) for c in base.completion_ids}
    assert len(lengths) > 2  # rows ended at different steps
    for shared, prealloc in itertools.product(("on", "off"), repeat=2):
        got = run(model64, shared_prefix=shared, preallocated_kv=prealloc, packed_weights="off")
        assert got.paths["shared_prefix"] == (shared == "on") and got.paths["preallocated_kv"] == (
            prealloc == "on"
        )
        assert got.completion_ids == base.completion_ids, (shared, prealloc)
        for a, b in zip(got.sampling_logprobs, base.sampling_logprobs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # float32 log-probs of a float64 model
    with pytest.raises(FastPathError, match="no float32 nn.Linear weight"):
        run(model64, packed_weights="on")
    packed = run(model, packed_weights="on", shared_prefix="on")
    plain = run(model, packed_weights="off", shared_prefix="on")
    assert packed.paths["packed_weights"] and not plain.paths["packed_weights"]
    assert packed.completion_ids == plain.completion_ids


# plan_micro_batches


def _cost(micro, G, plen, clen):
    groups = {}
    for r in micro:
        groups.setdefault(r // G, []).append(r)
    longest = max(plen[g] + sum(clen[r] for r in rows) for g, rows in groups.items())
    return longest * len(groups)


def _random_rows(seed: int) -> tuple[int, list[int], list[int], list[int]]:
    """Returns (G, prompt lengths, completion lengths, 25 of the 36 rows) drawn from `seed`."""
    rng = random.Random(seed)
    G, B = 4, 9
    plen = [rng.randint(3, 40) for _ in range(B)]
    clen = [rng.randint(0, 30) for _ in range(B * G)]
    return G, plen, clen, sorted(rng.sample(range(B * G), 25))


@pytest.mark.parametrize("seed", range(5))
def test_plan_covers_rows_once_within_budget(seed):
    G, plen, clen, rows = _random_rows(seed)
    budget = 200
    micro = plan_micro_batches(rows, G, plen, clen, budget)
    flat = [r for m in micro for r in m]
    assert sorted(flat) == rows
    for m in micro:
        # A single oversized group piece may exceed the budget on its own, never a batch of several.
        if len({r // G for r in m}) > 1:
            assert _cost(m, G, plen, clen) <= budget


def _padded_cost(micro, G, plen, clen):
    return max(plen[r // G] + clen[r] for r in micro) * len(micro)


@pytest.mark.parametrize("seed", range(5))
def test_padded_plan_covers_rows_once_within_budget_longest_first(seed):
    G, plen, clen, rows = _random_rows(seed)
    budget = 150
    micro = plan_micro_batches(rows, G, plen, clen, budget, padded=True)
    assert sorted(r for m in micro for r in m) == rows
    for m in micro:
        assert len(m) == 1 or _padded_cost(m, G, plen, clen) <= budget
    costs = [plen[r // G] + clen[r] for m in micro for r in m]
    assert costs == sorted(costs, reverse=True)  # rows of similar length share a micro-batch
    # The grouped plan of the same rows, laid out as padded rows, overruns this budget.
    grouped = plan_micro_batches(rows, G, plen, clen, budget)
    assert max(_padded_cost(m, G, plen, clen) for m in grouped) > budget


def test_padded_micro_batches_are_as_few_as_the_budget_allows_and_even():
    # 64 rows of 376-456 tokens under 8,192: a first-fit split gives 18, 19, 19 and 8 rows; four even ones do.
    rng = random.Random(0)
    G = 8
    plen = [rng.randint(120, 200) for _ in range(8)]
    clen = [256] * 64
    micro = plan_micro_batches(list(range(64)), G, plen, clen, 8192, padded=True)
    costs = [_padded_cost(m, G, plen, clen) for m in micro]
    assert len(micro) == 4 == math.ceil(sum(p + 256 for p in plen for _ in range(G)) / 8192)
    assert max(costs) <= 7100 and min(len(m) for m in micro) >= 15, (costs, [len(m) for m in micro])


def test_a_padded_row_longer_than_the_budget_is_a_micro_batch_of_its_own():
    assert plan_micro_batches([0, 1, 2], 3, [10], [50, 5, 5], token_budget=40, padded=True) == [[0], [1, 2]]


@pytest.mark.parametrize(
    "fast", [FastConfig(grouped="off"), FastConfig.all("off")], ids=["grouped_off", "plain"]
)
def test_every_padded_forward_of_an_update_fits_the_token_budget(model64, batch, fast):
    # Padded rows were once planned as grouped ones: a micro-batch of whole groups held each prompt G times.
    budget = 40
    shapes: list = []
    hook = model64.transformer.register_forward_pre_hook(
        lambda m, a, k: shapes.append(tuple((k["input_ids"] if "input_ids" in k else a[0]).shape)),
        with_kwargs=True,
    )
    try:
        _, stats = _gradient(model64, batch, "dapo", fast, budget)
    finally:
        hook.remove()
    assert shapes
    assert all(rows == 1 or rows * width <= budget for rows, width in shapes), shapes
    # The update reports its gradient passes and the largest of them (the rows of this batch fit 40 tokens).
    assert stats.micro_batches > 1 and 0 < stats.micro_batch_tokens_max <= budget
    assert stats.micro_batch_tokens_max in {rows * width for rows, width in shapes}
    metrics = stats.metrics()
    assert (metrics["micro_batches"], metrics["micro_batch_tokens_max"]) == (
        stats.micro_batches,
        stats.micro_batch_tokens_max,
    )


def test_unmasked_padded_rows_give_the_same_gradient_and_are_reported(model64, batch):
    ref, ref_stats = _gradient(model64, batch, "dapo", FastConfig.all("off"), 10**6, beta=0.1)
    assert ref_stats.paths["unmasked_padding"] == 0.0
    got, stats = _gradient(
        model64, batch, "dapo", FastConfig(grouped="off", unmasked_padding="on"), 40, beta=0.1
    )
    _assert_same(got, ref, "unmasked")
    assert stats.paths["padded"] == 1.0 and stats.paths["unmasked_padding"] == 1.0


def test_a_compiled_update_gives_the_same_gradient_and_is_reported(monkeypatch, model64, batch):
    from cohort.fastpath import compiled

    monkeypatch.setattr(compiled, "BACKEND", "aot_eager")  # AOTAutograd's forward and backward, run eagerly
    ref, _ = _gradient(model64, batch, "dapo", FastConfig.all("off"), 10**6, beta=0.1)
    fast = FastConfig(grouped="off", unmasked_padding="on", compile_update="on")
    got, stats = _gradient(model64, batch, "dapo", fast, 40, beta=0.1)
    _assert_same(got, ref, "compiled")
    assert stats.paths["compile_update"] == 1.0 and stats.paths["unmasked_padding"] == 1.0


def test_oversized_group_is_split():
    G = 4
    micro = plan_micro_batches([0, 1, 2, 3], G, [10], [50, 50, 50, 50], token_budget=80)
    assert [len(m) for m in micro] == [1, 1, 1, 1]


def test_small_budget_keeps_groups_separate_and_large_budget_packs_all():
    G = 2
    rows = list(range(8))
    assert len(plan_micro_batches(rows, G, [5] * 4, [5] * 8, token_budget=10_000)) == 1
    assert len(plan_micro_batches(rows, G, [5] * 4, [5] * 8, token_budget=15)) == 4


def test_gradient_checkpointing_recomputes_and_gives_the_same_gradient(batch):
    from _tiny import tiny_model

    plain = tiny_model(seed=3).double()
    ckpt = tiny_model(seed=3).double()
    assert checkpoint_activations(ckpt)
    calls = {"plain": 0, "ckpt": 0}
    for name, model in (("plain", plain), ("ckpt", ckpt)):
        # Counted in forward itself: transformers' recomputation runs without module hooks.
        mlp = model.model.layers[0].mlp
        mlp.forward = _counted(mlp.forward, calls, name)
    fast = FastConfig(skip_zero_advantage="off")
    want, _ = _gradient(plain, batch, "dapo", fast, 10**6)
    got, stats = _gradient(ckpt, batch, "dapo", fast, 10**6)
    _assert_same(got, want, "checkpointing")
    assert calls["ckpt"] == calls["plain"] + 1  # the one micro-batch ran the layer again in the backward pass
    assert not ckpt.model.layers[0].training  # back in eval mode after the update (dropout stays off)
    # Segment attention too: cohort's attention stays selected through the backward pass, so the recomputed
    # layers follow the same segment plan (outside an update it is refused, see fastpath/test_attention.py).
    segments = FastConfig(segments="on", grouped="on", skip_zero_advantage="off")
    before = dict(calls)
    want, _ = _gradient(plain, batch, "dapo", segments, 10**6)
    got, stats = _gradient(ckpt, batch, "dapo", segments, 10**6)
    _assert_same(got, want, "checkpointing with segment attention")
    assert stats.paths["segments"] == 1.0
    # the same forwards (segment attention's once-per-model check included), plus the recomputation
    assert calls["ckpt"] - before["ckpt"] == calls["plain"] - before["plain"] + 1
    assert ckpt.config._attn_implementation == "sdpa"  # restored after the update


def _counted(forward, calls: dict, name: str):
    def wrapped(*args, **kwargs):
        calls[name] += 1
        return forward(*args, **kwargs)

    return wrapped


def _entropy_gradient(
    model, batch, fast, micro_batch_tokens, **algo
) -> tuple[dict, UpdateStats, PolicyUpdater]:
    """Returns ({name: gradient} of one update with entropy-regularisation settings `algo`, stats, updater)."""
    for p in model.parameters():
        p.grad = None
    updater = PolicyUpdater(
        model,
        torch.optim.SGD(list(model.parameters()), lr=0.0),
        None,
        AlgoConfig(loss_type="dapo", **algo),
        temperature=0.9,
        max_completion_length=16,
        micro_batch_tokens=micro_batch_tokens,
        max_grad_norm=0.0,
        fast=fast,
    )
    stats = updater.update(batch)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats, updater


def test_the_entropy_bonus_adds_minus_coef_times_the_gradient_of_the_mean_token_entropy(model64, batch):
    from cohort.logprobs import completion_logprobs

    coef = 0.3
    plain = FastConfig.all("off")
    base, _, _ = _entropy_gradient(model64, batch, plain, 10**6)
    # The expected extra term, computed independently: -coef * (sum of token entropies / loss tokens).
    rows = [r for r in range(len(batch.completion_ids)) if batch.in_loss[r]]
    for p in model64.parameters():
        p.grad = None
    lp = completion_logprobs(
        model64,
        batch.prompt_ids,
        batch.completion_ids,
        G,
        rows=rows,
        temperature=0.9,
        with_entropy="grad",
        fast=plain,
    )
    tokens = sum(len(batch.completion_ids[r]) for r in rows)
    mean_entropy = (lp.entropy * lp.mask).sum() / tokens
    (-coef * mean_entropy).backward()
    bonus = {n: p.grad.clone() for n, p in model64.named_parameters()}
    expected = {n: base[n] + bonus[n] for n in base}
    for fast in (plain, FastConfig(chunked_head="on", segments="on")):
        for micro in (10**6, 12):  # the bonus's shares over micro-batches add up to the whole
            got, stats, _ = _entropy_gradient(model64, batch, fast, micro, entropy_coef=coef)
            _assert_same(got, expected, (fast, micro))
            assert stats.entropy_coef == coef and stats.metrics()["entropy_coef"] == coef
            assert stats.paths["skip_zero_advantage"] == 0.0  # zero-advantage rows have an entropy gradient
    assert any(g.abs().max() > 0 for g in bonus.values())


def test_the_adaptive_entropy_coefficient_follows_the_measured_entropy(model64, batch):
    plain = FastConfig.all("off")
    common = dict(adaptive_entropy=True, entropy_coef=0.1, entropy_coef_delta=0.02, num_iterations=2)
    _, stats, updater = _entropy_gradient(model64, batch, plain, 10**6, entropy_target=100.0, **common)
    # Entropy below the target: up by delta per optimizer step (two here), and the bonus stays on.
    assert stats.entropy_coef == pytest.approx(0.14)
    assert updater.last_entropy == pytest.approx(stats.entropy, rel=1e-6)
    _, stats, updater = _entropy_gradient(model64, batch, plain, 10**6, entropy_target=0.0, **common)
    assert stats.entropy_coef == pytest.approx(0.06)  # above the target: down
    # Above the target the next step applies no bonus: its gradient is the policy term's alone.
    base, _, _ = _entropy_gradient(model64, batch, plain, 10**6)
    got = updater.update(batch)
    assert got.entropy_coef == pytest.approx(0.02)
    grads = {n: p.grad.clone() for n, p in model64.named_parameters()}
    _assert_same(grads, base, "gated off")
    # The controller's state round-trips (it goes into checkpoints).
    state = updater.entropy_state()
    _, _, fresh = _entropy_gradient(model64, batch, plain, 10**6, entropy_target=0.0, **common)
    fresh.load_entropy_state(state)
    assert fresh.entropy_state() == state


def _updater(model, **algo) -> PolicyUpdater:
    params = list(model.parameters())
    return PolicyUpdater(
        model,
        torch.optim.SGD(params, lr=0.0),
        None,
        AlgoConfig(**algo),
        temperature=0.9,
        max_completion_length=16,
        micro_batch_tokens=10**6,
        max_grad_norm=0.0,
    )


def test_the_sampler_anchor_takes_the_ratio_against_the_samplers_log_probs(model64, batch):
    # Issue 40: trust_region_anchor=sampler puts the sampler's log-probs where pi_old goes. The sampler here is
    # the policy shifted by 0.1 nats per token: every ratio is e^0.1 (one step, the policy has not moved).
    import dataclasses

    with pytest.raises(Exception, match="trust_region_anchor=sampler .* returned none"):
        _updater(model64, trust_region_anchor="sampler").update(batch)
    own = _updater(model64).frozen_logprobs(model64, batch, list(range(3 * G)))
    sampled = [own[r] - 0.1 for r in range(3 * G)]
    shifted = dataclasses.replace(batch, sampling_logprobs=sampled)
    stats = _updater(model64, trust_region_anchor="sampler", loss_type="dppo_tv").update(shifted)
    assert stats.ratio_mean == pytest.approx(math.exp(0.1), rel=1e-9)
    assert _updater(model64, loss_type="dppo_tv").update(shifted).ratio_mean == pytest.approx(1.0, abs=1e-12)


def test_vespo_takes_the_sampler_weights_once(model64, batch):
    # token_tis weights are folded into VESPO's sequence weight and not multiplied into its tokens again: the
    # update differs from one that (wrongly) also multiplies the tokens by them.
    import dataclasses

    updater = _updater(model64)
    own = updater.frozen_logprobs(model64, batch, list(range(3 * G)))
    g = torch.Generator().manual_seed(5)
    sampled = [
        own[r] + 0.3 * torch.randn(own[r].shape, generator=g, dtype=own[r].dtype) for r in range(3 * G)
    ]
    shifted = dataclasses.replace(batch, sampling_logprobs=sampled)
    got, _ = _gradient_of(model64, shifted, loss_type="vespo", sampler_correction="token_tis")
    # The same update with the weights multiplied into the tokens a second time differs.
    from cohort.algo import losses

    spec = losses.POLICY_LOSSES["vespo"]
    losses.POLICY_LOSSES["vespo"] = dataclasses.replace(spec, folds_sampler_weights=False)
    try:
        twice, _ = _gradient_of(model64, shifted, loss_type="vespo", sampler_correction="token_tis")
    finally:
        losses.POLICY_LOSSES["vespo"] = spec
    assert any((got[k] - twice[k]).abs().max() > 1e-9 for k in got)


def _gradient_of(model, batch, **algo):
    for p in model.parameters():
        p.grad = None
    stats = _updater(model, **algo).update(batch)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, stats


def test_sum_pi_squared_comes_out_of_every_head_path_as_the_full_softmax_gives_it(model64, batch):
    # Issue 40 (OTB): sum_v pi(v)^2 at the sampling temperature, computed inside the (chunked) LM head, equals
    # the full logits' softmax squared and summed, on every layout and with the head in chunks or not.
    from cohort.logprobs import completion_logprobs

    rows = list(range(3 * G))
    want = []
    with torch.no_grad():
        for r in rows:
            prompt, comp = batch.prompt_ids[r // G], batch.completion_ids[r]
            logits = model64(torch.tensor([prompt + comp])).logits[0] / 0.9  # [L, V]
            probs = logits[len(prompt) - 1 : len(prompt) - 1 + len(comp)].softmax(-1)
            want.append(probs.square().sum(-1))
    for fast in _combinations():
        with torch.no_grad():
            lp = completion_logprobs(
                model64,
                batch.prompt_ids,
                batch.completion_ids,
                G,
                temperature=0.9,
                fast=fast,
                with_sum_pi_squared=True,
                chunk_size=5,
            )
        for i, r in enumerate(rows):
            got = lp.sum_pi_squared[i, : len(batch.completion_ids[r])]
            torch.testing.assert_close(got, want[i], rtol=1e-12, atol=1e-14)
            assert lp.sum_pi_squared[i, len(batch.completion_ids[r]) :].eq(0).all()


def test_the_optimal_token_baseline_trains_on_its_own_pi_old_pass(model64, batch):
    # The updater's per-token advantages are cohort.algo.optimal_token_baseline over its pi_old pass (log-probs
    # and sum pi^2 at the sampling temperature) for every row, rewards as the batch gives them.
    import dataclasses

    from cohort.algo import optimal_token_baseline
    from cohort.logprobs import completion_logprobs

    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 2.0, 0.0, 1.0, 0.0])
    otb = dataclasses.replace(batch, rewards=rewards)
    updater = _updater(model64, advantage="optimal_token_baseline")
    _, token_adv = updater._otb_pass(otb)
    with torch.no_grad():
        lp = completion_logprobs(
            model64, batch.prompt_ids, batch.completion_ids, G, temperature=0.9, with_sum_pi_squared=True
        )
    want = optimal_token_baseline(
        rewards, G, old_logp=lp.logp, sum_pi_squared=lp.sum_pi_squared, mask=lp.mask
    )
    for r, tok in enumerate(token_adv):
        torch.testing.assert_close(tok, want[r, : len(batch.completion_ids[r])].float(), rtol=1e-6, atol=1e-7)
    assert any(t.abs().max() > 0 for t in token_adv)
    # The update runs on them (and a process reward with OTB is refused, naming the fix).
    updater.update(otb)
    with pytest.raises(Exception, match="use algo.advantage=grpo with process rewards"):
        bad = dataclasses.replace(otb, token_advantages=[torch.zeros(len(c)) for c in batch.completion_ids])
        updater.update(bad)
