"""Options that a config accepts yet that change nothing in it: each with why, and whether that is an error.

`INERT_OPTIONS` is the one table of such rules; :func:`inert_options` lists the ones a config sets away
from their defaults to no effect. ``TrainConfig.validate`` (:mod:`cohort.config.validation`) turns each
into a ConfigWarning, or a ConfigError when the setting contradicts another. A rule reads the config and
the number of processes the run is launched on, both passed in (nothing here reads the environment). The
schema is read only as a type here (a config's defaults are those of its own class).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cohort.algo.options import advantage_arguments

if TYPE_CHECKING:
    from cohort.config.schema import TrainFields

__all__ = ["INERT_OPTIONS", "Inert", "inert_options"]


@dataclass(frozen=True)
class Inert:
    """An option that changes nothing in some configurations: `why(cfg, world_size)` says why (None: it has an
    effect here)."""

    key: str
    """Dotted config key."""
    why: Callable[[TrainFields, int], str | None]
    """Returns the reason and the fix when the option is inert in `cfg` run on `world_size` processes, else None."""
    error: bool = False
    """True: refusing is right (the setting contradicts another); False: a ConfigWarning."""


def _no_reference(cfg: TrainFields, world_size: int) -> str | None:
    """Returns why a reference-model option changes nothing at beta = 0 (None when beta > 0)."""
    return (
        "algo.beta=0 runs no reference model (no KL penalty); set algo.beta > 0 or drop this key"
        if (cfg.algo.beta == 0)
        else None
    )


def _estimator_ignores(name: str) -> Callable[[TrainFields, int], str | None]:
    """Returns the rule saying why algo.`name` changes nothing when the advantage estimator does not read it."""

    def why(cfg: TrainFields, world_size: int) -> str | None:
        a = cfg.algo
        reads = advantage_arguments(
            a.advantage, a
        )  # the fields the estimator declares (cohort.algo.estimators)
        if name in reads or (name == "adv_eps" and "eps" in reads):
            return None
        return (
            f"algo.advantage={a.advantage!r} does not read algo.{name} (drop it, or pick grpo / reinforce_pp)"
        )

    return why


INERT_OPTIONS: tuple[Inert, ...] = (
    Inert("algo.kl_estimator", _no_reference),
    Inert("algo.ref_sync", _no_reference, error=True),
    Inert(
        "algo.scale",
        lambda c, _: (
            "algo.reward_mode=decoupled (GDPO) normalises each reward in its group and the sum over the "
            "batch itself; drop this key"
            if c.algo.reward_mode == "decoupled"
            else None
        ),
    ),
    Inert("algo.std", _estimator_ignores("std")),
    Inert("algo.adv_eps", _estimator_ignores("adv_eps")),
    Inert(
        "algo.sampler_correction",
        lambda c, _: (
            None
            if c.algo.sampler_is is None  # none, or what auto gave here (derive resolves it)
            or c.rollout.sampler_dtype not in (None, "none", str(c.model.dtype))
            or c.rollout.engine == "vllm"
            or c.rollout.max_staleness != 0
            else "the completions are sampled by the weights being trained, in their precision, so the sampler and "
            "the trainer differ only by rounding; set rollout.sampler_dtype (a low-precision sampling copy), "
            "rollout.engine=vllm or rollout.max_staleness, or drop this key"
        ),
    ),
    Inert(
        "algo.kl_tau",
        lambda c, _: (
            "its penalty (log pi/pi_old)^2 is 0, with no gradient, when each batch makes one optimizer step against "
            "pi_old; set algo.num_iterations or algo.num_minibatches above 1, or algo.trust_region_anchor=sampler"
            if c.algo.trust_region_anchor == "old" and c.algo.num_iterations * c.algo.num_minibatches == 1
            else None
        ),
    ),
    Inert(
        "algo.dppo_topk",
        lambda c, _: (
            "the policy equals pi_old at the one optimizer step each batch makes, so the top-K divergence is 0 and "
            "masks nothing; set algo.num_iterations or algo.num_minibatches above 1, or "
            "algo.trust_region_anchor=sampler"
            if c.algo.dppo_topk
            and c.algo.trust_region_anchor == "old"
            and c.algo.num_iterations * c.algo.num_minibatches == 1
            else None
        ),
    ),
    Inert(
        "algo.use_bias_correction_kl",
        lambda c, _: (
            "algo.beta=0 has no KL term to correct; set algo.beta > 0 or drop this key"
            if c.algo.beta == 0
            else None
        ),
    ),
    *(
        Inert(
            f"iterative.optim.{key}",
            lambda c, _: (
                "iterative GRPO retrains its reward model at a constant learning rate (iterative.optim.lr); "
                "drop this key"
            ),
            error=True,
        )
        for key in ("warmup_steps", "schedule")
    ),
    *(
        Inert(
            f"iterative.{key}",
            lambda c, _: (
                "iterative GRPO is off (iterative.every=0); set iterative.every to retrain the reward model, or drop "
                "this key"
                if c.iterative.every == 0
                else None
            ),
        )
        for key in (
            "reward",
            "labeler",
            "label_threshold",
            "prompts",
            "max_pairs_per_prompt",
            "replay",
            "initial_data",
            "rm_steps",
            "rm_batch_size",
            "optim.lr",
            "optim.weight_decay",
        )
    ),
    Inert(
        "distributed.backend",
        lambda c, world_size: (
            "a one-process run opens no process group (launch with torchrun to use it)"
            if world_size == 1
            else None
        ),
    ),
    Inert(
        "rollout.push_bucket_mib",
        lambda c, world_size: (
            "no rollout workers to push to; set rollout.workers"
            if c.rollout.workers is None
            else "only several training processes, or an NCCL push, push in buckets (one process pushing over "
            "gloo sends its weights at once)"
            if world_size == 1 and (c.rollout.weight_transport == "gloo" or c.model.device == "cpu")
            else None
        ),
    ),
    Inert(
        "rollout.weight_transport",
        lambda c, _: (
            "no rollout workers to push to; set rollout.workers" if c.rollout.workers is None else None
        ),
    ),
    Inert(
        "data.task",
        lambda c, _: (
            "data.path is set, and the prompts are read from it (a built-in task makes its problems only without "
            "data.path); drop one of the two"
            if c.data.path
            else None
        ),
        error=True,
    ),
    *(
        Inert(
            f"data.{key}",
            lambda c, _: (
                "it shapes a built-in task's problems, and data.task is unset; drop this key or set data.task"
                if not c.data.task
                else None
            ),
        )
        for key in ("n_train", "n_eval", "task_seed", "task_options")
    ),
    Inert(
        "distributed.load",
        lambda c, world_size: (
            "a one-process run reads its checkpoint itself (launch with torchrun to use it)"
            if world_size == 1
            else None
        ),
    ),
)
"""Every option that can be accepted yet change nothing, with why: the one place such checks live."""


def inert_options(cfg: TrainFields, *, world_size: int) -> list[tuple[str, Any, str, bool]]:
    """Returns (key, value, why, is_error) for each option set away from its default that changes nothing in `cfg`
    run on `world_size` processes."""
    default = type(cfg)()  # the field defaults
    out = []
    for rule in INERT_OPTIONS:
        value, base = _dotted(cfg, rule.key), _dotted(default, rule.key)
        if value == base:
            continue
        why = rule.why(cfg, world_size)
        if why is not None:
            section = dataclasses.is_dataclass(value) and not isinstance(value, type)
            shown = _settings(value) if section else value  # a section by the settings set in it
            out.append((rule.key, shown, why, rule.error))
    return out


def _settings(section: Any) -> dict[str, Any]:
    """Returns a config section's settings that differ from its class's defaults (all of them when it has none)."""
    values = dataclasses.asdict(section)
    try:
        blank = dataclasses.asdict(type(section)())
    except TypeError:  # a section without defaults for every field
        return values
    return {k: v for k, v in values.items() if v != blank.get(k)}


def _dotted(obj: Any, key: str) -> Any:
    """Returns the value at a dotted key of a config tree."""
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj
