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


def run(model, prompts, params, agent, extend, seed=0, preallocate=True):
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
