"""`cohort pipeline CONFIG`: seed 002's R1 recipe as one command, stage after stage, each resumable.

A pipeline file names a base model, an output folder and a list of stages. Each stage is one of cohort's
own commands with its arguments, exactly as on the command line:

```yaml
out_dir: runs/r1
model: runs/tiny                      # the first stage's model; each later stage takes the one before's
stages:
  - {name: cold_start, command: sft,    args: {task: addition, steps: 300, lr: 3e-3}}
  - {name: grpo,       command: train,  args: {data.task: addition, steps: 200, rewards: [accuracy]}}
  - {name: reject,     command: sample, args: {task: addition, k: 8, threshold: 1.0}}
  - {name: sft_again,  command: sft,    args: {data: "@reject", steps: 100, lr: 1e-4}}
  - {name: grpo_again, command: train,  args: {data.task: addition, steps: 200, rewards: [accuracy]}}
```

Stage *i* runs in ``out_dir/<i>-<name>``; the pipeline passes it its model (``--model`` or
``model.name_or_path``) and its output (``--out`` or ``out_dir``). ``"@name"`` in an argument is the
output of the earlier stage `name` (the JSONL file a ``sample`` stage wrote). A stage that finished
writes ``done.json`` and is skipped when the pipeline runs again (with other arguments it is refused, naming the
folders to delete to run it and the stages after it again); a ``train`` stage that was killed
resumes from its last checkpoint (``resume=auto``), an ``sft`` or ``sample`` stage restarts (they take
seconds to minutes). ``out_dir/pipeline.html`` overlays the curves of every ``train`` stage and lists
each stage's result. Every stage's arguments are checked before the first stage runs.
"""

from __future__ import annotations

import contextlib
import html
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cohort.commands.arguments import build_parser
from cohort.config import load_config, read_yaml_file
from cohort.errors import ConfigError, TrainingError, disk_full_named
from cohort.models import looks_like_path
from cohort.report import write_comparison, write_report
from cohort.runtime.rundir import RunLock

COMMANDS = ("sft", "train", "sample")
"""The cohort commands a stage may run."""


@dataclass
class Stage:
    """One step of the pipeline: a cohort command, its arguments, and where it writes."""

    name: str
    command: str
    args: dict[str, Any] = field(default_factory=dict)
    folder: Path = Path()

    @property
    def output(self) -> Path:
        """Returns what the stage produces: a model folder (sft, train) or a JSONL file (sample)."""
        if self.command == "sample":
            return self.folder / "accepted.jsonl"
        return self.folder / ("final" if self.command == "train" else "model")


@dataclass
class Pipeline:
    """A base model, an output folder and the stages to run in order."""

    out_dir: Path
    model: str
    stages: list[Stage]


PIPELINE_FIX = "free some space there and run the pipeline again: finished stages are skipped"
"""What to do when a pipeline's own files find the disk full."""


def load_pipeline(path: str | Path) -> Pipeline:
    """Returns the pipeline a YAML file describes, after checking every stage (ConfigError naming the problem)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"pipeline file {str(p)!r} does not exist; pass the path of a YAML file")
    spec = read_yaml_file(p, "pipeline file")
    if not isinstance(spec, dict):
        raise ConfigError(f"pipeline file {str(p)!r} must hold a mapping with out_dir, model and stages")
    unknown = sorted(set(spec) - {"out_dir", "model", "stages"})
    if unknown:
        raise ConfigError(
            f"pipeline file {str(p)!r}: unknown key(s) {unknown}; the keys are out_dir, model, stages"
        )
    for key in ("out_dir", "model", "stages"):
        if not spec.get(key):
            raise ConfigError(f"pipeline file {str(p)!r} needs {key!r}")
    if not isinstance(spec["stages"], list):
        raise ConfigError("pipeline: stages must be a list of {name, command, args} mappings")
    out_dir = Path(str(spec["out_dir"]))
    stages: list[Stage] = []
    for i, raw in enumerate(spec["stages"]):
        if not isinstance(raw, dict) or set(raw) - {"name", "command", "args"} or "command" not in raw:
            raise ConfigError(
                f"pipeline stage {i}: give a mapping with name, command ({', '.join(COMMANDS)}) and args"
            )
        name = str(raw.get("name") or f"stage{i}")
        if raw["command"] not in COMMANDS:
            raise ConfigError(
                f"pipeline stage {name!r}: command {raw['command']!r} is not one of {', '.join(COMMANDS)}"
            )
        if any(s.name == name for s in stages):
            raise ConfigError(f"pipeline: two stages are called {name!r}; names must be unique")
        args = raw.get("args") or {}
        if not isinstance(args, dict):
            raise ConfigError(f"pipeline stage {name!r}: args must be a mapping of option to value")
        stages.append(Stage(name, raw["command"], dict(args), out_dir / f"{i}-{name}"))
    pipe = Pipeline(out_dir, str(spec["model"]), stages)
    _check_exists("model", pipe.model)
    for i in range(len(stages)):
        _check_stage(pipe, i)
        for key in ("data", "data.path", "data.eval_path"):
            value = stages[i].args.get(key)
            if isinstance(value, str) and not value.startswith("@"):
                _check_exists(f"stage {stages[i].name!r}: {key}", value)
    return pipe


def _check_exists(what: str, name: str) -> None:
    """Raises ConfigError when `name` can only be a local path (not a hub id) and nothing is there."""
    path = Path(name).expanduser()
    local = looks_like_path(name) or Path(name).suffix in (".jsonl", ".json", ".csv", ".parquet")
    if local and not path.exists():
        raise ConfigError(
            f"pipeline {what}: {name!r} does not exist; fix the path before running the pipeline"
        )


def _resolve(pipe: Pipeline, i: int, value: Any) -> Any:
    """Returns `value` with an "@name" reference replaced by that earlier stage's output."""
    if isinstance(value, str) and value.startswith("@"):
        earlier = {s.name: s for s in pipe.stages[:i]}
        if value[1:] not in earlier:
            raise ConfigError(
                f"pipeline stage {pipe.stages[i].name!r}: {value!r} names no earlier stage "
                f"(earlier: {', '.join(earlier) or 'none'})"
            )
        return str(earlier[value[1:]].output)
    return value


def _model_of(pipe: Pipeline, i: int) -> str:
    """Returns the model stage `i` starts from: the base, or the last model an earlier stage wrote."""
    for stage in reversed(pipe.stages[:i]):
        if stage.command != "sample":
            return str(stage.output)
    return pipe.model


def stage_argv(pipe: Pipeline, i: int) -> list[str]:
    """Returns the `cohort` command line that runs stage `i`."""
    stage = pipe.stages[i]
    args = {k: _resolve(pipe, i, v) for k, v in stage.args.items()}
    if stage.command == "train":
        for fixed in ("model.name_or_path", "out_dir", "resume"):
            if fixed in args:
                raise ConfigError(
                    f"pipeline stage {stage.name!r}: {fixed} is set by the pipeline; leave it out"
                )
        over = {
            **args,
            "model.name_or_path": _model_of(pipe, i),
            "out_dir": str(stage.folder),
            "resume": "auto",
        }
        return [
            "train",
            *(f"{k}={json.dumps(v) if isinstance(v, (list, dict)) else v}" for k, v in over.items()),
        ]
    for fixed in ("model", "out"):
        if fixed in args:
            raise ConfigError(
                f"pipeline stage {stage.name!r}: --{fixed} is set by the pipeline; leave it out"
            )
    argv = [stage.command, "--model", _model_of(pipe, i), "--out", str(stage.output)]
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if v is True:
            argv.append(flag)
        elif v is not False and v is not None:
            argv += [flag, str(v)]
    return argv


def _check_stage(pipe: Pipeline, i: int) -> None:
    """Raises ConfigError when stage `i`'s arguments would be refused by its command."""
    argv = stage_argv(pipe, i)
    stage = pipe.stages[i]
    if stage.command == "train":
        try:
            load_config(None, argv[1:]).validate(need_model=False)
        except ConfigError as e:
            raise ConfigError(f"pipeline stage {stage.name!r}: {e}") from None
        return
    messages = io.StringIO()
    try:
        with contextlib.redirect_stderr(messages):  # argparse prints its error, then exits
            ns = build_parser().parse_args(argv)
    except SystemExit:
        lines = messages.getvalue().strip().splitlines()
        raise ConfigError(
            f"pipeline stage {stage.name!r}: {lines[-1] if lines else 'bad arguments'}"
        ) from None
    if not (ns.task or ns.data):
        raise ConfigError(
            f"pipeline stage {stage.name!r}: give args task (addition, multistep, code, multiply) or data (a file)"
        )


def run_pipeline(pipe: Pipeline, *, run: Callable[[list[str]], int], write: Any = print) -> dict[str, Any]:
    """Returns the pipeline's summary (stage name -> result) after running every stage not yet done.

    `run(argv)` runs one cohort command line and returns its exit code: the CLI passes its own `main`, so
    a stage runs exactly as the same command typed by hand (and this module need not import the CLI)."""
    pipe.out_dir.mkdir(parents=True, exist_ok=True)
    # The pipeline's own lock, before any stage runs: a second pipeline on this folder stops here instead of
    # re-running a stage into the first one's folders until that stage's lock stops it.
    lock = RunLock(pipe.out_dir).acquire()
    try:
        return _run_stages(pipe, run, write)
    finally:
        lock.release()


def _run_stages(pipe: Pipeline, run: Callable[[list[str]], int], write: Any) -> dict[str, Any]:
    """Returns the pipeline's summary after running, in order, every stage not yet done (the lock held)."""
    results: dict[str, Any] = {}
    for i, stage in enumerate(pipe.stages):
        done = stage.folder / "done.json"
        argv = stage_argv(pipe, i)
        if done.is_file():
            results[stage.name] = json.loads(done.read_text())
            _check_unchanged(pipe, i, results[stage.name].get("argv"), argv)
            write(f"[{i + 1}/{len(pipe.stages)}] {stage.name}: done earlier, skipped")
            continue
        stage.folder.mkdir(parents=True, exist_ok=True)
        write(f"[{i + 1}/{len(pipe.stages)}] {stage.name}: cohort {' '.join(argv)}")
        t0 = time.perf_counter()
        code = run(argv)
        if code != 0:
            raise TrainingError(
                f"pipeline stage {stage.name!r} failed (exit code {code}, its error above); fix it and run the "
                "pipeline again: finished stages are skipped"
            )
        result: dict[str, Any] = {
            "seconds": round(time.perf_counter() - t0, 1),
            "output": str(stage.output),
            "argv": argv,  # what it ran with: a later run with other arguments is told, not skipped silently
        }
        summary = stage.folder / "summary.json"
        if stage.command == "train" and summary.is_file():
            s = json.loads(summary.read_text())
            result.update({k: s.get(k) for k in ("accuracy_before", "accuracy_after", "steps")})
        if stage.command == "sample":
            result["accepted"] = sum(1 for line in stage.output.read_text().splitlines() if line.strip())
            _check_accepted(pipe, i, result["accepted"])
        with disk_full_named(done.parent, done.name, PIPELINE_FIX):
            done.write_text(json.dumps(result) + "\n")
        results[stage.name] = result
    with disk_full_named(pipe.out_dir, "the pipeline's report and summary.json", PIPELINE_FIX):
        _report(pipe, results)
        (pipe.out_dir / "summary.json").write_text(json.dumps(results, indent=2) + "\n")
    return results


def _check_unchanged(pipe: Pipeline, i: int, before: list[str] | None, now: list[str]) -> None:
    """Raises ConfigError when finished stage `i` ran with other arguments than the file gives it now: skipped, the
    change would be silently ignored, and the later stages built on its old output."""
    if before is None or list(before) == now:  # a done.json from before the arguments were recorded
        return
    stage = pipe.stages[i]
    gone = [a for a in before if a not in now]
    new = [a for a in now if a not in before]
    later = [str(s.folder) for s in pipe.stages[i:]]
    raise ConfigError(
        f"pipeline stage {stage.name!r} finished earlier with other arguments (then: {' '.join(gone) or '-'}; "
        f"now: {' '.join(new) or '-'}); its output, and every later stage's, came from the earlier ones. To run "
        f"it again with the new ones, delete {', '.join(later)}; or restore its arguments"
    )


def _check_accepted(pipe: Pipeline, i: int, accepted: int) -> None:
    """Raises TrainingError when sample stage `i` accepted nothing and a later stage reads its output: marked done,
    that stage would fail at every run of the pipeline, with the stage that could mend it skipped."""
    stage = pipe.stages[i]
    readers = [s.name for s in pipe.stages[i + 1 :] if f"@{stage.name}" in s.args.values()]
    if accepted or not readers:
        return
    raise TrainingError(
        f"pipeline stage {stage.name!r} accepted no completion ({stage.output} is empty), and stage "
        f"{readers[0]!r} trains on what it accepts: lower its threshold, raise its k, or train the model longer "
        "before it, then run the pipeline again (this stage runs again; the ones before it are skipped)"
    )


def _report(pipe: Pipeline, results: dict[str, Any]) -> None:
    """Writes out_dir/pipeline.html: each stage's result, and the train stages' curves overlaid."""
    trains = [
        s.folder for s in pipe.stages if s.command == "train" and (s.folder / "metrics.jsonl").is_file()
    ]
    out = pipe.out_dir / "pipeline.html"
    if len(trains) >= 2:
        write_comparison(trains, out, title=f"cohort pipeline: {pipe.out_dir.name}")
    elif trains:
        write_report(trains[0])
        (out).write_text((trains[0] / "report.html").read_text(encoding="utf-8"), encoding="utf-8")
    else:
        out.write_text("<!doctype html><html><body></body></html>", encoding="utf-8")
    rows = "".join(
        f"<tr><th>{html.escape(s.name)}</th><td>{html.escape(s.command)}</td>"
        f"<td>{html.escape(json.dumps(results.get(s.name, {})))}</td></tr>"
        for s in pipe.stages
    )
    table = f"<h2>Stages</h2><table><tr><th>stage</th><th>command</th><th>result</th></tr>{rows}</table>"
    page = out.read_text(encoding="utf-8")
    cut = page.find("<h2>")
    page = page[:cut] + table + page[cut:] if cut >= 0 else page.replace("</body>", table + "</body>")
    out.write_text(page, encoding="utf-8")
