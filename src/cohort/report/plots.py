"""The report's charts: matplotlib panels rendered to PNG, each a smoothed curve over its faint raw trace.

A panel is a list of :class:`Series` (one run, one metric) and optional :class:`Band` ranges; the page
module decides which metrics make which panel. Every panel has a y-axis label and a step x-axis; a run
compared with others keeps one colour across every panel.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass, field

COLOURS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"]
"""One colour per run (matplotlib's tab10 order), reused across every panel of a report."""


@dataclass
class Series:
    """One line of a panel: (step, value) points of one metric of one run."""

    label: str
    steps: list[float]
    values: list[float]
    colour: str = COLOURS[0]
    smooth: bool = True
    """Draw the raw points faintly and an exponential moving average over them (False: the points as they are)."""
    dashed: bool = False
    right_axis: bool = False
    """Plot against a second y-axis on the right (the panel's right_label)."""


@dataclass
class Band:
    """A shaded min..max range of one run (e.g. completion length), drawn under the lines."""

    label: str
    steps: list[float]
    low: list[float]
    high: list[float]
    colour: str = COLOURS[0]


@dataclass
class Panel:
    """One chart: a title, axis labels, its lines and bands, and a note shown under the title."""

    title: str
    y_label: str
    series: list[Series] = field(default_factory=list)
    bands: list[Band] = field(default_factory=list)
    right_label: str | None = None
    note: str = ""
    y_range: tuple[float, float] | None = None


def smoothing_span(n: int) -> int:
    """Returns the span (in points) of the moving average for a trace of n points: about n / 40, at least 1."""
    return max(1, round(n / 40))


def ema(values: list[float], span: int) -> list[float]:
    """Returns the bias-corrected exponential moving average of values with the given span (1 = no smoothing).

    The weight of the newest point is 2 / (span + 1); dividing by the weights' sum so far keeps the first
    points from being pulled towards 0, as TensorBoard's smoothing does."""
    if span <= 1:
        return list(values)
    decay = 1 - 2 / (span + 1)
    out, acc, norm = [], 0.0, 0.0
    for v in values:
        acc = decay * acc + (1 - decay) * v
        norm = decay * norm + (1 - decay)
        out.append(acc / norm)
    return out


def render_png(panel: Panel, *, width: float = 5.6, height: float = 3.3, dpi: int = 96) -> str:
    """Returns the panel drawn as a base64 PNG (for a data: URL)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), dpi=dpi)
    right = ax.twinx() if any(s.right_axis for s in panel.series) else None
    for band in panel.bands:
        ax.fill_between(
            band.steps, band.low, band.high, color=band.colour, alpha=0.15, linewidth=0, label=band.label
        )
    for s in panel.series:
        axis = right if s.right_axis and right is not None else ax
        style = "--" if s.dashed else "-"
        few = len(s.steps) < 25
        if s.smooth and not few:
            axis.plot(s.steps, s.values, style, color=s.colour, alpha=0.25, linewidth=0.8)
            axis.plot(
                s.steps,
                ema(s.values, smoothing_span(len(s.values))),
                style,
                color=s.colour,
                linewidth=1.6,
                label=s.label,
            )
        else:
            axis.plot(
                s.steps,
                s.values,
                style,
                color=s.colour,
                linewidth=1.4,
                marker="o" if few else None,
                markersize=3,
                label=s.label,
            )
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(panel.y_label, fontsize=8)
    if right is not None:
        right.set_ylabel(panel.right_label or "", fontsize=8)
        right.tick_params(labelsize=7)
    if panel.y_range is not None:
        ax.set_ylim(*panel.y_range)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if right is not None:
        more = right.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    if len(labels) > 1:
        ax.legend(handles, labels, fontsize=6.5, loc="best", framealpha=0.7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def finite_points(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    """Returns the (steps, values) of rows where `key` is a finite number."""
    steps, values = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and "step" in r:
            steps.append(r["step"])
            values.append(float(v))
    return steps, values
