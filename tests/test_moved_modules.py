"""The import paths of 0.1.0 that moved into wings still import, as the same module, with a DeprecationWarning that
names the new path; the top of the package stays small and no two modules share a file name."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import cohort

PACKAGE = Path(cohort.__file__).resolve().parent


@pytest.mark.parametrize("old, new", sorted(cohort.MOVED_MODULES.items()))
def test_an_old_path_is_the_new_module_with_a_warning(old, new):
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"new = importlib.import_module({new!r})\n"
        "print(old is new, [str(w.message) for w in caught if w.category is DeprecationWarning])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    same, messages = out.split(" ", 1)
    assert same == "True"
    assert f"{old} moved to {new}" in messages


def test_every_new_path_exists_and_no_old_path_does():
    for old, new in cohort.MOVED_MODULES.items():
        assert importlib.util.find_spec(new) is not None, new
        assert not (PACKAGE.parent / (old.replace(".", "/") + ".py")).exists(), old


def test_an_unknown_module_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("cohort.no_such_module")


def test_at_most_twelve_loose_modules_and_three_shared_file_names():
    loose = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(loose) <= 12, loose
    names = Counter(p.name for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")
    shared = sorted(n for n, c in names.items() if c > 1)
    assert len(shared) <= 3, shared


def test_no_source_of_cohort_uses_an_old_path():
    """cohort's own code, tests, benchmarks and examples import the new paths (the old ones are for users)."""
    root = PACKAGE.parent.parent
    offenders = []
    for folder in ("src", "tests", "benchmarks", "examples"):
        for path in (root / folder).rglob("*.py"):
            if path.resolve() in (PACKAGE / "__init__.py", Path(__file__).resolve()):
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                else:
                    continue
                offenders += [
                    f"{path.relative_to(root)}:{node.lineno}: {n}" for n in names if n in cohort.MOVED_MODULES
                ]
    assert offenders == []
