"""The multi-turn decoder: inserted tokens extend the KV cache exactly as re-encoding the episode would."""

from __future__ import annotations

import pytest
import torch
from _tiny import EOS, PAD, tiny_model

from cohort.episodes.decoding import decode_episodes
from cohort.rollout import SamplingParams


class ScriptedAgent:
    """Inserts a fixed block after each ended turn, for at most `turns` turns; records what it saw."""

    def __init__(self, block_of, turns: int):
        self.block_of, self.turns = block_of, turns
        self.seen: dict[int, list[list[int]]] = {}

    def turn_ended(self, row, turn, *, truncated):
        self.seen.setdefault(row, []).append(list(turn))
        return len(self.seen[row]) < self.turns

    def continuation(self, row, room):
        block = self.block_of(row, len(self.seen[row]))
        return block if len(block) < room else None


def run(model, prompts, params, agent, extend, seed=0, preallocate=True, budgets=None, static=None):
    return decode_episodes(
        model,
        prompts,
        params,
        torch.Generator().manual_seed(seed),
        agent,
        end_of_turn_ids=[EOS],
        pad_token_id=PAD,
        device=torch.device("cpu"),
        extend_cache=extend,
        preallocate=preallocate,
        budgets=budgets,
        static=static,
    )


PROMPTS = [[5, 6, 7], [5, 6, 7], [9, 3], [9, 3], [4, 8, 2, 11, 12], [13]]


def blocks(row, turn):
    return [20 + row, 21, 22 + turn][: 1 + (row + turn) % 3]


@pytest.mark.parametrize("preallocate", [True, False])
@pytest.mark.parametrize("greedy", [True, False])
def test_extended_cache_equals_reencoding(greedy, preallocate):
    model = tiny_model(eos_bias=2.5, logit_scale=4.0)
    params = SamplingParams(max_completion_length=24, greedy=greedy, temperature=0.9)
    a = run(model, PROMPTS, params, ScriptedAgent(blocks, 3), extend=True, preallocate=preallocate)
    b = run(model, PROMPTS, params, ScriptedAgent(blocks, 3), extend=False, preallocate=False)
    assert a.tokens == b.tokens
    assert a.masks == b.masks
    assert a.truncated == b.truncated
    for x, y in zip(a.logprobs, b.logprobs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=0)
    assert max(a.turns) >= 2  # some episode really continued after an insertion


def test_masks_mark_inserted_tokens_and_budget_holds():
    model = tiny_model(eos_bias=2.5, logit_scale=4.0)
    params = SamplingParams(max_completion_length=16, greedy=True)
    agent = ScriptedAgent(blocks, 4)
    out = run(model, PROMPTS, params, agent, extend=True)
    for row in range(len(PROMPTS)):
        toks, mask = out.tokens[row], out.masks[row]
        assert len(toks) == len(mask) == len(out.logprobs[row]) <= 16
        # the sampled turns the agent saw, in order, are exactly the masked-in runs of the episode
        runs, cur = [], []
        for t, m in zip(toks, mask):
            if m:
                cur.append(t)
            elif cur:
                runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
        assert runs == agent.seen[row]
        assert all(lp == 0.0 for lp, m in zip(out.logprobs[row], mask) if not m)
        if out.truncated[row]:
            assert len(toks) == 16 and toks[-1] != EOS


def test_one_turn_matches_a_plain_decoding():
    """With no insertion the decoder samples what the builtin engine's plain path samples, greedily."""
    from _tiny import make_test_engine

    from cohort.fastpath import FastConfig

    model = tiny_model(eos_bias=1.0, logit_scale=4.0)
    params = SamplingParams(max_completion_length=12, greedy=True)
    out = run(model, PROMPTS, params, ScriptedAgent(blocks, 1), extend=True)
    engine = make_test_engine("builtin", fast=FastConfig(shared_prefix="off", packed_weights="off"))
    ref = engine.generate(model, PROMPTS, 1, params)
    assert out.tokens == ref.completion_ids
    assert out.truncated == ref.truncated.tolist()


@pytest.mark.parametrize("greedy", [True, False])
def test_non_finite_logits_are_a_typed_error_not_a_random_token(greedy, monkeypatch):
    """The draw takes a uniform token from a non-finite row (on a GPU, CUDA's multinomial would assert, which no
    one can catch): the episode decoder reads the log-prob it keeps anyway and raises NonFiniteSamplingError."""
    from cohort.errors import NonFiniteSamplingError

    model = tiny_model(eos_bias=2.5, logit_scale=4.0)
    with torch.no_grad():
        model.lm_head.weight[3].fill_(
            float("nan")
        )  # one vocabulary row: every position's logit for it is NaN
    params = SamplingParams(max_completion_length=8, greedy=greedy, temperature=0.9)
    with pytest.raises(NonFiniteSamplingError, match="not finite while sampling a multi-turn episode"):
        run(model, PROMPTS, params, ScriptedAgent(blocks, 2), extend=True)


@pytest.mark.parametrize("greedy", [True, False])
def test_outside_the_model_a_step_waits_for_the_device_only_to_read_its_tokens(greedy):
    """Which slots still decode is the host's own decision: no op outside the model's forward makes the host wait
    for the device (on a GPU each did: a `nonzero`, a `bool()`, one per dropped slot), besides the one copy of the
    sampled tokens and log-probs, which a CPU tensor's `tolist` makes without an op this mode sees."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from cohort.rollout.graph import HostSyncCheck

    class Syncs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: list[str] = []
            self.in_model = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if not self.in_model and name in HostSyncCheck.SYNCS:
                self.names.append(name)
            return func(*args, **(kwargs or {}))

    model = tiny_model(eos_bias=2.5, logit_scale=4.0)
    syncs = Syncs()

    def forward(**inputs):
        syncs.in_model = (
            True  # transformers' own mask checks read values; they are the model's, not the loop's
        )
        try:
            return model(**inputs)
        finally:
            syncs.in_model = False

    params = SamplingParams(max_completion_length=24, greedy=greedy, temperature=0.9)
    agent = ScriptedAgent(blocks, 3)
    with syncs:
        out = decode_episodes(
            model,
            PROMPTS,
            params,
            torch.Generator().manual_seed(1),
            agent,
            end_of_turn_ids=[EOS],
            pad_token_id=PAD,
            device=torch.device("cpu"),
            forward=forward,
        )
    assert max(out.turns) >= 2
    assert syncs.names == []
    plain = run(model, PROMPTS, params, ScriptedAgent(blocks, 3), extend=True, seed=1)
    assert plain.tokens == out.tokens and plain.logprobs == out.logprobs


def _static_run(model, params, agent, *, extend=True, preallocate=True, seed=0, budgets=None, **turns):
    from cohort.episodes.decoding import StaticTurns

    static = StaticTurns(capture=False, min_tokens=turns.pop("min_tokens", 1), check_every=3, **turns)
    out = run(model, PROMPTS, params, agent, extend, seed, preallocate, budgets, static)
    return out, static


BUDGETS = [24, 20, 17, 24, 9, 24]  # some episodes run out mid-turn, one before its second turn


@pytest.mark.parametrize("extend", [True, False], ids=["extended", "re-encoded"])
@pytest.mark.parametrize("preallocate", [True, False], ids=["preallocated", "dynamic"])
def test_greedy_static_turns_decode_what_the_eager_turns_decode(extend, preallocate):
    """Each turn through the builtin engine's static step (uncaptured on a CPU): the same tokens, log-probs (float64,
    1e-10), masks, ends and turns the agent sees as the eager decoder, holes and budgets included."""
    model = tiny_model(eos_bias=1.0, logit_scale=4.0).double()  # turns of 1-9 tokens, some cut by the budget
    params = SamplingParams(max_completion_length=24, greedy=True)
    eager_agent, static_agent = ScriptedAgent(blocks, 3), ScriptedAgent(blocks, 3)
    with torch.inference_mode():
        eager = decode_episodes(
            model, PROMPTS, params, None, eager_agent, end_of_turn_ids=[EOS], pad_token_id=PAD,
            device=torch.device("cpu"), extend_cache=extend, preallocate=preallocate, budgets=BUDGETS,
        )  # fmt: skip
        static_out, static = _static_run(
            model, params, static_agent, extend=extend, preallocate=preallocate, budgets=BUDGETS
        )
    assert static.turns == max(static_out.turns) == 3  # every turn of the batch static
    assert static_out.tokens == eager.tokens
    assert static_out.masks == eager.masks
    assert static_out.truncated == eager.truncated and any(eager.truncated) and not all(eager.truncated)
    assert static_out.turns == eager.turns
    assert static_agent.seen == eager_agent.seen
    for a, b in zip(static_out.logprobs, eager.logprobs):
        assert max((abs(x - y) for x, y in zip(a, b)), default=0.0) <= 1e-10


def test_sampled_static_turns_keep_budgets_and_masks_and_reproduce_from_the_seed():
    model = tiny_model(eos_bias=2.5, logit_scale=4.0)
    params = SamplingParams(max_completion_length=24, temperature=0.9, top_p=0.95)
    with torch.inference_mode():
        a, static = _static_run(model, params, ScriptedAgent(blocks, 3), budgets=BUDGETS, seed=3)
        b, _ = _static_run(model, params, ScriptedAgent(blocks, 3), budgets=BUDGETS, seed=3)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert static.turns == max(a.turns)
    for row, toks in enumerate(a.tokens):
        assert len(toks) == len(a.masks[row]) == len(a.logprobs[row]) <= BUDGETS[row]
        sampled = [t for t, m in zip(toks, a.masks[row]) if m]
        assert all(lp < 0 for lp, m in zip(a.logprobs[row], a.masks[row]) if m)
        # a turn ends at an end-of-turn id or at the budget: no sampled token follows an EOS within its turn
        for i, (t, m) in enumerate(zip(toks, a.masks[row])):
            if m and t == EOS and i + 1 < len(toks):
                assert not a.masks[row][i + 1]
        assert sampled


def test_a_short_turn_stays_eager_and_a_failed_capture_falls_back_once(monkeypatch):
    from cohort.rollout import graph

    model = tiny_model(eos_bias=1.0, logit_scale=4.0).double()
    params = SamplingParams(max_completion_length=24, greedy=True)
    with torch.inference_mode():
        eager = run(model, PROMPTS, params, ScriptedAgent(blocks, 3), extend=True)
        out, static = _static_run(model, params, ScriptedAgent(blocks, 3), min_tokens=25)
        assert static.turns == 0 and out.tokens == eager.tokens  # no turn long enough: all eager

        def fail(self, warmup, generator):
            raise RuntimeError("operation not permitted when stream is capturing")

        monkeypatch.setattr(graph.StaticDecoder, "capture", fail)
        heard = []
        from cohort.episodes.decoding import StaticTurns

        static = StaticTurns(capture=True, min_tokens=1, on_failure=heard.append)
        out = decode_episodes(
            model, PROMPTS, params, None, ScriptedAgent(blocks, 3), end_of_turn_ids=[EOS], pad_token_id=PAD,
            device=torch.device("cpu"), static=static,
        )  # fmt: skip
    assert static.failed and static.turns == 0 and len(heard) == 1 and "capturing" in str(heard[0])
    assert out.tokens == eager.tokens and out.masks == eager.masks
