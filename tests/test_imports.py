"""The package's import graph, read from the source (every import statement, those inside
functions too): the `unmask` command is imported by no module of the package, and the server's
modules import each other one way only."""

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


def test_the_server_modules_import_each_other_one_way() -> None:
    graph = import_graph()
    server = {m: {d for d in deps if d.startswith("unmask.server")}
              for m, deps in graph.items() if m.startswith("unmask.server")}
    try:
        tuple(TopologicalSorter(server).static_order())
    except CycleError as e:
        raise AssertionError(f"an import circle: {' -> '.join(e.args[1])}") from None
