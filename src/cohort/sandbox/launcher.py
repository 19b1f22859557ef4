"""The few lines that run first inside the sandbox, and the host's reading of what they report.

The sandboxed interpreter is started as ``python -I -S -c LAUNCHER <limits>``: isolated mode (no
``PYTHON*`` variables, no user site, no current directory on the path), no ``site`` (so no
site-packages unless asked). The launcher sets the resource limits, reads the payload (the program, its
tests, a per-run tag) from the head of stdin — so nothing about it is in argv, the environment or a file the
program could read — and leaves the rest of stdin to the program. The program runs as ``__main__`` in an
emptied ``__main__`` namespace (the launcher's names are gone).

The launcher reports to the host with lines ``\\n<tag> <event>\\n`` on stdout, which the host removes
from the output: ``exc <Name>`` (the program ended on an uncaught exception), ``test <i> pass|fail|error
<Name>`` (one per assert test), ``done`` (a session cell ended, on stdout and stderr). The tag is random per
run, so a program cannot print a passing report by chance; a program written to read the launcher's frame
could forge one (it runs in the same process): the sandbox bounds what code can do to the machine, not to
its own score (docs/sandbox.md).
"""

from __future__ import annotations

import marshal
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LAUNCHER", "Report", "frame", "new_tag", "parse_report"]

LAUNCHER = r"""
def _launch():
    import os, sys, resource
    cpu, memory, files, fsize, procs = (int(v) for v in sys.argv[1:6])
    for name, soft, hard in (("RLIMIT_CPU", cpu, cpu + 1), ("RLIMIT_AS", memory, memory),
                             ("RLIMIT_NOFILE", files, files), ("RLIMIT_FSIZE", fsize, fsize),
                             ("RLIMIT_NPROC", procs, procs), ("RLIMIT_CORE", 0, 0)):
        resource.setrlimit(getattr(resource, name), (soft, hard))

    def read_frame():
        head = b""
        while not head.endswith(b"\n"):
            byte = os.read(0, 1)
            if not byte or len(head) > 20:
                return None
            head += byte
        size, parts = int(head), []
        while size:
            chunk = os.read(0, size)
            if not chunk:
                return None
            parts.append(chunk)
            size -= len(chunk)
        import marshal
        return marshal.loads(b"".join(parts))

    payload = read_frame()
    if payload is None:
        os._exit(121)
    tag, tests, mode = payload["tag"], payload["tests"], payload["mode"]

    def report(event, streams=(1,)):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:
                pass
        for fd in streams:
            try:
                os.write(fd, ("\n" + tag + " " + event + "\n").encode())
            except OSError:
                pass

    def show(error):
        import traceback
        tb = error.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
            tb = tb.tb_next
        traceback.print_exception(type(error), error, tb)

    sys.argv[:] = ["<program>"]
    sys.path[:0] = payload["path"]
    import builtins
    main = sys.modules["__main__"].__dict__
    main.clear()
    main.update(__name__="__main__", __builtins__=builtins, __doc__=None)

    if mode == "session":
        import io
        sys.stdin = io.StringIO()
        while True:
            cell = read_frame()
            if cell is None:
                os._exit(0)
            try:
                exec(compile(cell["code"], "<cell>", "exec"), main)
            except SystemExit:
                pass
            except BaseException as error:
                report("exc " + type(error).__name__)
                show(error)
            report("done", (1, 2))

    try:
        program = compile(payload["code"], "<program>", "exec")
        exec(program, main)
    except SystemExit:
        if tests is None:
            raise
        report("exc SystemExit")
        os._exit(1)
    except BaseException as error:
        report("exc " + type(error).__name__)
        show(error)
        sys.exit(1)
    if tests is None:
        return
    for i, test in enumerate(tests):
        try:
            exec(compile(test, "<test %d>" % i, "exec"), main)
        except AssertionError:
            report("test %d fail" % i)
        except BaseException as error:
            report("test %d error %s" % (i, type(error).__name__))
        else:
            report("test %d pass" % i)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(0)

_launch()
"""
"""The launcher's source, passed with ``-c``; argv after it: CPU seconds, address space bytes, open files,
file size bytes, processes (``Limits.rlimit_args``)."""


def new_tag() -> str:
    """Returns a fresh random tag that marks the launcher's report lines of one run."""
    return "cohort-" + secrets.token_hex(12)


def frame(value: dict) -> bytes:
    """Returns `value` marshalled with its length in front, as the launcher reads a payload or a cell."""
    data = marshal.dumps(value, 2)  # version 2: plain str / list / dict / None read by any Python 3
    return b"%d\n" % len(data) + data


@dataclass(frozen=True)
class Report:
    """What the launcher reported in one run, and the output without its report lines."""

    text: str
    """The stream with the report lines taken out."""
    error: str | None
    """The type name of the exception the program ended on (None: it did not end on one)."""
    tests: tuple[str, ...]
    """Per assert test, in order, as far as they ran: ``pass``, ``fail`` or ``error <Name>``."""
    done: bool
    """Whether a session cell's ``done`` line was seen."""


def parse_report(text: str, tag: str) -> Report:
    """Returns the launcher's report lines found in `text` (one output stream) and the text without them."""
    pattern = re.compile("\n" + re.escape(tag) + " ([^\n]*)\n")
    events = pattern.findall(text)
    error: str | None = None
    tests: list[str] = []
    done = False
    for event in events:
        kind, _, rest = event.partition(" ")
        if kind == "exc" and error is None:
            error = rest
        elif kind == "test":
            index, _, outcome = rest.partition(" ")
            if index.isdigit() and int(index) == len(tests):
                tests.append(outcome)
        elif kind == "done":
            done = True
    return Report(pattern.sub("", text), error, tuple(tests), done)


def payload(code: str, *, tag: str, tests: Sequence[str] | None, mode: str, path: Sequence[str]) -> bytes:
    """Returns the framed payload the launcher reads first: the program, its tests, the tag and extra paths."""
    return frame(
        {
            "code": code,
            "tests": None if tests is None else list(tests),
            "tag": tag,
            "mode": mode,
            "path": list(path),
        }
    )
