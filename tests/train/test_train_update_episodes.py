"""The episode seam: a completion whose tokens were partly inserted by someone else (a tool's output, a chat
template's turn markers) trains only on the tokens the policy sampled.

A single completion is the episode whose loss mask is all True: both forms give the same update, bit for bit.
An episode's gradient is the gradient of the loss over its tokens with the inserted ones' mask at zero
(computed here by hand from cohort.algo), and no inserted token reaches a normaliser, the KL, the entropy,
the sampler gap or a length metric.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_train_update import G, _assert_same, _gradient, gpt2_64

from cohort.algo import loss_normalisers, policy_loss
from cohort.config import AlgoConfig
from cohort.fastpath import FastConfig
from cohort.logprobs import completion_logprobs
from cohort.rollout import RolloutBatch, select_groups
from cohort.train.metrics import rollout_tokens, step_metrics
from cohort.train.update import PolicyBatch, PolicyUpdater, UpdateStats

TEMPERATURE = 0.9


@pytest.fixture(scope="module")
def model64():
    return gpt2_64(seed=21)


def _episodes(seed: int = 41) -> tuple[PolicyBatch, list[torch.Tensor]]:
    """Returns (a batch of three groups with ragged completions, a loss mask per row with inserted spans)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(2, 40, (int(n),), generator=g).tolist() for n in torch.randint(2, 8, (3,), generator=g)
    ]
    comps = [
        torch.randint(2, 40, (int(n),), generator=g).tolist()
        for n in torch.randint(6, 14, (3 * G,), generator=g)
    ]
    masks = []
    for c in comps:
        m = torch.ones(len(c), dtype=torch.bool)
        start = int(torch.randint(1, len(c) - 3, (1,), generator=g))
        m[start : start + 3] = False  # a tool's result between two turns of the policy
        masks.append(m)
    masks[2][:] = False  # a row with no token of the policy's (its tool output filled the budget)
    adv = torch.randn(3 * G, generator=g, dtype=torch.float64).float()
    in_loss = torch.ones(3 * G, dtype=torch.bool)
    in_loss[G + 1] = False
    return PolicyBatch(prompts, comps, G, adv, in_loss), masks


def _still_updater(model) -> PolicyUpdater:
    """Returns an updater of `model` whose steps leave the weights where they are (lr 0), one micro-batch."""
    return PolicyUpdater(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        None,
        AlgoConfig(),
        temperature=TEMPERATURE,
        max_completion_length=16,
        micro_batch_tokens=10**6,
        max_grad_norm=0.0,
    )


def _hand_gradient(model, batch: PolicyBatch, masks: list[torch.Tensor], loss_type: str, beta: float = 0.0):
    """Returns {name: gradient} of cohort.algo's loss over the policy's tokens alone, written out directly."""
    for p in model.parameters():
        p.grad = None
    rows = [r for r in range(len(batch.completion_ids)) if bool(batch.in_loss[r])]
    lp = completion_logprobs(
        model, batch.prompt_ids, batch.completion_ids, batch.group_size, rows=rows, temperature=TEMPERATURE
    )
    width = lp.logp.shape[1]
    mask = torch.zeros_like(lp.mask)
    for i, r in enumerate(rows):
        mask[i, : len(masks[r])] = masks[r]
    ref = None
    if beta > 0:
        with torch.no_grad():
            frozen = gpt2_64(seed=12)
            ref = completion_logprobs(
                frozen, batch.prompt_ids, batch.completion_ids, G, rows=rows, temperature=TEMPERATURE
            ).logp[:, :width]
    num_items, num_seq = loss_normalisers(loss_type, [int(masks[r].sum()) for r in rows])
    loss, _ = policy_loss(
        lp.logp,
        None,
        batch.advantages[rows],
        mask,
        loss_type=loss_type,
        eps_high=0.28,
        beta=beta,
        ref_logp=ref,
        max_completion_length=16,
        num_items=num_items,
        num_sequences=num_seq,
    )
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_an_all_true_loss_mask_is_the_single_completion_bit_for_bit(model64, loss_type):
    plain, _ = _episodes()
    ones = dataclasses.replace(
        plain, loss_masks=[torch.ones(len(c), dtype=torch.bool) for c in plain.completion_ids]
    )
    for fast in (FastConfig.all("off"), FastConfig.all("on")):
        ref, ref_stats = _gradient(model64, plain, loss_type, fast, 40)
        got, stats = _gradient(model64, ones, loss_type, fast, 40)
        for name, r in ref.items():
            assert torch.equal(got[name], r), (fast, name)
        assert stats == ref_stats


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo"])
def test_an_episodes_gradient_is_the_gradient_with_the_inserted_tokens_masked_out(model64, loss_type):
    plain, masks = _episodes()
    episode = dataclasses.replace(plain, loss_masks=masks)
    expected = _hand_gradient(model64, plain, masks, loss_type)
    unmasked = _hand_gradient(model64, plain, [torch.ones_like(m) for m in masks], loss_type)
    differs = max(float((expected[n] - unmasked[n]).abs().max()) for n in expected)
    assert differs > 1e-6  # the inserted tokens would have changed the gradient
    for fast in (FastConfig.all("off"), FastConfig.all("on")):
        for tokens in (10**6, 30):
            got, _ = _gradient(model64, episode, loss_type, fast, tokens)
            _assert_same(got, expected, (loss_type, fast, tokens))


def test_the_kl_term_of_an_episode_counts_only_the_policys_tokens(model64):
    plain, masks = _episodes(seed=43)
    episode = dataclasses.replace(plain, loss_masks=masks)
    expected = _hand_gradient(model64, plain, masks, "grpo", beta=0.1)
    got, stats = _gradient(model64, episode, "grpo", FastConfig.all("off"), 10**6, beta=0.1)
    _assert_same(got, expected, "kl")
    assert stats.kl is not None and stats.kl > 0


def test_inserted_tokens_reach_no_entropy_or_sampler_gap(model64):
    """The inserted tokens get a wildly wrong sampler log-prob: the gap (over the policy's tokens) ignores it;
    the reported entropy is the mean over the policy's tokens alone."""
    plain, masks = _episodes(seed=45)
    rows = [r for r in range(len(plain.completion_ids)) if bool(plain.in_loss[r])]
    with torch.no_grad():
        lp = completion_logprobs(
            model64, plain.prompt_ids, plain.completion_ids, G, temperature=TEMPERATURE, with_entropy=True
        )
    sampled = []
    for r, m in enumerate(masks):
        s = lp.logp[r, : len(m)].float().clone()
        s[~m] = -50.0  # what no sampler reported: the tokens were a tool's
        sampled.append(s)
    batch = dataclasses.replace(plain, loss_masks=masks, sampling_logprobs=sampled)
    updater = _still_updater(model64)
    stats = updater.update(batch)
    assert stats.logprob_gap is not None and stats.logprob_gap < 1e-5
    ent = torch.cat([lp.entropy[r, : len(masks[r])][masks[r]] for r in rows])
    assert stats.entropy == pytest.approx(float(ent.mean()), rel=1e-9)
    everything = torch.cat([lp.entropy[r, : len(masks[r])] for r in rows])
    assert abs(float(everything.mean()) - float(ent.mean())) > 1e-6  # the inserted tokens would have moved it


def _rollout(masks: list[torch.Tensor] | None) -> RolloutBatch:
    comps = [[5] * 6, [6] * 4, [7] * 8, [8] * 3]
    return RolloutBatch([[1, 2], [3]], comps, torch.tensor([False, True, False, False]), 2, loss_masks=masks)


def test_length_metrics_and_num_tokens_count_the_policys_tokens():
    masks = [
        torch.tensor([1, 1, 0, 0, 1, 1], dtype=torch.bool),
        torch.ones(4, dtype=torch.bool),
        torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.bool),
        torch.tensor([0, 1, 1], dtype=torch.bool),
    ]
    episodes, plain = _rollout(masks), _rollout(None)
    assert episodes.loss_lengths.tolist() == [4, 4, 2, 2]
    assert plain.loss_lengths.tolist() == plain.completion_lengths.tolist() == [6, 4, 8, 3]
    assert rollout_tokens(episodes) == 3 * 2 + 12 and rollout_tokens(plain) == 3 * 2 + 21
    row = step_metrics(1, episodes, torch.zeros(4, 1), torch.zeros(4), torch.zeros(4, dtype=torch.bool),
                       UpdateStats(), ["r"], 18)  # fmt: skip
    assert row["completions/mean_length"] == 3.0
    assert row["completions/max_length"] == 4.0 and row["completions/min_length"] == 2.0
    assert row["completions/mean_terminated_length"] == pytest.approx((4 + 2 + 2) / 3)


def test_joining_rounds_with_and_without_inserted_tokens_keeps_every_mask():
    masks = [torch.tensor([True, False] * 3), torch.ones(4, dtype=torch.bool), torch.zeros(8, dtype=torch.bool),
             torch.tensor([True, True, False])]  # fmt: skip
    joined = select_groups([(_rollout(None), [1]), (_rollout(masks), [0, 1])])
    assert joined.loss_masks is not None
    got = [m.tolist() for m in joined.loss_masks]
    assert got == [[True] * 8, [True] * 3, *[m.tolist() for m in masks]]
    assert select_groups([(_rollout(None), [0, 1])]).loss_masks is None


@pytest.mark.parametrize(
    ("masks", "match"),
    [
        ([torch.ones(6, dtype=torch.bool)], "1 rows for 4 completions"),
        (
            [
                torch.ones(6, dtype=torch.bool),
                torch.ones(4, dtype=torch.bool),
                torch.ones(7, dtype=torch.bool),
                torch.ones(3, dtype=torch.bool),
            ],
            r"loss_masks\[2\] must be a bool tensor of shape \[8\]",
        ),  # fmt: skip
        ([torch.ones(6), torch.ones(4), torch.ones(8), torch.ones(3)], r"loss_masks\[0\].*float32"),
    ],
    ids=["rows", "length", "dtype"],
)
def test_a_malformed_loss_mask_is_refused_by_name(masks, match):
    with pytest.raises(ValueError, match=match):
        _rollout(masks)


def test_evaluate_loss_leaves_the_inserted_tokens_out(model64):
    plain, masks = _episodes(seed=47)
    updater = _still_updater(model64)
    both = updater.evaluate_loss(dataclasses.replace(plain, loss_masks=masks))
    ones = updater.evaluate_loss(plain)
    with torch.no_grad():
        lp = completion_logprobs(model64, plain.prompt_ids, plain.completion_ids, G, temperature=TEMPERATURE,
                                 with_entropy=True)  # fmt: skip
    ent = torch.cat([lp.entropy[r, : len(m)][m] for r, m in enumerate(masks) if bool(plain.in_loss[r])])
    assert both["entropy"] == pytest.approx(float(ent.mean()), rel=1e-9)
    assert both["entropy"] != pytest.approx(ones["entropy"], rel=1e-6)
