"""The builtin engine's top-K log-probs (SamplingParams.logprobs_topk, DPPO's top-K divergence).

Per completion token: the K most likely tokens under the distribution of sampling_logprobs (logits / T before
top-k / top-p filtering; raw logits when greedy), the sampled token forced into the K-th place when it is not
among them. Asking for them changes nothing else: the same tokens and sampling log-probs, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from _tiny import EOS, VOCAB, make_test_engine, random_prompts, tiny_model

from cohort.fastpath import FastConfig
from cohort.rollout import RolloutBatch, SamplingParams, select_groups
from cohort.rollout.builtin import graph_decode_unavailable
from cohort.rollout.sampling import forced_topk
from cohort.serve.protocol import params_from_dict, params_to_dict

K = 5
FASTS = [
    FastConfig(shared_prefix="on", packed_weights="off"),
    FastConfig(shared_prefix="off", packed_weights="off"),
]


@pytest.fixture(scope="module")
def model64():
    """Float64 weights (the engine samples from float32 logits of them), rows ending with EOS at various steps."""
    return tiny_model(seed=2, eos_bias=1.0, logit_scale=3.0).double()


def _direct_topk(model, prompt, completion, params):
    """Returns (ids [T, K], log-probs [T, K]) of a plain forward over prompt + completion, the sampled token forced
    into the K-th place when it is not among the top K (the definition, written out)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    scaled = logits if params.greedy else logits / params.temperature
    logp = torch.log_softmax(scaled, -1)  # [T, V]
    top, ids = logp.topk(K, dim=-1)
    for t, tok in enumerate(completion):
        if tok not in ids[t].tolist():
            ids[t, -1], top[t, -1] = tok, logp[t, tok]
    return ids, top


@pytest.mark.parametrize("fast", FASTS, ids=["shared_prefix", "repeated_cache"])
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_completion_length=10, greedy=True, logprobs_topk=K),
        SamplingParams(max_completion_length=10, temperature=0.7, logprobs_topk=K),
        SamplingParams(max_completion_length=10, temperature=1.3, top_k=3, top_p=0.8, logprobs_topk=K),
    ],
    ids=["greedy", "t0.7", "t1.3_filtered"],
)
def test_top_k_is_the_samplers_distribution_with_the_sampled_token_forced_in(model64, fast, params):
    prompts = random_prompts(3, seed=4)
    batch = make_test_engine("builtin", fast=fast).generate(
        model64, prompts, 3, params, torch.Generator().manual_seed(3)
    )
    assert batch.topk_ids is not None and batch.topk_logprobs is not None
    forced = 0
    for r, completion in enumerate(batch.completion_ids):
        ids, top = _direct_topk(model64, prompts[r // 3], completion, params)
        forced += int((ids[:, :-1] != torch.tensor(completion)[:, None]).all(-1).sum())
        got_ids, got = batch.topk_ids[r], batch.topk_logprobs[r]
        assert (
            got_ids.dtype == torch.long
            and got.dtype == torch.float32
            and got_ids.shape == (len(completion), K)
        )
        assert torch.equal(got_ids, ids), r
        torch.testing.assert_close(got, top, rtol=0, atol=1e-5)
        # The sampled token is in every row, with its sampling log-prob.
        col = (got_ids == torch.tensor(completion)[:, None]).float().argmax(-1)
        assert torch.equal(got.gather(-1, col[:, None]).squeeze(-1), batch.sampling_logprobs[r])
    if not params.greedy and params.top_k == 0:
        assert forced > 0  # some sampled tokens fell outside the top K and were forced in


@pytest.mark.parametrize("case", ["shared_prefix", "repeated_cache", "float32_packed"])
@pytest.mark.parametrize("greedy", [True, False])
def test_asking_for_top_k_leaves_tokens_and_sampling_logprobs_bitwise_unchanged(model64, case, greedy):
    prompts = random_prompts(4, seed=9)
    if case == "float32_packed":  # ALL_FAST: shared prefix and oneDNN-packed weights, which need float32
        model, engine = tiny_model(seed=2, eos_bias=1.0, logit_scale=3.0), make_test_engine("builtin")
    else:
        model, engine = model64, make_test_engine("builtin", fast=FASTS[case == "repeated_cache"])
    runs = []
    for k in (0, K):
        params = SamplingParams(max_completion_length=12, temperature=0.8, greedy=greedy, logprobs_topk=k)
        runs.append(engine.generate(model, prompts, 4, params, torch.Generator().manual_seed(11)))
    plain, top = runs
    assert plain.topk_ids is None and plain.topk_logprobs is None
    assert plain.completion_ids == top.completion_ids
    assert torch.equal(plain.truncated, top.truncated)
    assert all(torch.equal(a, b) for a, b in zip(plain.sampling_logprobs, top.sampling_logprobs))
    assert min(len(c) for c in top.completion_ids) < max(
        len(c) for c in top.completion_ids
    )  # rows ended early
    if case == "float32_packed":
        assert top.paths["packed_weights"] and plain.paths == top.paths


def test_forced_topk_replaces_the_last_entry_only_when_the_token_is_missing():
    logp = torch.log_softmax(torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]]), -1)
    ids, top = forced_topk(logp, torch.tensor([1, 3]), 2)
    assert ids.tolist() == [[0, 1], [0, 3]]
    assert torch.equal(top, logp.gather(-1, ids))
    with pytest.raises(ValueError, match="logprobs_topk=5 must be in 1..4"):
        forced_topk(logp, torch.tensor([1, 3]), 5)


def test_requests_the_engine_cannot_serve_are_refused(model64):
    with pytest.raises(ValueError, match="logprobs_topk must be an int >= 0"):
        SamplingParams(max_completion_length=4, logprobs_topk=-1)
    params = SamplingParams(max_completion_length=4, logprobs_topk=2)
    with pytest.raises(
        ValueError, match="the hf engine does not return top-K log-probs.*use the builtin engine"
    ):
        make_test_engine("hf").generate(model64, [[3, 4]], 2, params)
    too_many = SamplingParams(max_completion_length=4, logprobs_topk=VOCAB + 1)
    with pytest.raises(ValueError, match=f"logprobs_topk={VOCAB + 1} must be in 1..{VOCAB}"):
        make_test_engine("builtin", fast=FASTS[0]).generate(model64, [[3, 4]], 2, too_many)


def test_the_captured_decode_step_is_not_taken_for_top_k():
    reason = graph_decode_unavailable(None, torch.device("cuda"), logprobs_topk=4)
    assert reason is not None and "top-K log-probs" in reason
    assert graph_decode_unavailable(None, torch.device("cuda")) is None


def test_rollout_batch_checks_its_top_k_and_select_groups_carries_it():
    ids = [torch.zeros(2, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long)]
    lps = [torch.zeros(2, 3), torch.zeros(1, 3)]
    common = dict(prompt_ids=[[3]], completion_ids=[[4, EOS], [5]], truncated=torch.tensor([False, True]))
    batch = RolloutBatch(**common, group_size=2, topk_ids=ids, topk_logprobs=lps)
    with pytest.raises(ValueError, match="pass both or neither"):
        RolloutBatch(**common, group_size=2, topk_ids=ids)
    with pytest.raises(ValueError, match=r"topk_ids\[1\] must be a long tensor of shape \[1, K\]"):
        RolloutBatch(**common, group_size=2, topk_ids=[ids[0], ids[1][:, :2]], topk_logprobs=lps)
    with pytest.raises(ValueError, match=r"topk_logprobs\[0\] must be a float32 tensor"):
        RolloutBatch(**common, group_size=2, topk_ids=ids, topk_logprobs=[lps[0].double(), lps[1]])
    joined = select_groups([(batch, [0]), (batch, [0])])
    assert joined.topk_ids is not None and joined.topk_logprobs is not None
    assert [t.tolist() for t in joined.topk_ids] == [t.tolist() for t in ids + ids]
    plain = RolloutBatch(**common, group_size=2)
    assert select_groups([(batch, [0]), (plain, [0])]).topk_ids is None  # not every round has them


def test_the_worker_request_is_unchanged_without_top_k():
    params = SamplingParams(max_completion_length=4, temperature=0.5)
    assert "logprobs_topk" not in params_to_dict(params)
    assert params_from_dict(params_to_dict(params)) == params
    asked = SamplingParams(max_completion_length=4, logprobs_topk=3)
    assert params_from_dict(params_to_dict(asked)) == asked
