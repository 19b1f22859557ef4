"""A pytest plugin that appends every test's outcome to a JSONL file as it comes (GPU_CHECK_TESTLOG), so a
suite stopped by the GPU check's time limit still leaves its counts and failing test ids.

    python3 -m pytest -p benchmarks.gpu.pytest_record ...
"""

from __future__ import annotations

import json
import os

_FILE = None


def pytest_configure(config) -> None:
    """Opens the log in the controlling process (xdist's workers report to it; they write nothing)."""
    global _FILE
    path = os.environ.get("GPU_CHECK_TESTLOG")
    if path and not hasattr(config, "workerinput"):
        _FILE = open(path, "a", buffering=1)  # line-buffered: each record is on disk when written


def pytest_runtest_logreport(report) -> None:
    """Writes the outcome of a test's call, and of a setup or teardown that did not pass."""
    if _FILE is None or (report.when != "call" and report.passed):
        return
    if report.when == "teardown" and report.skipped:
        return
    outcome = report.outcome
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "xpassed"
    elif report.when != "call" and report.failed:
        outcome = "error"
    rec = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": outcome,
        "seconds": round(report.duration, 2),
    }
    if report.failed:
        rec["message"] = str(report.longrepr)[-600:]
    _FILE.write(json.dumps(rec) + "\n")


def pytest_sessionfinish(session, exitstatus) -> None:
    """Notes the suite's end and exit status (absent when the time limit stopped it)."""
    if _FILE is not None:
        _FILE.write(json.dumps({"finished": True, "exitstatus": int(exitstatus)}) + "\n")
        _FILE.flush()
