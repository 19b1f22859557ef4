"""Named recipes: DeepSeek R1, DAPO, Dr. GRPO and classic PPO from the seeds, and the later GRPO family (GSPO,
CISPO, SAPO, GMPO, RLOO, REINFORCE++, top-entropy masking, Clip-Cov, KL-Cov) and the 2026 family (DPPO, prime-rl's
default loss, VESPO, LUSPO, MaxRL), with each value's source (`PRESET_SOURCES`; `cohort config --presets`).

A preset only sets values; the YAML file and command-line overrides applied after it still win, so
``preset=dapo rollout.group_size=8`` is DAPO with smaller groups. Each value's source is in the comment.
"""

from __future__ import annotations

import copy
import typing
from typing import Any

from cohort.config.kinds import kind_value, kinds_of
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
        "algo": {"cov": {"kind": "clip_cov", "ratio": 2e-4, "bounds": [1.0, 5.0]}, "beta": 0.0},
    },
    # KL-Cov (same paper): |log(pi/pi_old)| penalty (coefficient 1) on the top 2e-3 tokens by covariance. The
    # penalty needs the policy to move within a batch, so the batch is split into 4 minibatches (an
    # optimizer step each; the paper's runs update in mini-batches too).
    "kl_cov": {
        "algo": {
            "cov": {"kind": "kl_cov", "ratio": 2e-3, "coef": 1.0},
            "num_minibatches": 4,
            "beta": 0.0,
        },
    },
    # DPPO (arXiv 2602.04879), the authors' recipe (verl examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh):
    # the binary-TV mask at 0.15 on both sides, the ratio truncated at 1e4 (effectively none), each sequence's
    # token sum over a constant length (seq-mean-token-sum-norm = cohort's dr_grpo aggregation); no KL.
    "dppo": {
        "algo": {
            "loss_type": "dppo_tv",
            "loss_kwargs": {"mask_low": 0.15, "mask_high": 0.15, "max_ratio": 1e4},
            "aggregation": "dr_grpo",
            "eps_high": None,
            "delta": None,
            "beta": 0.0,
        },
    },
    # prime-rl's default loss (src/prime_rl/trainer/rl/loss.py, configs/trainer.py defaults): DPPO's binary-TV
    # mask at 0.2 / 0.2 measured against the sampler, the untruncated ratio pi / pi_sampler, the squared
    # log-ratio penalty kl_tau = 1e-3, normalised over the batch's tokens (dapo); no KL to a reference.
    "prime_rl": {
        "algo": {
            "loss_type": "dppo_tv",
            "loss_kwargs": {"mask_low": 0.2, "mask_high": 0.2, "max_ratio": None},
            "aggregation": "dapo",
            "trust_region_anchor": "sampler",
            "sampler_correction": "none",
            "kl_tau": 1e-3,
            "eps_high": None,
            "delta": None,
            "beta": 0.0,
        },
    },
    # VESPO (arXiv 2602.10693) with TRL 1.16's defaults: gamma weights (k, lambda) = (2, 3) for A >= 0 and
    # (3, 2) for A < 0, token-level ratios, normalised over the batch's tokens; no KL.
    "vespo": {
        "algo": {
            "loss_type": "vespo",
            "loss_kwargs": {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0},
            "importance": "token",
            "eps_high": None,
            "delta": None,
            "beta": 0.0,
        },
    },
    # LUSPO (arXiv 2602.05261), as TRL 1.16 runs it: GSPO's sequence ratio with each sequence's token sum
    # averaged over sequences (TRL's documentation says luspo requires importance_sampling_level="sequence").
    "luspo": {
        "algo": {"loss_type": "luspo", "importance": "sequence", "beta": 0.0},
    },
    # MaxRL (arXiv 2602.02710; prime-rl's max_rl advantage): (r - mean) / mean per group, about 1 / pass rate.
    "max_rl": {"algo": {"advantage": "max_rl", "scale": "group"}},
    # Classic PPO defaults as the seeds list them: small groups, a strong KL leash, several epochs.
    "ppo_classic": {
        "rollout": {"group_size": 4},
        "algo": {"loss_type": "grpo", "eps_low": 0.2, "eps_high": 0.2, "beta": 0.04, "num_iterations": 4},
    },
}


PRESET_SOURCES: dict[str, str] = {
    "r1": "DeepSeekMath / DeepSeek-R1 GRPO (arXiv 2402.03300, 2501.12948)",
    "dapo": "DAPO (arXiv 2503.14476)",
    "dr_grpo": "Dr. GRPO (arXiv 2503.20783)",
    "gspo": "GSPO (arXiv 2507.18071)",
    "cispo": "CISPO (MiniMax-M1, arXiv 2506.13585) with ScaleRL's loss-side choices (arXiv 2510.13786)",
    "sapo": "SAPO (arXiv 2511.20347)",
    "gmpo": "GMPO (arXiv 2507.20673)",
    "rloo": "RLOO (arXiv 2402.14740)",
    "reinforce_pp": "REINFORCE++-baseline (arXiv 2501.03262)",
    "top_entropy": "Beyond the 80/20 Rule (arXiv 2506.01939) on DAPO",
    "clip_cov": "Clip-Cov (arXiv 2505.22617)",
    "kl_cov": "KL-Cov (arXiv 2505.22617)",
    "dppo": "DPPO (arXiv 2602.04879), the authors' verl recipe (examples/dppo_trainer)",
    "prime_rl": "prime-rl's default loss (src/prime_rl/trainer/rl/loss.py, default since 2026-04)",
    "vespo": "VESPO (arXiv 2602.10693) with TRL 1.16's defaults",
    "luspo": "LUSPO (arXiv 2602.05261) as TRL 1.16 runs it",
    "max_rl": "MaxRL (arXiv 2602.02710), prime-rl's max_rl advantage",
    "ppo_classic": "classic PPO defaults as the seeds list them",
}
"""Each preset's source, which `cohort config --presets` prints beside its values."""


def describe_presets() -> list[str]:
    """Returns one line per preset: its name, its source and the values it sets."""
    lines = []
    for name, sections in PRESETS.items():
        values = ", ".join(f"{sec}.{k}={v!r}" for sec, items in sections.items() for k, v in items.items())
        lines.append(f"{name}: {PRESET_SOURCES[name]}\n    {values}")
    return lines


def apply_preset(cfg: Any, name: str) -> Any:
    """Return `cfg` with the named preset's values written into it (raises ConfigError if unknown)."""
    if not isinstance(name, str) or name not in PRESETS:  # a list or mapping from YAML is not a name either
        raise ConfigError(f"preset={name!r} is not known; choose one of: {', '.join(PRESETS)}")
    for section, values in PRESETS[name].items():
        target = getattr(cfg, section)
        hints = typing.get_type_hints(type(target))
        for key, value in values.items():
            kinds = kinds_of(hints[key]) if key in hints else None
            if kinds is not None:  # a kind (cohort.config.kinds): the kind's instance with its settings
                value, settings = kind_value(getattr(target, key), value, kinds, f"{section}.{key}")
                for setting, v in settings.items():
                    setattr(value, setting, copy.deepcopy(v))
            setattr(target, key, value)
    cfg.preset = name
    return cfg
