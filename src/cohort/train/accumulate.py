"""What a policy update measures: token-weighted means over its micro-batches, the extremes some metrics keep,
their merge over every process, and the UpdateStats they end as."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cohort.logprobs import PATHS as LOGPROB_PATHS
from cohort.logprobs import LogProbs


@dataclass
class UpdateStats:
    """What one call of PolicyUpdater.update measured (token-weighted means over its micro-batches)."""

    loss: float = 0.0
    """The loss summed over micro-batches and processes, averaged over optimizer steps."""
    grad_norm: float = 0.0
    """Global gradient norm before clipping, averaged over optimizer steps."""
    lr: float = 0.0
    """The learning rate the update's last optimizer step used (the schedule's value before it stepped)."""
    kl: float | None = None
    """Mean per-token KL to the reference (None when beta = 0 or no reference)."""
    entropy: float | None = None
    """Mean per-token entropy of the policy on the first pass."""
    clip_ratio: dict[str, float] = field(default_factory=dict)
    """TRL's clip metrics: low_mean, high_mean, region_mean (token-weighted means), low_min and high_max (the
    smallest low / largest high clip ratio of one micro-batch)."""
    ratio_mean: float | None = None
    """Mean importance ratio pi_theta / pi_old."""
    rows_computed_frac: float = 1.0
    """Share of the batch's completions that needed a forward/backward (the rest were left out of the loss
    or skipped: zero advantage)."""
    logprob_gap: float | None = None
    """Largest |trainer log-prob - sampler log-prob| over the sampled tokens of the first pass (None when the
    batch carried no sampler log-probs, or no row needed a pass); at num_iterations = 1 both should agree to
    rounding."""
    paths: dict[str, float] = field(default_factory=dict)
    """Fast paths taken: share of log-prob computations per path (segments, dense_mask, padded), with the
    chunked head, with unmasked padded rows and with the compiled decoder, and whether zero-advantage skipping
    and FlashAttention first (fast.flash_first) were on (1.0) or off (0.0)."""
    micro_batches: int = 0
    """Forward / backward passes with gradients over the update's optimizer steps (the busiest process's)."""
    micro_batch_tokens_max: int = 0
    """The largest of their layouts in tokens, padding included: what micro_batch_tokens bounds (a single row
    longer than the budget is a micro-batch of its own)."""

    controls: dict[str, float] = field(default_factory=dict)
    """What the token controls did (entropy_mask/kept_frac, cov/selected_frac, sampler/is_ratio_* ...)."""
    entropy_coef: float | None = None
    """The entropy-regularisation coefficient after the update (None when algo.entropy_coef is 0 and the
    adaptive controller is off)."""

    def metrics(self) -> dict[str, float | None]:
        """Returns the stats under the names metrics.jsonl uses (TRL's where TRL has one)."""
        out: dict[str, float | None] = {
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "lr": self.lr,
            "kl": self.kl,
            "entropy": self.entropy,
        }
        for name in ("region_mean", "low_mean", "high_mean", "low_min", "high_max"):
            out[f"clip_ratio/{name}"] = self.clip_ratio.get(name, 0.0)
        out["ratio/mean"] = self.ratio_mean
        out["rows_computed_frac"] = self.rows_computed_frac
        if self.logprob_gap is not None:
            out["sampler/logprob_gap"] = self.logprob_gap
        out.update({f"fast/{k}": v for k, v in self.paths.items()})
        out["micro_batches"] = self.micro_batches
        out["micro_batch_tokens_max"] = self.micro_batch_tokens_max
        out.update(self.controls)
        if self.entropy_coef is not None:
            out["entropy_coef"] = self.entropy_coef
        return out


class WeightedMeans:
    """Weighted running means by name."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, name: str, value: float, weight: float) -> None:
        """Adds `value` with `weight` to the running mean of `name`."""
        self.sums[name] = self.sums.get(name, 0.0) + value * weight
        self.weights[name] = self.weights.get(name, 0.0) + weight

    def get(self, name: str, default=None):
        """Returns the weighted mean of `name`, or `default` when nothing of weight > 0 was added."""
        w = self.weights.get(name, 0.0)
        return self.sums[name] / w if w > 0 else default

    def means(self) -> dict[str, float]:
        """Returns every name's weighted mean (names of weight 0 left out)."""
        return {k: v / self.weights[k] for k, v in self.sums.items() if self.weights[k] > 0}

    def merge(self, other: WeightedMeans, skip: tuple[str, ...] = ()) -> None:
        """Adds another process's sums and weights (except the names in `skip`, already global)."""
        for name, value in other.sums.items():
            if name not in skip:
                self.sums[name] = self.sums.get(name, 0.0) + value
                self.weights[name] = self.weights.get(name, 0.0) + other.weights[name]


def read_floats(values: list[Any]) -> list[float]:
    """Returns `values` (tensors of one element, or numbers) as the floats float() reads, those on an accelerator
    read in one transfer (one wait for the device, where float() would wait once for each)."""
    out: list[Any] = [
        None if isinstance(v, torch.Tensor) and v.device.type != "cpu" else float(v) for v in values
    ]
    remote = [v for v, o in zip(values, out) if o is None]
    if remote:
        read = iter(read_together(remote))
        out = [next(read) if o is None else o for o in out]
    return out


def read_together(tensors: list[torch.Tensor]) -> list[float]:
    """Returns one-element tensors of one device as the floats float() reads, in one transfer: float64 holds every
    float32, float16 and bfloat16 value and every count up to 2**53 exactly."""
    return torch.stack([t.detach().reshape(()).double() for t in tensors]).tolist()


def _extreme(name: str) -> Callable[[float, float], float]:
    return min if name.endswith("_min") else max


class UpdateMeter:
    """Accumulates one update's measurements, micro-batch by micro-batch; `merge_processes` then `stats`."""

    GLOBAL = ("loss", "grad_norm")
    """Names already the same on every process (summed or reduced before they were added)."""

    def __init__(self) -> None:
        self.means = WeightedMeans()
        self.paths = WeightedMeans()
        self.extremes: dict[str, float] = {}
        self.low_min, self.high_max = math.inf, -math.inf  # extremes of the per-micro-batch clip ratios
        self.gap = 0.0
        self.control_names: set[str] = set()
        self.passes = self.largest = 0  # gradient passes and their largest layout (tokens)
        self.pending: list[tuple] = []  # queue_micro_batch's, until read_micro_batches
        self.pending_gaps: list[torch.Tensor] = []

    def path(self, lp: LogProbs) -> None:
        """Counts one log-prob computation with gradients by the layout that ran it, whether the chunked head did,
        whether its padded rows ran without a mask and its decoder compiled, and its size in tokens."""
        self.passes += 1
        self.largest = max(self.largest, lp.layout_tokens)
        for p in LOGPROB_PATHS:
            self.paths.add(p, float(lp.path == p), 1.0)
        self.paths.add("chunked_head", float(lp.chunked_head), 1.0)
        self.paths.add("unmasked_padding", float(lp.unmasked), 1.0)
        self.paths.add("compile_update", float(lp.compiled), 1.0)

    def sampler_gap(self, logp: torch.Tensor, sampled: torch.Tensor, mask: torch.Tensor) -> None:
        """Keeps the largest |trainer - sampler| log-prob over the masked-in tokens (read with the next
        `read_micro_batches`)."""
        diff = (logp.detach().float() - sampled.float()).abs() * mask
        if diff.numel():
            self.pending_gaps.append(diff.max())

    def queue_micro_batch(
        self,
        loss: torch.Tensor,
        mask: torch.Tensor,
        metrics: dict[str, Any],
        entropy: torch.Tensor | None,
        controls: dict[str, float] | None = None,
    ) -> None:
        """Queues a micro-batch's loss, masked-in tokens, loss metrics, mean entropy and token-control metrics for
        `read_micro_batches`: nothing is read from the device here, so the host goes on to the next micro-batch
        while this one's backward runs."""
        entropy_sum = None if entropy is None else (entropy.detach() * mask).sum()  # divided once read
        self.pending.append((loss.detach(), mask.sum(), dict(metrics), entropy_sum, controls))

    def read_micro_batches(self) -> float:
        """Returns the queued micro-batches' loss summed in order, after adding each one's measurements as
        `micro_batch` and `controls` would have when it ran; every device value is read in one transfer."""
        flat: list[Any] = list(self.pending_gaps)
        for loss, ntok, metrics, entropy_sum, _ in self.pending:
            flat += [loss, ntok, *metrics.values()] + ([entropy_sum] if entropy_sum is not None else [])
        values = iter(read_floats(flat))
        for _ in self.pending_gaps:
            self.gap = max(self.gap, next(values))
        total = 0.0
        for _, _, metrics, entropy_sum, controls in self.pending:
            total += next(values)
            ntok = next(values)
            read = {k: next(values) for k in metrics}
            if controls is not None:
                self.controls(controls, ntok)
            mean_entropy = next(values) / max(ntok, 1.0) if entropy_sum is not None else None
            self.micro_batch(read, ntok, mean_entropy)
        self.pending.clear()
        self.pending_gaps.clear()
        return total

    def controls(self, metrics: dict[str, float], tokens: float) -> None:
        """Adds a micro-batch's token-control metrics: names ending _min / _max as extremes, the rest as means."""
        self.control_names.update(metrics)
        for k, val in metrics.items():
            if k.endswith(("_min", "_max")):
                self.extremes[k] = _extreme(k)(self.extremes.get(k, val), val)
            else:
                self.means.add(k, val, tokens)

    def micro_batch(self, metrics: dict[str, float], tokens: float, mean_entropy: float | None) -> None:
        """Adds a micro-batch's loss metrics and mean entropy, weighted by its `tokens` masked-in tokens; a loss's
        own metrics (vespo/phi_seq_mean, kl_tau/penalty_mean) are reported with the controls'."""
        for k, v in metrics.items():
            self.means.add(k, v, tokens)
            if k not in ("kl", "ratio/mean") and not k.startswith("clip_ratio/"):
                self.control_names.add(k)
        if "clip_ratio/low_mean" in metrics and tokens > 0:
            self.low_min = min(self.low_min, metrics["clip_ratio/low_mean"])
            self.high_max = max(self.high_max, metrics["clip_ratio/high_mean"])
        if mean_entropy is not None:
            self.means.add("entropy", mean_entropy, tokens)

    def optimizer_step(
        self, *, loss: float, grad_norm: float, rows_computed_frac: float, entropy_coef: float | None
    ) -> None:
        """Adds one optimizer step's loss (over every process), gradient norm and share of rows computed."""
        if entropy_coef is not None:
            self.means.add("entropy_coef", entropy_coef, 1.0)
        self.means.add("loss", loss, 1.0)
        self.means.add("grad_norm", grad_norm, 1.0)
        self.means.add("rows_computed_frac", rows_computed_frac, 1.0)

    def merge_processes(self, all_gather_object: Callable[[Any], list[Any]], rank: int) -> None:
        """Merges every other process's token-weighted means, extremes and gap into this one (a collective)."""
        mine = (
            self.means,
            self.extremes,
            self.low_min,
            self.high_max,
            self.gap,
            self.control_names,
            self.passes,
            self.largest,
        )
        for r, (means, extremes, low, high, gap, names, passes, largest) in enumerate(
            all_gather_object(mine)
        ):
            if r == rank:
                continue
            self.means.merge(means, skip=self.GLOBAL)
            for k, val in extremes.items():
                self.extremes[k] = _extreme(k)(self.extremes.get(k, val), val)
            self.low_min, self.high_max, self.gap = (
                min(self.low_min, low),
                max(self.high_max, high),
                max(self.gap, gap),
            )
            self.control_names.update(names)
            self.passes, self.largest = max(self.passes, passes), max(self.largest, largest)

    def stats(
        self, *, lr: float, skip_zero: bool, measured_gap: bool, entropy_coef: float | None
    ) -> UpdateStats:
        """Returns the UpdateStats of what was accumulated (measured_gap: the batch carried sampler log-probs)."""
        means = self.means
        taken = self.paths.means()  # what `path` counted (nothing when no micro-batch ran)
        taken["skip_zero_advantage"] = float(skip_zero)
        return UpdateStats(
            loss=means.get("loss", 0.0),
            grad_norm=means.get("grad_norm", 0.0),
            lr=lr,
            kl=means.get("kl"),
            entropy=means.get("entropy"),
            clip_ratio={
                **{k: means.get(f"clip_ratio/{k}", 0.0) for k in ("low_mean", "high_mean", "region_mean")},
                "low_min": self.low_min if math.isfinite(self.low_min) else 0.0,
                "high_max": self.high_max if math.isfinite(self.high_max) else 0.0,
            },
            ratio_mean=means.get("ratio/mean"),
            rows_computed_frac=means.get("rows_computed_frac", 1.0),
            # with no pass run, no sampled token was compared: 0.0 would claim an agreement never measured
            logprob_gap=self.gap if measured_gap and self.passes else None,
            paths=taken,
            controls={
                k: self.extremes[k] if k in self.extremes else means.get(k, 0.0)
                for k in sorted(self.control_names)
            },
            entropy_coef=entropy_coef,
            micro_batches=self.passes,
            micro_batch_tokens_max=self.largest,
        )
