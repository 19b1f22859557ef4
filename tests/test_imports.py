"""The import graph of cohort: no cycles (deferred imports counted too), `cohort.config` a leaf that nothing it
imports leads back to, and no function-level import of cohort's own modules outside the CLI's commands.

The graph is read from the source with `ast` (nothing is imported). An edge A -> B is an import of B at
A's module level (inside a top-level `if` / `try` too, but not under `if TYPE_CHECKING:`); `from cohort.x
import name` is an edge to `cohort.x.name` when that is a module, else to `cohort.x`; a package's
`__init__` importing its own submodules counts like any other import. Importing `cohort.x.y` from
outside `cohort.x` also runs `cohort.x/__init__`, so it is an edge to `cohort.x` as well.

Imports inside functions are deferred: they do not run at import time, so they are kept out of the
module-level graph, but the second graph below counts them too (a deferred cycle still ties two modules
into one unit that cannot be understood or tested apart).
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import cohort

PACKAGE_DIR = Path(cohort.__file__).resolve().parent
CONFIG = "cohort.config"


def _module_name(path: Path) -> str:
    """Returns the dotted name of a source file under the package."""
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    """Returns every module of cohort by dotted name."""
    return {_module_name(p): p for p in sorted(PACKAGE_DIR.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    """Returns whether `node` is `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`)."""
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _module_level_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Yields the imports that run when the module is imported (top level, top-level if / try blocks)."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _module_level_imports(node.body)
            yield from _module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _module_level_imports(block)


def _all_imports(tree: ast.AST, *, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Yields every import in a module, inside functions too, and under `if TYPE_CHECKING:` with `type_checking`."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node) and not type_checking:
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """Returns the cohort modules one import statement of `module` imports."""

    def known(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    out: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name.split(".")[0] == "cohort":
                out.add(known(alias.name))
        return out
    if node.level:
        base = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        base = f"{base}.{node.module}" if node.module else base
    else:
        base = node.module or ""
    if base.split(".")[0] != "cohort":
        return out
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.add(sub if sub in modules else known(base))
    return out


def import_graph(*, deferred: bool = False, type_checking: bool = False) -> dict[str, set[str]]:
    """Returns {module: the cohort modules it imports} (with `deferred`, imports inside functions too; with
    `type_checking`, those and the imports under `if TYPE_CHECKING:`)."""
    sources = _sources()
    modules = set(sources)
    graph: dict[str, set[str]] = {}
    for module, path in sources.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        if deferred or type_checking:
            nodes = _all_imports(tree, type_checking=type_checking)
        else:
            nodes = _module_level_imports(tree.body)
        edges: set[str] = set()
        for node in nodes:
            edges |= _targets(node, module, path.name == "__init__.py", modules)
        for target in list(edges):  # importing cohort.x.y from outside cohort.x runs cohort.x/__init__ first
            parts = target.split(".")
            for i in range(2, len(parts)):
                parent = ".".join(parts[:i])
                if parent in modules and module != parent and not module.startswith(parent + "."):
                    edges.add(parent)
        edges.discard(module)
        edges.discard("")
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Returns the import cycles of `graph`: its strongly connected components of two or more modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0

    def visit(root: str) -> None:  # Tarjan's algorithm, iterative (no recursion limit)
        nonlocal counter
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Returns every module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _in_config(module: str) -> bool:
    return module == CONFIG or module.startswith(CONFIG + ".")


def _leads_back(graph: dict[str, set[str]]) -> list[str]:
    """Returns 'config module -> import -> ... config module' for each outside import of config that leads back."""
    problems = []
    for module in sorted(m for m in graph if _in_config(m)):
        for dep in sorted(graph[module]):
            if not _in_config(dep):
                back = sorted(m for m in reachable(graph, dep) if _in_config(m))
                if back:
                    problems.append(f"{module} -> {dep} -> ... -> {', '.join(back)}")
    return problems


def test_the_graph_reader_sees_known_edges():
    graph = import_graph()
    assert {"cohort.config.schema", "cohort.config.loading"} <= graph[CONFIG]  # an __init__'s own submodules
    assert (
        "cohort.runtime.distributed" in graph["cohort.runtime.sharding"]
    )  # `from cohort import distributed as dist`
    assert "cohort.algo.kl" in graph["cohort.algo.losses"]  # a relative import
    assert CONFIG in graph["cohort.compat.drop_in"]
    assert CONFIG not in graph["cohort.models"]  # imported under `if TYPE_CHECKING:` only
    # importing cohort.fastpath.switches runs the package's __init__ first
    assert "cohort.fastpath" in graph["cohort.config.schema"]
    assert CONFIG in import_graph(deferred=True)["cohort.cli"]  # imported inside a function


def test_config_is_a_leaf_in_no_cycle():
    graph = import_graph()
    assert [c for c in cycles(graph) if any(_in_config(m) for m in c)] == []
    assert _leads_back(graph) == []
    # Counting the deferred imports of everything it reaches too: config's imports never come back to it.
    assert _leads_back(import_graph(deferred=True)) == []


def _deferred_own_imports(path: Path) -> list[int]:
    """Returns the line of each import of cohort's own modules in `path` that runs only when a function does."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(node) for node in _module_level_imports(tree.body)}
    found = []
    for node in _all_imports(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        own = node.level > 0 if isinstance(node, ast.ImportFrom) else False
        if id(node) not in top and (own or any(n.split(".")[0] == "cohort" for n in names)):
            found.append(node.lineno)
    return sorted(found)


def test_config_defers_no_import_of_cohort():
    """Every import of cohort's own modules in cohort.config is at module level, where the graph sees it."""
    found = [
        f"{path.name}:{line}"
        for module, path in _sources().items()
        if _in_config(module)
        for line in _deferred_own_imports(path)
    ]
    assert found == []


def test_only_the_cli_defers_imports_of_cohort():
    """A function-level import of cohort's own modules hides an edge of the graph: only cli's commands defer
    theirs, so that `cohort --help` (and a command) loads what that command needs and no more."""
    found = [
        f"{module}:{line}"
        for module, path in _sources().items()
        if module != "cohort.cli"
        for line in _deferred_own_imports(path)
    ]
    assert found == []


#: The modules of cohort outside cohort.config that importing the config may load: the owners' leaf modules,
#: which hold the names and the checks of the owners' own values, and import nothing else of cohort.
CONFIG_LEAVES = {
    "cohort",  # the package: lazy exports, the table of moved import paths
    "cohort.errors",
    "cohort.choices",
    "cohort.algo",  # lazy: its names load with the module that defines them
    "cohort.algo.options",  # the algorithm's names, tables and the checks of algo.* values, free of torch
    "cohort.compat",  # lazy
    "cohort.compat.fields",  # TRL's field names, data only
    "cohort.fastpath",
    "cohort.fastpath.switches",  # the fast-path switchboard's names and its FastConfig section
}


def test_config_loads_only_leaf_modules():
    """Importing cohort.config loads no module of cohort outside it but the owners' leaf modules, and neither
    transformers nor torch's distributed or model code."""
    import subprocess
    import sys

    code = "import sys, cohort.config; print(sorted(m for m in sys.modules if m.startswith(('cohort', 'transformers'))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(eval(out.stdout))  # a printed list of str
    outside = sorted(m for m in loaded if not _in_config(m) and m not in CONFIG_LEAVES)
    assert outside == []


def test_the_config_leaves_import_only_leaves():
    """What each leaf imports when it loads stays among the leaves: a new import there would pull the rest in."""
    graph = import_graph()
    assert {m: sorted(graph[m] - CONFIG_LEAVES) for m in CONFIG_LEAVES} == {m: [] for m in CONFIG_LEAVES}


def test_validation_changes_no_registry():
    """Validating a config that names user code imports none of it and registers nothing (the trainer's
    check_user_objective does, after the run's own checks)."""
    import cohort.algo.options as options
    from cohort.config import load_config

    kinds, estimators = dict(options.LOSS_KINDS), set(options.ADVANTAGE_NAMES)
    cfg = load_config(
        None,
        [
            "model.name_or_path=m",
            "data.task=addition",
            f"algo.loss_type={Path(__file__).parent / 'user_objective.py'}:my_loss",
            f"algo.advantage={Path(__file__).parent / 'user_objective.py'}:my_advantages",
        ],
    )
    cfg.validate()
    assert dict(options.LOSS_KINDS) == kinds and set(options.ADVANTAGE_NAMES) == estimators
    assert not any("user_objective" in name for name in sys.modules)


def test_no_module_level_import_cycles():
    assert cycles(import_graph()) == []


def test_deferred_imports_close_no_cycle():
    """cli runs `cohort pipeline` through cohort.commands.pipeline; the pipeline parses its stages with
    cohort.commands.arguments' parser and runs them through the `run` the CLI hands it, never importing the CLI."""
    assert cycles(import_graph(deferred=True)) == []


def test_type_only_imports_close_no_cycle():
    """An import for annotations alone still ties two modules into one unit: the trainer imports the loop, and
    the loop takes the run of parts, not the trainer."""
    graph = import_graph(type_checking=True)
    assert "cohort.models" in graph and CONFIG in graph["cohort.models"]  # under `if TYPE_CHECKING:` only
    assert cycles(graph) == []


def test_the_trainer_constructor_only_wires_the_run():
    """GRPOTrainer.__init__ translates its arguments, validates, builds the run of parts and resumes it; the
    building is cohort.train.run's."""
    import inspect

    from cohort.trainer import GRPOTrainer

    lines, _ = inspect.getsourcelines(GRPOTrainer.__init__)
    assert len(lines) <= 80
