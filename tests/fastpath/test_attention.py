"""Segment attention: the plan covers every packed position once, and the grouped layout falls back safely."""

from __future__ import annotations

import pytest
import torch
from _tiny import random_prompts, tiny_model
from test_logprobs import (
    PATHS,
    G,
    assert_grads_close,
    completion_logprobs,
    grads_of,
    naive,
    ragged_completions,
)
from transformers import AttentionInterface

from cohort.fastpath import FastConfig, FastPathError, attention, probes


def test_plan_places_every_position_once_in_length_buckets():
    prompts = [[0, 1, 2], [9, 10]]  # packed positions of each prompt
    bodies = [(0, [3, 4, 5, 6]), (0, [7]), (0, [8]), (1, [11, 12, 13]), (1, [14, 15, 16, 17, 18])]
    plan = attention.build_plan(prompts, bodies, "cpu")
    assert len(set(plan.inverse.tolist())) == 19  # one output row per packed position
    flat = torch.cat([b.q_idx.reshape(-1) for b in plan.buckets])
    assert torch.equal(flat[plan.inverse], torch.arange(19))  # each position reads its own output row
    prompt_buckets = [b for b in plan.buckets if b.mask is None]
    assert sorted(len(q) for b in prompt_buckets for q in b.q_idx) == [2, 3]  # prompts of 3 and 2 share one
    for b in plan.buckets:
        if b.mask is not None:
            assert b.mask.shape == (b.q_idx.shape[0], 1, b.q_idx.shape[1], b.k_idx.shape[1])


def test_length_buckets_bound_padding():
    lengths = [1, 128, 60, 61, 2, 3, 100, 90, 5, 128]
    buckets = attention._length_buckets(lengths)
    assert sorted(i for b in buckets for i in b) == list(range(len(lengths)))
    for b in buckets:
        assert lengths[b[0]] == max(lengths[i] for i in b)  # the bucket's width
        assert min(lengths[i] for i in b) >= attention.BUCKET_RATIO * lengths[b[0]]
    assert len(buckets) < len(set(lengths))


def test_mask_lets_a_completion_see_its_prompt_and_its_own_past_only():
    plan = attention.build_plan([[0, 1, 2], [3]], [(0, [4, 5]), (1, [6, 7])], "cpu")
    bucket = plan.buckets[-1]  # both completions, keys = [prompt padded to 3, own 2 tokens]
    rows = {
        tuple(q.tolist()): (k.tolist(), m[0].int().tolist())
        for q, k, m in zip(bucket.q_idx, bucket.k_idx, bucket.mask)
    }
    keys, mask = rows[(6, 7)]  # prompt [3] (padded), then 6, 7
    assert keys == [3, 3, 3, 6, 7]
    assert mask == [[1, 0, 0, 1, 0], [1, 0, 0, 1, 1]]
    keys, mask = rows[(4, 5)]
    assert keys == [0, 1, 2, 4, 5] and mask == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]


@pytest.fixture
def data():
    return random_prompts(3, seed=21, min_len=1, max_len=10), ragged_completions(3 * G, seed=22)


def test_gradient_checkpointing_uses_the_dense_mask_and_stays_exact(data):
    model = tiny_model(seed=4, logit_scale=3.0).train()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    prompts, comps = data
    ref = grads_of(model, lambda: naive(model, prompts, comps, G)[0].sum())
    out = {}

    def run():
        out["lp"] = completion_logprobs(model, prompts, comps, G)
        return out["lp"].logp.sum()

    assert_grads_close(grads_of(model, run), ref)
    assert out["lp"].path == "dense_mask"
    assert "segments" not in probes.results(model)  # never tried: the check itself is skipped
    with pytest.raises(FastPathError, match="gradient checkpointing is on"):
        completion_logprobs(model, prompts, comps, G, fast=PATHS["segments"])


def test_a_model_that_segments_get_wrong_falls_back_with_a_warning(data, monkeypatch):
    def wrong(module, query, key, value, attention_mask, **kwargs):
        out, _ = attention.custom_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return out * 0.5, None

    monkeypatch.setitem(AttentionInterface._global_mapping, attention.NAME, wrong)
    model = tiny_model(seed=5, logit_scale=3.0)
    prompts, comps = data
    with pytest.warns(UserWarning, match="segment attention does not reproduce"):
        out = completion_logprobs(model, prompts, comps, G)
    torch.testing.assert_close(out.logp, naive(model, prompts, comps, G)[0], rtol=0, atol=1e-5)
    assert out.path == "dense_mask" and probes.results(model)["segments"] is False
    with pytest.raises(FastPathError, match="segment attention does not reproduce"):
        completion_logprobs(model, prompts, comps, G, fast=FastConfig(segments="on"))


def test_attention_choice_is_restored_when_the_forward_fails(data, monkeypatch):
    model = tiny_model(seed=6)
    prompts, comps = data
    completion_logprobs(model, prompts, comps, G)  # passes the check

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setitem(AttentionInterface._global_mapping, attention.NAME, boom)
    with pytest.raises(RuntimeError, match="boom"):
        completion_logprobs(model, prompts, comps, G)
    assert model.config._attn_implementation == "sdpa"


def test_short_completions_of_a_prompt_share_one_problem_and_long_ones_do_not():
    prompts = [list(range(0, 4))]
    bodies = [(0, [4, 5]), (0, [6]), (0, list(range(7, 407)))]  # 2 tokens, 1 token, 400 tokens
    pieces = attention._pieces([4], bodies)
    assert sorted(sorted(m) for _, m in pieces) == [[0, 1], [2]]
    plan = attention.build_plan(prompts, bodies, "cpu")
    shared = next(b for b in plan.buckets if b.mask is not None and b.q_idx.shape[1] == 3)
    assert shared.q_idx.tolist() == [[6, 4, 5]]  # shortest first
    assert shared.k_idx.tolist() == [[0, 1, 2, 3, 6, 4, 5]]
    # Each query sees the whole prompt and, causally, only the tokens of its own completion.
    assert shared.mask[0, 0].int().tolist() == [
        [1, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 1, 0],
        [1, 1, 1, 1, 0, 1, 1],
    ]


def test_a_plan_is_found_by_its_carrier_only_and_goes_with_it():
    plan = attention.build_plan([[0, 1]], [(0, [2, 3])], "cpu")
    before = len(attention._PLANS)
    carrier = attention.plan_carrier(torch.device("cpu"), plan)
    assert attention.plan_of(carrier) is plan
    assert vars(carrier) == {}  # nothing is set on the tensor itself
    assert attention.plan_of(torch.ones(1, 1, 1, 1, dtype=torch.bool)) is None  # an equal mask is not it
    assert attention.plan_of(None) is None
    del carrier
    assert len(attention._PLANS) == before  # the table holds no plan past its mask


def test_hold_attention_selects_cohort_attention_until_it_ends_and_is_seen_by_the_checks():
    model = tiny_model(seed=6)
    assert not attention.attention_held(model)
    with attention.hold_attention(model):
        assert attention.attention_held(model)
        assert model.config._attn_implementation == attention.NAME
    assert not attention.attention_held(model)
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"), attention.hold_attention(model):
        raise RuntimeError("boom")
    assert not attention.attention_held(model) and model.config._attn_implementation == "sdpa"
