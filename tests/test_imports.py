"""The package's import graph, read from the source (every import statement, those inside
functions and under `if TYPE_CHECKING:` too): the `unmask` command is imported by no module of the
package, and no two modules import each other, directly or around a circle."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import unmask

ROOT = Path(unmask.__file__).parent


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (`from a import b` counts a.b when b is one)."""
    files = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            deps |= {m for m in found if m in files and m != name}
        graph[name] = deps
    return graph


def test_no_module_imports_the_command() -> None:
    """bench, serve and trace take their arguments from unmask.cli_args, not from unmask.cli
    (which imports them to build its parser)."""
    graph = import_graph()
    assert "unmask.cli_args" in graph
    assert [m for m, deps in graph.items() if "unmask.cli" in deps] == []


def test_the_package_imports_one_way() -> None:
    """A circle hides which module is the lower one (a name shared by two modules belongs in a
    third that both import), and a function-level import that closes one only defers it."""
    graph = import_graph()
    assert len(graph) > 80 and "unmask.server.app" in graph
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as e:
        raise AssertionError(f"an import circle: {' -> '.join(e.args[1])}") from None
