"""What a sandboxed run costs: start-up per execution and executions per second, by isolation and concurrency.

    python benchmarks/sandbox/bench_sandbox.py [--n 200]

Start-up: the median wall time of a run of ``pass`` (sequential), beside the same interpreter started bare
(``python -I -S -c pass``, no sandbox). Throughput: N runs through ``Sandbox.run_many`` at each concurrency,
for ``pass`` and for one completion of the code task against its assert tests (the code reward's unit of work).
Prints a Markdown table (docs/sandbox.md holds the figures).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings

from cohort.data import get_task
from cohort.sandbox import Job, Limits, Sandbox, default_concurrency
from cohort.sandbox.bwrap import inspect_interpreter


def _median_ms(times: list[float]) -> float:
    """Returns the median of `times` (seconds) in milliseconds."""
    return 1000 * statistics.median(times)


def startup(box: Sandbox, n: int) -> float:
    """Returns the median milliseconds of one sequential run of ``pass`` in `box`."""
    box.run("pass")  # first run: caches warm
    times = []
    for _ in range(n):
        started = time.perf_counter()
        box.run("pass")
        times.append(time.perf_counter() - started)
    return _median_ms(times)


def bare_startup(n: int) -> float:
    """Returns the median milliseconds of the sandbox's interpreter started bare, ``-I -S -c pass``."""
    python = inspect_interpreter(None).executable
    times = []
    for _ in range(n):
        started = time.perf_counter()
        subprocess.run([python, "-I", "-S", "-c", "pass"], check=True)
        times.append(time.perf_counter() - started)
    return _median_ms(times)


def throughput(box: Sandbox, jobs: list[Job]) -> float:
    """Returns executions per second of `jobs` through the pool."""
    started = time.perf_counter()
    results = box.run_many(jobs)
    elapsed = time.perf_counter() - started
    bad = [r for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"{len(bad)} benchmark runs failed: {bad[0]}")
    return len(jobs) / elapsed


def main() -> None:
    """Prints the start-up and throughput table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=200, help="runs per measurement")
    args = parser.parse_args()
    task = get_task("code")
    problems = [task.problem(i) for i in range(0, task.size - 197, 7)]  # assert-tested functions only
    code_jobs = [
        Job(task.solution(i), tests=tuple(p["tests"])) for i, p in zip(range(0, task.size - 197, 7), problems)
    ]
    code_jobs = (code_jobs * (args.n // len(code_jobs) + 1))[: args.n]
    trivial = [Job("pass")] * args.n
    cores = default_concurrency()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, uid {os.geteuid()}, n = {args.n}")
    print(f"bare interpreter start-up (no sandbox): {bare_startup(args.n // 4):.1f} ms")
    print("| isolation | start-up (ms, median) | concurrency | `pass` runs/s | code-task runs/s |")
    print("|---|---|---|---|---|")
    for unsafe in (False, True):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sandboxes = {
                c: Sandbox(concurrency=c, unsafe=unsafe, limits=Limits())
                for c in sorted({1, cores, 2 * cores})
            }
        ms = startup(sandboxes[1], args.n // 4)
        for concurrency, box in sandboxes.items():
            rates = [throughput(box, trivial), throughput(box, code_jobs)]
            print(f"| {box.kind} | {ms:.1f} | {concurrency} | {rates[0]:.0f} | {rates[1]:.0f} |", flush=True)
            box.close()


if __name__ == "__main__":
    main()
