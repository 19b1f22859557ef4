"""Where a run's numbers go: metrics.jsonl / samples.jsonl / evals.jsonl (the source of truth), TensorBoard and
W&B, and summary.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from cohort.errors import disk_full_named

RESUME_FIX = (
    "free some space there and resume with resume=auto: the checkpoints and the rows logged before are intact"
)
"""What to do when a run's log finds the disk full."""


def clean_value(value: Any) -> Any:
    """Returns a JSON-safe Python scalar (tensors become floats, NaN/inf become None)."""
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
            for name in ("metrics", "samples", "evals", "health")
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
        row = {k: clean_value(v) for k, v in metrics.items()}
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
        rows = [{k: clean_value(v) for k, v in s.items()} for s in samples]
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
        row = {"step": step, **{k: clean_value(v) for k, v in results.items()}}
        self._write("evals", row)
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(f"eval/{k}", v, step)
        if self._wandb is not None:
            self._wandb.log({f"eval/{k}": v for k, v in row.items() if k != "step"}, step=step)

    def log_health(self, row: dict[str, Any]) -> None:
        """Append a health check that fired (step, check, value, threshold, message) to health.jsonl."""
        self._write("health", {k: clean_value(v) for k, v in row.items()})

    def _write(self, name: str, row: dict[str, Any]) -> None:
        f = self._files[name]
        with disk_full_named(self.run_dir, f"{name}.jsonl", RESUME_FIX):
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
        text = format_value(v) if not isinstance(v, str) else v
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _cell(v: Any) -> Any:
    """Return a value a W&B table cell holds: numbers and strings as they are, anything else as text."""
    return v if v is None or isinstance(v, (bool, int, float, str)) else str(v)


def format_value(v: Any) -> str:
    """Returns a metric value as short text: 3 significant digits, "-" for a missing or non-finite one."""
    v = clean_value(v)
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def write_summary(run_dir: str | Path, summary: dict[str, Any]) -> Path:
    """Return the path of run_dir/summary.json after writing `summary` to it (JSON-safe, atomically)."""
    path = Path(run_dir) / "summary.json"
    tmp = path.with_suffix(".json.tmp")
    with disk_full_named(path.parent, "summary.json"):
        try:
            tmp.write_text(json.dumps(json_safe(summary), indent=2) + "\n", encoding="utf-8")
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    tmp.replace(path)
    return path


def json_safe(value: Any) -> Any:
    """Return `value` with nested dicts / lists cleaned by _clean and anything else JSON cannot hold as text."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    value = clean_value(value)
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
