"""The package's import graph stays a tree of layers: no import circle inside machgen/ (function-level imports
count: they are circles deferred, not removed), and the parts a user installs alone never reach the build.

Read from the source with ``ast`` (nothing is imported), so the fast tier runs it and a circle is named by its
modules, not found as a half-initialised module at some caller's import time."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "machgen"
MAX_MODULE_LINES = 600
# The parts that run without the export stack: the served runtime, the client and the HTTP API.
LIGHT_PARTS = ("machgen.api", "machgen.client", "machgen.runtime")
BUILD_PART = "machgen.builder"


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module under ``package`` by its dotted name (a package by its own name, for its __init__)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """The dotted names ``module`` imports anywhere in its body (module scope, functions, conditionals), relative
    imports resolved; ``from X import Y`` gives ``X.Y``, which is a module or a name in ``X``."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.update(f"{source}.{alias.name}" for alias in node.names)
            names.add(source)
    return names


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (a name imported from a module counts as that module)."""
    modules = module_files(package)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in modules.items():
        targets = {owner(name) for name in imported_names(module, path)}
        # A package the module lies in is already being imported when the module runs: no edge back to it.
        graph[module] = {t for t in targets if t and t != module and not module.startswith(t + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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
    return sorted(found)


def reaches_into(graph: dict[str, set[str]], parts: tuple[str, ...], forbidden: str) -> list[str]:
    """'a -> b' for each module of ``parts`` that imports a module of ``forbidden`` directly."""
    def within(module: str, part: str) -> bool:
        return module == part or module.startswith(part + ".")

    return sorted(f"{source} -> {target}" for source, targets in graph.items()
                  if any(within(source, part) for part in parts)
                  for target in targets if within(target, forbidden))


def test_no_import_circle_inside_machgen():
    found = circles(import_graph())
    assert not found, "import circles (each a helper in the wrong module):\n" + "\n".join(map(" <-> ".join, found))


def test_the_runtime_client_and_api_import_nothing_of_the_builder():
    found = reaches_into(import_graph(), LIGHT_PARTS, BUILD_PART)
    assert not found, "the light parts reach the build:\n" + "\n".join(found)


def test_no_module_is_over_600_lines():
    long = {str(path.relative_to(ROOT)): lines for path in module_files().values()
            if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them along their concerns): {long}"


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


@pytest.mark.parametrize("importer", [
    "from pkg.a import thing\n",                        # module scope
    "def later():\n    from pkg import a\n",            # function level: a circle deferred is still a circle
    "import pkg.a\n",
    "from . import a\n",                                 # relative
    "from .a import thing\n",
])
def test_a_circle_put_back_is_found(tmp_path, importer):
    package = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import other\nthing = 1\n",
                                "pkg/b.py": importer + "other = 2\n", "pkg/c.py": "from pkg import a\n"})
    assert circles(import_graph(package)) == [["pkg.a", "pkg.b"]]


def test_no_circle_is_found_where_there_is_none(tmp_path):
    package = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import other\n",
                                "pkg/b.py": "import json\nother = 2\n",
                                "pkg/sub/__init__.py": "from pkg.sub.c import x\n", "pkg/sub/c.py": "x = 1\n",
                                "pkg/d.py": "from pkg.sub import c\nfrom pkg import sub\n"})
    assert circles(import_graph(package)) == []


def test_a_light_part_importing_the_build_is_found(tmp_path):
    package = _write(tmp_path, {"pkg/__init__.py": "", "pkg/runtime/__init__.py": "",
                                "pkg/runtime/run.py": "def load():\n    from pkg.builder.build import x\n",
                                "pkg/builder/__init__.py": "", "pkg/builder/build.py": "x = 1\n"})
    assert reaches_into(import_graph(package), ("pkg.runtime",), "pkg.builder") == [
        "pkg.runtime.run -> pkg.builder.build"]
