"""Rollout engines: greedy parity with transformers' generate, EOS / truncation handling, log-probs, RNG."""

from __future__ import annotations

import pytest
import torch
from _tiny import ALL_FAST, EOS, PAD, VOCAB, make_test_engine, random_prompts, tiny_model
from transformers import AttentionInterface

from cohort.fastpath import FastConfig, FastPathError, probes
from cohort.fastpath import attention as attention_module
from cohort.rollout import BuiltinEngine, HFEngine, RolloutBatch, SamplingParams, make_engine

ENGINES = ["builtin", "hf"]


def engine(name: str, eos=(EOS,), **changes):
    """Returns make_test_engine(name): every fast path on, with `changes` to the FastConfig."""
    return make_test_engine(name, eos=eos, fast=ALL_FAST.replace(**changes))


def recomputed_logprobs(model, batch: RolloutBatch, temperature: float) -> list[torch.Tensor]:
    """Log-probs of each completion under log_softmax(logits / T), one plain forward per row."""
    out = []
    with torch.no_grad():
        for r, comp in enumerate(batch.completion_ids):
            prompt = batch.prompt_ids[r // batch.group_size]
            logits = model(torch.tensor([prompt + comp])).logits[0].float()  # [P+T, V]
            logp = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]  # [T, V]
            out.append(logp.gather(-1, torch.tensor(comp)[:, None]).squeeze(-1))
    return out


def check_invariants(batch: RolloutBatch, n_prompts: int, group_size: int, max_len: int, eos=(EOS,)):
    assert batch.num_prompts == n_prompts and batch.group_size == group_size
    assert batch.num_completions == n_prompts * group_size
    assert batch.truncated.dtype == torch.bool and batch.truncated.shape == (n_prompts * group_size,)
    for comp, trunc, lp in zip(batch.completion_ids, batch.truncated.tolist(), batch.sampling_logprobs):
        assert 1 <= len(comp) <= max_len
        ends = [i for i, t in enumerate(comp) if t in eos]
        assert ends in ([], [len(comp) - 1])  # at most one EOS, and only as the last token
        assert trunc == (not ends)
        assert trunc == (not ends and len(comp) == max_len)
        assert lp.dtype == torch.float32 and lp.shape == (len(comp),)


def test_make_engine_names_and_errors():
    assert isinstance(engine("builtin"), BuiltinEngine)
    assert isinstance(engine("hf"), HFEngine)
    with pytest.raises(ValueError, match="unknown rollout engine 'vllm2'.*builtin"):
        make_engine("vllm2", eos_token_ids=[EOS], pad_token_id=PAD)
    with pytest.raises(ValueError, match="eos_token_ids"):
        make_engine("builtin", eos_token_ids=[], pad_token_id=PAD)
    with pytest.raises(ValueError, match="drop_ended_fraction"):
        make_engine(
            "builtin", eos_token_ids=[EOS], pad_token_id=PAD, fast=FastConfig(drop_ended_fraction=0.0)
        )
    with pytest.raises(TypeError, match="FastConfig"):
        make_engine("builtin", eos_token_ids=[EOS], pad_token_id=PAD, fast={"shared_prefix": "on"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_completion_length": 0}, "max_completion_length must be >= 1"),
        ({"max_completion_length": 4, "temperature": 0.0}, "temperature must be > 0"),
        ({"max_completion_length": 4, "top_p": 0.0}, "top_p"),
        ({"max_completion_length": 4, "top_k": -1}, "top_k"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    SamplingParams(max_completion_length=4, temperature=0.0, greedy=True)  # greedy ignores temperature


@pytest.mark.parametrize("name", ENGINES)
def test_generate_rejects_bad_requests(eos_model, name):
    params = SamplingParams(max_completion_length=4)
    with pytest.raises(ValueError, match="prompt 1 must be a non-empty"):
        engine(name).generate(eos_model, [[3, 4], []], 2, params)
    with pytest.raises(ValueError, match="group_size"):
        engine(name).generate(eos_model, [[3, 4]], 0, params)


@pytest.mark.parametrize("drop_ended_fraction", [1e-9, 0.25, 1.0])
def test_builtin_greedy_equals_generate(eos_model, drop_ended_fraction):
    """Guards prefill sharing, cache repetition, row dropping and position ids against generate()."""
    prompts = random_prompts(8, seed=1)
    assert len({len(p) for p in prompts}) > 2  # left padding is exercised
    params = SamplingParams(max_completion_length=20, greedy=True)
    ours = engine("builtin", drop_ended_fraction=drop_ended_fraction).generate(eos_model, prompts, 3, params)
    ref = engine("hf").generate(eos_model, prompts, 3, params)
    assert ours.completion_ids == ref.completion_ids
    assert torch.equal(ours.truncated, ref.truncated)
    lengths = ours.completion_lengths
    assert (lengths < 20).any() and (lengths > 1).any() and ours.truncated.any()  # EOS mid-way and never
    for a, b in zip(ours.sampling_logprobs, ref.sampling_logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    check_invariants(ours, 8, 3, 20)
    # Greedy log-probs are those of the raw logits.
    for a, b in zip(ours.sampling_logprobs, recomputed_logprobs(eos_model, ours, 1.0)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_greedy_with_several_eos_ids_cuts_at_the_first_one(eos_model):
    prompts = random_prompts(6, seed=2)
    params = SamplingParams(max_completion_length=12, greedy=True)
    eos = (EOS, 7, 11)
    ours = engine("builtin", eos=eos).generate(eos_model, prompts, 2, params)
    ref = engine("hf", eos=eos).generate(eos_model, prompts, 2, params)
    assert ours.completion_ids == ref.completion_ids
    assert {c[-1] for c, t in zip(ours.completion_ids, ours.truncated) if not t} - {EOS} != set()
    check_invariants(ours, 6, 2, 12, eos=eos)


@pytest.mark.parametrize("name", ENGINES)
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.6, 10, 0.9)])
def test_sampling_logprobs_equal_plain_forward(eos_model, name, temperature, top_k, top_p):
    prompts = random_prompts(4, seed=5)
    params = SamplingParams(max_completion_length=10, temperature=temperature, top_k=top_k, top_p=top_p)
    batch = engine(name).generate(eos_model, prompts, 4, params, torch.Generator().manual_seed(0))
    check_invariants(batch, 4, 4, 10)
    assert batch.truncated.any() and not batch.truncated.all()
    for a, b in zip(batch.sampling_logprobs, recomputed_logprobs(eos_model, batch, temperature)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ENGINES)
def test_truncation_and_eos_extremes(name):
    prompts = random_prompts(3, seed=4)
    never = tiny_model(eos_bias=-1e4)
    batch = engine(name).generate(never, prompts, 2, SamplingParams(max_completion_length=7))
    assert [len(c) for c in batch.completion_ids] == [7] * 6 and batch.truncated.all()
    always = tiny_model(eos_bias=1e4)
    batch = engine(name).generate(always, prompts, 2, SamplingParams(max_completion_length=7))
    assert batch.completion_ids == [[EOS]] * 6 and not batch.truncated.any()
    batch = engine(name).generate(never, prompts, 2, SamplingParams(max_completion_length=1))
    assert [len(c) for c in batch.completion_ids] == [1] * 6 and batch.truncated.all()


def test_a_sampled_pad_token_is_kept(eos_model):
    """Only EOS ends a row: a PAD id sampled mid-completion is a real token, not padding."""
    model = tiny_model(eos_bias=-1e4)
    with torch.no_grad():
        model.lm_head.bias[PAD] = 2.0  # PAD becomes frequent
    batch = engine("builtin").generate(
        model,
        random_prompts(2, seed=0),
        4,
        SamplingParams(max_completion_length=6),
        torch.Generator().manual_seed(0),
    )
    assert any(PAD in c for c in batch.completion_ids)
    assert all(len(c) == 6 for c in batch.completion_ids)


@pytest.mark.parametrize("name", ENGINES)
def test_seeded_generator_reproduces_and_leaves_global_rng_alone(eos_model, name):
    prompts = random_prompts(3, seed=6)
    params = SamplingParams(max_completion_length=8, temperature=1.2)
    torch.manual_seed(123)
    state = torch.random.get_rng_state()
    a = engine(name).generate(eos_model, prompts, 4, params, torch.Generator().manual_seed(42))
    assert torch.equal(torch.random.get_rng_state(), state)
    b = engine(name).generate(eos_model, prompts, 4, params, torch.Generator().manual_seed(42))
    c = engine(name).generate(eos_model, prompts, 4, params, torch.Generator().manual_seed(43))
    assert a.completion_ids == b.completion_ids
    assert a.completion_ids != c.completion_ids


def test_hf_engine_ignores_the_checkpoint_generation_defaults(eos_model):
    """A generation_config.json (Qwen ships top_k=20, repetition_penalty=1.05) must not leak into sampling."""
    prompts = random_prompts(3, seed=7)
    params = SamplingParams(max_completion_length=8, temperature=1.0)
    plain = engine("hf").generate(eos_model, prompts, 4, params, torch.Generator().manual_seed(1))
    saved = eos_model.generation_config
    eos_model.generation_config = type(saved)(top_k=1, repetition_penalty=3.0, min_new_tokens=5)
    try:
        tweaked = engine("hf").generate(eos_model, prompts, 4, params, torch.Generator().manual_seed(1))
        assert eos_model.generation_config.top_k == 1  # restored afterwards
    finally:
        eos_model.generation_config = saved
    assert tweaked.completion_ids == plain.completion_ids


@pytest.mark.parametrize("name", ENGINES)
def test_training_mode_with_gradient_checkpointing_still_uses_the_cache(name):
    """transformers drops the KV cache of checkpointed layers in training mode; engines must decode in eval."""
    model = tiny_model(eos_bias=0.7, logit_scale=4.0)
    prompts = random_prompts(4, seed=1)
    params = SamplingParams(max_completion_length=12, greedy=True)
    ref = engine(name).generate(model, prompts, 2, params)
    # transformers renamed it (activation_*) after 5.0; the oldest supported version has only the old name.
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.train()
    got = engine(name).generate(model, prompts, 2, params)
    assert got.completion_ids == ref.completion_ids
    assert model.training and all(m.training for m in model.modules())


def warm_up(model) -> None:
    """Runs the builtin engine's one-off check of shared-prefix decoding, so hooks see only the real call."""
    engine("builtin").generate(model, random_prompts(1, seed=0), 2, SamplingParams(max_completion_length=1))


def test_builtin_prefills_each_prompt_once(eos_model):
    """The prefill forward sees the B unique prompts, not B*G rows; decode steps see at most B*G rows."""
    prompts = random_prompts(3, seed=8)
    warm_up(eos_model)
    batch_sizes = []
    hook = eos_model.model.register_forward_pre_hook(
        lambda mod, args, kwargs: batch_sizes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        engine("builtin").generate(
            eos_model, prompts, 5, SamplingParams(max_completion_length=6, greedy=True)
        )
    finally:
        hook.remove()
    assert batch_sizes[0] == (3, max(len(p) for p in prompts))
    assert all(shape[1] == 1 and shape[0] <= 15 for shape in batch_sizes[1:])
    assert len(batch_sizes) <= 6  # stops once all rows ended or after the last token


def test_builtin_drops_ended_rows(eos_model):
    prompts = random_prompts(8, seed=1)
    warm_up(eos_model)
    batch_sizes = []
    hook = eos_model.model.register_forward_pre_hook(
        lambda mod, args, kwargs: batch_sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        batch = engine("builtin").generate(
            eos_model, prompts, 2, SamplingParams(max_completion_length=20, greedy=True)
        )
    finally:
        hook.remove()
    still_running = [(batch.completion_lengths > t + 1).sum().item() for t in range(len(batch_sizes) - 1)]
    decode_sizes = batch_sizes[1:]
    assert decode_sizes[-1] == still_running[-1] < 16  # finished rows are gone by the end
    assert all(size >= alive for size, alive in zip(decode_sizes, still_running))
    assert len(decode_sizes) == batch.completion_lengths.max().item() - 1


@pytest.mark.parametrize("greedy", [True, False])
def test_shared_prefix_decoding_matches_the_repeated_cache(greedy):
    """One copy of each prompt's cache gives the tokens and log-probs of G copies (left padding, GQA,
    rows dropped as they end)."""
    model = tiny_model(seed=2, eos_bias=1.0, logit_scale=3.0)
    prompts = random_prompts(5, seed=4, min_len=1, max_len=14)
    params = SamplingParams(max_completion_length=16, greedy=greedy)
    runs = []
    with torch.inference_mode():
        for shared in (True, False):
            gen = torch.Generator().manual_seed(7)
            runs.append(
                engine("builtin")._decode(model, prompts, 4, params, gen, torch.device("cpu"), shared=shared)
            )
    (tok_a, len_a, end_a, lp_a), (tok_b, len_b, end_b, lp_b) = runs
    assert torch.equal(tok_a, tok_b) and torch.equal(len_a, len_b) and torch.equal(end_a, end_b)
    assert len_a.min() < len_a.max()  # rows ended at different steps, so rows were dropped mid-way
    torch.testing.assert_close(lp_a, lp_b, rtol=0, atol=1e-5)
    assert "shared_prefix" not in probes.results(model)  # explicit choice: the check never ran


def test_shared_prefix_decoding_is_checked_once_and_falls_back_when_wrong(monkeypatch):
    model = tiny_model(seed=3, eos_bias=0.5, logit_scale=3.0)
    prompts = random_prompts(3, seed=5)
    params = SamplingParams(max_completion_length=8, greedy=True)
    ref = engine("hf").generate(model, prompts, 3, params)

    def wrong(module, query, key, value, attention_mask, **kwargs):
        out, _ = attention_module.custom_attention_forward(
            module, query, key, value, attention_mask, **kwargs
        )
        return out * 0.5, None

    # cohort's attention function, registered with transformers, made wrong for this model's first checks
    monkeypatch.setitem(AttentionInterface._global_mapping, attention_module.NAME, wrong)
    with pytest.warns(UserWarning, match="shared-prefix decoding does not reproduce"):
        got = engine("builtin", shared_prefix="auto", shared_prefix_min_elements=0).generate(
            model, prompts, 3, params
        )
    assert got.completion_ids == ref.completion_ids and got.paths["shared_prefix"] is False
    assert probes.results(model)["shared_prefix"] is False
    with pytest.raises(FastPathError, match="shared-prefix decoding does not reproduce"):
        engine("builtin").generate(model, prompts, 3, params)  # `on` refuses what auto falls back from
    monkeypatch.undo()
    healthy = tiny_model(seed=3, eos_bias=0.5, logit_scale=3.0)
    got = engine("builtin").generate(healthy, prompts, 3, params)
    assert got.completion_ids == ref.completion_ids and got.paths["shared_prefix"] is True
    assert probes.results(healthy)["shared_prefix"] is True


def test_rollout_batch_properties():
    batch = RolloutBatch(
        prompt_ids=[[5, 6]],
        completion_ids=[[3, EOS], [4, 4, 4]],
        truncated=torch.tensor([False, True]),
        group_size=2,
    )
    assert batch.num_prompts == 1 and batch.num_completions == 2
    assert batch.completion_lengths.tolist() == [2, 3] and batch.completion_lengths.dtype == torch.long
    assert batch.sampling_logprobs is None
    assert VOCAB > EOS  # the shared tiny vocabulary is what the fixtures assume


@pytest.mark.parametrize(
    ("n_prompts", "group", "width", "shares"),
    [(16, 8, 8, False), (4, 16, 1000, True), (64, 1, 4096, False)],
    ids=["demo-shape", "long-prompts", "G=1"],
)
def test_shared_prefix_decoding_only_where_the_copies_it_avoids_are_large(n_prompts, group, width, shares):
    """auto shares when the avoided copies reach shared_prefix_min_elements (2 kv heads x head size 12 here:
    24 cache elements per position and layer; the demo's shape avoids 21 504, long prompts 1.4 M)."""
    model = tiny_model()
    prompts = [[2 + (i + t) % 30 for t in range(width)] for i in range(n_prompts)]
    params = SamplingParams(max_completion_length=2, greedy=True)
    batch = engine("builtin", shared_prefix="auto", packed_weights="off").generate(
        model, prompts, group, params
    )
    assert batch.paths["shared_prefix"] is shares


@pytest.mark.parametrize("name", ENGINES)
def test_on_finished_hears_each_eos_completion_as_returned(eos_model, name):
    heard: list[tuple[int, list[int]]] = []
    prompts = random_prompts(3, seed=5)
    params = SamplingParams(max_completion_length=20, temperature=1.0)
    eng = engine(name)
    batch = eng.generate(
        eos_model,
        prompts,
        4,
        params,
        torch.Generator().manual_seed(0),
        on_finished=lambda row, ids: heard.append((row, ids)),
    )
    ended = [r for r, t in enumerate(batch.truncated.tolist()) if not t]
    assert 0 < len(ended) < 12  # some rows end with EOS, some are cut at the limit
    assert sorted(r for r, _ in heard) == ended  # once each, truncated rows never
    assert all(ids == batch.completion_ids[r] for r, ids in heard)
    lengths = [len(ids) for _, ids in heard]
    if eng.streams_finished:  # heard as each ended (shortest first), not after the batch (by row)
        assert lengths == sorted(lengths) and [r for r, _ in heard] != ended
    # the hook changes nothing sampled
    again = eng.generate(eos_model, prompts, 4, params, torch.Generator().manual_seed(0))
    assert again.completion_ids == batch.completion_ids
