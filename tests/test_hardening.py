"""Properties of the package as a whole: what importing the CLI costs, which loaders it uses,
and which Python versions it runs on."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "unmask"
# The package's modules, plus the two that run outside it: setup.py (the build) and the hook
# unmask_lm_eval.pth imports at every interpreter start.
SOURCES = [*sorted(PACKAGE.rglob("*.py")), PACKAGE.parent / "_unmask_lm_eval.py", PACKAGE.parent / "setup.py"]


def _modules_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys, json\n"
                          "print(json.dumps(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_cli_import_and_help_do_not_import_torch() -> None:
    """`unmask --help` answers in a fraction of a second: torch (and transformers) load only
    when a command runs."""
    heavy = {"torch", "transformers", "matplotlib", "safetensors", "tokenizers"}
    assert not heavy & _modules_after("import unmask.cli")
    assert not heavy & _modules_after("import unmask.cli\nunmask.cli.build_parser()")
    # the public API still works as before: `unmask.LLM` loads torch when first touched
    assert "torch" in _modules_after("import unmask\nunmask.LLM")


def unsafe_loads(text: str, name: str) -> list[str]:
    """Calls in ``text`` that may unpickle code: torch.load without weights_only=True, and any
    pickle.load/pickle.loads (also imported as ``from pickle import load``)."""
    tree = ast.parse(text, name)
    from_torch = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                  and n.module == "torch" for a in n.names if a.name == "load"}
    from_pickle = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and n.module in ("pickle", "_pickle") for a in n.names if a.name in ("load", "loads")}
    bad = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = ast.unparse(node.func)
        if func in ("pickle.load", "pickle.loads") or func in from_pickle:
            bad.append(f"{name}:{node.lineno}: {func}")
        elif func == "torch.load" or func in from_torch:
            safe = any(k.arg == "weights_only" and isinstance(k.value, ast.Constant)
                       and k.value.value is True for k in node.keywords)
            if not safe:
                bad.append(f"{name}:{node.lineno}: {func} without weights_only=True")
    return bad


def test_no_unsafe_unpickling_in_the_package() -> None:
    """Loading a file must never run code from it (a crafted run folder, a crafted checkpoint)."""
    bad = [b for path in SOURCES for b in unsafe_loads(path.read_text(), str(path))]
    assert not bad, bad
    # A textual backstop for what the syntax walk could miss (getattr tricks aside).
    for path in SOURCES:
        assert not re.search(r"\bpickle\.loads?\b", path.read_text()), path


@pytest.mark.parametrize("text, found", [
    ("import torch\nst = torch.load(p, weights_only=False)\n", 1),
    ("import torch\nst = torch.load(p)\n", 1),
    ("from torch import load\nst = load(p, map_location='cpu')\n", 1),
    ("import pickle\nx = pickle.loads(b)\n", 1),
    ("from pickle import load as ld\nx = ld(f)\n", 1),
    ("import torch\nst = torch.load(p, map_location='cpu', weights_only=True)\n", 0),
])
def test_the_scan_sees_unsafe_loads(text: str, found: int) -> None:
    assert len(unsafe_loads(text, "m.py")) == found


# --- Python 3.10 (the oldest version pyproject.toml promises) ------------------------------------



def _find_py310() -> str | None:
    """A working Python 3.10 (pyenv's shims exist even where the version does not run)."""
    candidates = [str(p) for p in sorted(Path("/root/.pyenv/versions").glob("3.10.*/bin/python3.10"))]
    candidates += [p for p in (shutil.which("python3.10"),) if p]
    for exe in candidates:
        try:
            r = subprocess.run([exe, "-c", "import sys; assert sys.version_info[:2] == (3, 10)"],
                               capture_output=True, timeout=30)
        except OSError:
            continue
        if r.returncode == 0:
            return exe
    return None


PY310 = _find_py310()

# Run under 3.10: every module compiles, and every stdlib name the package reaches through a
# module (`datetime.UTC`, `from typing import Self`, ...) exists in 3.10's stdlib.
_CHECK_310 = r'''
import ast, importlib, sys
bad = []
for path in sys.argv[1:]:
    source = open(path, encoding="utf-8").read()
    try:
        compile(source, path, "exec")  # byte-compile: 3.11+ syntax fails here
    except SyntaxError as e:
        bad.append(f"{path}:{e.lineno}: {e.msg}")
        continue
    tree = ast.parse(source)
    alias = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in sys.stdlib_module_names:
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] in sys.stdlib_module_names and node.module != "__future__":
            mod = importlib.import_module(node.module)
            for a in node.names:
                if not hasattr(mod, a.name):
                    try:
                        importlib.import_module(node.module + "." + a.name)
                    except ImportError:
                        bad.append(f"{path}:{node.lineno}: from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in alias:
            mod = importlib.import_module(alias[node.value.id])
            if not hasattr(mod, node.attr):
                try:
                    importlib.import_module(alias[node.value.id] + "." + node.attr)
                except ImportError:
                    bad.append(f"{path}:{node.lineno}: {alias[node.value.id]}.{node.attr}")
print("\n".join(bad))
sys.exit(1 if bad else 0)
'''


@pytest.mark.skipif(PY310 is None, reason="no Python 3.10 interpreter on this machine")
def test_package_compiles_and_uses_only_310_stdlib() -> None:
    r = subprocess.run([PY310, "-c", _CHECK_310, *map(str, SOURCES)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(PY310 is None, reason="no Python 3.10 interpreter on this machine")
def test_310_check_sees_datetime_utc(tmp_path: Path) -> None:
    """The check above catches what broke `unmask bench` on 3.10."""
    f = tmp_path / "m.py"
    f.write_text("import datetime as _dt\nnow = _dt.datetime.now(_dt.UTC)\n")
    r = subprocess.run([PY310, "-c", _CHECK_310, str(f)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "datetime.UTC" in r.stdout


def test_ruff_targets_the_oldest_supported_python() -> None:
    import tomllib

    conf = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    oldest = conf["project"]["requires-python"].removeprefix(">=")
    assert conf["tool"]["ruff"]["target-version"] == "py" + oldest.replace(".", "")


# --- the design document the code cites is in the repository ------------------------------------

ROOT = PACKAGE.parent


def script_files() -> list[Path]:
    """scripts/ and its folders by purpose (docs/benchmarking.md), bytecode caches left out."""
    return sorted(p for p in (ROOT / "scripts").rglob("*") if p.is_file() and "__pycache__" not in p.parts)


def test_design_citations_name_sections_that_exist() -> None:
    design = (ROOT / "docs" / "design.md").read_text()
    headings = [h.strip() for h in re.findall(r"^#{2,3} (.+)$", design, flags=re.M)]
    cited = 0
    pages = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "design.md")
    for path in [*SOURCES, *sorted((ROOT / "tests").glob("*.py")), *script_files(),
                 ROOT / "README.md", ROOT / "BENCHMARKS.md", *pages]:
        text = path.read_text()
        assert not re.search(r"DESIGN(\.md)? (section|§)", text), f"{path}: cites a document not here"
        for m in re.finditer(r"docs/design\.md\s+§\s+", text):
            after = " ".join(text[m.end():m.end() + 80].split())
            assert any(after.startswith(h) for h in headings), f"{path}: § {after[:40]}..."
            cited += 1
    assert cited >= 10
