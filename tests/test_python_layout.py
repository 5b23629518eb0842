"""The layout of the Python package: its modules import one another without a circle.

Every module under python/llamarunner is parsed (not imported: the Ray modules need Ray),
and each of its imports, at module level or inside a function (or under TYPE_CHECKING), is an
edge to the package's module it names: ``from .x import y`` to ``x.y`` when that is a module,
else to ``x``; ``from . import _core`` to ``_core`` (its stub, _core.pyi). Imports of other
packages (``ray``, ``httpx``) are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "llamarunner"
ROOT = Path(__file__).resolve().parent.parent / "python" / PACKAGE


def module_names() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    found: dict[str, Path] = {}
    for path in sorted([*ROOT.rglob("*.py"), *ROOT.rglob("*.pyi")]):
        parts = [PACKAGE, *path.relative_to(ROOT).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found.setdefault(".".join(parts), path)
    return found


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that the module ``name`` (at ``path``) imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = name if _is_package(path) else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = here.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif base in modules:
                    found.add(base)
    found.discard(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of imports (its modules, the first repeated at the end), or None."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> list[str] | None:
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_stack:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in done:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_graph_sees_every_kind_of_import() -> None:
    graph = import_graph()
    # Module level, relative.
    assert "llamarunner.terminal_chat" in graph["llamarunner.cli"]
    # Inside a function, and a module imported by name from its package.
    assert "llamarunner.ray.cluster" in graph["llamarunner.cli"]
    assert "llamarunner._core" in graph["llamarunner.cli"]
    # Two levels up.
    assert "llamarunner.config" in graph["llamarunner.ray.replica"]
    # Under TYPE_CHECKING, in a package's __init__.
    assert "llamarunner.client" in graph["llamarunner"]
    # Other packages are not nodes.
    assert all(m.startswith(PACKAGE) for targets in graph.values() for m in targets)


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) is None


def test_no_module_imports_itself_back() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_only_the_entry_points_import_the_cli() -> None:
    """cli.py is the top of the graph: the helpers it shares live in modules it imports."""
    graph = import_graph()
    importers = sorted(m for m, targets in graph.items() if "llamarunner.cli" in targets)
    assert importers == ["llamarunner.__main__"]


def test_the_settings_table_and_the_health_wait_import_nothing_of_the_package() -> None:
    """Everything else builds on them (config, arguments, the clients, the server, the CLI)."""
    graph = import_graph()
    for leaf in ("llamarunner.settings", "llamarunner._health", "llamarunner._progress"):
        assert graph[leaf] == set(), leaf
