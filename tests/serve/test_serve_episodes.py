"""Multi-turn episodes whose turns rollout workers sample (cohort.episodes.remote): the turn decoder against the
in-process one (greedy: the same tokens, masks, truncations), budgets and the group's shared first prompt, the
episode loop's tools through a stand-in of the workers, then a text-environment run with real local workers:
records, masks and log-probs, two runs equal, held-out evaluation through the workers, a worker lost mid-episode,
and the refusal of rollout.max_staleness > 0."""

from __future__ import annotations

import json
import os
import signal
import warnings

import pytest
import torch
from _scripted_lm import script_of
from _serve_helpers import run_config
from _tiny import EOS, PAD, build_tool_model, make_test_engine, tiny_model

from cohort.config import ConfigError, EpisodeConfig, load_config
from cohort.config.validation import check_episode_sampling
from cohort.episodes.decoding import decode_episodes
from cohort.episodes.environments import GuessNumber
from cohort.episodes.multiturn import EpisodeGeneration, episode_metrics
from cohort.episodes.remote import decode_episodes_remote
from cohort.episodes.spec import build_episode_spec
from cohort.episodes.templates import install_tool_format, render_prompt, render_tool_turn
from cohort.models import build_tiny_tokenizer
from cohort.rollout import RolloutBatch, SamplingParams
from cohort.trainer import GRPOTrainer

# ---------------------------------------------------------------------------------------------- the turn decoder


class BlockAgent:
    """Inserts a fixed block after each ended turn, for at most `turns` turns; records the turns it saw."""

    def __init__(self, turns: int):
        self.turns = turns
        self.seen: dict[int, list[tuple[list[int], bool]]] = {}

    def turn_ended(self, row, turn, *, truncated):
        self.seen.setdefault(row, []).append((list(turn), truncated))
        return len(self.seen[row]) < self.turns

    def continuation(self, row, room):
        block = [20 + row, 21, 22 + len(self.seen[row])][: 1 + (row + len(self.seen[row])) % 3]
        return block if len(block) < room else None


class EngineSampler:
    """The workers' side of a round, in this process: the builtin engine on the model; records each request."""

    def __init__(self, model):
        self.model, self.engine = model, make_test_engine("builtin")
        self.requests: list[tuple[list[list[int]], int, int]] = []

    def __call__(self, prompt_ids, group_size, params, generator):
        self.requests.append((prompt_ids, group_size, params.max_completion_length))
        return self.engine.generate(self.model, prompt_ids, group_size, params, generator)


PROMPTS = [[5, 6, 7], [5, 6, 7], [9, 3], [9, 3], [4, 8, 2, 11, 12], [4, 8, 2, 11, 12]]
BUDGETS = [24, 24, 7, 24, 5, 16]


def _local(model, params, budgets, seed=0):
    agent = BlockAgent(3)
    out = decode_episodes(
        model,
        PROMPTS,
        params,
        torch.Generator().manual_seed(seed),
        agent,
        end_of_turn_ids=[EOS],
        pad_token_id=PAD,
        device=torch.device("cpu"),
        budgets=budgets,
    )
    return out, agent


def _remote(model, params, budgets, seed=0, group_size=2):
    agent, sampler = BlockAgent(3), EngineSampler(model)
    out = decode_episodes_remote(
        sampler,
        PROMPTS,
        params,
        torch.Generator().manual_seed(seed),
        agent,
        end_of_turn_ids=[EOS],
        budgets=budgets,
        group_size=group_size,
    )
    return out, agent, sampler


def test_greedy_turns_through_the_sampler_equal_the_in_process_decoder():
    model = tiny_model(eos_bias=1.0, logit_scale=4.0)  # turns of a few tokens; row 2's budget cuts one
    params = SamplingParams(max_completion_length=24, greedy=True)
    local, seen_local = _local(model, params, BUDGETS)
    remote, seen_remote, sampler = _remote(model, params, BUDGETS)
    assert remote.tokens == local.tokens and remote.masks == local.masks
    assert remote.truncated == local.truncated and remote.turns == local.turns
    assert seen_remote.seen == seen_local.seen  # the agent heard the same turns, truncated alike
    for x, y in zip(remote.logprobs, local.logprobs):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-4, rtol=0)
    assert max(remote.turns) >= 2 and any(remote.truncated)  # insertions happened, budgets cut turns
    for row, budget in enumerate(BUDGETS):
        assert len(remote.tokens[row]) <= budget
        assert all(lp == 0.0 for lp, m in zip(remote.logprobs[row], remote.masks[row]) if not m)
        if remote.truncated[row]:
            assert remote.tokens[row][-1] != EOS
    # round 1: each group's shared prompt once with the group size, asking for the largest budget
    first_prompts, first_g, first_max = sampler.requests[0]
    assert (first_prompts, first_g, first_max) == ([PROMPTS[0], PROMPTS[2], PROMPTS[4]], 2, 24)
    for prompts, g, most in sampler.requests[1:]:  # later rounds: each live episode's whole history, alone
        assert g == 1 and most <= 24 and all(any(p[: len(q)] == q for q in PROMPTS) for p in prompts)


def test_a_round_asks_for_the_largest_budget_left_and_cuts_each_turn_at_its_own():
    model = tiny_model(eos_bias=-1e4)  # never ends a turn: every turn runs to its budget
    params = SamplingParams(max_completion_length=10)
    out, agent, sampler = _remote(model, params, [10, 3, 6, 10, 1, 2], group_size=1)
    assert [len(t) for t in out.tokens] == [10, 3, 6, 10, 1, 2] and all(out.truncated)
    assert all(m == [True] * len(m) for m in out.masks) and out.turns == [1] * 6
    assert len(sampler.requests) == 1 and sampler.requests[0][1:] == (1, 10)
    assert all(seen == [(out.tokens[row], True)] for row, seen in agent.seen.items())


def test_sampled_rounds_reproduce_from_the_seed():
    model = tiny_model(eos_bias=2.5, logit_scale=4.0)
    params = SamplingParams(max_completion_length=24, temperature=0.9)
    a, _, _ = _remote(model, params, BUDGETS, seed=3)
    b, _, _ = _remote(model, params, BUDGETS, seed=3)
    c, _, _ = _remote(model, params, BUDGETS, seed=4)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert c.tokens != a.tokens


# ------------------------------------------------------------------------- the episode loop, workers stood in


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


class ScriptedRemote:
    """Stands in for RemoteGeneration: each completion follows a position -> token script (EOS where it is silent),
    every sampled token at log-prob -0.5; counts pushes and rounds."""

    def __init__(self, script: dict[int, int], eos: int):
        self.script, self.eos = script, eos
        self.pushes, self.rounds = 0, []

    def push_weights(self):
        self.pushes += 1

    def submit(self, prompt_ids, group_size, params, generator):
        self.rounds.append((len(prompt_ids), group_size, params.max_completion_length))
        completions = []
        for p in prompt_ids:
            out = []
            while len(out) < params.max_completion_length and (not out or out[-1] != self.eos):
                out.append(self.script.get(len(p) + len(out), self.eos))
            completions += [out] * group_size
        return RolloutBatch(
            prompt_ids=prompt_ids,
            completion_ids=completions,
            truncated=torch.tensor([c[-1] != self.eos for c in completions]),
            group_size=group_size,
            sampling_logprobs=[torch.full((len(c),), -0.5) for c in completions],
        )

    def collect(self, ticket):
        return ticket


def test_tool_calls_run_in_the_trainer_between_rounds_the_workers_sample():
    tok = install_tool_format(build_tiny_tokenizer(), "hermes")
    spec = build_episode_spec(EpisodeConfig(), tools=[multiply])
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt_messages = [{"role": "user", "content": "3*4?"}]
    prompt = render_prompt(tok, prompt_messages, tools=spec.schemas(None))
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    turn1 = ids('<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>') + [
        tok.eos_token_id
    ]
    insert = render_tool_turn(
        tok,
        [*prompt_messages, {"role": "assistant", "content": "", "tool_calls": [call]}],
        [{"role": "tool", "name": "multiply", "content": "12"}],
        tools=spec.schemas(None),
        end_of_turn=[tok.eos_token_id],
    )
    turn2 = ids("12 is the answer")
    remote = ScriptedRemote(
        script_of(len(prompt), [(True, turn1), (False, insert), (True, turn2)]), tok.eos_token_id
    )
    budget = len(turn1) + len(insert) + 5  # the answer is cut at its 5th token
    loop = EpisodeGeneration(
        spec, None, tok, end_of_turn_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, remote=remote
    )
    try:
        batch = loop.generate(
            [prompt],
            2,
            SamplingParams(max_completion_length=budget),
            torch.Generator(),
            rows=[{"prompt": "3*4?"}],
        )
    finally:
        loop.close()
    assert remote.pushes == 1 and remote.rounds == [(1, 2, budget), (2, 1, 5)]
    for row in range(2):
        assert batch.completion_ids[row] == turn1 + insert + turn2[:5]
        mask = batch.token_mask(row).tolist()
        assert mask == [True] * len(turn1) + [False] * len(insert) + [True] * 5
        lps = batch.sampling_logprobs[row].tolist()
        assert lps == [-0.5 if m else 0.0 for m in mask]  # the workers' log-probs, 0 on inserted tokens
        record = batch.episodes[row]
        assert record.messages[1] == {"role": "tool", "name": "multiply", "content": "12"}
        assert (record.calls, record.stop) == (1, "length")
    assert batch.truncated.all()
    metrics = episode_metrics(batch.episodes)
    assert metrics["tools/call_frequency"] == 1.0 and metrics["episodes/stop_length"] == 1.0
    assert loop.counts["calls"] == 2 and loop.counts["turns"] == 4


# ------------------------------------------------------------------------------------- real workers, a trainer


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """A tiny model with the Hermes tool template whose turns end after ~11 tokens."""
    return build_tool_model(tmp_path_factory.mktemp("tools") / "model")


ROWS = [{"prompt": "Play."}] * 4
EVAL_ROWS = [{"prompt": f"Play {i}."} for i in range(2)]


def _cfg(model_dir, out, **over):
    base = {
        "model": {"name_or_path": str(model_dir)},
        "rollout": {"group_size": 4, "batch_size": 8, "max_completion_length": 96, "workers": 1},
        "optim": {"lr": 5e-3},
        "rewards": [],
        "episodes": {"environment": "episode_envs:small_game"},
        "steps": 2,
        "out_dir": str(out),
        "progress": False,
        "eval_at_ends": False,
        "save_every": 0,
    }
    for key, value in over.items():
        section, _, name = key.partition(".")
        if name:
            base[section] = {**base[section], name: value}
        else:
            base[key] = value
    return load_config(None, base)


def _metrics(out):
    keep = lambda row: {k: v for k, v in row.items() if not k.startswith(("time", "step_time", "perf"))}  # noqa: E731
    return [keep(json.loads(line)) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _train_and_evaluate(model_dir, out):
    t = GRPOTrainer(_cfg(model_dir, out), train_rows=ROWS, eval_rows=EVAL_ROWS)
    batches, rounds = [], []
    generate, submit = t.episodes.generate, t.remote.submit
    t.episodes.generate = lambda *a, **k: batches.append(generate(*a, **k)) or batches[-1]
    t.remote.submit = lambda *a, **k: rounds.append(a[0]) or submit(*a, **k)
    try:
        t.train()
        trained_rounds = len(rounds)
        ev = t.evaluate(k=2)
        eval_rounds = len(rounds) - trained_rounds
        weights = {k: v.clone() for k, v in t.model.state_dict().items()}
    finally:
        t.remote.close()
    return batches, trained_rounds, ev, eval_rounds, weights


def test_a_text_environment_run_samples_its_turns_on_a_worker_and_reproduces(tool_model_dir, tmp_path):
    batches, rounds, ev, eval_rounds, weights = _train_and_evaluate(tool_model_dir, tmp_path / "a")
    metrics = _metrics(tmp_path / "a")
    assert len(metrics) == 2 and all(m["serve/workers"] == 1.0 for m in metrics)
    assert all("rewards/GuessNumber/mean" in m and "tools/call_frequency" in m for m in metrics)
    assert max(m["episodes/turns_mean"] for m in metrics) > 1.0  # observations inserted, turns went on
    assert rounds > len(batches) == 2  # several rounds of turns per batch, each sampled by the worker
    inserted = 0
    for batch in batches:
        for row in range(len(batch.completion_ids)):
            mask = batch.token_mask(row)
            lps = batch.sampling_logprobs[row]
            assert bool((lps[~mask] == 0).all()) and bool((lps[mask] <= 0).all())
            inserted += int((~mask).sum())
            assert len(batch.completion_ids[row]) <= 96
            if batch.truncated[row]:
                assert batch.episodes[row].stop == "length"
    assert inserted > 0
    # held-out evaluation of a multi-turn run: its greedy and sampled episodes were played through the worker
    assert eval_rounds > 0 and ev["n"] == 2.0 and "eval_reward" in ev and "pass@2" in ev
    again = _train_and_evaluate(tool_model_dir, tmp_path / "b")
    timeless = lambda d: {k: v for k, v in d.items() if "runtime" not in k and "per_second" not in k}  # noqa: E731
    assert _metrics(tmp_path / "b") == metrics and timeless(again[2]) == timeless(ev)
    for k, v in weights.items():
        assert torch.equal(v, again[4][k]), k


KILL: dict[str, int | None] = {"pid": None}


class KillingGame(GuessNumber):
    """A guessing game whose first step kills the worker process KILL names (once): a worker lost mid-episode."""

    def __init__(self):
        super().__init__(lo=1, hi=9, max_turns=3, seed=0)

    def step(self, action):
        pid, KILL["pid"] = KILL["pid"], None
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        return super().step(action)


def _killing_step(model_dir, out, kill: bool):
    t = GRPOTrainer(
        _cfg(model_dir, out, **{"rollout.workers": 2, "steps": 1, "episodes": {}}),
        train_rows=ROWS,
        environment_factory=KillingGame,
    )
    try:
        KILL["pid"] = t.remote.local.processes[1].pid if kill else None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = t.step()
        lost = [str(w.message) for w in caught if "is lost" in str(w.message)]
        return result.metrics, lost, len(t.remote.live)
    finally:
        KILL["pid"] = None
        t.remote.close()


def test_a_worker_lost_mid_episode_hands_its_turns_to_the_other(tool_model_dir, tmp_path):
    metrics, lost, live = _killing_step(tool_model_dir, tmp_path / "kill", kill=True)
    assert lost and live == 1 and KILL["pid"] is None
    assert metrics["episodes/turns_mean"] > 1.0  # the episodes went on after the loss
    # each round's chunks carry their own seeds: the other worker samples what the lost one would have
    whole, lost_none, _ = _killing_step(tool_model_dir, tmp_path / "whole", kill=False)
    same = lambda m: {k: v for k, v in m.items() if not k.startswith(("time", "step_time", "perf", "serve/"))}  # noqa: E731
    assert not lost_none and same(metrics) == same(whole)


# ------------------------------------------------------------------------------------------------- the refusal


def shout(text: str) -> str:
    """Returns the text in capitals.

    Args:
        text: what to shout
    """
    return text.upper()


def test_episodes_ahead_of_their_step_are_refused(tool_model_dir, tmp_path):
    cfg = _cfg(tool_model_dir, tmp_path, **{"rollout.max_staleness": 1})
    with pytest.raises(
        ConfigError, match=r"max_staleness=1 with multi-turn episodes.*set rollout.max_staleness=0"
    ):
        cfg.validate()
    plain = run_config(tool_model_dir, tmp_path, **{"rollout.workers": 1, "rollout.max_staleness": 2})
    with pytest.raises(ConfigError, match=r"cannot be requested ahead"):
        GRPOTrainer(plain, tools=[shout])


def test_episodes_in_the_trainer_refuse_the_hf_engine(tool_model_dir, tmp_path):
    # In the trainer episodes decode with cohort's turn decoder: rollout.engine=hf would be silently unused.
    cfg = _cfg(tool_model_dir, tmp_path, **{"rollout.workers": None, "rollout.engine": "hf"})
    with pytest.raises(
        ConfigError, match=r"rollout.engine=hf with multi-turn episodes.*set rollout.engine=builtin"
    ):
        cfg.validate()
    plain = run_config(tool_model_dir, tmp_path, **{"rollout.engine": "hf"})
    with pytest.raises(ConfigError, match=r"rollout.engine=hf with multi-turn episodes"):
        GRPOTrainer(plain, tools=[shout])
    # through workers each turn is a plain request, which an hf worker serves
    check_episode_sampling(_cfg(tool_model_dir, tmp_path, **{"rollout.engine": "hf"}))
