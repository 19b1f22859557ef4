"""Live health checks: seed 002's failure modes, each a named check with a threshold, evaluated every step.

Every check reads numbers the step has already computed (its metrics, the completion ids it sampled);
none runs a forward pass or waits on the device. A check that fires prints one warning with the value,
the threshold and what usually fixes it (once per check until it recovers), sets ``health/<name>`` to 1
in that step's metrics, and is written to ``health.jsonl`` for the report's Health section. With
``health.abort=true`` the first firing check stops the run after the step is committed and saved
(:class:`HealthAbort`, exit code 1 from the CLI). A non-finite loss, gradient or logit is not a warning
but an error that stops the step before the weights change (``cohort.train.update``); it is listed here as the
``non_finite`` check so the whole table lives in one place.

| check | fires when | usual fix |
|---|---|---|
| ``no_reward`` | every reward is None | rewards that apply to the data |
| ``rows_dropped`` | every completion left out of the loss (the loss is exactly 0) | relax filters, longer completions |
| ``no_advantage`` | every group's rewards equal (β = 0: the step changes nothing) | harder/easier prompts, dynamic sampling |
| ``zero_gradient`` | gradient exactly 0 with non-zero advantages | lower the learning rate |
| ``zero_variance`` | mean share of all-equal groups over the window > ``zero_variance_max`` | dynamic sampling, curriculum |
| ``truncation`` | mean truncated share over the window > ``truncation_max`` | raise max_completion_length |
| ``clipping`` | clipped token share > ``clip_max`` (seed 002 pilot: 30 %) | lower lr or μ |
| ``kl_early`` | mean KL > ``kl_early_max`` before step ``kl_early_steps`` (pilot: 1 before 1000) | lower lr, raise β |
| ``kl_drift`` | the KL term's pull on a token, β·√(2·KL) (its gradient coefficient β·(1 − π_ref/π) at the typical log-ratio), larger than ``kl_drift_ratio`` × the mean absolute advantage of the completions in the loss (the policy term's) | lower β, sync the reference |
| ``grad_spike`` | grad norm > ``grad_spike`` × the median of the window | lower lr, clip gradients |
| ``length_drift`` | mean length over the window left [1/r, r] × the first window's | check rewards for length hacking |
| ``collapse`` | share of groups whose G completions are identical and below the step's best reward > ``collapse_max`` | higher temperature, check the rewards for a degenerate answer |
| ``surrogate_zero`` | the loss is exactly 0 for a whole window | see rows_dropped / no_advantage |
| ``logprob_gap`` | sampler and trainer log-probs of the sampled tokens differ by > ``logprob_gap_max`` at μ = 1 (on batches sampled by the current weights); by default a threshold for the least precise dtype either computes in (``LOGPROB_GAP_MAX``), so rounding alone does not fire it | same weights, temperature and engine settings for both; ``algo.sampler_correction`` |
| ``non_finite`` | a non-finite loss, gradient or logit | lower lr, float32, clip gradients |
"""

from __future__ import annotations

import math
import statistics
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cohort.choices import HEALTH_CHECKS
from cohort.errors import TrainingError

LOGPROB_GAP_MAX: dict[torch.dtype, float] = {
    torch.float64: 1e-3,
    torch.float32: 1e-3,
    torch.bfloat16: 0.5,
    torch.float16: 0.1,
}
"""logprob_gap's default threshold by the least precise dtype the sampler or the trainer computes in: rounding
alone keeps the gap near 3e-4 in float32 (the demo's 3000 CPU steps), 0.002-0.004 on the tiny test model in
bfloat16 weights and 0.008-0.06 on a 0.5B model under CUDA bf16 autocast; float16 has 8x bfloat16's
mantissa. A mismatch of weights or temperature moves log-probs by tenths to whole nats."""


def compute_precision(*dtypes: torch.dtype | None) -> torch.dtype:
    """Returns the least precise floating dtype among `dtypes` (None entries skipped; float32 when none)."""
    floats = [d for d in dtypes if d is not None and d.is_floating_point]
    return max(floats, key=lambda d: torch.finfo(d).eps, default=torch.float32)


CHECKS = HEALTH_CHECKS
"""Every health check by name (``health.off`` lists the ones to skip); defined in cohort.choices, where the
config reads them without importing the checks."""


class HealthAbort(TrainingError):
    """A health check fired with health.abort=true: the run stopped after saving a checkpoint."""


@dataclass
class Finding:
    """One check that fired at one step."""

    check: str
    step: int
    value: float
    threshold: float
    message: str

    def row(self) -> dict[str, Any]:
        """Returns the finding as a health.jsonl row."""
        return {
            "step": self.step,
            "check": self.check,
            "value": self.value,
            "threshold": self.threshold,
            "message": self.message,
        }


def collapsed_share(
    completion_ids: Sequence[Sequence[int]], rewards: Sequence[float], group_size: int
) -> float:
    """Returns the share of groups whose G completions are all identical while scoring below the step's best
    reward: a policy that settled on one wrong or degenerate answer per prompt. (Identical completions at the
    best reward are convergence, not collapse.)"""
    n = len(completion_ids)
    if n == 0 or group_size < 2:
        return 0.0
    finite = [r for r in rewards if math.isfinite(r)]
    best = max(finite) if finite else 0.0
    collapsed = 0
    for g in range(0, n, group_size):
        same = len({tuple(c) for c in completion_ids[g : g + group_size]}) == 1
        score = rewards[g]
        collapsed += same and (not math.isfinite(score) or score < best)
    return collapsed / (n // group_size)


class HealthMonitor:
    """Evaluates the checks on each step's metrics and keeps the window they average over."""

    def __init__(
        self,
        cfg: Any,
        *,
        beta: float,
        num_iterations: int,
        log: Any = None,
        precision: torch.dtype = torch.float32,
        sampler_corrected: bool = False,
    ):
        self.cfg, self.beta, self.num_iterations = cfg, beta, num_iterations
        self.advantage_scale: float | None = None
        """The mean |advantage| of this step's completions in the loss (check_batch records it; kl_drift reads it)."""
        self.precision = precision  # the least precise dtype the sampler's or the trainer's passes compute in
        # algo.sampler_correction weighs each token by its sampler ratio: the gap is known and corrected
        self.sampler_corrected = sampler_corrected
        self.logprob_gap_max = (
            cfg.logprob_gap_max if cfg.logprob_gap_max is not None else LOGPROB_GAP_MAX.get(precision, 1e-3)
        )
        self.window: deque[dict[str, Any]] = deque(maxlen=max(1, cfg.window))
        self.first_length: float | None = None  # the first full window's mean completion length
        self.firing: set[str] = set()
        self.findings: list[Finding] = []
        self.pending: list[Finding] = []  # fired since the trainer last looked (health.abort acts on them)
        self.log = log  # called with each Finding (the trainer writes health.jsonl)

    def warn(self, check: str, step: int, value: float, threshold: float, message: str) -> Finding | None:
        """Returns the Finding of check `check` at `step` (None when switched off); warns when it starts firing."""
        if not self.cfg.enabled or check in self.cfg.off:
            return None
        finding = Finding(check, step, float(value), float(threshold), message)
        if check not in self.firing:
            self.firing.add(check)
            warnings.warn(f"step {step}: health check {check!r}: {message}", stacklevel=3)
            self.findings.append(finding)
            self.pending.append(finding)
            if self.log is not None:
                self.log(finding)
        return finding

    def active(self, check: str) -> bool:
        """Returns True when check `check` is evaluated (health on and the check not switched off)."""
        return self.cfg.enabled and check not in self.cfg.off

    def take_pending(self) -> list[Finding]:
        """Returns the findings fired since the last call, and forgets them."""
        out, self.pending = self.pending, []
        return out

    def check_batch(
        self, step: int, per_func: torch.Tensor, adv: torch.Tensor, in_loss: torch.Tensor
    ) -> None:
        """Returns None; records (warning once per kind) a batch that cannot move the policy: no reward at all,
        every completion filtered out, or every advantage 0 with no KL term to learn from."""
        kept = adv[in_loss]
        self.advantage_scale = float(kept.abs().mean()) if kept.numel() else None
        if bool(torch.isnan(per_func).all()):
            self.warn(
                "no_reward",
                step,
                1.0,
                1.0,
                "every reward function returned None for every completion: nothing to learn from; "
                "check that the reward functions apply to this dataset",
            )
        elif not bool(in_loss.any()):
            self.warn(
                "rows_dropped",
                step,
                1.0,
                1.0,
                "every completion was left out of the loss (algo.filter_zero_std / algo.mask_truncated): "
                "the loss is exactly 0; raise rollout.max_completion_length or relax the filters",
            )
        elif not bool((adv[in_loss] != 0).any()) and self.beta == 0:
            self.warn(
                "no_advantage",
                step,
                1.0,
                1.0,
                "every group's completions got equal rewards: every advantage is 0 and the step "
                "changes nothing (too easy or too hard prompts, or a reward that cannot tell completions apart)",
            )

    def check_gradient(
        self, step: int, grad_norm: float, adv: torch.Tensor, in_loss: torch.Tensor, lr: float
    ) -> None:
        """Returns None; records a gradient of exactly 0 although some advantages in the loss are not 0."""
        if grad_norm == 0 and bool((adv[in_loss] != 0).any()):
            self.warn(
                "zero_gradient",
                step,
                0.0,
                0.0,
                "the gradient is exactly 0 although some advantages are not: the policy's "
                f"probabilities are saturated (often a learning rate too high, optim.lr={lr:g}); "
                "the run cannot learn from here",
            )

    def observe(self, step: int, metrics: dict[str, Any], collapse: float | None) -> list[Finding]:
        """Returns the checks that fire on this step's metrics (adds health/<check> = 1 for each to metrics)."""
        if not self.cfg.enabled:
            return []
        c = self.cfg
        row = {
            k: metrics.get(k)
            for k in (
                "frac_reward_zero_std",
                "completions/clipped_ratio",
                "loss",
                "grad_norm",
                "completions/mean_length",
            )
        }
        self.window.append(row)
        full = len(self.window) == self.window.maxlen
        found: list[Finding | None] = []
        now: set[str] = set()

        def check(name: str, bad: bool, value: float, threshold: float, message: str) -> None:
            if bad:
                now.add(name)
                found.append(self.warn(name, step, value, threshold, message))

        mean = lambda key: statistics.fmean(r[key] for r in self.window if _num(r[key]))  # noqa: E731
        if full:
            zv = mean("frac_reward_zero_std")
            check(
                "zero_variance",
                zv > c.zero_variance_max,
                zv,
                c.zero_variance_max,
                f"{100 * zv:.0f}% of groups had all-equal rewards over the last {c.window} steps (threshold "
                f"{100 * c.zero_variance_max:.0f}%): they teach nothing; turn on algo.dynamic_sampling or the "
                "curriculum, or use prompts of a difficulty the model sometimes solves",
            )
            tr = mean("completions/clipped_ratio")
            check(
                "truncation",
                tr > c.truncation_max,
                tr,
                c.truncation_max,
                f"{100 * tr:.0f}% of completions hit max_completion_length over the last {c.window} steps "
                f"(threshold {100 * c.truncation_max:.0f}%): raise rollout.max_completion_length, or add an "
                "overlong penalty",
            )
            length = mean("completions/mean_length")
            if self.first_length is None:
                self.first_length = length
            elif self.first_length > 0:
                ratio = length / self.first_length
                check(
                    "length_drift",
                    not 1 / c.length_ratio <= ratio <= c.length_ratio,
                    ratio,
                    c.length_ratio,
                    f"the mean completion length went from {self.first_length:.1f} to {length:.1f} tokens "
                    f"({ratio:.2f}x; threshold {c.length_ratio:g}x either way): check the rewards for length "
                    "hacking or collapse",
                )
            if all(r["loss"] == 0 for r in self.window):
                check(
                    "surrogate_zero",
                    True,
                    0.0,
                    0.0,
                    f"the loss was exactly 0 for {c.window} steps: nothing is being learned (every row out of "
                    "the loss, or every advantage 0)",
                )
            norms = [r["grad_norm"] for r in list(self.window)[:-1] if _num(r["grad_norm"])]
            gn = _value(metrics.get("grad_norm"))
            median = statistics.median(norms) if norms else 0.0
            if gn is not None and median > 0:  # a window of zero gradients has no scale to spike against
                check(
                    "grad_spike",
                    gn > c.grad_spike * median,
                    gn / median,
                    c.grad_spike,
                    f"the gradient norm {gn:.3g} is {gn / median:.1f}x the median of the last {c.window} steps "
                    f"(threshold {c.grad_spike:g}x): lower optim.lr or optim.max_grad_norm",
                )
        clip = _value(metrics.get("clip_ratio/region_mean"))
        if clip is not None:
            check(
                "clipping",
                clip > c.clip_max,
                clip,
                c.clip_max,
                f"{100 * clip:.0f}% of tokens had their ratio clipped (threshold {100 * c.clip_max:.0f}%, seed "
                "002's pilot): the update moves too far per batch; lower optim.lr or algo.num_iterations",
            )
        kl = _value(metrics.get("kl"))
        if kl is not None and step <= c.kl_early_steps:
            check(
                "kl_early",
                kl > c.kl_early_max,
                kl,
                c.kl_early_max,
                f"mean per-token KL {kl:.3g} > {c.kl_early_max:g} before step {c.kl_early_steps} (seed 002's pilot "
                "threshold): the policy is leaving the reference fast; lower optim.lr or raise algo.beta",
            )
        # The surrogate loss's value says nothing of its pull: at ratio 1 it is the mean advantage, about 0 by
        # construction (it fired on almost every beta > 0 run). Per token the policy term pulls with |A| and the
        # KL term with beta * (1 - pi_ref / pi), about beta * sqrt(2 KL) for the k3 estimator's KL.
        scale = self.advantage_scale
        if kl is not None and self.beta > 0 and scale is not None and scale > 0:
            pull = self.beta * math.sqrt(2 * max(kl, 0.0))
            check(
                "kl_drift",
                pull > c.kl_drift_ratio * scale,
                pull / scale,
                c.kl_drift_ratio,
                f"the KL term's pull per token, beta*sqrt(2*KL) = {pull:.3g}, outweighs the advantages' (mean "
                f"|advantage| {scale:.3g}) by more than {c.kl_drift_ratio:g}x: the anchor dominates; lower algo.beta "
                "or sync the reference (algo.ref_sync.kl)",
            )
        if collapse is not None:
            check(
                "collapse",
                collapse > c.collapse_max,
                collapse,
                c.collapse_max,
                f"{100 * collapse:.0f}% of groups answered their prompt with G identical completions that score "
                f"below the step's best (threshold {100 * c.collapse_max:.0f}%): the policy collapsed onto one "
                "answer per prompt; raise rollout.temperature, or check the rewards for a degenerate answer",
            )
        gap = _value(metrics.get("sampler/logprob_gap"))
        # a batch requested ahead was sampled by older weights (rollout.max_staleness): its gap is expected
        if (
            gap is not None
            and self.num_iterations == 1
            and not self.sampler_corrected
            and not metrics.get("serve/staleness")
        ):
            limit = self.logprob_gap_max
            precision = str(self.precision).removeprefix("torch.")
            check(
                "logprob_gap",
                gap > limit,
                gap,
                limit,
                f"the trainer's log-probs of the sampled tokens differ from the sampler's by up to {gap:.3g}, more "
                f"than {precision} rounding explains (threshold {limit:g}): the update is off-policy without "
                "knowing it; sample with the weights and temperature being trained, or correct for the sampler "
                "with algo.sampler_correction (token_tis)",
            )
        self.firing &= now | {"no_reward", "rows_dropped", "no_advantage", "zero_gradient"}  # recovered ones
        for name in now:
            metrics[f"health/{name}"] = 1.0
        return [f for f in found if f is not None]

    def state_dict(self) -> dict[str, Any]:
        """Returns the window and which checks are firing (saved in checkpoints so resume warns alike)."""
        return {"window": list(self.window), "first_length": self.first_length, "firing": sorted(self.firing)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a :meth:`state_dict`."""
        self.window.clear()
        self.window.extend(state["window"])
        self.first_length = state["first_length"]
        self.firing = set(state["firing"])


def _value(x: Any) -> float | None:
    """Returns x as a float when it is a finite number, else None."""
    return float(x) if _num(x) else None


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
