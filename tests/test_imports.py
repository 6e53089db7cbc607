"""DESIGN.md's import rules, checked on the tree: no module of the api or the batcher imports
torch (every module, imported in a fresh interpreter), no import cycle between tgq's top-level
packages, and imports run downward only ("Layering")."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections import defaultdict, deque
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import tgq

TGQ = Path(tgq.__file__).parent
PACKAGES = ("api", "batcher", "bulk", "cli", "devtools", "gpu_worker", "kernels", "migrations")
# DESIGN.md, "Layering (imports only run downward)", from the ground up. `devtools/` (model and
# tokenizer builders) and `migrations/` (Alembic, reading the api's metadata) are not in it:
# only the cycle rule holds for them.
LAYERS = ("kernels", "gpu_worker", "batcher", "api", "bulk", "cli")
TORCH_FREE = ("tgq.api", "tgq.batcher")
# Modules of TORCH_FREE that cannot import without an optional extra: name -> the extra and why.
NEEDS_EXTRA: dict[str, str] = {}

# Run in a fresh interpreter: imports every module of the packages in walk order and names the
# first one after which torch is loaded. walk_packages imports a package just after yielding it,
# so each module is imported (and checked) before anything inside it.
IMPORT_ALL = """
import importlib, json, pkgutil, sys
torch_by, failed, names = None, {}, []
for root in sys.argv[1:]:
    package = importlib.import_module(root)
    for info in pkgutil.walk_packages(package.__path__, root + "."):
        names.append(info.name)
        try:
            importlib.import_module(info.name)
        except Exception as error:
            failed[info.name] = repr(error)
        if torch_by is None and "torch" in sys.modules:
            torch_by = info.name
print(json.dumps({"torch_by": torch_by, "failed": failed, "names": names}))
"""

Site = str  # "api/app.py:113", where an import statement is
Graph = dict[str, dict[str, list[Site]]]  # package -> imported package -> import sites


def test_api_and_batcher_never_import_torch(tmp_path: Path) -> None:
    # A fresh interpreter (this one has torch: the session's conftest imports it), outside the
    # repository, that finds `tgq` where this one did.
    command = [sys.executable, "-c", IMPORT_ALL, *TORCH_FREE]
    env = {**os.environ, "PYTHONPATH": str(TGQ.parent)}
    done = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert len(found["names"]) > 50, found["names"]  # the walk found the packages' modules
    assert found["torch_by"] is None, f"importing {found['torch_by']} loads torch"
    failed = {name: error for name, error in found["failed"].items() if name not in NEEDS_EXTRA}
    assert not failed, f"cannot import (an optional extra goes in NEEDS_EXTRA, with why): {failed}"


def test_no_import_cycle_between_packages() -> None:
    graph = package_graph()
    cycles = [describe_cycle(graph, component) for component in cyclic_components(graph)]
    assert not cycles, "import cycles between tgq's packages:\n" + "\n".join(cycles)


def test_imports_run_down_the_layers() -> None:
    upward = [
        f"{source} imports {target} (above it): {by_file(sites)}"
        for source, targets in package_graph().items()
        for target, sites in targets.items()
        if source in LAYERS and target in LAYERS and LAYERS.index(target) > LAYERS.index(source)
    ]
    assert not upward, "\n".join(upward)


def test_kernels_import_no_other_folder() -> None:
    assert package_graph().get("kernels", {}) == {}


def test_the_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """Function-local imports and relative ones count; `if TYPE_CHECKING:` ones do not."""
    module = tmp_path / "bulk" / "sample.py"
    module.parent.mkdir()
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "import tgq.api.db\n"
        "from tgq import kernels\n"
        "if TYPE_CHECKING:\n"
        "    from tgq.cli import main\n"
        "else:\n"
        "    from tgq.batcher import logs\n"
        "def f():\n"
        "    from ..gpu_worker import config\n"
    )
    modules = [name for _, name in imported_modules(module, root=tmp_path)]
    assert modules == ["typing", "tgq.api.db", "tgq.kernels", "tgq.batcher", "tgq.gpu_worker"]


# --- the package graph ------------------------------------------------------------------------


@cache
def package_graph() -> Graph:
    """Every import between two of tgq's packages, from every module's source: module-level and
    function-local imports alike, except those under `if TYPE_CHECKING:`. Left out: the imports
    of a process's entry (a `__main__` that no module imports, as `python -m tgq.api`), which
    assembles its process from any layer and, imported by nothing, cannot close a cycle."""
    imports = {
        path: list(imported_modules(path))
        for package in PACKAGES
        for path in sorted((TGQ / package).rglob("*.py"))
    }
    imported = {module for found in imports.values() for _, module in found}
    graph: Graph = defaultdict(lambda: defaultdict(list))
    for path, found in imports.items():
        package = path.relative_to(TGQ).parts[0]
        if path.name == "__main__.py" and module_name(path) not in imported:
            continue
        for line, module in found:
            parts = module.split(".")
            if len(parts) > 1 and parts[0] == "tgq" and parts[1] != package:
                graph[package][parts[1]].append(f"{path.relative_to(TGQ)}:{line}")
    return {source: dict(targets) for source, targets in graph.items()}


def module_name(path: Path) -> str:
    return ".".join(("tgq", *path.relative_to(TGQ).with_suffix("").parts))


def imported_modules(path: Path, root: Path = TGQ) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for each import in the file; `from tgq import api` names
    `tgq.api`, `from .x import y` is resolved against the file's own package under `tgq`."""
    package = ("tgq", *path.relative_to(root).parent.parts)
    for node in walk_runtime(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *filter(None, [node.module])])
            if module == "tgq":
                for alias in node.names:
                    yield node.lineno, f"tgq.{alias.name}"
            else:
                yield node.lineno, module


def walk_runtime(node: ast.AST) -> Iterator[ast.AST]:
    """The node and those inside it, except the bodies of `if TYPE_CHECKING:` (their `else`
    runs)."""
    yield node
    if isinstance(node, ast.If) and is_type_checking(node.test):
        children: list[ast.AST] = [node.test, *node.orelse]
    else:
        children = list(ast.iter_child_nodes(node))
    for child in children:
        yield from walk_runtime(child)


def is_type_checking(test: ast.expr) -> bool:
    name = test.attr if isinstance(test, ast.Attribute) else getattr(test, "id", None)
    return name == "TYPE_CHECKING"


def cyclic_components(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one package (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(package: str) -> None:
        index[package] = lowlink[package] = len(index)
        stack.append(package)
        for target in graph.get(package, {}):
            if target not in index:
                visit(target)
                lowlink[package] = min(lowlink[package], lowlink[target])
            elif target in stack:
                lowlink[package] = min(lowlink[package], index[target])
        if lowlink[package] == index[package]:
            component: list[str] = []
            while not component or component[-1] != package:
                component.append(stack.pop())
            if len(component) > 1:
                components.append(sorted(component))

    for package in sorted(graph):
        if package not in index:
            visit(package)
    return components


def describe_cycle(graph: Graph, component: list[str]) -> str:
    """A shortest cycle through the component's first package, then every import inside it."""
    start = component[0]
    paths, queue = {start: [start]}, deque([start])
    cycle: list[str] = []
    while queue and not cycle:
        package = queue.popleft()
        for target in sorted(graph[package]):
            if target == start:
                cycle = [*paths[package], start]
                break
            if target in component and target not in paths:
                paths[target] = [*paths[package], target]
                queue.append(target)
    lines = [" -> ".join(cycle)]
    for source in component:
        for target, sites in sorted(graph[source].items()):
            if target in component:
                lines.append(f"  {source} -> {target}: {by_file(sites)}")
    return "\n".join(lines)


def by_file(sites: list[Site]) -> str:
    """The sites grouped by file: `a.py:1,5 b.py:2`."""
    lines: dict[str, list[str]] = defaultdict(list)
    for site in sites:
        path, line = site.rsplit(":", 1)
        lines[path].append(line)
    return " ".join(f"{path}:{','.join(numbers)}" for path, numbers in lines.items())
