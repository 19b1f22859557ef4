"""TRL's trainer contract around cohort's loop: transformers' TrainerCallback events, TrainerState and
TrainerControl, and the rows of `trainer.state.log_history`.

cohort's step is one generation batch; TRL counts optimizer steps. `state.global_step` counts optimizer
steps (each cohort step makes num_iterations x num_minibatches of them), so a callback, `max_steps` and the
log rows read as on TRL. The events are transformers' (`on_init_end`, `on_train_begin`, `on_step_begin`,
`on_step_end`, `on_log`, `on_evaluate`, `on_save`, `on_train_end`), fired once per generation batch for the
step events; a callback that sets `control.should_training_stop`, `should_save`, `should_evaluate` or
`should_log` is obeyed at the end of that batch. The dispatch is written here rather than through
transformers' CallbackHandler, which expects (and warns without) the Trainer's own flow callback: cohort's
loop decides when to log, evaluate and save.
"""

from __future__ import annotations

import math
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState

from cohort.errors import ConfigError
from cohort.report.sinks import json_safe
from cohort.rewards.scoring import METRIC_STATS

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_step_begin",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_save",
)
"""The TrainerCallback events cohort fires (not the epoch events: cohort's steps do not align with epochs)."""

_LAST_VALUE = ("num_tokens", "ref/syncs")
"""Running totals: a log row keeps their latest value, not the mean over its window."""


class Callbacks:
    """The run's callbacks with the TrainerState and TrainerControl they share."""

    def __init__(self, callbacks: Any, *, args: Any, state: TrainerState):
        given = callbacks if isinstance(callbacks, (list, tuple)) else [callbacks] if callbacks else []
        self.callbacks = [_callback(cb) for cb in given]
        self.args = args
        self.state = state
        self.control = TrainerControl()
        self.objects: dict[str, Any] = {}
        """model, processing_class, optimizer, lr_scheduler: passed to every event, as transformers does."""
        self.window = LogWindow()
        """The generation batches' metrics since the last log_history row."""

    def fire(self, event: str, **kwargs: Any) -> TrainerControl:
        """Returns the control after calling `event` on every callback (one may return a new control)."""
        for cb in self.callbacks:
            handler = getattr(cb, event, None)
            if handler is None:
                continue
            result = handler(
                self.args,
                self.state,
                self.control,
                train_dataloader=None,
                eval_dataloader=None,
                **self.objects,
                **kwargs,
            )
            if result is not None:
                self.control = result
        return self.control

    def add(self, callback: Any) -> None:
        """Adds a callback (an instance, or a class to instantiate), as Trainer.add_callback."""
        self.callbacks.append(_callback(callback))

    def pop(self, callback: Any) -> Any:
        """Returns the callback removed: the instance given, or the first of the class given (None if absent)."""
        for cb in self.callbacks:
            if cb is callback or (isinstance(callback, type) and type(cb) is callback):
                self.callbacks.remove(cb)
                return cb
        return None

    def log(self, row: dict[str, Any]) -> None:
        """Appends `row` to state.log_history (with epoch and step, as transformers' Trainer.log) and fires
        on_log."""
        logs = {**row, "epoch": self.state.epoch, "step": self.state.global_step}
        self.state.log_history.append(logs)
        self.fire("on_log", logs=dict(row))

    def state_dict(self) -> dict[str, Any]:
        """Returns what a checkpoint keeps: the log rows and the open window, the best metric and each stateful
        callback's state."""
        s = self.state
        out: dict[str, Any] = {
            "log_history": [dict(r) for r in s.log_history],
            "best_metric": s.best_metric,
            "best_global_step": s.best_global_step,
            "best_model_checkpoint": s.best_model_checkpoint,
            "callbacks": {},
            # weights_only checkpoints hold plain values only: the window's rows keep their numbers and strings
            "log_window": [
                {k: v for k, v in row.items() if v is None or isinstance(v, (bool, int, float, str))}
                for row in self.window.rows
            ],
        }
        for cb in self.callbacks:  # transformers' ExportableState (EarlyStoppingCallback's patience counter)
            if callable(getattr(cb, "state", None)):
                out["callbacks"][type(cb).__name__] = json_safe(cb.state())
        return out

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Restores state_dict(): log rows and window, best metric, and the attributes of stateful callbacks."""
        s = self.state
        s.log_history = [dict(r) for r in saved.get("log_history", [])]
        self.window.rows = [dict(r) for r in saved.get("log_window", [])]
        s.best_metric = saved.get("best_metric")
        s.best_global_step = saved.get("best_global_step")
        s.best_model_checkpoint = saved.get("best_model_checkpoint")
        for cb in self.callbacks:
            kept = saved.get("callbacks", {}).get(type(cb).__name__)
            for name, value in (kept or {}).get("attributes", {}).items():
                setattr(cb, name, value)

    def track_best(self, metrics: dict[str, Any]) -> None:
        """Updates state.best_metric / best_global_step from an evaluation, as the Trainer does when
        args.metric_for_best_model is set (after on_evaluate has seen the previous best)."""
        name = getattr(self.args, "metric_for_best_model", None)
        if not name:
            return
        key = name if name.startswith("eval_") else f"eval_{name}"
        if key not in metrics:
            raise ConfigError(
                f"metric_for_best_model={name!r}: the evaluation has no {key!r}; it has "
                f"{', '.join(sorted(k for k in metrics if k.startswith('eval_')))}"
            )
        value = float(metrics[key])
        greater = getattr(self.args, "greater_is_better", None)
        greater = not key.endswith("loss") if greater is None else bool(greater)
        best = self.state.best_metric
        if best is None or (value > best if greater else value < best):
            self.state.best_metric = value
            self.state.best_global_step = self.state.global_step


def _callback(cb: Any) -> Any:
    """Returns a callback instance (a class is instantiated), refusing an object with no TrainerCallback event."""
    cb = cb() if isinstance(cb, type) else cb
    if not isinstance(cb, TrainerCallback) and not any(callable(getattr(cb, e, None)) for e in EVENTS):
        raise ConfigError(
            f"callbacks=[{type(cb).__name__}]: a callback is a transformers.TrainerCallback (or has its on_* "
            f"methods: {', '.join(EVENTS)})"
        )
    return cb


class LogWindow:
    """The metrics of the generation batches since the last log_history row."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.plain_metrics: set[str] = set()
        """Reward functions whose log_metric names a log row gives as TRL does, unprefixed: the user's own (cohort's
        built-in rewards keep `rewards/<func>/<name>`, whose bare names, `passed` or `seconds`, would say nothing)."""

    def add(self, metrics: dict[str, Any]) -> None:
        """Adds one generation batch's metrics."""
        self.rows.append(metrics)

    def flush(self) -> dict[str, Any]:
        """Returns TRL's log row for the window (numeric means; running totals' latest value; keys whose
        values were all None, such as kl at beta 0, left out; `learning_rate`: the rate the last optimizer step
        used, its batch's `lr`) and empties it."""
        out: dict[str, Any] = {}
        keys = dict.fromkeys(k for row in self.rows for k in row if k != "step")
        for key in keys:
            values = [
                row[key]
                for row in self.rows
                if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool)
            ]
            if not values:
                continue
            out[key] = values[-1] if key in _LAST_VALUE else math.fsum(values) / len(values)
        # A reward function's log_metric(name, ...) is `rewards/<func>/<name>` in metrics.jsonl; TRL logs `name`.
        for key in [k for k in out if k.count("/") == 2 and k.startswith("rewards/")]:
            _, func, name = key.split("/")
            if func in self.plain_metrics and name not in METRIC_STATS and name not in out:
                out[name] = out.pop(key)
        out["learning_rate"] = self.rows[-1]["lr"]
        self.rows = []
        return out
