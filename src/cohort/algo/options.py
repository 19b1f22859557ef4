"""The algorithm's names, the tables of what each loss type and estimator reads, and the checks of its own
settings, free of torch.

`cohort.config` reads this module, and nothing else of `cohort.algo`, to validate the `algo:` section before
anything heavy loads; the tensor modules beside it take their names and parameter tables from here and
register into the same tables (`LOSS_KINDS`, `ESTIMATOR_FIELDS`, `ADVANTAGE_NAMES`), so each name and each
rule is written once. Importing it loads only `cohort.errors` and `cohort.choices`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, TypeGuard

from cohort.choices import is_function_spec
from cohort.errors import ConfigError, ConfigWarning

SCALES = ("group", "batch", "none")
"""What a group's reward deviations are divided by: its std, the batch's std, nothing (Dr. GRPO)."""
STD_KINDS = ("sample", "population")
COMBINE_MODES = ("sum", "decoupled")
KL_KINDS = ("k1", "k2", "k3")
IMPORTANCE_LEVELS = ("token", "sequence")
AGGREGATIONS = ("grpo", "bnpo", "dapo", "dr_grpo", "luspo")
"""The loss aggregations (cohort.algo.losses registers one function under each name)."""
COV_METHODS = ("none", "clip_cov", "kl_cov")
"""Covariance-based token selections: none, Clip-Cov (detach the chosen tokens), KL-Cov (penalise them)."""
SAMPLER_CORRECTIONS: dict[str, tuple[str, str] | None] = {
    "none": None,
    "token_tis": ("token", "truncate"),
    "token_mis": ("token", "mask"),
    "sequence_tis": ("sequence", "truncate"),
    "sequence_mis": ("sequence", "mask"),
}
"""Sampler importance corrections by name: (level, mode) of :func:`cohort.algo.offpolicy.sampler_correction`."""
IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")
TRUST_REGION_ANCHORS = ("old", "sampler")
"""algo.trust_region_anchor's values: pi_old, or the sampler's log-probs."""


class LossKind(NamedTuple):
    """What a loss type reads and how it is aggregated: the facts the config checks need, without its function."""

    aggregation: str
    """Its default aggregation (algo.aggregation overrides it)."""
    sequence_advantages: bool = False
    """True when it needs one advantage per completion (gmpo)."""
    token_importance: bool = False
    """True when it is built on token-level ratios (algo.importance must be token)."""
    folds_sampler_weights: bool = False
    """True when it folds the sampler correction's weights into its own sequence weight (vespo)."""
    reads_divergence: bool = False
    """True when it reads a per-token divergence from the anchor (dppo_tv, dppo_kl)."""
    clip: bool = False
    """True when it is PPO's clip loss, the one that reads algo.eps_high and algo.delta."""


BUILTIN_LOSSES: dict[str, LossKind] = {
    **{name: LossKind(name, clip=True) for name in ("grpo", "bnpo", "dapo", "dr_grpo", "luspo")},
    # MiniMax-M1 and ScaleRL normalise cispo over all tokens of the batch; SAPO averages per sequence.
    "cispo": LossKind("dapo"),
    "sapo": LossKind("grpo"),
    "gmpo": LossKind("grpo", sequence_advantages=True, token_importance=True),
    "vespo": LossKind("dapo", token_importance=True, folds_sampler_weights=True),
    "dppo_tv": LossKind("dapo", token_importance=True, reads_divergence=True),
    "dppo_kl": LossKind("dapo", token_importance=True, reads_divergence=True),
    "dro": LossKind("dapo", token_importance=True),
}
"""The built-in loss types and what each reads (cohort.algo.losses registers each with these facts)."""

LOSS_TYPES = tuple(BUILTIN_LOSSES)
"""The built-in loss types (user losses registered later are in LOSS_KINDS and POLICY_LOSSES only)."""

LOSS_KINDS: dict[str, LossKind] = dict(BUILTIN_LOSSES)
"""Every loss type the run knows by name, built-in or registered from user code (register_loss adds to it)."""


class LossParameter(NamedTuple):
    """A built-in loss's keyword parameter: the range a value must lie in, and its default."""

    rule: str
    """"> 1", "> 0" or "in [0, 1)"."""
    default: float | None


LOSS_PARAMETERS: dict[str, dict[str, LossParameter]] = {
    "cispo": {"max_ratio": LossParameter("> 1", 5.0), "min_ratio": LossParameter("in [0, 1)", None)},
    "sapo": {"tau_pos": LossParameter("> 0", 1.0), "tau_neg": LossParameter("> 0", 1.05)},
    "gmpo": {"clip": LossParameter("> 0", 0.4)},
    "vespo": {
        "k_pos": LossParameter("> 0", 2.0),
        "lambda_pos": LossParameter("> 0", 3.0),
        "k_neg": LossParameter("> 0", 3.0),
        "lambda_neg": LossParameter("> 0", 2.0),
    },
    "dppo_tv": {
        "mask_low": LossParameter("> 0", 0.15),
        "mask_high": LossParameter("> 0", 0.15),
        "max_ratio": LossParameter("> 1", None),
    },
    "dppo_kl": {
        "mask_low": LossParameter("> 0", 0.05),
        "mask_high": LossParameter("> 0", 0.05),
        "max_ratio": LossParameter("> 1", None),
    },
}
"""Each built-in loss's keyword parameters: (valid range, default), the one place their defaults are written
(the loss functions' signatures read them). Sources: cispo's max_ratio 5.0 is the value TRL's documentation
gives as ScaleRL's recommendation; sapo's temperatures are the SAPO paper's; gmpo's 0.4 (a ratio range of
[e^-0.4, e^0.4]) is the GMPO paper's. vespo's (k, lambda) per advantage sign are TRL 1.16's defaults
(vespo_k_pos ... vespo_lambda_neg); dppo's mask thresholds are the DPPO authors' recipe (0.15 for the TV mask,
0.05 for the KL one), and max_ratio None leaves the detached ratio untruncated (prime-rl; the authors' 1e4 is
nearly the same); dro has no parameter of its own (its penalty is algo.kl_tau)."""

ESTIMATOR_FIELDS: dict[str, dict[str, str]] = {
    "grpo": {"scale": "scale", "std": "std", "eps": "adv_eps"},
    "rloo": {},
    "reinforce_pp": {"std": "std", "eps": "adv_eps"},
    "reinforce_pp_baseline": {"std": "std", "eps": "adv_eps"},
    "max_rl": {},
    "optimal_token_baseline": {},
}
"""The config fields each built-in estimator reads, as {its keyword argument: the algo.* field it comes from}
(advantage_arguments builds its call from them; cohort.algo.estimators checks each built-in's keywords
against them; the inert-option rules are tested against them). A user estimator reads algo.advantage_kwargs
instead, so registering one under a built-in's name removes that name from this table."""

ADVANTAGE_TYPES = tuple(ESTIMATOR_FIELDS)
"""The built-in estimators' names."""

ADVANTAGE_NAMES: set[str] = set(ADVANTAGE_TYPES)
"""Every estimator the run knows by name, built-in or registered from user code (register_advantage adds)."""


def loss_kind(loss_type: str) -> LossKind | None:
    """Returns what loss type `loss_type` reads (None: not a known name, e.g. user code not imported yet)."""
    return LOSS_KINDS.get(loss_type)


def advantage_arguments(name: str, algo: Any) -> dict[str, object]:
    """Returns the keyword arguments estimator `name` is called with, read from `algo` (an AlgoConfig): the
    fields a built-in estimator declares (ESTIMATOR_FIELDS), or algo.advantage_kwargs for a user estimator."""
    if name in ESTIMATOR_FIELDS:
        return {keyword: getattr(algo, field) for keyword, field in ESTIMATOR_FIELDS[name].items()}
    return dict(algo.advantage_kwargs)


def check_loss_parameters(loss_type: str, kwargs: Mapping[str, object]) -> dict[str, object]:
    """Returns `kwargs` after checking each is a parameter of built-in `loss_type` inside its valid range."""
    kwargs = dict(kwargs)
    spec = LOSS_PARAMETERS.get(loss_type)
    if spec is None:
        if kwargs:
            raise ConfigError(f"loss_type={loss_type!r} takes no parameters, got {sorted(kwargs)}")
        return kwargs
    for key, value in kwargs.items():
        if key not in spec:
            raise ConfigError(
                f"loss_type={loss_type!r} has no parameter {key!r}; its parameters are {sorted(spec)}"
            )
        rule = spec[key].rule
        if value is None and spec[key].default is None:
            continue
        if not _is_number(value) or value != value:
            raise ConfigError(f"{loss_type} parameter {key} must be a number {rule}, got {value!r}")
        ok = {"> 1": value > 1, "> 0": value > 0, "in [0, 1)": 0 <= value < 1}[rule]
        if not ok:
            raise ConfigError(
                f"{loss_type} parameter {key} must be {rule} (the paper's range), got {value!r}"
            )
    return kwargs


def _is_number(value: object) -> TypeGuard[int | float]:
    """Returns whether `value` is an int or a float (a bool, though an int to Python, is not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _number(name: str, value: object) -> float:
    """Returns `value` as a float after checking it is a real number (TypeError otherwise)."""
    if not _is_number(value) or value != value:
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    return float(value)


def check_clip(
    eps_low: object, eps_high: object, delta: object, *, prefix: str = ""
) -> tuple[float, float, float | None]:
    """Returns (eps_low, eps_high, delta) of PPO's clip, eps_high defaulting to eps_low, after checking their
    ranges (`prefix` names the keys in messages, e.g. "algo.")."""
    low = _number(f"{prefix}eps_low", eps_low)
    if not 0 <= low < 1:
        raise ConfigError(
            f"{prefix}eps_low={eps_low!r} must be in [0, 1) (the ratio is clipped at 1 - eps_low > 0; 0.2 is usual)"
        )
    high = low if eps_high is None else _number(f"{prefix}eps_high", eps_high)
    if high < 0:
        raise ConfigError(f"{prefix}eps_high={eps_high!r} must be >= 0 (DAPO's clip-higher uses 0.28)")
    if delta is None:
        return low, high, None
    cap = _number(f"{prefix}delta", delta)
    if not cap > 1 + high:
        raise ConfigError(
            f"{prefix}delta={delta!r} must be > 1 + eps_high = {1 + high!r}: it caps the ratio above the clip range "
            "for negative advantages (e.g. 4.0), or null / None for no cap"
        )
    return low, high, cap


def _choice(key: str, value: Any, valid: tuple[str, ...] | Mapping[str, Any]) -> None:
    """Raises ConfigError when `value` is not one of `valid`, listing them."""
    if value not in valid:
        raise ConfigError(f"{key}={value!r} is not valid; choose one of: {', '.join(valid)}")


def _unimported(spec: str, known: Any, label: str) -> bool:
    """Returns whether `spec` names user code not imported yet, after checking its form (and, for a file, that
    it exists) without importing it."""
    if spec in known or not is_function_spec(spec):
        return False
    target, attr = spec.rsplit(":", 1)
    if not attr.strip():
        raise ConfigError(
            f"{label}={spec!r} names no function after the ':'; write e.g. '{target}:my_function'"
        )
    if (target.endswith(".py") or "/" in target) and not Path(target).expanduser().is_file():
        raise ConfigError(f"{label}={spec!r}: file {target!r} not found")
    return True


def check_algo(a: Any) -> None:
    """Raises ConfigError for a value of the `algo:` section (`a`, an AlgoConfig) out of range, or a
    combination that cannot run; imports and registers nothing.

    A loss type or estimator named as user code that is not imported yet is checked for its form only, and so
    are the rules that depend on what it reads: `cohort.runtime.plugins.check_user_objective` imports it and
    runs this check again once it is known."""
    _choice("algo.scale", a.scale, SCALES)
    _choice("algo.std", a.std, STD_KINDS)
    _choice("algo.importance", a.importance, IMPORTANCE_LEVELS)
    _choice("algo.kl_estimator", a.kl_estimator, KL_KINDS)
    _choice("algo.reward_mode", a.reward_mode, COMBINE_MODES)
    for key in ("loss_kwargs", "advantage_kwargs"):
        if not isinstance(getattr(a, key), dict):
            raise ConfigError(f"algo.{key}={getattr(a, key)!r} must be a mapping of keyword arguments")
    try:
        check_clip(a.eps_low, a.eps_high, a.delta, prefix="algo.")
    except TypeError as e:
        raise ConfigError(str(e)) from None
    _check_ranges(a)
    _check_entropy_regularisation(a)
    _check_token_controls(a)
    _check_2026_family(a)
    if _unimported(a.loss_type, LOSS_KINDS, "algo.loss_type") or _unimported(
        a.advantage, ADVANTAGE_NAMES, "algo.advantage"
    ):
        return  # the rest reads what the user's loss and estimator are: check_user_objective, once imported
    _check_objective(a)


def _check_ranges(a: Any) -> None:
    """Raises ConfigError for a number of the algo section outside its range."""
    if not a.adv_eps > 0:
        raise ConfigError(
            f"algo.adv_eps={a.adv_eps} must be > 0 (it keeps the std division finite; 1e-4 is usual)"
        )
    sync = a.ref_sync
    if sync is not None:
        every, kl, alpha = sync.every, sync.kl, sync.alpha
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError(
                f"algo.ref_sync.every (algo.ref_update_every)={every!r} must be an int >= 0 (0: not on a schedule)"
            )
        if kl is not None and (not _is_number(kl) or not kl > 0):
            raise ConfigError(
                f"algo.ref_sync.kl (algo.ref_sync_kl)={kl!r} must be > 0 (the mean per-token KL above which the "
                "reference syncs; seed 002 suggests 0.5), or null"
            )
        if not _is_number(alpha) or not 0 < alpha <= 1:
            raise ConfigError(
                f"algo.ref_sync.alpha (algo.ref_mixup_alpha)={alpha!r} must be in (0, 1] (1 copies the policy; "
                "TRL uses 0.6)"
            )
        if not every and kl is None:
            raise ConfigError(
                "algo.ref_sync is on but never syncs: set algo.ref_sync.every (steps) or algo.ref_sync.kl (a KL "
                "threshold), or algo.ref_sync=none"
            )
    ds = a.dynamic_sampling
    if ds is not None and getattr(ds, "KIND", None) != "dynamic":
        raise ConfigError(f"algo.dynamic_sampling={ds!r} must be true, false or a mapping of its settings")
    if ds is not None and (
        isinstance(ds.max_rounds, bool) or not isinstance(ds.max_rounds, int) or ds.max_rounds < 1
    ):
        raise ConfigError(f"algo.dynamic_sampling.max_rounds={ds.max_rounds!r} must be an integer >= 1")


def _check_objective(a: Any) -> None:
    """Raises ConfigError for a loss or estimator that cannot run with the rest of the section (both known)."""
    kind = LOSS_KINDS.get(a.loss_type)
    if kind is None:
        raise ConfigError(
            f"algo.loss_type={a.loss_type!r} is not a loss type; choose one of {', '.join(LOSS_KINDS)} or name "
            "your own as 'my_pkg.module:function' / 'path/to/file.py:function'"
        )
    if a.advantage not in ADVANTAGE_NAMES:
        raise ConfigError(
            f"algo.advantage={a.advantage!r} is not an advantage estimator; choose one of "
            f"{', '.join(sorted(ADVANTAGE_NAMES))} or name your own as 'my_pkg.module:function' / "
            "'path/to/file.py:function'"
        )
    if a.advantage == "optimal_token_baseline" and kind.sequence_advantages:
        raise ConfigError(
            f"algo.advantage=optimal_token_baseline gives one advantage per token, and loss_type={a.loss_type} "
            "needs one per completion: choose another loss type"
        )
    if a.advantage in ESTIMATOR_FIELDS and a.advantage_kwargs:
        raise ConfigError(
            f"algo.advantage_kwargs={a.advantage_kwargs!r} is for your own estimator; the built-in "
            f"{a.advantage!r} reads algo.std and algo.adv_eps (grpo also algo.scale)"
        )
    if a.loss_type in BUILTIN_LOSSES and LOSS_KINDS[a.loss_type] == BUILTIN_LOSSES[a.loss_type]:
        try:
            check_loss_parameters(a.loss_type, a.loss_kwargs)
        except ConfigError as e:  # the config's key is named: the values may have come from a preset
            raise ConfigError(f"algo.loss_kwargs={dict(a.loss_kwargs)!r}: {e}") from None
    if a.aggregation is not None:
        _choice("algo.aggregation", a.aggregation, AGGREGATIONS)
    if not kind.clip:
        for key, value in (("delta", a.delta), ("eps_high", a.eps_high)):
            if value is not None:
                raise ConfigError(
                    f"algo.{key}={value} belongs to PPO's clip loss, which loss_type={a.loss_type!r} does not use; "
                    f"set algo.{key}=null (its own parameters go in algo.loss_kwargs)"
                )
    if kind.token_importance and a.importance != "token":
        raise ConfigError(
            f"loss_type={a.loss_type!r} is built on token-level ratios; set algo.importance=token"
        )
    if a.advantage != "grpo":
        if a.scale != "group":
            raise ConfigError(
                f"algo.scale={a.scale!r} applies to the grpo estimator; algo.advantage={a.advantage!r} "
                "has its own normalisation: set algo.scale=group"
            )
        if a.reward_mode != "sum":
            raise ConfigError(
                f"algo.reward_mode={a.reward_mode!r} computes GDPO's own advantages; it needs "
                f"algo.advantage=grpo, not {a.advantage!r}"
            )
    correction = _sampler_kind(a)
    if kind.folds_sampler_weights and correction.startswith("sequence_"):
        raise ConfigError(
            f"algo.loss_type={a.loss_type} folds the sampler's per-token ratios into its own sequence weight, so "
            f"algo.sampler_is={correction} would weigh each sequence twice: set "
            "algo.sampler_correction to token_tis, token_mis or none"
        )
    if a.dppo_topk and not kind.reads_divergence:
        raise ConfigError(
            f"algo.dppo_topk={a.dppo_topk} is the top-K divergence of DPPO's mask; loss_type={a.loss_type!r} has "
            "no such mask: set algo.loss_type to dppo_tv or dppo_kl, or algo.dppo_topk=0"
        )
    if a.loss_type == "dro" and a.kl_tau == 0:
        raise ConfigError(
            "algo.loss_type=dro is -A * r plus the squared log-ratio penalty, whose coefficient is algo.kl_tau; "
            "kl_tau=0 leaves a plain policy gradient: set algo.kl_tau > 0 (verl's dro_beta = 2 * kl_tau)"
        )
    if a.loss_type == "luspo" and a.importance != "sequence":
        warnings.warn(
            f"algo.loss_type=luspo is meant with algo.importance=sequence (the LUSPO paper's GSPO ratio); "
            f"algo.importance={a.importance} runs it with token-level ratios",
            ConfigWarning,
            stacklevel=5,
        )


def _check_token_controls(a: Any) -> None:
    """Raises ConfigError for a token control (entropy mask, Clip-Cov / KL-Cov, sampler correction) that cannot
    work."""
    if not 0 < a.top_entropy_quantile <= 1:
        raise ConfigError(
            f"algo.top_entropy_quantile={a.top_entropy_quantile} must be in (0, 1] (the share of highest-"
            "entropy tokens kept; the paper uses 0.2, 1.0 keeps all)"
        )
    cov = a.cov
    if cov is not None and getattr(cov, "KIND", None) not in COV_METHODS[1:]:
        raise ConfigError(f"algo.cov={cov!r} must be none or a kind of {', '.join(COV_METHODS[1:])}")
    if cov is not None:
        ratio = cov.ratio
        if not _is_number(ratio) or not 0 < ratio <= 1:
            raise ConfigError(f"algo.cov.ratio={ratio!r} must be in (0, 1] (clip_cov: 2e-4, kl_cov: 2e-3)")
    if cov is not None and cov.KIND == "clip_cov":
        bounds = cov.bounds
        if (
            not isinstance(bounds, (list, tuple))
            or len(bounds) != 2
            or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds)
            or not bounds[0] < bounds[1]
        ):
            raise ConfigError(
                f"algo.cov.bounds={bounds!r} must be [low, high] with low < high (the paper's [1, 5])"
            )
    if cov is not None and cov.KIND == "kl_cov":
        if not _is_number(cov.coef) or not cov.coef >= 0:
            raise ConfigError(f"algo.cov.coef={cov.coef!r} must be >= 0 (the paper uses 1)")
        if a.num_iterations * a.num_minibatches == 1:
            raise ConfigError(
                "algo.cov kind kl_cov penalises |log(pi/pi_old)|, which is 0 (with no gradient) when each batch "
                "makes one optimizer step; set algo.num_minibatches or algo.num_iterations above 1"
            )
    _choice("algo.sampler_is", _sampler_kind(a), (*SAMPLER_CORRECTIONS, "auto"))
    high = getattr(a.sampler_is, "max_ratio", None)
    if high is not None and (not _is_number(high) or not high > 1):
        raise ConfigError(
            f"algo.sampler_is.max_ratio (algo.sampler_is_max)={high!r} must be a number > 1 (TIS uses 2)"
        )
    low = getattr(a.sampler_is, "min_ratio", None)
    if low is not None and (not _is_number(low) or not 0 <= low < 1):
        raise ConfigError(
            f"algo.sampler_is.min_ratio (algo.sampler_is_min)={low!r} must be a number in [0, 1), or null"
        )


def _sampler_kind(a: Any) -> str:
    """Returns the name of the sampler correction `a` (an AlgoConfig) holds: its algo.sampler_is kind's, or none."""
    return "none" if a.sampler_is is None else str(a.sampler_is.KIND)


def _check_2026_family(a: Any) -> None:
    """Raises ConfigError for a value of the 2026 family's options out of range, or a combination that cannot
    run whatever the loss: the sampler anchor with a sampler correction. (Where DPPO's top-K log-probs can come
    from is the config's check: it reads the rollout section.)"""
    _choice("algo.trust_region_anchor", a.trust_region_anchor, TRUST_REGION_ANCHORS)
    if not _is_number(a.kl_tau) or not a.kl_tau >= 0:
        raise ConfigError(
            f"algo.kl_tau={a.kl_tau!r} must be a number >= 0 (the squared log-ratio penalty's coefficient; "
            "prime-rl uses 1e-3, 0 turns it off)"
        )
    if not isinstance(a.use_bias_correction_kl, bool):
        raise ConfigError(f"algo.use_bias_correction_kl={a.use_bias_correction_kl!r} must be true or false")
    t = a.off_policy_mask_threshold
    if t is not None and (not _is_number(t) or not t >= 0):
        raise ConfigError(
            f"algo.off_policy_mask_threshold={t!r} must be a number >= 0 (the mean per-token KL from the sampler "
            "above which a negative sample is dropped; TRL's example is 0.5), or null to turn the mask off"
        )
    if a.trust_region_anchor == "sampler" and _sampler_kind(a) not in ("none", "auto"):
        raise ConfigError(
            f"algo.trust_region_anchor=sampler takes the importance ratio against the sampler's log-probs, which "
            f"already corrects for the sampler: algo.sampler_is={_sampler_kind(a)} would correct "
            "twice; set algo.sampler_correction=none (or trust_region_anchor=old)"
        )
    k = a.dppo_topk
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(f"algo.dppo_topk={k!r} must be an int >= 0 (0: DPPO's binary mask)")


def _check_entropy_regularisation(a: Any) -> None:
    """Raises ConfigError for entropy-regularisation settings that cannot work."""
    ae = a.adaptive_entropy
    values = {"algo.entropy_coef": a.entropy_coef}
    if ae is not None:
        if getattr(ae, "KIND", None) != "adaptive":
            raise ConfigError(
                f"algo.adaptive_entropy={ae!r} must be true, false or a mapping of its settings"
            )
        settings = ("target", "coef_min", "coef_max", "delta")
        values.update({f"algo.adaptive_entropy.{k}": getattr(ae, k) for k in settings})
    for key, value in values.items():
        if not _is_number(value) or not math.isfinite(value):
            raise ConfigError(f"{key}={value!r} must be a finite number")
    if ae is None:
        return
    if ae.delta <= 0:
        raise ConfigError(
            f"algo.adaptive_entropy.delta={ae.delta} must be > 0 (the adaptive coefficient's step; TRL's "
            "entropy_coef_delta default is 0.005)"
        )
    if ae.coef_min > ae.coef_max:
        raise ConfigError(
            f"algo.adaptive_entropy.coef_min={ae.coef_min} is above algo.adaptive_entropy.coef_max="
            f"{ae.coef_max}; the adaptive coefficient stays within [min, max]"
        )
    if ae.target < 0:
        raise ConfigError(
            f"algo.adaptive_entropy.target={ae.target} must be >= 0 (a mean per-token entropy in nats)"
        )
