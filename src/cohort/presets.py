"""Named recipes from the seeds: DeepSeek R1, DAPO, Dr. GRPO and classic PPO defaults.

A preset only sets values; the YAML file and command-line overrides applied after it still win, so
``preset=dapo rollout.group_size=8`` is DAPO with smaller groups. Each value's source is in the comment.
"""

from __future__ import annotations

from typing import Any

from cohort.errors import ConfigError

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # DeepSeek R1 / DeepSeekMath GRPO: G=16, eps=0.2, beta=1e-3, lr=1e-6 constant, one epoch per rollout,
    # per-sequence length normalisation, group z-score.
    "r1": {
        "rollout": {"group_size": 16, "temperature": 1.0},
        "algo": {
            "loss_type": "grpo",
            "scale": "group",
            "eps_low": 0.2,
            "eps_high": 0.2,
            "beta": 1e-3,
            "num_iterations": 1,
        },
        "optim": {"lr": 1e-6, "schedule": "constant", "warmup_steps": 0},
    },
    # DAPO: clip-higher (0.2 / 0.28), token-level loss over the whole batch, no KL, dynamic sampling
    # (zero-variance groups dropped), overlong filtering.
    "dapo": {
        "rollout": {"group_size": 16, "temperature": 1.0},
        "algo": {
            "loss_type": "dapo",
            "scale": "group",
            "eps_low": 0.2,
            "eps_high": 0.28,
            "beta": 0.0,
            "filter_zero_std": True,
            "dynamic_sampling": True,  # DAPO section 3.2: refill the batch with groups of unequal rewards
            "mask_truncated": True,
        },
        "optim": {"lr": 1e-6, "schedule": "constant", "warmup_steps": 0},
    },
    # Dr. GRPO: no std scaling (question-difficulty bias) and a constant length normaliser
    # (response-length bias); no KL.
    "dr_grpo": {
        "rollout": {"group_size": 16, "temperature": 1.0},
        "algo": {"loss_type": "dr_grpo", "scale": "none", "eps_low": 0.2, "eps_high": 0.2, "beta": 0.0},
        "optim": {"lr": 1e-6, "schedule": "constant", "warmup_steps": 0},
    },
    # Classic PPO defaults as the seeds list them: small groups, a strong KL leash, several epochs.
    "ppo_classic": {
        "rollout": {"group_size": 4},
        "algo": {"loss_type": "grpo", "eps_low": 0.2, "eps_high": 0.2, "beta": 0.04, "num_iterations": 4},
    },
}


def apply_preset(cfg: Any, name: str) -> Any:
    """Return `cfg` with the named preset's values written into it (raises ConfigError if unknown)."""
    if not isinstance(name, str) or name not in PRESETS:  # a list or mapping from YAML is not a name either
        raise ConfigError(f"preset={name!r} is not known; choose one of: {', '.join(PRESETS)}")
    for section, values in PRESETS[name].items():
        target = getattr(cfg, section)
        for key, value in values.items():
            setattr(target, key, value)
    cfg.preset = name
    return cfg
