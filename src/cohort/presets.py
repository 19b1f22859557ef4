"""Named recipes: DeepSeek R1, DAPO, Dr. GRPO and classic PPO from the seeds, and the later GRPO family (GSPO,
CISPO, SAPO, GMPO, RLOO, REINFORCE++, top-entropy masking, Clip-Cov, KL-Cov) with each value's source.

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
    # GSPO (arXiv 2507.18071): sequence-level importance ratio, clipped at the paper's 3e-4 / 4e-4, sequences
    # averaged; no KL.
    "gspo": {
        "algo": {
            "loss_type": "grpo",
            "importance": "sequence",
            "eps_low": 3e-4,
            "eps_high": 4e-4,
            "beta": 0.0,
        },
    },
    # CISPO with ScaleRL's loss-side choices (arXiv 2510.13786): the clipped, detached ratio weighs every
    # token's gradient (max_ratio 5.0, the value TRL documents as ScaleRL's), batch-level advantage
    # normalisation, zero-variance groups filtered. ScaleRL's prompt-level loss averaging, no-positive
    # resampling and asynchronous off-policy generation are not part of this preset.
    "cispo": {
        "algo": {
            "loss_type": "cispo",
            "loss_kwargs": {"max_ratio": 5.0},
            "eps_high": None,
            "delta": None,
            "scale": "batch",
            "filter_zero_std": True,
            "beta": 0.0,
        },
    },
    # SAPO (arXiv 2511.20347): the soft gate with the paper's temperatures, 1.0 for positive and 1.05 for
    # negative advantages; no KL.
    "sapo": {
        "algo": {
            "loss_type": "sapo",
            "loss_kwargs": {"tau_pos": 1.0, "tau_neg": 1.05},
            "eps_high": None,
            "delta": None,
            "beta": 0.0,
        },
    },
    # GMPO (arXiv 2507.20673): the geometric-mean ratio with token log-ratios clipped to [-0.4, 0.4].
    "gmpo": {
        "algo": {
            "loss_type": "gmpo",
            "loss_kwargs": {"clip": 0.4},
            "importance": "token",
            "eps_high": None,
            "delta": None,
            "beta": 0.0,
        },
    },
    # RLOO (Ahmadian et al. 2024, arXiv 2402.14740): the leave-one-out baseline, no std scaling.
    "rloo": {"algo": {"advantage": "rloo", "scale": "group"}},
    # REINFORCE++-baseline (arXiv 2501.03262): group mean subtracted, then whitened over the batch.
    "reinforce_pp": {"algo": {"advantage": "reinforce_pp_baseline", "scale": "group"}},
    # "Beyond the 80/20 Rule" (arXiv 2506.01939): DAPO's recipe with only the top 20 % highest-entropy
    # tokens in the policy loss.
    "top_entropy": {
        "rollout": {"group_size": 16, "temperature": 1.0},
        "algo": {
            "loss_type": "dapo",
            "eps_low": 0.2,
            "eps_high": 0.28,
            "beta": 0.0,
            "filter_zero_std": True,
            "dynamic_sampling": True,
            "top_entropy_quantile": 0.2,
        },
    },
    # Clip-Cov (Cui et al. 2025, arXiv 2505.22617): detach the gradient of 2e-4 of the tokens, drawn among
    # those with covariance in [1, 5]; no KL.
    "clip_cov": {
        "algo": {"cov_method": "clip_cov", "cov_ratio": 2e-4, "clip_cov_bounds": [1.0, 5.0], "beta": 0.0},
    },
    # KL-Cov (same paper): |log(pi/pi_old)| penalty (coefficient 1) on the top 2e-3 tokens by covariance. The
    # penalty needs the policy to move within a batch, so the batch is split into 4 minibatches (an
    # optimizer step each; the paper's runs update in mini-batches too).
    "kl_cov": {
        "algo": {
            "cov_method": "kl_cov",
            "cov_ratio": 2e-3,
            "kl_cov_coef": 1.0,
            "num_minibatches": 4,
            "beta": 0.0,
        },
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
