"""Train with a custom reward function written in TRL's calling convention.

Run: python examples/custom_reward.py   (builds a tiny local model; takes about a minute on a CPU)
"""

import time

from cohort import GRPOTrainer, build_tiny_model, load_config


def short_and_right(completions, answer, **kwargs):
    """Return 1.0 for a correct answer, minus a small penalty per extra character; None if no answer."""
    out = []
    for text, gold in zip(completions, answer):
        text = text.strip()
        if not text:
            out.append(None)  # not applicable: this reward has nothing to say
            continue
        out.append(float(text == gold) - 0.01 * max(0, len(text) - len(gold)))
    return out


if __name__ == "__main__":
    model_dir = build_tiny_model("runs/example-tiny")
    cfg = load_config(
        None,
        {
            "model": {"name_or_path": str(model_dir)},
            "data": {"task": "addition", "n_train": 500, "n_eval": 50},
            "rollout": {"group_size": 4, "batch_size": 32, "max_completion_length": 6},
            "optim": {"lr": 1e-3},
            "steps": 10,
            "out_dir": f"runs/example-custom-reward-{time.strftime('%Y%m%d-%H%M%S')}",  # a new run each time
        },
    )
    trainer = GRPOTrainer(cfg, reward_funcs=[short_and_right, "accuracy"])
    print(trainer.train())
