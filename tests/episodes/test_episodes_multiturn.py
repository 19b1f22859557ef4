"""The episode loop on a scripted model: tool calls executed and inserted, masks, limits, budgets, failures,
text environments and TRL-style environments, as TRL 1.16's agent loop behaves."""

from __future__ import annotations

import time

import pytest
import torch
from _scripted_lm import ScriptedLM, script_of

from cohort.config import EpisodeConfig
from cohort.episodes.environments import EnvStep, TextEnvironment
from cohort.episodes.multiturn import EMPTY_PROMPT, EpisodeGeneration, episode_metrics
from cohort.episodes.spec import build_episode_spec
from cohort.episodes.templates import install_tool_format, render_prompt, render_tool_turn
from cohort.errors import ConfigError
from cohort.models import build_tiny_tokenizer
from cohort.rollout import SamplingParams


def multiply(a: int, b: int) -> int:
    """Multiplies two integers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


def broken(a: int) -> int:
    """Always fails.

    Args:
        a: Anything.
    """
    raise RuntimeError(f"cannot handle {a}")


def sleepy(a: int) -> int:
    """Never answers in time.

    Args:
        a: Anything.
    """
    time.sleep(5)
    return a


@pytest.fixture(scope="module")
def tok():
    return install_tool_format(build_tiny_tokenizer(), "hermes")


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def call_turn(tok, name="multiply", args='{"a": 3, "b": 4}'):
    return ids(tok, f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>') + [
        tok.eos_token_id
    ]


def call_message(name="multiply", arguments=None):
    arguments = {"a": 3, "b": 4} if arguments is None else arguments
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }


PROMPT = [{"role": "user", "content": "3*4?"}]


def episode(tok, spec, pieces, *, G=2, budget=300, rows=None, env=None):
    """Returns the batch of one row's G episodes on a model scripted with `pieces` after the prompt."""
    row = rows or {"prompt": PROMPT}
    prompt = render_prompt(tok, PROMPT, tools=spec.schemas(env) or None)
    model = ScriptedLM(len(tok), tok.eos_token_id, script_of(len(prompt), pieces))
    loop = EpisodeGeneration(
        spec, model, tok, end_of_turn_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id
    )
    try:
        return loop.generate(
            [prompt], G, SamplingParams(max_completion_length=budget), torch.Generator(), rows=[row]
        ), loop
    finally:
        loop.close()


def tool_insert(tok, spec, content, name="multiply", arguments=None):
    return render_tool_turn(
        tok,
        [*PROMPT, call_message(name, arguments)],
        [{"role": "tool", "name": name, "content": content}],
        tools=spec.schemas(None),
        end_of_turn=[tok.eos_token_id],
    )


class LinearScriptedLM(ScriptedLM):
    """The scripted model with a Linear whose output adds 0 to the logits (so its weights are read)."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.probe = torch.nn.Linear(4, 1)

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None
    ):
        out = super().forward(input_ids, attention_mask, position_ids, past_key_values, use_cache)
        touch = self.probe(torch.ones(*input_ids.shape, 4)).float() * 0  # [B, L, 1]
        return type(out)(logits=out.logits + touch)


@pytest.mark.parametrize("setting", ["auto", "off"])
def test_under_autocast_the_local_decoding_reports_its_weights_cast_once(tok, setting):
    """fast.cast_once reaches the episodes' decoding and batch.paths (fast/cast_once) says what it did."""
    from cohort.fastpath import FastConfig

    spec = build_episode_spec(EpisodeConfig(), tools=[multiply])
    turn1, insert, turn2 = call_turn(tok), tool_insert(tok, spec, "12"), ids(tok, "12") + [tok.eos_token_id]
    prompt = render_prompt(tok, PROMPT, tools=spec.schemas(None))
    model = LinearScriptedLM(
        len(tok), tok.eos_token_id, script_of(len(prompt), [(True, turn1), (False, insert), (True, turn2)])
    )
    loop = EpisodeGeneration(
        spec,
        model,
        tok,
        end_of_turn_ids=[tok.eos_token_id],
        pad_token_id=tok.pad_token_id,
        autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        fast=FastConfig(cast_once=setting),
    )
    try:
        batch = loop.generate(
            [prompt],
            2,
            SamplingParams(max_completion_length=300),
            torch.Generator(),
            rows=[{"prompt": PROMPT}],
        )
    finally:
        loop.close()
    assert batch.paths["cast_once"] == (setting == "auto")
    assert batch.completion_ids[0] == batch.completion_ids[1] == turn1 + insert + turn2


def test_a_tool_call_is_executed_inserted_and_masked(tok):
    spec = build_episode_spec(EpisodeConfig(), tools=[multiply])
    turn1, insert, turn2 = call_turn(tok), tool_insert(tok, spec, "12"), ids(tok, "12") + [tok.eos_token_id]
    batch, loop = episode(tok, spec, [(True, turn1), (False, insert), (True, turn2)])
    for row in range(2):
        assert batch.completion_ids[row] == turn1 + insert + turn2
        assert batch.token_mask(row).tolist() == [True] * len(turn1) + [False] * len(insert) + [True] * len(
            turn2
        )
        assert batch.sampling_logprobs[row][len(turn1) : len(turn1) + len(insert)].abs().sum() == 0
        record = batch.episodes[row]
        assert record.messages == [
            call_message(),
            {"role": "tool", "name": "multiply", "content": "12"},
            {"role": "assistant", "content": "12"},
        ]
        assert record.prompt == PROMPT and (record.calls, record.failures, record.stop) == (1, 0, "answer")
        assert record.turn_ends == [len(turn1) - 1, len(turn1) + len(insert) + len(turn2) - 1]
    assert batch.loss_lengths.tolist() == [len(turn1) + len(turn2)] * 2
    assert not batch.truncated.any()
    assert episode_metrics(batch.episodes)["tools/call_frequency"] == 1.0
    assert loop.counts["calls"] == 2 and loop.counts["episodes"] == 2


def test_a_call_past_max_tool_calling_iterations_stays_unexecuted(tok):
    spec = build_episode_spec(EpisodeConfig(max_tool_calling_iterations=0), tools=[multiply])
    turn1 = call_turn(tok)
    batch, _ = episode(tok, spec, [(True, turn1), (False, tool_insert(tok, spec, "12")), (True, [5, 6])])
    record = batch.episodes[0]
    assert batch.completion_ids[0] == turn1
    assert record.messages == [call_message()] and record.calls == 0 and record.stop == "max_tool_calls"


def test_a_failing_tool_returns_trls_error_text_and_is_counted(tok):
    spec = build_episode_spec(EpisodeConfig(), tools=[broken])
    turn1 = call_turn(tok, "broken", '{"a": 7}')
    error = "{'error': 'cannot handle 7'}"
    insert = tool_insert(tok, spec, error, "broken", {"a": 7})
    batch, loop = episode(tok, spec, [(True, turn1), (False, insert), (True, [tok.eos_token_id])])
    record = batch.episodes[0]
    assert record.messages[1] == {"role": "tool", "name": "broken", "content": error}
    assert (record.calls, record.failures) == (1, 1)
    assert episode_metrics(batch.episodes)["tools/failure_frequency"] == 1.0
    assert loop.counts["failures"] == 2


def test_a_tool_that_never_returns_times_out_and_the_episode_goes_on(tok):
    spec = build_episode_spec(EpisodeConfig(tool_timeout=0.2), tools=[sleepy])
    turn1 = call_turn(tok, "sleepy", '{"a": 1}')
    t0 = time.perf_counter()
    batch, _ = episode(tok, spec, [(True, turn1)], G=1)
    assert time.perf_counter() - t0 < 4
    record = batch.episodes[0]
    assert record.failures == 1 and "timed out" in record.messages[1]["content"]
    assert record.messages[-1]["role"] == "assistant"


def test_a_result_past_the_token_budget_ends_the_episode_as_trl_does(tok):
    spec = build_episode_spec(EpisodeConfig(), tools=[multiply])
    turn1, insert = call_turn(tok), tool_insert(tok, spec, "12")
    batch, loop = episode(tok, spec, [(True, turn1), (False, insert)], budget=len(turn1) + len(insert))
    record = batch.episodes[0]
    assert batch.completion_ids[0] == turn1 and record.stop == "budget"
    assert record.messages == [call_message()]  # the result is rolled back
    assert not batch.truncated[0] and loop.counts["budget_stops"] == 2


def test_a_turn_cut_by_the_budget_is_truncated(tok):
    spec = build_episode_spec(EpisodeConfig(), tools=[multiply])
    batch, _ = episode(tok, spec, [(True, ids(tok, "abcdefgh"))], budget=5)
    assert batch.truncated.all() and batch.completion_ids[0] == ids(tok, "abcde")
    assert batch.episodes[0].stop == "length"


class Higher(TextEnvironment):
    """Answers the first guess with "higher" (reward 0), the second with done (reward 1)."""

    def __init__(self):
        self.turn = 0

    def reset(self, **row):
        self.turn = 0
        return " Guess."

    def step(self, action):
        self.turn += 1
        return EnvStep("higher", 0.0, False) if self.turn == 1 else EnvStep("yes", 1.0, True)


def test_a_text_environment_steps_on_each_turn_and_scores_per_turn(tok):
    spec = build_episode_spec(EpisodeConfig(turn_rewards=True), environment_factory=Higher)
    prompt = [{"role": "user", "content": "3*4? Guess."}]
    turn1, turn2 = ids(tok, "5") + [tok.eos_token_id], ids(tok, "9") + [tok.eos_token_id]
    insert = render_tool_turn(
        tok,
        [*prompt, {"role": "assistant", "content": "5"}],
        [{"role": "user", "content": "higher"}],
        end_of_turn=[tok.eos_token_id],
    )
    full = render_prompt(tok, prompt)
    model = ScriptedLM(
        len(tok), tok.eos_token_id, script_of(len(full), [(True, turn1), (False, insert), (True, turn2)])
    )
    loop = EpisodeGeneration(
        spec, model, tok, end_of_turn_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id
    )
    batch = loop.generate(
        [full], 2, SamplingParams(max_completion_length=100), torch.Generator(), rows=[{"prompt": PROMPT}]
    )
    record = batch.episodes[0]
    assert record.prompt == prompt  # reset's string appended to the last user message
    assert batch.completion_ids[0] == turn1 + insert + turn2
    assert record.turn_rewards == [0.0, 1.0] and record.stop == "done"
    assert [m["role"] for m in record.messages] == ["assistant", "user", "assistant", "user"]
    assert batch.episodes[0].environment is not batch.episodes[1].environment  # one instance per rollout
    (reward,) = spec.reward_functions()
    assert reward.__name__ == "Higher"
    steps = reward(episodes=batch.episodes)
    assert steps[0].rewards == [0.0, 1.0] and steps[0].ends == record.turn_ends
    loop.close()


class BrokenStep(TextEnvironment):
    """A text environment whose step raises on every episode (a bug in it)."""

    def reset(self, **row):
        return " Guess."

    def step(self, action):
        raise KeyError("score")


def test_an_environment_whose_step_raises_is_said_once_loudly_and_counted(tok):
    spec = build_episode_spec(EpisodeConfig(), environment_factory=BrokenStep)
    full = render_prompt(tok, [{"role": "user", "content": "3*4? Guess."}])
    turn = ids(tok, "5") + [tok.eos_token_id]
    model = ScriptedLM(len(tok), tok.eos_token_id, script_of(len(full), [(True, turn)]))
    loop = EpisodeGeneration(
        spec, model, tok, end_of_turn_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id
    )
    params, rows = SamplingParams(max_completion_length=50), [{"prompt": PROMPT}]
    with pytest.warns(UserWarning) as caught:
        for _ in range(2):  # two batches of two episodes: every step fails
            batch = loop.generate([full], 2, params, torch.Generator(), rows=rows)
    loop.close()
    said = [str(w.message) for w in caught if "BrokenStep.step" in str(w.message)]
    assert len(said) == 1, said  # once, not once per episode
    assert "KeyError: 'score'" in said[0] and "episodes/stop_env_error" in said[0] and "fix" in said[0]
    assert loop.counts["env_errors"] == 4 and all(r.stop == "env_error" for r in batch.episodes)


class Counter:
    """A TRL-style environment: reset(**row) -> str, a public method as its tool, get_reward."""

    def reset(self, **row):
        self.row, self.total = row, 0
        return None

    def add(self, n: int) -> int:
        """Adds to the counter.

        Args:
            n: How much to add.
        """
        self.total += n
        return self.total

    def get_reward(self):
        return float(self.total)


def test_a_trl_environment_exposes_its_methods_and_owns_its_reward(tok):
    spec = build_episode_spec(EpisodeConfig(), environment_factory=Counter)
    env = spec.environments[None]
    assert list(env.tools) == ["add"] and env.owns_reward
    turn1 = call_turn(tok, "add", '{"n": 5}')
    insert = render_tool_turn(
        tok,
        [*PROMPT, call_message("add", {"n": 5})],
        [{"role": "tool", "name": "add", "content": "5"}],
        tools=spec.schemas(env),
        end_of_turn=[tok.eos_token_id],
    )
    batch, _ = episode(tok, spec, [(True, turn1), (False, insert), (True, [tok.eos_token_id])], env=env)
    first, second = batch.episodes[0].environment, batch.episodes[1].environment
    assert first is not second and first.total == second.total == 5
    assert first.row == {"prompt": PROMPT}  # one factory: the row as it is, prompt included
    (reward,) = spec.reward_functions()
    assert reward.__name__ == "Counter" and reward(environments=[first, object()]) == [5.0, None]


def test_bad_tools_and_factories_are_refused_before_any_model(tok):
    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ConfigError, match="docstring"):
        build_episode_spec(EpisodeConfig(), tools=[undocumented])
    with pytest.raises(ConfigError, match="named 'multiply'"):
        build_episode_spec(EpisodeConfig(tools=["multiply"]), tools=[multiply])

    class NoReset:
        def step(self, action):
            return "", 0.0, True

    with pytest.raises(ConfigError, match="reset"):
        build_episode_spec(EpisodeConfig(), environment_factory=NoReset)

    def raising():
        raise OSError("server down")

    with pytest.raises(ConfigError, match="server down"):
        build_episode_spec(EpisodeConfig(), environment_factory=raising)

    class Clash(Counter):
        def multiply(self, a: int) -> int:
            """Clashes.

            Args:
                a: Anything.
            """
            return a

    with pytest.raises(ConfigError, match="same name"):
        build_episode_spec(EpisodeConfig(), tools=[multiply], environment_factory=Clash)


CALL_TEXT = {
    "hermes": '<tool_call>\n{"name": "add", "arguments": {"n": 2}}\n</tool_call>',
    "llama3": '{"name": "add", "parameters": {"n": 2}}',
    "mistral": '[TOOL_CALLS] [{"name": "add", "arguments": {"n": 2}}]',
}
"""What a model of each family samples to call add(n=2) (its end-of-turn token follows)."""


def add(n: int) -> int:
    """Adds.

    Args:
        n: How much.
    """
    return n


class Numbered(Counter):
    """Counter whose reset gives each instance its own task (the rollouts of one row get different prompts)."""

    made = 0

    def __init__(self):
        Numbered.made += 1
        self.number = Numbered.made % 10

    def reset(self, **row):
        self.total = 0
        return f"Task {self.number}."


class Shouting(Numbered):
    """Another environment class with one more tool (its rollouts render other schemas)."""

    def shout(self, text: str) -> str:
        """Shouts.

        Args:
            text: What to shout.
        """
        return text.upper()


@pytest.mark.parametrize("form", ["tools", "one environment", "routed"])
@pytest.mark.parametrize("family", sorted(CALL_TEXT))
def test_lengths_count_the_sampled_tokens_in_every_form_and_family(family, form):
    """Issue 41 item 4: the loss mask (which completions/mean_length and num_tokens sum) is True on exactly the
    tokens the policy sampled, whether the tools come from tools=, one environment or environments routed by the
    `environment` column, on each family's template. The rollouts of a row whose resets differ share the
    common start of their prompts; the rest of each prompt opens its completion and is not counted either."""
    tok = install_tool_format(build_tiny_tokenizer(), family)
    eos = tok.eos_token_id
    Numbered.made = 0  # each instance its own single-digit task: equal prompt lengths, different prompts
    if form == "tools":
        spec, env = build_episode_spec(EpisodeConfig(), tools=[add]), None
        row = {"prompt": [{"role": "user", "content": "Task 1."}]}
    elif form == "one environment":
        spec = build_episode_spec(EpisodeConfig(), environment_factory=Numbered)
        env, row = spec.environments[None], {"prompt": [{"role": "user", "content": ""}]}
    else:
        spec = build_episode_spec(EpisodeConfig(), environment_factory={"a": Counter, "b": Shouting})
        env, row = spec.environments["b"], {"environment": "b"}
    schemas = spec.schemas(env) or None
    messages = [{"role": "user", "content": "Task 1."}]
    prompt = render_prompt(tok, messages, tools=schemas)
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [call_message("add", {"n": 2})["tool_calls"][0]],
    }
    turn1 = ids(tok, CALL_TEXT[family]) + [eos]
    insert = render_tool_turn(
        tok,
        [*messages, call],
        [{"role": "tool", "name": "add", "content": "2"}],
        tools=schemas,
        end_of_turn=[eos],
    )
    turn2 = ids(tok, "done") + [eos]
    model = ScriptedLM(len(tok), eos, script_of(len(prompt), [(True, turn1), (False, insert), (True, turn2)]))
    loop = EpisodeGeneration(spec, model, tok, end_of_turn_ids=[eos], pad_token_id=tok.pad_token_id)
    if "environment" in row:
        row = {**row, "prompt": EMPTY_PROMPT}  # what the trainer gives a routing-only row
    batch = loop.generate(
        [prompt], 2, SamplingParams(max_completion_length=400), torch.Generator(), rows=[row]
    )
    loop.close()
    sampled = len(turn1) + len(turn2)
    assert batch.loss_lengths.tolist() == [sampled, sampled]
    for completion, mask, logprobs in zip(batch.completion_ids, batch.loss_masks, batch.sampling_logprobs):
        kept = [t for t, m in zip(completion, mask.tolist()) if m]
        assert kept == turn1 + turn2  # the sampled tokens, in order, and nothing else
        assert all(lp == 0.0 for lp, m in zip(logprobs.tolist(), mask.tolist()) if not m)
    assert all(r.stop == "answer" and r.calls == 1 for r in batch.episodes)
    if form != "tools":  # different tasks: the second rollout's prompt ends its own way, and is not counted
        tasks = [r.prompt[-1]["content"] for r in batch.episodes]
        assert tasks[0] != tasks[1] and all(t.startswith("Task ") for t in tasks), tasks
        # each completion opens with its prompt's own end (from the task's digit), masked like the tool turn
        assert all(len(c) > sampled + len(insert) for c in batch.completion_ids)
    else:
        assert all(len(c) == sampled + len(insert) for c in batch.completion_ids)


def test_the_episode_loop_decodes_its_turns_with_the_static_step_where_the_engine_would(
    monkeypatch, tmp_path
):
    """fast.graph_decode reaches the episodes: where the builtin engine would take its captured step (here forced,
    uncaptured, on the CPU), each turn of the batch decodes through it, greedily the same episodes as eagerly;
    `on` on a CPU is refused with the engine's reason."""
    from _tiny import build_tool_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cohort.fastpath import FastConfig, FastPathError
    from cohort.rollout.builtin import BuiltinEngine

    folder = build_tool_model(tmp_path / "model")
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    spec = build_episode_spec(EpisodeConfig(), environment_factory=Higher)  # two turns whatever the guess
    play = [{"role": "user", "content": "Play."}]

    def generate(fast):
        loop = EpisodeGeneration(
            spec, model, tok, end_of_turn_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id, fast=fast
        )
        try:
            return loop.generate(
                [render_prompt(tok, play)] * 2,
                2,
                SamplingParams(max_completion_length=90, greedy=True),
                None,
                rows=[{"prompt": play}] * 2,
            )
        finally:
            loop.close()

    with pytest.raises(FastPathError, match="fast.graph_decode=on.*CUDA"):
        generate(FastConfig(graph_decode="on"))
    eager = generate(FastConfig(graph_decode="off"))
    monkeypatch.setattr(BuiltinEngine, "takes_captured_step", lambda self, *a: True)
    static = generate(FastConfig(graph_decode="on", graph_decode_min_tokens=1))
    assert static.paths["graph_decode"] is True and eager.paths["graph_decode"] is False
    assert static.completion_ids == eager.completion_ids
    assert [r.messages for r in static.episodes] == [r.messages for r in eager.episodes]
    assert min(len(r.messages) for r in eager.episodes) == 4  # guess, "higher", guess, "yes"
    for a, b in zip(static.sampling_logprobs, eager.sampling_logprobs):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-9)
