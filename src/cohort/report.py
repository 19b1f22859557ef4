"""Seeing a run: metric sinks (JSONL, TensorBoard, W&B), progress (a live bar in a terminal, plain log lines
otherwise), ``summary.json`` and ``report.html``.

``metrics.jsonl`` is the source of truth: one JSON object per optimizer step. ``report.html`` is rebuilt
from it (and from ``samples.jsonl`` / ``evals.jsonl`` / ``summary.json``) by :func:`write_report`, so
``cohort report RUN_DIR`` works on a finished, interrupted or still-running run.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import html
import io
import json
import math
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _clean(value: Any) -> Any:
    """Return a JSON-safe Python scalar (tensors become floats, NaN/inf become None)."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Writes each step's metrics to metrics.jsonl and, when enabled, TensorBoard and W&B."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        tensorboard: bool = False,
        wandb: bool = False,
        wandb_project: str = "cohort",
        config: dict | None = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._files = {
            name: open(self.run_dir / f"{name}.jsonl", "a", encoding="utf-8")  # noqa: SIM115
            for name in ("metrics", "samples", "evals")
        }
        self._tb = None
        self._wandb = None
        self._wandb_mod: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError(
                    "tensorboard=true needs the tensorboard package: pip install 'cohort[tensorboard]'"
                ) from e
            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError as e:
                raise ImportError("wandb=true needs the wandb package: pip install 'cohort[wandb]'") from e
            self._wandb_mod = wandb_mod
            self._wandb = wandb_mod.init(
                project=wandb_project,
                name=self.run_dir.resolve().name,  # the run is called after its out_dir
                dir=str(self.run_dir),
                config=config or {},
            )

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one step's metrics (must contain "step") to every sink."""
        row = {k: _clean(v) for k, v in metrics.items()}
        self._write("metrics", row)
        step = row["step"]
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if k != "step"}, step=step)

    def log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Append sample completions of one step (prompt, completion, reward, log_extra columns) to every sink."""
        rows = [{k: _clean(v) for k, v in s.items()} for s in samples]
        for row in rows:
            self._write("samples", {"step": step, **row})
        if not rows:
            return
        columns = list(dict.fromkeys(k for row in rows for k in row))
        if self._tb is not None:
            self._tb.add_text("completions", samples_markdown(rows, columns), step)
        if self._wandb is not None:
            cells = [[_cell(row.get(c)) for c in columns] for row in rows]
            table = self._wandb_mod.Table(columns=columns, data=cells)
            self._wandb.log({"completions": table}, step=step)

    def log_eval(self, step: int, results: dict[str, Any]) -> None:
        """Append held-out evaluation results at `step`."""
        row = {"step": step, **{k: _clean(v) for k, v in results.items()}}
        self._write("evals", row)
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"eval/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log({f"eval/{k}": v for k, v in row.items() if k != "step"}, step=step)

    def _write(self, name: str, row: dict[str, Any]) -> None:
        f = self._files[name]
        f.write(json.dumps(row) + "\n")
        f.flush()

    def close(self) -> None:
        """Flush and close every sink."""
        for f in self._files.values():
            f.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def samples_markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Return one step's sample rows as a markdown table (TensorBoard's text dashboard renders it)."""

    def cell(v: Any) -> str:
        text = _fmt(v) if not isinstance(v, str) else v
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _cell(v: Any) -> Any:
    """Return a value a W&B table cell holds: numbers and strings as they are, anything else as text."""
    return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)


@contextlib.contextmanager
def quiet_hf_progress() -> Iterator[None]:
    """Yields with transformers' progress bars ("Loading weights", "Writing model shards") switched off.

    The switch is transformers' public one (it also covers huggingface_hub's bars); the state before is
    restored on exit, so bars a user's own code shows afterwards are untouched.
    """
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars
    from transformers.utils import logging as hf_logging

    was_on, hub_off = hf_logging.is_progress_bar_enabled(), are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            with warnings.catch_warnings():  # huggingface_hub warns when HF_HUB_DISABLE_PROGRESS_BARS pins it
                warnings.simplefilter("ignore")
                hf_logging.enable_progress_bar()
            if hub_off:
                disable_progress_bars()


class Progress:
    """Shows a run's progress: a live rich bar when stdout is a terminal, plain log lines when it is not
    (one every `logging_steps` steps and at the last), and a line per held-out evaluation in both; nothing
    when disabled."""

    def __init__(
        self,
        total: int,
        *,
        start: int = 0,
        enabled: bool = True,
        description: str = "GRPO",
        logging_steps: int = 10,
        interactive: bool | None = None,
    ):
        self.enabled = enabled
        self.total, self.start, self.logging_steps = total, start, max(1, logging_steps)
        self.interactive = (
            bool(getattr(sys.stdout, "isatty", lambda: False)()) if interactive is None else interactive
        )
        self._bar = None
        self._last_step = start
        self._t0 = self._t_line = time.perf_counter()
        self._step_line = start  # the step of the last plain line
        if not enabled or not self.interactive:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        from rich.progress import Progress as RichProgress

        self._bar = RichProgress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task(description, total=total, completed=start, info="")

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """Advance to `step` and show its headline metrics (a plain line every logging_steps steps)."""
        if not self.enabled:
            return
        self._last_step = step
        if self._bar is not None:
            parts = [f"reward {_fmt(metrics.get('reward'))}"]
            if metrics.get("kl") is not None:
                parts.append(f"kl {_fmt(metrics.get('kl'))}")
            if metrics.get("step_time") is not None:
                parts.append(f"{_fmt(metrics.get('step_time'))} s/step")
            self._bar.update(self._task, completed=step, info=" | ".join(parts))
            return
        if step % self.logging_steps and step != self.total:
            return
        now = time.perf_counter()
        # Wall-clock seconds per step over the steps since the last line (evaluations and saves included),
        # and the ETA from the mean over every step of this attempt.
        per_step = (now - self._t_line) / max(1, step - self._step_line)
        eta = (self.total - step) * (now - self._t0) / max(1, step - self.start)
        self._t_line, self._step_line = now, step
        parts = [f"step {step}/{self.total}", f"reward {_fmt(metrics.get('reward'))}"]
        if metrics.get("kl") is not None:
            parts.append(f"kl {_fmt(metrics.get('kl'))}")
        if metrics.get("completions/mean_length") is not None:
            parts.append(f"length {_fmt(metrics.get('completions/mean_length'))}")
        parts += [f"{per_step:.3g} s/step", f"ETA {_duration(eta)}"]
        print(" | ".join(parts), flush=True)

    def evaluated(self, step: int, results: dict[str, Any]) -> None:
        """Print one line for a held-out evaluation at `step`: accuracy, and pass@k / maj@k when present."""
        if not self.enabled or not results:
            return
        if step == self.start == self._last_step:  # an evaluation before the first step is not step time
            self._t0 = self._t_line = time.perf_counter()
        line = eval_line(step, results)
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def close(self) -> None:
        """Stop redrawing the bar."""
        if self._bar is not None:
            self._bar.stop()


def eval_line(step: int, results: dict[str, Any]) -> str:
    """Return the one-line text of a held-out evaluation: step, accuracy, pass@k / maj@k, prompts."""
    parts = [f"eval step {step}"]
    for k, v in results.items():
        if k == "accuracy" or k.startswith(("pass@", "maj@")):
            v = _clean(v)
            parts.append(f"{k} {100 * v:.1f}%" if isinstance(v, (int, float)) else f"{k} -")
    if results.get("n") is not None:
        parts.append(f"{int(results['n'])} prompts")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    """Return seconds as H:MM:SS."""
    return str(datetime.timedelta(seconds=max(0, round(seconds))))


def _fmt(v: Any) -> str:
    v = _clean(v)
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _summary_text(v: Any) -> str:
    """Return a summary.json value as report text (a dict of metrics as "name value" pairs)."""
    if isinstance(v, dict):
        return ", ".join(f"{k} {_summary_text(x)}" for k, x in v.items())
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    """Return the path of run_dir/summary.json after writing `summary` to it (JSON-safe, atomically)."""
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_json_safe(summary), indent=2) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def _json_safe(value: Any) -> Any:
    """Return `value` with nested dicts / lists cleaned by _clean and anything else JSON cannot hold as text."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    value = _clean(value)
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Return the objects of a JSONL file (an absent file gives [], a torn last line is skipped)."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a run killed mid-write leaves a partial final line
    return rows


_PLOTS = [
    ("Reward", ["reward"], "metrics"),
    ("Held-out accuracy", ["accuracy"], "evals"),
    ("KL to reference", ["kl"], "metrics"),
    ("Clip ratio", ["clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"], "metrics"),
    ("Completion length", ["completions/mean_length"], "metrics"),
    ("Entropy", ["entropy"], "metrics"),
    ("Loss", ["loss"], "metrics"),
    ("Seconds per step", ["step_time"], "metrics"),
]


def _plot_png(title: str, series: dict[str, tuple[list[float], list[float]]]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.0), dpi=90)
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, markersize=3, label=name)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def write_report(run_dir: str | Path, *, title: str | None = None, max_samples: int = 40) -> Path:
    """Return the path of run_dir/report.html, rebuilt from the run's JSONL files."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(
            f"{str(run_dir)!r} is a file, not a run directory; pass the out_dir of a run (the folder holding "
            "metrics.jsonl)"
        )
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    data = {
        "metrics": read_jsonl(run_dir / "metrics.jsonl"),
        "evals": read_jsonl(run_dir / "evals.jsonl"),
    }
    samples = read_jsonl(run_dir / "samples.jsonl")
    if not data["metrics"] and not data["evals"]:
        raise FileNotFoundError(
            f"{str(run_dir)!r} has no metrics.jsonl or evals.jsonl: is it a cohort run directory?"
        )
    summary = {}
    if (run_dir / "summary.json").is_file():
        summary = json.loads((run_dir / "summary.json").read_text())
    images = []
    for plot_title, keys, source in _PLOTS:
        series = {}
        for key in keys:
            pts = [(r["step"], r[key]) for r in data[source] if isinstance(r.get(key), (int, float))]
            if pts:
                series[key] = ([p[0] for p in pts], [p[1] for p in pts])
        if series:
            images.append((plot_title, _plot_png(plot_title, series)))
        else:
            why = "beta = 0: no reference model is run" if keys == ["kl"] else "nothing logged yet"
            images.append((plot_title, why))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title or 'cohort run ' + run_dir.name)}</title>",
        "<style>body{font-family:system-ui,sans-serif;margin:24px;max-width:1200px}"
        ".grid{display:flex;flex-wrap:wrap;gap:8px}table{border-collapse:collapse;font-size:13px}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}"
        "pre{margin:0;white-space:pre-wrap;font-size:12px}</style></head><body>",
        f"<h1>{html.escape(title or 'cohort run: ' + run_dir.name)}</h1>",
        f"<p>Generated {time.strftime('%Y-%m-%d %H:%M:%S')} from {html.escape(str(run_dir))}: "
        f"{len(data['metrics'])} logged steps, {len(data['evals'])} evaluations.</p>",
    ]
    if summary:
        parts.append("<h2>Summary</h2><table>")
        for k, v in summary.items():
            parts.append(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_summary_text(v))}</td></tr>")
        parts.append("</table>")
    if data["evals"]:
        parts.append("<h2>Held-out evaluations</h2><table><tr>")
        keys = sorted({k for r in data["evals"] for k in r}, key=lambda k: (k != "step", k))
        parts += [f"<th>{html.escape(k)}</th>" for k in keys] + ["</tr>"]
        for r in data["evals"]:
            parts.append("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(k)))}</td>" for k in keys) + "</tr>")
        parts.append("</table>")
    parts.append("<h2>Plots</h2><div class='grid'>")
    for plot_title, png in images:
        if png.startswith(("beta", "nothing")):
            parts.append(
                f"<div style='width:468px;height:270px;border:1px solid #ddd;display:flex;align-items:center;"
                f"justify-content:center'><b>{html.escape(plot_title)}</b>: {html.escape(png)}</div>"
            )
        else:
            parts.append(f"<img alt='{html.escape(plot_title)}' src='data:image/png;base64,{png}'>")
    parts.append("</div>")
    if samples:
        parts.append(
            "<h2>Sample completions</h2><table><tr><th>step</th><th>prompt</th>"
            "<th>completion</th><th>reward</th></tr>"
        )
        stride = max(1, len(samples) // max_samples)
        shown = samples[::stride][-max_samples:]
        for s in shown:
            parts.append(
                f"<tr><td>{s.get('step')}</td><td><pre>{html.escape(str(s.get('prompt', '')))}</pre></td>"
                f"<td><pre>{html.escape(str(s.get('completion', '')))}</pre></td>"
                f"<td>{html.escape(_fmt(s.get('reward')))}</td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>")
    out = run_dir / "report.html"
    out.write_text("\n".join(parts), encoding="utf-8")
    return out
