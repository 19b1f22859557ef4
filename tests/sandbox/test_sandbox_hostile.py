"""Hostile programs: each must leave the machine and the run intact and score 0 with the right counted reason.

Every program goes through the `code` reward (one row whose tests a harmless solution would pass), which must
give it 0 and the outcome named in HOSTILE, and the run's result is checked where the harm would show: the
project, the home directory (a canary folder in each that the programs aim at), the test's own environment
variable, a listener this test opens on 127.0.0.1 (no traffic goes anywhere else), and the process table
(nothing a program started is left). Time limits are 1 s, so the suite takes seconds.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import socket
import time
from pathlib import Path

import pytest

import cohort
from cohort.rewards.code import OUTCOMES, make_code_reward
from cohort.sandbox import Limits, Sandbox
from cohort.sandbox.runner import slot_uid

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (CI installs it)"
)

PROJECT = Path(cohort.__file__).resolve().parents[2]
HOME = Path(pwd.getpwuid(os.getuid()).pw_dir)
SECRET = "cohort-test-secret-" + secrets.token_hex(8)
MARK = f"{secrets.randbelow(10**6) + 10**6}.25"  # a sleep length no other process uses: finds leftovers
TESTS = ["assert f(2) == 4"]  # a harmless `def f(x): return 2 * x` passes
OUR_UIDS = slot_uid(0)  # the first of this process's block of 4096 slot uids (root mode)


@pytest.fixture(scope="module")
def canaries():
    """Yields {name: path} of canary folders in the project and the home directory (removed afterwards)."""
    made = {}
    for name, root in (("project", PROJECT), ("home", HOME)):
        folder = root / f".cohort-sandbox-canary-{secrets.token_hex(4)}"
        folder.mkdir()
        (folder / "keep.txt").write_text("intact\n")
        made[name] = folder
    yield made
    for folder in made.values():
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def listener():
    """Yields (port, socket) of a TCP listener on 127.0.0.1 that no sandboxed program may reach."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    yield server.getsockname()[1], server
    server.close()


@pytest.fixture(scope="module")
def reward():
    return make_code_reward(timeout=1.0, memory_mb=256)


def _hostile(canaries, port):
    """Returns {case: (program, outcomes the reward may count)} for every hostile program of the issue."""
    project, home = canaries["project"], canaries["home"]
    return {
        "infinite loop": ("while True:\n    pass", {"timeout"}),
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            {"timeout"},
        ),
        "memory bomb": ("blocks = []\nwhile True:\n    blocks.append(bytearray(2**24))", {"memory"}),
        "huge file": (
            "with open('/tmp/huge', 'wb') as f:\n    while True:\n        f.write(b'0' * 2**20)",
            {"crash"},  # EFBIG at the 16 MiB file-size limit
        ),
        "disk filler": (
            "for i in range(1000):\n    with open(f'/tmp/part{i}', 'wb') as f:\n"
            "        for _ in range(15):\n            f.write(b'0' * 2**20)",
            {"crash"},  # ENOSPC when the 64 MiB /tmp is full
        ),
        "rm -rf ~": (
            f"import shutil, subprocess\nsubprocess.run(['rm', '-rf', {str(HOME)!r}], check=True)\n"
            f"shutil.rmtree({str(home)!r})",
            {"crash", "output_limit"},  # rm's error per read-only file can pass the output cap first
        ),
        "write into the project": (
            f"open({str(project / 'keep.txt')!r}, 'w').write('pwned')\n"
            f"open({str(PROJECT / 'pwned.py')!r}, 'w').write('pwned')",
            {"crash"},
        ),
        "delete outside its folder": (
            "import os, shutil\nos.remove('/usr/bin/env')\nshutil.rmtree('/usr')",
            {"crash"},
        ),
        "read /etc/shadow": ("print(open('/etc/shadow').read())", {"crash"}),
        "read the ssh keys": (
            f"import glob\nkeys = glob.glob({str(HOME / '.ssh' / '*')!r}) + glob.glob('/home/*/.ssh/*')\n"
            "print([open(k).read() for k in keys])\nassert keys, 'no key found'",
            {"crash"},
        ),
        "read cohort's environment": (
            "import glob, os\nfound = [repr(dict(os.environ))]\n"
            "for path in ['/proc/self/environ', '/proc/1/environ', *glob.glob('/proc/*/environ')]:\n"
            "    try:\n        found.append(open(path, 'rb').read().decode(errors='replace'))\n"
            "    except OSError as e:\n        found.append(str(e))\n"
            "print('\\n'.join(found))",
            {"wrong"},  # it runs, finds nothing, and never defines f
        ),
        "connect to 127.0.0.1": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5).sendall(b'hi')",
            {"crash"},
        ),
        "kill its parent": (
            f"import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)\n"
            f"os.kill({os.getpid()}, signal.SIGKILL)\nos.kill({os.getppid()}, signal.SIGKILL)",
            {"crash"},
        ),
        "sleep past the timeout": ("import time\ntime.sleep(60)", {"timeout"}),
        "print gigabytes": ("import sys\nwhile True:\n    sys.stdout.write('x' * 2**20)", {"output_limit"}),
        "outliving background process": (
            "import os, subprocess\n"
            f"subprocess.Popen(['sleep', '{MARK}'], start_new_session=True)\n"
            "if os.fork() == 0:\n    os.setsid()\n"
            f"    os.execvp('sleep', ['sleep', '{MARK}'])\n"
            "print('left behind')",
            {"wrong"},  # it ends at once, and never defines f
        ),
        "ctypes crash": ("import ctypes\nctypes.string_at(0)", {"crash"}),
    }


def _leftovers() -> list[str]:
    """Returns the processes of this machine that a sandboxed program of this test started (by the slot uids of
    this process in root mode, and by the mark of the background sleepers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            uid = entry.stat().st_uid
        except OSError:
            continue
        if MARK in cmdline or OUR_UIDS <= uid < OUR_UIDS + 4096:
            found.append(f"{entry.name} (uid {uid}): {cmdline}")
    return found


def _snapshot(root: Path) -> list[str]:
    """Returns the names at the top of `root` (what `rm -rf` would take away first)."""
    return sorted(p.name for p in root.iterdir())


def test_every_hostile_program_scores_zero_for_the_right_reason(reward, canaries, listener, monkeypatch):
    port, server = listener
    monkeypatch.setenv("COHORT_TEST_SECRET", SECRET)  # in cohort's environment while the programs run
    before = {"project": _snapshot(PROJECT), "home": _snapshot(HOME)}
    cases = _hostile(canaries, port)
    logged: dict[str, list[float]] = {}
    outcomes: dict[str, list[str]] = {}
    started = time.perf_counter()
    scores = reward(
        completions=[code for code, _ in cases.values()],
        tests=[TESTS] * len(cases),
        log_metric=lambda name, value: logged.setdefault(name, []).append(value),
        log_extra=lambda column, values: outcomes.setdefault(column, list(values)),
    )
    elapsed = time.perf_counter() - started
    got = dict(zip(cases, outcomes["code_outcome"]))
    for (case, (_, expected)), score in zip(cases.items(), scores):
        assert score == 0.0, case
        assert got[case] in expected, f"{case}: counted as {got[case]}, expected {expected}"
    # The counts per kind are the step's metrics (shares of the completions).
    for kind in OUTCOMES:
        assert sum(logged[kind]) == sum(o == kind for o in got.values()), kind
    assert sum(logged["timeout"]) >= 3 and sum(logged["crash"]) >= 8 and sum(logged["passed"]) == 0
    assert elapsed < 30, f"the hostile programs took {elapsed:.1f} s"
    # The machine and the run are intact.
    for name, folder in canaries.items():
        assert (folder / "keep.txt").read_text() == "intact\n", f"the {name} canary was touched"
    assert {"project": _snapshot(PROJECT), "home": _snapshot(HOME)} == before
    assert not (PROJECT / "pwned.py").exists()
    with pytest.raises(BlockingIOError):
        server.accept()  # nothing connected to the listener
    assert _leftovers() == []
    assert reward(completions=["def f(x):\n    return 2 * x"], tests=[TESTS]) == [1.0]  # still works


def test_what_the_programs_saw(canaries, listener, monkeypatch):
    port, _ = listener
    monkeypatch.setenv("COHORT_TEST_SECRET", SECRET)
    box = Sandbox(limits=Limits(timeout=1.0))
    cases = _hostile(canaries, port)
    env = box.run(cases["read cohort's environment"][0])
    assert env.ok and SECRET not in env.stdout and "COHORT_TEST_SECRET" not in env.stdout
    assert "HOME" in env.stdout  # the program did read its own (minimal) environment
    shadow = box.run(cases["read /etc/shadow"][0])
    assert shadow.error == "FileNotFoundError" and "root:" not in shadow.stdout
    keys = box.run(cases["read the ssh keys"][0])
    assert keys.error == "AssertionError"  # no key file visible at all
    listing = box.run(
        f"import os\nprint(os.path.exists({str(PROJECT)!r}), os.path.exists({str(HOME / '.ssh')!r}))"
    )
    assert listing.stdout == "False False\n"
    network = box.run("import socket\nsocket.getaddrinfo('example.com', 80)")
    assert network.error == "gaierror"  # no DNS, no network: the name is not even looked up outside
    gigabytes = box.run(cases["print gigabytes"][0])
    assert gigabytes.status == "output_limit" and len(gigabytes.stdout) <= Limits().output_bytes
    bomb = box.run(cases["fork bomb"][0])
    assert bomb.status == "timeout" and bomb.seconds < 3
    crash = box.run(cases["ctypes crash"][0])
    assert (crash.status, crash.returncode) == ("killed", -11)
    parent = box.run(cases["kill its parent"][0])
    assert parent.status == "error"  # refused (or ignored) inside its own pid namespace; we are alive
    started = time.perf_counter()
    background = box.run(cases["outliving background process"][0])
    assert background.ok and background.stdout == "left behind\n"
    assert time.perf_counter() - started < 1.0  # it did not wait for the sleepers...
    assert _leftovers() == []  # ...which died with the sandbox


def test_a_session_is_as_closed_as_a_run(canaries, listener, monkeypatch):
    port, server = listener
    monkeypatch.setenv("COHORT_TEST_SECRET", SECRET)
    with Sandbox(limits=Limits(timeout=1.0)).session() as session:
        assert session.run(f"import os\nprint(os.path.exists({str(canaries['home'])!r}))").stdout == "False\n"
        assert session.run("import os\nprint(repr(dict(os.environ)))").stdout.count(SECRET) == 0
        assert (
            session.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 0.5)").status
            == "error"
        )
        session.run(f"import subprocess\nsubprocess.Popen(['sleep', '{MARK}'], start_new_session=True)")
        assert session.run("while True:\n    pass").status == "timeout"
    with pytest.raises(BlockingIOError):
        server.accept()
    assert _leftovers() == []
