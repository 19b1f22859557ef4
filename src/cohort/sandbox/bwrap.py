"""How a program is started in isolation: bubblewrap's command line, by who runs cohort.

Three ways, tried in this order of preference by :func:`choose_isolation`:

- ``userns`` (cohort runs as an ordinary user): bubblewrap unprivileged, ``--unshare-all`` (new user,
  mount, pid, network, IPC, UTS and cgroup namespaces). The process limit counts the sandbox's own processes
  (limits set inside a user namespace are counted per namespace).
- ``root`` (cohort runs as root, as CI does): the kernel exempts uid 0 from the process limit even inside a
  user namespace bubblewrap creates (it maps the sandbox's uid to the caller's, 0), so bubblewrap runs
  privileged (mount, pid, network, IPC, UTS and cgroup namespaces, no user namespace) and ``setpriv`` drops
  the program to a real unprivileged uid, one per concurrent run (``runner.slot_uid``: from 2000000000, a range
  no account uses), with no capabilities and ``no_new_privs``; the process limit then binds and counts that run
  alone.
- ``drop`` (root, where privileged mounts are refused, e.g. a container without CAP_SYS_ADMIN): cohort
  starts bubblewrap already as the slot's uid, which then works as in ``userns``; the interpreter must be
  readable by that uid.

The sandbox sees, read-only: ``/usr`` (with ``/bin``, ``/lib``... as on the host), ``/etc/ld.so.cache``,
the interpreter's installation, and the folders asked for; a fresh ``/proc`` and ``/dev``; a private tmpfs
``/tmp`` of bounded size, the only writable place, as its working and home directory. Not the user's home,
not the project, not ``/etc``, no network (an empty network namespace: loopback only), no environment
(bubblewrap itself starts with an empty environment, so ``/proc/1/environ`` is empty too).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from cohort.sandbox.launcher import LAUNCHER
from cohort.sandbox.limits import Limits

__all__ = [
    "INSTALL_HELP",
    "KINDS",
    "SLOT_UID_BASE",
    "Interpreter",
    "Isolation",
    "SandboxUnavailable",
    "default_python",
    "inspect_interpreter",
]

KINDS = ("userns", "root", "drop", "unsafe")
"""The ways a program can be started (module docstring); ``unsafe`` is resource limits only, no isolation."""

SLOT_UID_BASE = 2_000_000_000
"""Run as root, each concurrently running program has its own uid from here (``runner.slot_uid``): a range no
account or container mapping uses (systemd assigns none of 1879048192-2147483647), so the process limit counts
that run alone."""

INSTALL_HELP = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap; Arch: "
    "pacman -S bubblewrap) and make sure unprivileged user namespaces are allowed (sysctl "
    "user.max_user_namespaces > 0; Debian before 11: sysctl kernel.unprivileged_userns_clone=1; Ubuntu 24.04: "
    "sysctl kernel.apparmor_restrict_unprivileged_userns=0; in Docker, a seccomp profile that allows "
    "unshare/clone, e.g. --security-opt seccomp=unconfined). To run code without isolation anyway, with "
    "resource limits only, ask for it explicitly: Sandbox(unsafe=True) (`code(unsafe=True)` as a reward spec)"
)
"""What to do when no isolation works, appended to SandboxUnavailable's message."""

_SYSTEM_DIRS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}


class SandboxUnavailable(RuntimeError):
    """No way to isolate programs works on this machine (bubblewrap missing, namespaces refused, ...)."""


@dataclass(frozen=True)
class Interpreter:
    """A Python interpreter the sandbox runs, and the host folders it needs to start."""

    executable: str
    """Absolute, resolved path of the binary."""
    mounts: tuple[str, ...]
    """Folders outside /usr to mount read-only (its installation prefix)."""
    site_packages: tuple[str, ...]
    """The folders of installed packages (mounted and put on sys.path only when asked)."""
    version: int
    """Its ``sys.hexversion``, which the sandbox checks the interpreter it started reports."""


def default_python() -> str:
    """Returns the interpreter running cohort, resolved past a virtual environment to its base installation."""
    base = getattr(sys, "_base_executable", None) or sys.executable
    return os.path.realpath(base)


def _under(path: str, parents: Sequence[str]) -> bool:
    """Returns whether `path` is one of `parents` or inside one."""
    return any(path == p or path.startswith(p.rstrip("/") + "/") for p in parents)


@lru_cache(maxsize=8)
def inspect_interpreter(python: str | None = None) -> Interpreter:
    """Returns the Interpreter for `python` (None: cohort's own), asking it once where it is installed."""
    executable = os.path.realpath(shutil.which(python) or python) if python else default_python()
    if not os.access(executable, os.X_OK):
        raise SandboxUnavailable(f"sandbox interpreter {python or executable!r} is not an executable file")
    probe = (
        "import json, site, sys; "
        "print(json.dumps([sys.prefix, sys.exec_prefix, site.getsitepackages(), sys.hexversion]))"
    )
    try:
        done = subprocess.run(
            [executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60, env={}
        )
        prefix, exec_prefix, site_dirs, version = json.loads(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError) as exc:
        raise SandboxUnavailable(
            f"could not ask the interpreter {executable!r} where it is installed ({type(exc).__name__}: {exc}); "
            "give a working Python 3 as python="
        ) from exc
    mounts: list[str] = []
    for path in (prefix, exec_prefix, os.path.dirname(executable)):
        path = os.path.realpath(path)
        if not _under(path, ["/usr", *mounts]):
            mounts.append(path)
    if python is None:  # cohort's own packages are the ones its environment (a venv's) sees
        site_dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
    site = tuple(os.path.realpath(p) for p in site_dirs if os.path.isdir(p))
    return Interpreter(executable, tuple(mounts), site, int(version))


@lru_cache(maxsize=4)
def _bwrap_options(bwrap: str) -> frozenset[str]:
    """Returns the options this bubblewrap's --help lists."""
    try:
        text = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30, env={}).stdout
    except (OSError, subprocess.SubprocessError):
        return frozenset()
    return frozenset(word for word in text.split() if word.startswith("--"))


@dataclass(frozen=True)
class Isolation:
    """One way of starting programs (``kind``), with what it needs; ``command`` builds the command line."""

    kind: str
    interpreter: Interpreter
    bwrap: str | None = None
    setpriv: str | None = None
    mounts: tuple[str, ...] = ()
    """Extra host folders mounted read-only at the same path (the interpreter's and the ones asked for)."""
    options: frozenset[str] = field(default_factory=frozenset)

    def command(self, limits: Limits, uid: int | None) -> tuple[list[str], dict]:
        """Returns (argv, extra Popen keyword arguments) that run the launcher under `limits` as slot `uid`;
        under bubblewrap, the argument ``{info}`` stands for the --info-fd descriptor the caller opens."""
        python = [self.interpreter.executable, "-I", "-S", "-c", LAUNCHER, *limits.rlimit_args()]
        if self.kind == "unsafe":
            return python, {}
        assert self.bwrap is not None
        argv = [self.bwrap]
        if self.kind == "root":
            argv += [
                "--unshare-ipc",
                "--unshare-pid",
                "--unshare-net",
                "--unshare-uts",
                "--unshare-cgroup-try",
            ]
            argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:
            argv += ["--unshare-all", "--unshare-user"]
            if "--disable-userns" in self.options:
                argv += ["--disable-userns"]
        argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox"]
        argv += ["--info-fd", "{info}"]
        argv += ["--ro-bind", "/usr", "/usr"]
        for path in _SYSTEM_DIRS:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                argv += ["--ro-bind", path, path]
        if os.path.isfile("/etc/ld.so.cache"):  # the dynamic loader's index, the one file of /etc shown
            argv += ["--perms", "0755", "--dir", "/etc", "--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
        argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
        argv += ["--perms", "1777", "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp"]
        # After /tmp, so that a folder under the host's /tmp is mounted on top of the sandbox's own.
        made: set[str] = set()
        for path in self.mounts:
            # The folders above a mount are created by bubblewrap in the sandbox's own root; they hold nothing but
            # the way to the mount, so they are made enterable (bubblewrap copies the host's mode, e.g. /root's 0700,
            # which would hide the interpreter from the unprivileged uid it runs as).
            for parent in reversed(Path(path).parents[:-1]):
                if str(parent) not in made and not _under(str(parent), ["/usr", *_SYSTEM_DIRS]):
                    made.add(str(parent))
                    argv += ["--perms", "0755", "--dir", str(parent)]
            argv += ["--ro-bind", path, path]
        argv += ["--remount-ro", "/", "--chdir", "/tmp", "--clearenv"]
        for key, value in _ENV.items():
            argv += ["--setenv", key, value]
        argv += ["--"]
        extra: dict = {}
        if self.kind == "root":
            assert self.setpriv is not None and uid is not None
            argv += [self.setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
            argv += ["--inh-caps=-all", "--bounding-set=-all", "--"]
        elif self.kind == "drop":
            extra = {"user": uid, "group": uid, "extra_groups": []}
        return argv + python, extra

    @property
    def environment(self) -> dict[str, str]:
        """Returns the environment bubblewrap (or, unsafe, the program) starts with: empty, or the minimal one."""
        return dict(_ENV) if self.kind == "unsafe" else {}


def candidates(
    interpreter: Interpreter, mounts: Sequence[str], *, bwrap: str | None = None
) -> tuple[list[Isolation], str]:
    """Returns the isolations worth trying here, best first, and why others were not (for error messages)."""
    path = shutil.which(bwrap or "bwrap")
    if not path:
        return [], f"bubblewrap ({bwrap or 'bwrap'}) is not installed or not on PATH"
    options = _bwrap_options(path)
    if "--size" not in options:
        return [], (
            f"{path} is too old: it lacks --size, needed to bound the sandbox's /tmp (bubblewrap >= 0.6; "
            "Debian 12 ships 0.8)"
        )
    all_mounts = tuple(dict.fromkeys([*interpreter.mounts, *(os.path.realpath(m) for m in mounts)]))
    common = {"interpreter": interpreter, "bwrap": path, "mounts": all_mounts, "options": options}
    if os.geteuid() != 0:
        return [Isolation("userns", **common)], ""  # type: ignore[arg-type]
    found: list[Isolation] = []
    why = ""
    setpriv = shutil.which("setpriv")
    if setpriv:
        found.append(Isolation("root", setpriv=setpriv, **common))  # type: ignore[arg-type]
    else:
        why = (
            "setpriv (util-linux) is not installed, which drops root to an unprivileged uid in the sandbox; "
        )
    found.append(Isolation("drop", **common))  # type: ignore[arg-type]
    return found, why


def unreadable_by_others(paths: Sequence[str]) -> list[str]:
    """Returns the folders among `paths` (and their parents) that a user other than their owner cannot enter."""
    bad = []
    for path in paths:
        p = Path(path)
        for part in [p, *p.parents]:
            try:
                if not part.stat().st_mode & 0o001:
                    bad.append(str(part))
                    break
            except OSError:
                bad.append(str(part))
                break
    return bad
