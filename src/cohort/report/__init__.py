"""Seeing a run: metric sinks, progress, ``summary.json`` and ``report.html``.

- :mod:`cohort.report.sinks`: metrics.jsonl / samples.jsonl / evals.jsonl (the source of truth: one JSON
  object per optimizer step), TensorBoard and W&B, summary.json.
- :mod:`cohort.report.progress`: a live bar in a terminal, plain log lines otherwise, evaluation lines.
- :mod:`cohort.report.page` and :mod:`cohort.report.plots`: report.html for one run
  (``cohort report RUN``) and a page overlaying several (``cohort report RUN_A RUN_B``), rebuilt from the
  run directories' files, so they work on finished, interrupted or still-running runs.
"""

from cohort.report.page import build_panels, load_run, sample_groups, write_comparison, write_report
from cohort.report.progress import Progress, eval_line, quiet_hf_progress
from cohort.report.sinks import MetricsLogger, read_jsonl, samples_markdown, write_summary

__all__ = [
    "MetricsLogger",
    "Progress",
    "build_panels",
    "eval_line",
    "load_run",
    "quiet_hf_progress",
    "read_jsonl",
    "sample_groups",
    "samples_markdown",
    "write_comparison",
    "write_report",
    "write_summary",
]
