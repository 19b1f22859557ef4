"""Watching a run: a live rich bar in a terminal, plain log lines when stdout is not one (nohup, SLURM, CI), a
line per held-out evaluation, and transformers' own bars switched off around loads and saves."""

from __future__ import annotations

import contextlib
import datetime
import sys
import time
import warnings
from collections.abc import Iterator
from typing import Any

from cohort.report.sinks import clean_value, format_value


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
            parts = [f"reward {format_value(metrics.get('reward'))}"]
            if metrics.get("kl") is not None:
                parts.append(f"kl {format_value(metrics.get('kl'))}")
            if metrics.get("step_time") is not None:
                parts.append(f"{format_value(metrics.get('step_time'))} s/step")
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
        parts = [f"step {step}/{self.total}", f"reward {format_value(metrics.get('reward'))}"]
        if metrics.get("kl") is not None:
            parts.append(f"kl {format_value(metrics.get('kl'))}")
        if metrics.get("completions/mean_length") is not None:
            parts.append(f"length {format_value(metrics.get('completions/mean_length'))}")
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
            v = clean_value(v)
            parts.append(f"{k} {100 * v:.1f}%" if isinstance(v, (int, float)) else f"{k} -")
    if results.get("n") is not None:
        parts.append(f"{int(results['n'])} prompts")
    return " | ".join(parts)


def _duration(seconds: float) -> str:
    """Return seconds as H:MM:SS."""
    return str(datetime.timedelta(seconds=max(0, round(seconds))))
