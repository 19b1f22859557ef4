"""Reward functions that start early: the trainer hands them each completion that ends during generation."""

from __future__ import annotations

from cohort import GRPOTrainer
from cohort.config import load_config


def test_a_reward_with_prefetch_hears_each_finished_completion_before_its_call(tiny_model_dir, tmp_path):
    events: list[tuple[str, object, object]] = []

    def length_reward(completions, answer, **kwargs):
        """Returns len(completion) / 10, recording the call."""
        events.append(("call", list(completions), list(answer)))
        return [len(c) / 10 for c in completions]

    length_reward.prefetch = lambda completion, row: events.append(("early", completion, row["answer"]))
    cfg = load_config(
        None,
        {
            "model": {"name_or_path": str(tiny_model_dir)},
            "data": {"task": "addition", "n_train": 64, "n_eval": 4},
            "rollout": {"group_size": 4, "batch_size": 16, "max_completion_length": 48},
            "steps": 2,
            "out_dir": str(tmp_path / "run"),
            "progress": False,
            "save_every": 0,
            "eval_at_ends": False,
        },
    )
    trainer = GRPOTrainer(cfg, reward_funcs=[length_reward])
    heard = 0
    for _ in range(2):
        events.clear()
        trainer.step()
        (call,) = [e for e in events if e[0] == "call"]
        assert events[-1] is call  # every early notice came before the reward's call
        # each early notice is one of the call's (completion, row) pairs, exactly as the call gets it
        pairs = list(zip(call[1], call[2]))
        assert all((completion, answer) in pairs for _, completion, answer in events[:-1])
        heard += len(events) - 1
    assert heard > 0  # some completions ended with EOS during the two steps
