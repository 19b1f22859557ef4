"""``report.html``: one self-contained page per run, or one page overlaying several runs.

Everything is rebuilt from the run directory's files (metrics.jsonl, evals.jsonl, samples.jsonl,
summary.json, config.yaml), so ``cohort report`` works on a finished, interrupted or still-running run.
The page has no script and loads nothing from the network: its charts are PNG data URLs.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from cohort.errors import disk_full_named
from cohort.report.plots import COLOURS, Band, Panel, Series, finite_points, render_png, smoothing_span
from cohort.report.sinks import format_value, read_jsonl


@dataclass
class RunFiles:
    """What a run directory holds for its report."""

    path: Path
    name: str
    metrics: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    samples: list[dict[str, Any]]
    health: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    config_text: str = ""

    @property
    def config(self) -> dict[str, Any]:
        """Returns the resolved config as nested dicts ({} when config.yaml is absent or unreadable)."""
        try:
            loaded = yaml.safe_load(self.config_text) if self.config_text else {}
        except yaml.YAMLError:
            return {}
        return loaded if isinstance(loaded, dict) else {}


def load_run(run_dir: str | Path, name: str | None = None) -> RunFiles:
    """Returns the files of a run directory (FileNotFoundError / ValueError naming the path when it is not one)."""
    path = Path(run_dir)
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"{str(path)!r} is a file, not a run directory; pass the out_dir of a run (the folder holding "
            "metrics.jsonl)"
        )
    if not path.is_dir():
        raise FileNotFoundError(f"run directory {str(path)!r} does not exist")
    run = RunFiles(
        path=path,
        name=name or path.resolve().name,
        metrics=read_jsonl(path / "metrics.jsonl"),
        evals=read_jsonl(path / "evals.jsonl"),
        samples=read_jsonl(path / "samples.jsonl"),
        health=read_jsonl(path / "health.jsonl"),
    )
    if not run.metrics and not run.evals:
        # a folder inside a run (RUN/checkpoints/step-N, RUN/final) is a common slip: name the run itself
        outer = next((p for p in path.parents[:2] if (p / "metrics.jsonl").is_file()), None)
        question = "is it a cohort run directory?"
        if outer is not None:
            question = f"it is a folder inside the run directory {str(outer)!r}: pass that"
        raise FileNotFoundError(f"{str(path)!r} has no metrics.jsonl or evals.jsonl: {question}")
    try:
        loaded = json.loads((path / "summary.json").read_text(encoding="utf-8"))
        run.summary = loaded if isinstance(loaded, dict) else {}
    except (OSError, ValueError):
        run.summary = {}  # absent, or torn by a kill: the report is still worth having
    if (path / "config.yaml").is_file():
        run.config_text = (path / "config.yaml").read_text(encoding="utf-8", errors="replace")
    return run


# ---------------------------------------------------------------------------------------------- panels
def reward_functions(runs: Sequence[RunFiles]) -> list[str]:
    """Returns the reward function names logged by any of the runs (rewards/<name>/mean), in first-seen order."""
    names: dict[str, None] = {}
    for run in runs:
        for row in run.metrics[:1] + run.metrics[-1:]:
            for key in row:
                if key.startswith("rewards/") and key.endswith("/mean") and key.count("/") == 2:
                    names[key.split("/")[1]] = None
    return list(names)


def build_panels(runs: Sequence[RunFiles]) -> list[Panel]:
    """Returns the report's charts for one run, or the same charts with every run overlaid in its own colour."""
    many = len(runs) > 1

    def lines(
        key: str, *, source: str = "metrics", smooth: bool = True, label: str | None = None
    ) -> list[Series]:
        out = []
        for i, run in enumerate(runs):
            steps, values = finite_points(getattr(run, source), key)
            if steps:
                name = run.name if many else (label or key)
                out.append(Series(name, steps, values, COLOURS[i % len(COLOURS)], smooth=smooth))
        return out

    def panel(title: str, y_label: str, key: str, note: str = "", **kw: Any) -> Panel:
        return Panel(title, y_label, lines(key, **kw), note=note)

    panels = [panel("Reward", "mean reward per completion", "reward")]
    functions = reward_functions(runs)
    if len(functions) > 1:
        panels += [panel(f"Reward: {f}", "mean score", f"rewards/{f}/mean") for f in functions]
    panels.append(panel("Reward spread within groups", "std of rewards in a group", "reward_std"))
    zero = panel(
        "Groups with equal rewards",
        "fraction of groups",
        "frac_reward_zero_std",
        note="all-equal groups have advantage 0 and teach nothing",
    )
    zero.y_range = (-0.02, 1.02)
    panels.append(zero)
    accuracy = Panel(
        "Held-out accuracy", "accuracy (greedy)", lines("accuracy", source="evals", smooth=False)
    )
    for i, run in enumerate(runs):
        for key in sorted({k for r in run.evals for k in r if k.startswith(("pass@", "maj@"))}):
            steps, values = finite_points(run.evals, key)
            label = f"{run.name} {key}" if many else key
            accuracy.series.append(
                Series(label, steps, values, COLOURS[i % len(COLOURS)], smooth=False, dashed=True)
            )
    panels.append(accuracy)
    # Per-token values (KL, entropy) are measured on the tokens in the loss: a run whose every step had none has
    # no value to draw, and saying "nothing logged yet" of a finished run would read as a fault.
    no_loss_tokens = _no_token_in_any_loss(runs)
    panels.append(
        panel(
            "KL to the reference",
            "mean per-token KL",
            "kl",
            note="" if lines("kl") else no_loss_tokens or "beta = 0: no reference",
        )
    )
    panels.append(_length_panel(runs))
    clip = Panel("Clipped tokens", "fraction of tokens")
    for key, label in (
        ("clip_ratio/region_mean", "either side"),
        ("clip_ratio/low_mean", "low"),
        ("clip_ratio/high_mean", "high"),
    ):
        for s in lines(key, label=label):
            s.label = f"{s.label} {label}" if many else label
            s.dashed = key != "clip_ratio/region_mean"
            clip.series.append(s)
    if clip.series and all(v == 0 for s in clip.series for v in s.values):
        clip.note = "0 at every step: with one update per batch the ratio is exactly 1 (num_iterations=1)"
    panels.append(clip)
    panels.append(
        panel("Entropy", "nats per token", "entropy", note="" if lines("entropy") else no_loss_tokens)
    )
    panels.append(panel("Loss", "loss", "loss"))
    panels.append(panel("Gradient norm", "L2 norm before clipping", "grad_norm"))
    panels.append(panel("Learning rate", "learning rate", "lr", smooth=False))
    speed = Panel("Seconds per step", "seconds", lines("step_time", label="step"))
    if not many:
        for key, label in (("time/generate", "generate"), ("time/update", "update")):
            for s in lines(key, label=label):
                s.dashed = True
                speed.series.append(s)
    panels.append(speed)
    return panels


def _no_token_in_any_loss(runs: Sequence[RunFiles]) -> str:
    """Returns why per-token panels are empty when no logged step of any run had a token in the loss, else ''."""
    rows = [r for run in runs for r in run.metrics]
    if rows and all(r.get("rows_computed_frac") == 0 for r in rows):
        return (
            "not measured: at every logged step each group's completions got equal rewards, so no token "
            "reached the loss"
        )
    return ""


def _length_panel(runs: Sequence[RunFiles]) -> Panel:
    """Returns the completion-length chart: a min..max band, the mean, and the truncated fraction on the right."""
    many = len(runs) > 1
    p = Panel("Completion length", "tokens", right_label="truncated fraction")
    for i, run in enumerate(runs):
        colour = COLOURS[i % len(COLOURS)]
        rows = [
            r
            for r in run.metrics
            if all(isinstance(r.get(f"completions/{k}_length"), (int, float)) for k in ("min", "mean", "max"))
        ]
        if rows:
            steps = [r["step"] for r in rows]
            p.bands.append(
                Band(
                    f"{run.name} min..max" if many else "min..max",
                    steps,
                    [r["completions/min_length"] for r in rows],
                    [r["completions/max_length"] for r in rows],
                    colour,
                )
            )
            mean = [float(r["completions/mean_length"]) for r in rows]
            p.series.append(Series(f"{run.name} mean" if many else "mean", steps, mean, colour))
        steps, values = finite_points(run.metrics, "completions/clipped_ratio")
        if steps:
            label = f"{run.name} truncated" if many else "truncated (right axis)"
            p.series.append(Series(label, steps, values, colour, dashed=True, right_axis=True))
    return p


# ---------------------------------------------------------------------------------------------- HTML
_STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1240px;padding:0 16px;
color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd;padding-bottom:4px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(540px,1fr));gap:12px}
figure{margin:0;border:1px solid #e4e4e4;border-radius:4px;padding:4px}
figure img{width:100%;height:auto;display:block}figcaption{font-size:12px;color:#666;padding:2px 6px}
.empty{min-height:120px;display:flex;align-items:center;justify-content:center;color:#777;font-size:14px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}
td,th{border:1px solid #d8d8d8;padding:3px 8px;text-align:left;vertical-align:top}th{background:#f6f6f6}
td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{margin:0;white-space:pre-wrap;word-break:break-word;font-size:12px}
.group{border:1px solid #e4e4e4;border-radius:4px;padding:8px 12px;margin:12px 0}
.group h3{font-size:14px;margin:0 0 6px}.pos{color:#17692e}.neg{color:#a1261c}.out{color:#999}
.muted{color:#666;font-size:13px}
.turn{border-left:3px solid #ccc;padding:1px 6px;margin:2px 0}.turn .who{font-size:11px;color:#666}
.turn.call{border-color:#2a6fb0}.turn.tool{border-color:#b07a2a;background:#fbf6ee}.turn.user{border-color:#888}
"""


def _page(title: str, body: list[str]) -> str:
    head = (
        "<!doctype html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{html.escape(title)}</title><style>{_STYLE}</style></head><body>"
    )
    return head + "\n".join(body) + "\n</body></html>\n"


def _figures(panels: list[Panel]) -> list[str]:
    out = ["<div class='grid'>"]
    for p in panels:
        caption = f"<figcaption>{html.escape(p.note)}</figcaption>" if p.note else ""
        if p.series or p.bands:
            png = render_png(p)
            out.append(
                f"<figure class='plot'><img alt='{html.escape(p.title)}' src='data:image/png;base64,{png}'>"
                f"{caption}</figure>"
            )
        else:
            why = p.note or "nothing logged yet"
            out.append(
                f"<figure class='empty'><b>{html.escape(p.title)}</b>:&nbsp;{html.escape(why)}</figure>"
            )
    out.append("</div>")
    return out


def _smoothing_note(runs: Sequence[RunFiles]) -> str:
    n = max((len(r.metrics) for r in runs), default=0)
    span = smoothing_span(n)
    if span <= 1:
        return "<p class='muted'>Every logged step is drawn as it is (too few steps to smooth).</p>"
    return (
        f"<p class='muted'>Bold lines are exponential moving averages over about {span} steps; the faint trace "
        "under each is the raw value of every step.</p>"
    )


def _summary_value(v: Any) -> str:
    if isinstance(v, dict):
        return ", ".join(f"{k} {_summary_value(x)}" for k, x in v.items())
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _summary_table(runs: Sequence[RunFiles]) -> list[str]:
    keys = list(dict.fromkeys(k for r in runs for k in r.summary if k != "final_metrics"))
    if not keys:
        return []
    out = ["<h2>Summary</h2><table class='summary'>"]
    if len(runs) > 1:
        out.append("<tr><th></th>" + "".join(f"<th>{html.escape(r.name)}</th>" for r in runs) + "</tr>")
    for k in keys:
        cells = "".join(f"<td>{html.escape(_summary_value(r.summary.get(k, '')))}</td>" for r in runs)
        out.append(f"<tr><th>{html.escape(k)}</th>{cells}</tr>")
    final = list(dict.fromkeys(k for r in runs for k in r.summary.get("final_metrics", {}) or {}))
    for k in final:
        cells = "".join(
            f"<td class='num'>{html.escape(format_value((r.summary.get('final_metrics') or {}).get(k)))}</td>"
            for r in runs
        )
        out.append(f"<tr><th>last step: {html.escape(k)}</th>{cells}</tr>")
    out.append("</table>")
    return out


def _evals_table(run: RunFiles) -> list[str]:
    if not run.evals:
        return []
    keys = sorted({k for r in run.evals for k in r}, key=lambda k: (k != "step", k))
    out = ["<h2>Held-out evaluations</h2><table class='evals'><tr>"]
    out += [f"<th>{html.escape(k)}</th>" for k in keys] + ["</tr>"]
    for r in run.evals:
        out.append(
            "<tr>"
            + "".join(f"<td class='num'>{html.escape(format_value(r.get(k)))}</td>" for k in keys)
            + "</tr>"
        )
    out.append("</table>")
    return out


def _health_section(run: RunFiles) -> list[str]:
    out = ["<h2>Health</h2>"]
    if not run.health:
        checked = (
            "checked every step" if run.config.get("health", {}).get("enabled", True) else "switched off"
        )
        return out + [f"<p class='muted health-ok'>No health check fired (the checks were {checked}).</p>"]
    out.append(
        "<p class='muted'>Each check that fired, at the step it started firing (cohort.train.health lists them all).</p>"
        "<table class='health'><tr><th>step</th><th>check</th><th>value</th><th>threshold</th><th>what it means</th></tr>"
    )
    for r in run.health:
        out.append(
            f"<tr><td class='num'>{html.escape(str(r.get('step')))}</td><td>{html.escape(str(r.get('check')))}</td>"
            f"<td class='num'>{html.escape(format_value(r.get('value')))}</td>"
            f"<td class='num'>{html.escape(format_value(r.get('threshold')))}</td>"
            f"<td>{html.escape(str(r.get('message', '')))}</td></tr>"
        )
    out.append("</table>")
    return out


def _config_block(run: RunFiles) -> list[str]:
    if not run.config_text:
        return []
    return [
        "<h2>Resolved config</h2>",
        "<details><summary>config.yaml (every key, after preset, file and overrides)</summary>",
        f"<pre class='config'>{html.escape(run.config_text)}</pre></details>",
    ]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _config_differences(runs: Sequence[RunFiles]) -> list[str]:
    flat = [_flatten(r.config) for r in runs]
    keys = sorted({k for f in flat for k in f})
    differing = [
        k for k in keys if len({json.dumps(f.get(k), sort_keys=True, default=str) for f in flat}) > 1
    ]
    out = ["<h2>Config differences</h2>"]
    if not any(flat):
        return out + ["<p class='muted'>No config.yaml in these runs.</p>"]
    if not differing:
        return out + ["<p class='muted'>The runs have the same resolved config.</p>"]
    out.append(
        "<table class='config-diff'><tr><th>key</th>"
        + "".join(f"<th>{html.escape(r.name)}</th>" for r in runs)
    )
    for k in differing:
        cells = "".join(f"<td>{html.escape(json.dumps(f.get(k), default=str))}</td>" for f in flat)
        out.append(f"<tr><th>{html.escape(k)}</th>{cells}</tr>")
    out.append("</table>")
    return out


def sample_groups(samples: list[dict[str, Any]], limit: int) -> list[tuple[int, str, list[dict[str, Any]]]]:
    """Returns up to `limit` (step, prompt, completions) groups spread evenly over the run, latest included.

    Rows are grouped by step and group index (by step and prompt for rows logged before groups were)."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in samples:
        key = (row.get("step"), row.get("group", row.get("prompt")))
        groups.setdefault(key, []).append(row)
    keys = list(groups)
    if limit <= 0 or not keys:
        return []
    if len(keys) > limit:
        stride = (len(keys) - 1) / (limit - 1) if limit > 1 else 0
        keys = [keys[round(i * stride)] for i in range(limit)] if limit > 1 else keys[-1:]
    return [(int(k[0] or 0), str(groups[k][0].get("prompt", "")), groups[k]) for k in keys]


_SAMPLE_FIXED = (
    "step",
    "group",
    "prompt",
    "completion",
    "reward",
    "advantage",
    "in_loss",
    "length",
    "truncated",
    "turns",
)


def episode_html(turns: list[Any]) -> str:
    """Returns a multi-turn episode as HTML, turn by turn: the policy's text, its tool calls, tool results and
    an environment's observations each marked apart."""
    parts = []
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = str(turn.get("role", ""))
        content = html.escape(str(turn.get("content") or ""))
        if role == "tool":
            who = f"tool result · {html.escape(str(turn.get('name', '')))}"
            parts.append(f"<div class='turn tool'><div class='who'>{who}</div><pre>{content}</pre></div>")
        elif role == "assistant":
            calls = "".join(
                f"<pre>→ {html.escape(str(c.get('name')))}({html.escape(json.dumps(c.get('arguments'), default=str))})</pre>"
                for c in turn.get("tool_calls") or []
                if isinstance(c, dict)
            )
            kind = "turn call" if calls else "turn"
            parts.append(
                f"<div class='{kind}'><div class='who'>policy</div><pre>{content}</pre>{calls}</div>"
            )
        else:
            who = "environment" if role == "user" else html.escape(role)
            parts.append(f"<div class='turn user'><div class='who'>{who}</div><pre>{content}</pre></div>")
    return "".join(parts)


def _samples_section(run: RunFiles, limit: int) -> list[str]:
    chosen = sample_groups(run.samples, limit)
    if not chosen:
        return []
    out = [
        "<h2>Samples</h2>",
        f"<p class='muted'>{len(chosen)} of the logged groups, spread over the run: every completion of the "
        "prompt with each reward function's score, the combined reward and its advantage (grey rows were "
        "left out of the loss).</p>",
    ]
    for step, prompt, rows in chosen:
        scores = [k for k in dict.fromkeys(k for r in rows for k in r) if k.startswith("rewards/")]
        extra = [
            k for k in dict.fromkeys(k for r in rows for k in r) if k not in _SAMPLE_FIXED and k not in scores
        ]
        head = ["#", "completion", *(s.split("/", 1)[1] for s in scores), "reward"]
        head += [h for h in ("advantage", "length") if any(h in r for r in rows)] + extra
        out.append(f"<div class='group'><h3>step {step}</h3><pre class='prompt'>{html.escape(prompt)}</pre>")
        out.append(
            "<table class='completions'><tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in head) + "</tr>"
        )
        for i, r in enumerate(rows):
            adv = r.get("advantage")
            cls = "out" if r.get("in_loss") is False else ""
            sign = (
                "pos"
                if isinstance(adv, (int, float)) and adv > 0
                else "neg"
                if isinstance(adv, (int, float)) and adv < 0
                else ""
            )
            body = (
                episode_html(r["turns"])
                if isinstance(r.get("turns"), list)
                else f"<pre>{html.escape(str(r.get('completion', '')))}</pre>"
            )
            cells = [f"<td class='num'>{i + 1}</td>", f"<td>{body}</td>"]
            cells += [f"<td class='num'>{html.escape(format_value(r.get(s)))}</td>" for s in scores]
            cells.append(f"<td class='num'>{html.escape(format_value(r.get('reward')))}</td>")
            if any("advantage" in x for x in rows):
                cells.append(f"<td class='num {sign}'>{html.escape(format_value(adv))}</td>")
            if any("length" in x for x in rows):
                trunc = " (truncated)" if r.get("truncated") else ""
                cells.append(f"<td class='num'>{html.escape(format_value(r.get('length')))}{trunc}</td>")
            cells += [
                f"<td>{html.escape(format_value(r.get(k)) if not isinstance(r.get(k), str) else r[k])}</td>"
                for k in extra
            ]
            out.append(f"<tr class='{cls}'>" + "".join(cells) + "</tr>")
        out.append("</table></div>")
    return out


def write_report(run_dir: str | Path, *, title: str | None = None, max_groups: int = 12) -> Path:
    """Returns the path of run_dir/report.html, rebuilt from the run's files."""
    run = load_run(run_dir)
    title = title or f"cohort run: {run.name}"
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='muted'>Generated {time.strftime('%Y-%m-%d %H:%M:%S')} from {html.escape(str(run.path))}: "
        f"{len(run.metrics)} logged steps, {len(run.evals)} evaluations.</p>",
        *_summary_table([run]),
        *_health_section(run),
        *_evals_table(run),
        "<h2>Curves</h2>",
        _smoothing_note([run]),
        *_figures(build_panels([run])),
        *_samples_section(run, max_groups),
        *_config_block(run),
    ]
    out = run.path / "report.html"
    _write_atomically(out, _page(title, body))
    return out


def write_comparison(run_dirs: Sequence[str | Path], out: str | Path, *, title: str | None = None) -> Path:
    """Returns the path of an HTML page overlaying the runs' curves, with their summaries and config differences."""
    if len(run_dirs) < 2:
        raise ValueError("a comparison needs at least two run directories")
    if len(run_dirs) > len(COLOURS):
        raise ValueError(f"at most {len(COLOURS)} runs can be overlaid on one page; got {len(run_dirs)}")
    runs = [load_run(d) for d in run_dirs]
    names = [r.name for r in runs]
    for r in runs:  # two runs called "run" (runs/a/run, runs/b/run) stay apart in the legends
        if names.count(r.name) > 1:
            r.name = str(r.path)
    out = Path(out)
    if out.is_dir():
        out = out / "compare.html"
    title = title or "cohort runs: " + " vs ".join(r.name for r in runs)
    legend = "".join(
        f"<li><span style='color:{COLOURS[i]}'>&#9632;</span> {html.escape(r.name)} "
        f"<span class='muted'>({html.escape(str(r.path))}, {len(r.metrics)} steps)</span></li>"
        for i, r in enumerate(runs)
    )
    body = [
        f"<h1>{html.escape(title)}</h1>",
        f"<p class='muted'>Generated {time.strftime('%Y-%m-%d %H:%M:%S')}.</p><ul class='runs'>{legend}</ul>",
        *_summary_table(runs),
        "<h2>Curves</h2>",
        _smoothing_note(runs),
        *_figures(build_panels(runs)),
        *_config_differences(runs),
    ]
    _write_atomically(out, _page(title, body))
    return out


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with disk_full_named(
        path.parent, path.name, "free some space there and run `cohort report` on the folder"
    ):
        try:
            tmp.write_text(text, encoding="utf-8")
        except BaseException:
            tmp.unlink(missing_ok=True)  # the earlier page stays as it was
            raise
    tmp.replace(path)
