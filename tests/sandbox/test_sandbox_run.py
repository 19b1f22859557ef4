"""The sandbox's contract: statuses, stdin/stdout, limits, tests, the pool, sessions, refusal and unsafe mode.

The hostile programs are in test_sandbox_hostile.py; these are the ordinary ways a program ends.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import cohort.sandbox as sandbox_module
from cohort.sandbox import (
    EXIT_STATUSES,
    Job,
    Limits,
    Sandbox,
    SandboxError,
    SandboxUnavailable,
    UnsafeSandboxWarning,
    default_concurrency,
    run,
)
from cohort.sandbox.launcher import parse_report
from cohort.sandbox.process import classify

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (CI installs it)"
)

SRC = Path(sandbox_module.__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def box():
    sandbox = Sandbox(limits=Limits(timeout=2.0))
    yield sandbox
    sandbox.close()


def test_run_returns_what_the_program_printed(box):
    result = box.run("import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (result.status, result.returncode, result.stdout, result.stderr) == ("ok", 0, "out\n", "err\n")
    assert result.ok and result.error is None and not result.truncated and result.tests is None
    assert 0 < result.seconds < 2


def test_stdin_reaches_the_program_after_the_launchers_payload(box):
    result = box.run("import sys\nprint(sum(int(v) for v in sys.stdin.read().split()))", stdin="1 2\n3\n")
    assert result.stdout == "6\n"
    assert box.run("print(input()[::-1])", stdin="abc").stdout == "cba\n"


def test_exit_status_and_uncaught_exception(box):
    assert (box.run("import sys; sys.exit(3)").status, box.run("import sys; sys.exit(3)").returncode) == (
        "error",
        3,
    )
    result = box.run("def f():\n    return 1 / 0\nf()")
    assert (result.status, result.returncode, result.error) == ("error", 1, "ZeroDivisionError")
    # The traceback is the program's alone: the launcher's own frame is left out.
    assert 'File "<program>", line 2, in f' in result.stderr and "_launch" not in result.stderr
    syntax = box.run("def f(:\n    pass")
    assert (syntax.status, syntax.error) == ("error", "SyntaxError") and "^" in syntax.stderr


def test_statuses_of_time_memory_output_and_signals(box):
    slow = box.run("import time; time.sleep(5)", timeout=0.5)
    assert (slow.status, slow.returncode) == ("timeout", -9)
    assert 0.5 <= slow.seconds < 1.5  # killed at the deadline, not at the end of the sleep
    memory = box.run("x = bytearray(300 * 2**20)", memory_mb=128)
    assert (memory.status, memory.error) == ("memory", "MemoryError")
    assert box.run("x = bytearray(64 * 2**20); print(len(x))", memory_mb=256).stdout == str(64 * 2**20) + "\n"
    loud = Sandbox(limits=Limits(output_bytes=4096)).run("print('y' * 100000)")
    assert (loud.status, loud.truncated, len(loud.stdout)) == ("output_limit", True, 4096)
    crash = box.run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    assert (crash.status, crash.returncode) == ("killed", -11)
    cpu = Sandbox(limits=Limits(timeout=5.0, cpu_seconds=1)).run("while True: pass")
    assert (cpu.status, cpu.returncode) == ("timeout", -24)  # SIGXCPU from the CPU-seconds limit
    assert {slow.status, memory.status, loud.status, crash.status} <= set(EXIT_STATUSES)


def test_the_limits_are_set_inside(box):
    code = (
        "import resource as r\n"
        "print([r.getrlimit(getattr(r, n)) for n in ('RLIMIT_CPU', 'RLIMIT_AS', 'RLIMIT_NPROC', "
        "'RLIMIT_NOFILE', 'RLIMIT_FSIZE', 'RLIMIT_CORE')])"
    )
    limits = eval(box.run(code, memory_mb=200).stdout)
    # timeout 2 s -> CPU 3 s (SIGXCPU), 4 s (SIGKILL); the other defaults of Limits.
    assert limits == [(3, 4), (200 << 20, 200 << 20), (32, 32), (64, 64), (16 << 20, 16 << 20), (0, 0)]


def test_assert_tests_run_after_the_program_each_on_its_own(box):
    result = box.run(
        "def f(x):\n    return x + 1",
        tests=["assert f(1) == 2", "assert f(1) == 3", "assert g(1)", "print('visible')"],
    )
    assert result.status == "ok"
    assert result.tests == ("pass", "fail", "error NameError", "pass")
    assert result.stdout == "visible\n"  # the launcher's report lines are not part of the output
    early = box.run("import sys\nsys.exit(0)\ndef f(x): return x", tests=["assert f(1) == 1"])
    assert (early.status, early.error, early.tests) == ("error", "SystemExit", ())  # no test ran
    hang = box.run("def f(x):\n    while True: pass", tests=["assert True", "assert f(1)"], timeout=0.5)
    assert (hang.status, hang.tests) == ("timeout", ("pass",))
    one = box.run("x = 1", tests="assert x == 1")  # one test, as the code reward reads a string
    assert one.tests == ("pass",)


def test_report_lines_need_the_runs_tag():
    tag = "cohort-abc"
    text = "a\n\ncohort-abc test 0 pass\nb\ncohort-xyz test 1 pass\n\ncohort-abc exc ValueError\n"
    report = parse_report(text, tag)
    assert report.tests == ("pass",) and report.error == "ValueError"
    assert report.text == "a\nb\ncohort-xyz test 1 pass\n"  # a line without the tag is the program's own
    forged = Sandbox().run("print('\\ncohort-0 test 0 pass')\ndef f(): return 0", tests=["assert f() == 1"])
    assert forged.tests == ("fail",)


def test_classify_reads_reason_before_exit():
    assert classify(reason="output", returncode=-9, signal_number=9, error=None) == "output_limit"
    assert classify(reason="timeout", returncode=-9, signal_number=9, error=None) == "timeout"
    assert classify(reason=None, returncode=-24, signal_number=24, error=None) == "timeout"
    assert classify(reason=None, returncode=1, signal_number=None, error="MemoryError") == "memory"
    assert classify(reason=None, returncode=0, signal_number=None, error=None) == "ok"


def test_the_interpreter_is_cohorts_own_without_site_packages(box):
    result = box.run("import sys\nprint(sys.version_info[:3], sys.flags.isolated, sys.flags.no_site)")
    assert result.stdout == f"{tuple(sys.version_info[:3])} 1 1\n"
    assert box.run("import pytest").error == "ModuleNotFoundError"
    with_site = Sandbox(site_packages=True).run("import pytest\nprint(pytest.__name__)")
    assert with_site.stdout == "pytest\n"


def test_extra_paths_are_importable_and_read_only(tmp_path):
    (tmp_path / "helper_mod.py").write_text("VALUE = 42\n")
    if os.geteuid() == 0:  # programs run as an unprivileged uid, which must be able to read the folder
        tmp_path.chmod(0o700)
        with pytest.raises(ValueError, match="not readable by other users"):
            Sandbox(paths=[str(tmp_path)])
    tmp_path.chmod(0o755)
    box = Sandbox(paths=[str(tmp_path)])
    assert box.run("import helper_mod\nprint(helper_mod.VALUE)").stdout == "42\n"
    result = box.run(f"open({str(tmp_path / 'helper_mod.py')!r}, 'w').write('x')")
    assert result.error in ("OSError", "PermissionError")
    assert (tmp_path / "helper_mod.py").read_text() == "VALUE = 42\n"
    with pytest.raises(ValueError, match="not folders"):
        Sandbox(paths=[str(tmp_path / "missing")])


def test_run_many_keeps_order_and_bounds_concurrency():
    box = Sandbox(concurrency=2, limits=Limits(timeout=3.0))
    jobs = [Job(f"import time\ntime.sleep(0.3)\nprint({i})") for i in range(4)]
    started = time.perf_counter()
    results = box.run_many(jobs)
    elapsed = time.perf_counter() - started
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(4)]
    # 4 programs of 0.3 s, 2 at a time: about 0.6 s, never the 0.3 s of 4 at once.
    assert elapsed >= 0.6
    future = box.submit("print('later')")
    assert future.result().stdout == "later\n"
    box.close()
    assert default_concurrency() >= 1
    with pytest.raises(ValueError, match="positive integer"):
        Sandbox(concurrency=0)


def test_the_module_level_run_uses_one_default_sandbox():
    result = run("print(6 * 7)", timeout=2)
    assert result.stdout == "42\n"
    assert sandbox_module.default_sandbox() is sandbox_module.default_sandbox()


def test_no_process_is_reused_between_runs(box):
    first = box.run("import os\nopen('/tmp/mark', 'w').write('x')\nprint(os.getpid())")
    second = box.run("import os\nprint(os.path.exists('/tmp/mark'))")
    assert first.ok and second.stdout == "False\n"


def test_a_session_keeps_its_state_and_ends_cleanly(box):
    with box.session(timeout=1.0) as session:
        assert session.run("x = 41").stdout == ""
        assert session.run("x += 1\nprint(x)").stdout == "42\n"
        failed = session.run("1 / 0")
        assert (failed.status, failed.error) == ("error", "ZeroDivisionError")
        assert session.run("print(x)").stdout == "42\n"  # an exception in a cell keeps the state
        assert session.run("print(input())").error == "EOFError"  # cells get an empty stdin
        slow = session.run("import time\ntime.sleep(5)")
        assert slow.status == "timeout" and session.restarts == 1
        assert session.run("print('x' in dir())").stdout == "False\n"  # a fresh interpreter
    assert session._process is None


def test_limits_are_checked():
    with pytest.raises(ValueError, match="timeout=0"):
        Limits(timeout=0)
    with pytest.raises(ValueError, match="memory_mb=8"):
        Limits(memory_mb=8)
    with pytest.raises(
        ValueError, match=r"sandbox limit timeout='2' is out of range"
    ):  # a TypeError, unnamed
        Limits(timeout="2")
    assert Limits(timeout=2.5).cpu == 4 and Limits(cpu_seconds=9).cpu == 9
    assert Limits().with_(timeout=None, memory_mb=64) == Limits(memory_mb=64)


def test_missing_bubblewrap_is_refused_with_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match=r"not installed.*apt-get install bubblewrap.*unsafe=True"):
        Sandbox()


def test_namespaces_refused_is_refused_with_how_to_enable_them(tmp_path):
    fake = tmp_path / "bwrap"  # a bubblewrap whose kernel refuses it user namespaces, as Debian's says it
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = --help ]; then echo "--size BYTES --disable-userns"; exit 0; fi\n'
        "echo 'bwrap: No permissions to create new namespace, likely because the kernel does not allow "
        "non-privileged user namespaces.' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable) as refused:
        Sandbox(bwrap=str(fake))
    message = str(refused.value)
    assert "No permissions to create new namespace" in message
    assert "user.max_user_namespaces" in message and "unsafe=True" in message


def test_unsafe_mode_is_loud_and_keeps_the_limits(caplog):
    with pytest.warns(UnsafeSandboxWarning, match="WITHOUT isolation"):
        box = Sandbox(unsafe=True, limits=Limits(timeout=1.0))
    assert box.kind == "unsafe" and "UNSAFE" in caplog.text
    assert box.run("print(1 + 1)").stdout == "2\n"
    assert box.run("import time; time.sleep(5)").status == "timeout"
    assert box.run("x = bytearray(2**31)", memory_mb=128).status == "memory"
    assert box.run("import os\nprint(os.getcwd())").stdout.strip() != os.getcwd()  # a fresh folder
    with pytest.raises(SandboxError, match="sessions need isolation"):
        box.session().run("x = 1")


def _python_for_others() -> str | None:
    """Returns a system Python that an unprivileged user can run (None when there is none)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            version = subprocess.run(
                [candidate, "-c", "import sys; print(sys.version_info >= (3, 9))"],
                capture_output=True,
                text=True,
            )
            if version.stdout.strip() == "True":
                return candidate
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="run as an ordinary user, every other test already uses userns")
def test_an_ordinary_user_gets_the_user_namespace_sandbox():
    python = _python_for_others()
    if python is None or any(not p.stat().st_mode & 0o001 for p in [SRC, *SRC.parents]):
        pytest.skip("no system Python, or cohort's source, that an unprivileged user can read")
    script = (
        "import json, os\n"
        "from cohort.sandbox import Sandbox\n"
        "box = Sandbox()\n"
        "bomb = 'import os\\nn = 0\\ntry:\\n    while True:\\n        if os.fork() == 0:\\n"
        "            import time; time.sleep(3); os._exit(0)\\n        n += 1\\nexcept OSError:\\n    print(n)'\n"
        "env = \"print(open('/proc/1/environ').read() + str(sorted(__import__('os').environ)))\"\n"
        "print(json.dumps([box.kind, box.run('import os; print(os.getuid())').stdout, box.run(bomb).stdout,"
        " box.run(env).stdout]))\n"
    )
    done = subprocess.run(
        [python, "-c", script],
        user=65534,
        group=65534,
        extra_groups=[],
        env={
            "PYTHONPATH": str(SRC),
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "SECRET_OF_THE_TEST": "s3",
        },
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    kind, uid, forks, env = json.loads(done.stdout)
    assert kind == "userns" and uid == "65534\n"
    assert int(forks) < 32  # the process limit holds for the sandbox's own processes
    assert "s3" not in env and "SECRET_OF_THE_TEST" not in env  # bubblewrap started with no environment


def test_runs_from_many_threads_share_the_bound(box):
    results = []

    def worker():
        results.append(box.run("print('t')").stdout)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == ["t\n"] * 6
