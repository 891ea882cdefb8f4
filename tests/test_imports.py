"""The package's import graph: no circles, and no library module importing the benchmark.

Every module of manual_train (its loops and bench too) is parsed with ast, not imported: module-level and
function-level imports alike (a lazy import is still a dependency), relative ones resolved. `import manual_train.a.b`
and `from manual_train.a import b` (b a submodule) are edges to manual_train.a.b; `from manual_train.a import name`
is an edge to manual_train.a. The test fails on any cycle, named (zero -> zero_fairscale -> zero), and on any import
of manual_train.bench from a module outside manual_train/bench/. The self-test feeds the checks a graph that breaks
both rules.
"""
from __future__ import annotations

import ast
import importlib.util
import pkgutil
from collections import deque
from pathlib import Path

import manual_train

PACKAGE = "manual_train"
BENCH = "manual_train.bench"


def package_modules() -> dict[str, bool]:
    """{module name: is a package} for manual_train itself and every module under it."""
    modules = {PACKAGE: True}
    for info in pkgutil.walk_packages(manual_train.__path__, prefix=PACKAGE + "."):
        modules[info.name] = info.ispkg
    return modules


def resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name a `from ... import` statement reads from (relative imports resolved)."""
    if node.level == 0:
        return node.module
    parts = module.split(".") if is_package else module.split(".")[:-1]  # the package this module is in
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def owning_module(name: str, modules: dict) -> str | None:
    """The longest prefix of the dotted `name` that is a module of the package (None: outside it)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def imports_of(module: str, is_package: bool, source: str, modules: dict) -> set[str]:
    """The package's modules that `module` imports anywhere in `source` (itself left out)."""
    targets = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets.update(owning_module(alias.name, modules) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = resolve_from(module, is_package, node)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in modules else owning_module(base, modules))
    return targets - {None, module}


def import_graph() -> dict[str, set[str]]:
    """{module: the package's modules it imports}, for every module of manual_train."""
    modules = package_modules()
    graph = {}
    for name, is_package in modules.items():
        source = Path(importlib.util.find_spec(name).origin).read_text()
        graph[name] = imports_of(name, is_package, source, modules)
    return graph


def shortest_cycle(graph: dict, start: str) -> list[str] | None:
    """The shortest path start -> ... -> start (breadth first), or None."""
    parent, queue = {}, deque([start])
    while queue:
        node = queue.popleft()
        for target in sorted(graph.get(node, ())):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1] + [start]
            if target not in parent:
                parent[target] = node
                queue.append(target)
    return None


def cycles(graph: dict) -> list[str]:
    """Every module's shortest cycle, each cycle once, as 'a -> b -> a' (the package prefix dropped)."""
    seen, named = set(), []
    for module in sorted(graph):
        cycle = shortest_cycle(graph, module)
        if cycle is None or frozenset(cycle) in seen:
            continue
        seen.add(frozenset(cycle))
        named.append(" -> ".join(m.removeprefix(PACKAGE + ".") for m in cycle))
    return named


def bench_imports(graph: dict) -> list[str]:
    """'module imports bench module' for each import of manual_train.bench from outside manual_train/bench/."""
    def in_bench(name):
        return name == BENCH or name.startswith(BENCH + ".")

    return [f"{module} imports {target}" for module in sorted(graph) if not in_bench(module)
            for target in sorted(graph[module]) if in_bench(target)]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert found == [], "import cycles (move the shared piece to the lower module):\n  " + "\n  ".join(found)


def test_no_library_module_imports_the_benchmark():
    found = bench_imports(import_graph())
    assert found == [], "the library imports the benchmark (manual_train/bench/):\n  " + "\n  ".join(found)


def test_the_checks_report_a_cycle_and_a_bench_import():
    """A synthetic package breaking both rules: the checks must say so (they can fail)."""
    modules = {"manual_train": True, "manual_train.a": False, "manual_train.b": False, "manual_train.sub": True,
               "manual_train.sub.c": False, "manual_train.bench": True, "manual_train.bench.x": False}
    sources = {
        "manual_train.a": "def f():\n    from manual_train.sub import c\n",  # function level: an edge to sub.c
        "manual_train.b": "import torch\nfrom manual_train import a, bench\n",  # a and bench: submodules
        "manual_train.sub.c": "from ..b import name\nfrom .. import sub\n",  # relative: b, and the package sub
        "manual_train.bench.x": "from manual_train.a import f\n",  # bench may import the library
    }
    graph = {m: imports_of(m, modules[m], sources.get(m, ""), modules) for m in modules}
    assert graph["manual_train.a"] == {"manual_train.sub.c"}
    assert graph["manual_train.b"] == {"manual_train.a", "manual_train.bench"}
    assert graph["manual_train.sub.c"] == {"manual_train.b", "manual_train.sub"}
    assert cycles(graph) == ["a -> sub.c -> b -> a"]
    assert bench_imports(graph) == ["manual_train.b imports manual_train.bench"]
