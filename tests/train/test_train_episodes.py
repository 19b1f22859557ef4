"""Multi-turn runs through the trainer: a text environment, TRL's agent keywords, exact resume, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from _tiny import build_tool_model
from episode_envs import small_game

from cohort import GRPOConfig, GRPOTrainer
from cohort.config import load_config
from cohort.episodes.environments import GuessNumber
from cohort.errors import ConfigError
from cohort.rewards import final_text


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory):
    """A tiny model with the Hermes tool template whose turns end after ~11 tokens (EOS made likely)."""
    return build_tool_model(tmp_path_factory.mktemp("tools") / "model")


def _cfg(model_dir, out, **over):
    base = {
        "model": {"name_or_path": str(model_dir)},
        "rollout": {"group_size": 4, "batch_size": 8, "max_completion_length": 96},
        "optim": {"lr": 5e-3},
        "rewards": [],
        "episodes": {"environment": "episode_envs:small_game"},
        "steps": 4,
        "out_dir": str(out),
        "progress": False,
        "eval_at_ends": False,
        "save_every": 0,
    }
    base.update(over)
    return load_config(None, base)


ROWS = [{"prompt": "Play."}] * 4


def _rows(path):
    keep = lambda row: {k: v for k, v in row.items() if not k.startswith(("time", "step_time", "perf"))}  # noqa: E731
    return [keep(json.loads(line)) for line in path.read_text().splitlines()]


def test_a_text_environment_run_trains_on_several_turns_and_resumes_exactly(tool_model_dir, tmp_path):
    full = GRPOTrainer(_cfg(tool_model_dir, tmp_path / "full"), train_rows=ROWS)
    full.train()
    metrics = _rows(tmp_path / "full" / "metrics.jsonl")
    assert all("rewards/GuessNumber/mean" in m and "episodes/turns_mean" in m for m in metrics)
    assert max(m["episodes/turns_mean"] for m in metrics) > 1.5  # observations were inserted, turns went on
    samples = [json.loads(line) for line in (tmp_path / "full" / "samples.jsonl").read_text().splitlines()]
    assert any(len(s["turns"]) > 2 for s in samples)  # each episode logged turn by turn
    first = GRPOTrainer(_cfg(tool_model_dir, tmp_path / "part", steps=2, save_every=2), train_rows=ROWS)
    first.train()
    resumed = GRPOTrainer(_cfg(tool_model_dir, tmp_path / "part", resume="auto"), train_rows=ROWS)
    assert resumed.step_idx == 2
    resumed.train()
    for k, v in full.model.state_dict().items():
        torch.testing.assert_close(v, resumed.model.state_dict()[k], rtol=0, atol=1e-6, msg=k)
    assert _rows(tmp_path / "part" / "metrics.jsonl") == metrics


def test_trls_environment_factory_trains_without_a_dataset(tool_model_dir, tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=96,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        use_cpu=True,
    )
    trainer = GRPOTrainer(model=str(tool_model_dir), args=args, environment_factory=small_game)
    trainer.train()
    last = trainer.state.log_history[-1]
    logged = [row for row in trainer.state.log_history if "rewards/GuessNumber/mean" in row]
    assert logged and "tools/call_frequency" in logged[0] and last["train_loss"] == last["train_loss"]


def test_several_environments_need_the_routing_column_before_the_model_loads(tmp_path):
    cfg = _cfg(
        "no-model-needed",  # a Hub-like name: never loaded, the refusal comes first
        tmp_path / "route",
        episodes={"environments": {"a": "episode_envs:small_game", "b": "episode_envs:small_game"}},
    )
    with pytest.raises(ConfigError, match="row 0 has no `environment` column"):
        GRPOTrainer(cfg, train_rows=ROWS)
    with pytest.raises(ConfigError, match="names 'c'"):
        GRPOTrainer(cfg, train_rows=[{"prompt": "Play.", "environment": "c"}])


def test_rows_routed_to_several_environments_each_get_their_own(tool_model_dir, tmp_path):
    class Other(GuessNumber):
        pass

    rows = [{"prompt": "Play.", "environment": "a"}, {"prompt": "Play.", "environment": "b"}]
    t = GRPOTrainer(
        _cfg(tool_model_dir, tmp_path / "two", steps=1, episodes={}),
        train_rows=rows,
        environment_factory={"a": small_game, "b": lambda: Other(lo=1, hi=9, max_turns=2)},
    )
    result = t.step()
    assert {"rewards/GuessNumber/mean", "rewards/Other/mean"} <= set(result.metrics)
    kinds = (
        {type(r.environment).__name__ for r in t.drawer.last.rollout.episodes}
        if hasattr(t.drawer, "last")
        else None
    )
    assert kinds in (None, {"GuessNumber", "Other"})


def test_held_out_pass_at_k_and_maj_at_k_are_measured_on_sampled_episodes(tool_model_dir, tmp_path):
    calls: list[tuple[list, list[float]]] = []

    def even_answer(completions, **kw):
        """1.0 when the episode's last assistant message has an even length: a reward that splits episodes."""
        scores = [float(len(final_text(c)) % 2 == 0) for c in completions]
        calls.append((completions, scores))
        return scores

    rows = [{"prompt": f"Play {i}."} for i in range(3)]
    t = GRPOTrainer(
        _cfg(tool_model_dir, tmp_path / "k", steps=1),
        reward_funcs=[even_answer],
        train_rows=ROWS,
        eval_rows=rows,
    )
    calls.clear()
    ev = t.evaluate(k=4, sampled=False)
    assert ev["n"] == 3 and 0 <= ev["accuracy"] <= 1 and "tool_calls" in ev
    greedy, sampled = calls[0][1], [s for _, scores in calls[1:] for s in scores]
    assert len(greedy) == 3 and len(sampled) == 12  # 1 greedy + 4 sampled episodes per held-out row
    assert all(isinstance(c, list) and c and "role" in c[0] for c in calls[1][0])  # episodes as messages
    assert ev["accuracy"] == sum(greedy) / 3
    assert ev["pass@4"] == sum(any(s == 1.0 for s in sampled[4 * i : 4 * i + 4]) for i in range(3)) / 3
    assert 0 <= ev["maj@4"] <= ev["pass@4"]
    assert t.evaluate(k=4, sampled=False) == ev  # seeded by the step: the same episodes again
