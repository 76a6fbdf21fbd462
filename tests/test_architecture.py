"""The package's shape: imports flow one way, ``import convnets`` stays light, errors are exported.

Import cycles are found by parsing the sources with :mod:`ast` (nothing is imported), over every
module of ``convnets/``, ``processing_utils/`` and ``hubconf.py``. An edge A -> B is any import of B
by A that runs at some point:

* module-level imports (also inside ``if``/``try``/``with`` and class bodies),
* function-level ("lazy") imports and ``importlib.import_module("literal")`` calls, too. Lazy
  imports are how a module defers a *heavy* dependency (torch, onnx, DALI) until it is used; they
  must not be a way to hide a cycle: two modules that need each other are one concept split in two,
  and which of them breaks first depends on which one a caller happens to import first;
* and imports under ``if TYPE_CHECKING:`` too: they never run, but a type that two modules need
  from each other is one concept split in two, and type checkers and readers follow them;
* but not the implicit import of a module's parent packages (``convnets.models.specs`` runs
  ``convnets/__init__.py`` first): every submodule has that edge, and a package importing its own
  submodules is the normal direction.

Cycles are checked at three grains: between modules, between the parts of ``convnets``
(``convnets.train``, ``convnets.registry``, ...; see docs/design.md's layout) and between the
top-level packages (``convnets``, ``processing_utils``, ``hubconf``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import REPO

import convnets
from convnets import errors

PACKAGES = ("convnets", "processing_utils")


def _module_files() -> dict[str, Path]:
    """Dotted module name -> source file, for every module that the cycle check covers."""
    files = [REPO / "hubconf.py"] + [p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))]
    modules = {}
    for path in files:
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = _module_files()


def _own_module(name: str) -> str | None:
    """The covered module that importing ``name`` runs last (``convnets.errors.X`` -> ``convnets.errors``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imported_names(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """``(imported dotted name, line)`` for every import in the file (see the module doc)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import: climb from the importing module's package
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                # ``from pkg import sub`` imports the submodule when there is one, else a name of pkg.
                yield (f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base), node.lineno
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            yield node.args[0].value, node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """Module -> {imported covered module: line of the first such import}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        edges = graph.setdefault(module, {})
        for name, line in _imported_names(module, path):
            target = _own_module(name)
            if target is not None and target != module:
                edges.setdefault(target, line)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one node (Tarjan), as
    ``[a, b, ..., a]``, sorted so that the report is stable."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(_cycle_in(graph, set(c)) for c in components)


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """A shortest cycle through the first node of a strongly connected component (breadth-first)."""
    start = min(component)
    parents: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [start, *reversed(path[:-1]), start] if v != start else [start, start]
            if w in component and w not in parents:
                parents[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start}")  # pragma: no cover (a component has one)


def _collapse(graph: dict[str, dict[str, int]], group: Callable[[str], str]) -> dict[str, set[str]]:
    collapsed: dict[str, set[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            if group(a) != group(b):
                collapsed.setdefault(group(a), set()).add(group(b))
    return collapsed


def _describe(cycles: list[list[str]], graph: dict[str, dict[str, int]],
              group: Callable[[str], str] = lambda m: m) -> str:
    """``a -> b -> a`` per cycle, each step with one import that makes it (file:line)."""
    lines = []
    for cycle in cycles:
        steps = []
        for a, b in zip(cycle, cycle[1:]):
            where = next(f"{MODULES[m].relative_to(REPO)}:{line} imports {t}" for m, ts in sorted(graph.items())
                         for t, line in sorted(ts.items()) if group(m) == a and group(t) == b)
            steps.append(f"{a} -> {b} ({where})")
        lines.append(" ; ".join(steps))
    return "\n".join(lines)


def _part(module: str) -> str:
    """``convnets.train.data`` -> ``convnets.train``; the ``convnets`` package itself stays ``convnets``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "convnets" else parts[0]


def test_cycle_finder_finds_and_names_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "x": {"y"}, "y": {"x"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["x", "y", "x"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_covered_modules_are_found() -> None:
    assert {"hubconf", "convnets", "convnets.registry", "convnets.models.specs", "processing_utils"} <= set(MODULES)
    graph = import_graph()
    assert "convnets.errors" in graph["convnets.registry"]  # a module-level import
    assert "convnets.models.resnet" in graph["convnets.models"]  # importlib.import_module("...") in a function
    assert "convnets.deploy.optimize" in graph["convnets"]  # under TYPE_CHECKING: counted too


def test_no_import_cycle_between_modules() -> None:
    graph = import_graph()
    cycles = find_cycles({m: set(ts) for m, ts in graph.items()})
    assert not cycles, "import cycles between modules:\n" + _describe(cycles, graph)


def test_no_import_cycle_between_the_parts_of_convnets() -> None:
    graph = import_graph()
    cycles = find_cycles(_collapse(graph, _part))
    assert not cycles, "import cycles between packages:\n" + _describe(cycles, graph, _part)


def test_no_import_cycle_between_top_level_packages() -> None:
    graph = import_graph()

    def top(module: str) -> str:
        return module.split(".")[0]

    cycles = find_cycles(_collapse(graph, top))
    assert not cycles, "import cycles between top-level packages:\n" + _describe(cycles, graph, top)


def _loaded_after(statement: str) -> set[str]:
    """The modules in ``sys.modules`` after running ``statement`` in a fresh interpreter."""
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(json.loads(done.stdout.splitlines()[-1]))


HEAVY = ("torch._inductor", "torch._dynamo", "onnx", "onnxruntime", "openvino", "nvidia.dali",
         "convnets.train", "convnets.deploy", "convnets.commands")


def _matching(loaded: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in prefixes))


def test_import_convnets_loads_no_torch_and_no_feature_stack() -> None:
    loaded = _loaded_after("import convnets")
    assert _matching(loaded, HEAVY + ("torch",)) == []
    assert "convnets.errors" in loaded


def test_building_a_model_loads_no_compiler_exporter_or_data_backend() -> None:
    loaded = _loaded_after("import convnets\nconvnets.resnet50(device='meta')")
    assert "torch" in loaded and "convnets.registry" in loaded
    assert _matching(loaded, HEAVY) == []


@pytest.mark.parametrize("module", ["convnets.models.specs", "convnets.errors"])
def test_leaf_modules_load_no_torch(module: str) -> None:
    assert _matching(_loaded_after(f"import {module}"), ("torch", "numpy", "PIL")) == []


def test_every_error_class_is_exported_and_a_convnets_error() -> None:
    classes = {name: obj for name, obj in vars(errors).items()
               if isinstance(obj, type) and issubclass(obj, BaseException) and obj.__module__ == errors.__name__}
    assert len(classes) >= 16
    for name, cls in classes.items():
        assert issubclass(cls, errors.ConvnetsError), name
        assert name in convnets.__all__ and getattr(convnets, name) is cls, name
        # Each one also keeps a built-in base, so that ``except ValueError`` and the like still catch it.
        assert cls is errors.ConvnetsError or any(
            issubclass(cls, base) for base in (ValueError, TypeError, OSError, RuntimeError, ImportError)), name
