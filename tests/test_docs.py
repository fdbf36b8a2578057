"""The documentation stays true: docs/architecture.md cites files and names that exist and maps
every module, relative links and their anchors resolve, a citation of a page's section
("docs/serving.md, "Ray Serve"") names text that page holds, every script a text cites exists,
scripts and results are named after what they measure, and no text cites an issue number."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from unmask.training.model_card import ISSUE_CITATION

ROOT = Path(__file__).resolve().parents[1]
ARCH = ROOT / "docs" / "architecture.md"
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
FILE_END = re.compile(r"\.(py|md|json|jsonl|yaml|toml|sh|js|html|png|gif|txt|pth|template)$")
NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def spans(text: str) -> list[str]:
    """The backticked spans of a markdown text, fenced blocks left out."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)


def cited_paths(text: str) -> list[str]:
    return [s.rstrip("/") for s in spans(text) if "/" in s and " " not in s and not s.startswith("/")]


def module_of(path: str) -> str:
    parts = Path(path).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def cited_modules(text: str) -> dict[str, str]:
    """Last name -> dotted module, for each unmask module the text cites by path."""
    mods = [module_of(p) for p in cited_paths(text) if p.startswith("unmask/") and p.endswith(".py")]
    return {m.rsplit(".", 1)[-1]: m for m in mods if not m.endswith("__main__")}


def has(obj: object, attr: str) -> bool:
    if hasattr(obj, attr):
        return True
    return dataclasses.is_dataclass(obj) and attr in {f.name for f in dataclasses.fields(obj)}


def resolves(name: str, modules: dict[str, str]) -> bool:
    """`unmask.a.B.c`, `a.B` (a: a cited module's last name) or `B.c` (B in a cited module)."""
    parts = name.split(".")
    if parts[0] == "unmask":
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            return _walk(obj, parts[cut:])
        return False
    if parts[0][0].islower():
        return parts[0] in modules and _walk(_import(modules[parts[0]]), parts[1:])
    return any(_walk(m, parts) for m in map(_import, modules.values()) if m is not None)


def _import(module: str) -> object | None:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:  # an optional extra this install lacks (ray)
        if e.name and e.name.split(".")[0] == "unmask":
            raise
        return None


def _walk(obj: object | None, attrs: list[str]) -> bool:
    for a in attrs:
        if obj is None or not has(obj, a):
            return False
        obj = getattr(obj, a, None) if hasattr(obj, a) else type(None)
    return obj is not None


def checked_names(text: str) -> list[str]:
    """Backticked names the check resolves: dotted names, and single CamelCase ones."""
    out = []
    for s in spans(text):
        s = s.removesuffix("()")
        if not NAME.match(s) or FILE_END.search(s):
            continue
        if "." in s or re.match(r"^_?[A-Z][a-z]\w*$", s):
            out.append(s)
    return out


def test_architecture_cites_paths_that_exist() -> None:
    paths = cited_paths(ARCH.read_text())
    assert len(paths) > 80
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_architecture_cites_names_that_exist() -> None:
    text = ARCH.read_text()
    modules = cited_modules(text)
    names = checked_names(text)
    assert len(names) > 60
    missing = [n for n in names if not resolves(n, modules)]
    assert not missing, missing


def test_the_module_map_names_every_module() -> None:
    cited = set(cited_paths(ARCH.read_text()))
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "unmask").rglob("*.py")}
    missing = sorted(f for f in files if f not in cited and not f.endswith("decoding/__init__.py")
                     and not f.endswith("engine/__init__.py") and not f.endswith("bench/__init__.py")
                     and not f.endswith("server/__init__.py") and not f.endswith("evaluation/__init__.py")
                     and not f.endswith("training/__init__.py"))
    assert not missing, f"modules missing from docs/architecture.md's map: {missing}"


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return [u for u in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", u)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    bad = []
    for url in links(page):
        path, _, frag = url.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{url}: no such file")
        elif frag and target.suffix == ".md" and frag not in anchors(target):
            bad.append(f"{url}: no heading #{frag} in {target.name}")
    assert not bad, bad


SOURCES = [*(ROOT / "unmask").rglob("*.py"), *(ROOT / "unmask").rglob("*.js"),
           *(ROOT / "tests").glob("*.py"), *(ROOT / "scripts").rglob("*"), ROOT / "pyproject.toml",
           *PAGES, *(ROOT / "benchmarks" / "extra").glob("*.md")]
CITATION = re.compile(r"(README|docs/[\w-]+\.md)(?:'s)?,?\s+(?:§\s+)?\"([^\"]+)\"")


def test_quoted_section_citations_name_text_the_page_holds() -> None:
    """`README, "X"` and `docs/page.md, "X"`: the page holds X (a heading or a phrase), so a
    section that moves takes its citations with it."""
    cited, bad = 0, []
    for src in SOURCES:
        if src.is_dir() or src.name == "test_docs.py":
            continue
        for page, quote in CITATION.findall(src.read_text()):
            target = ROOT / ("README.md" if page == "README" else page)
            body = " ".join(target.read_text().split()) if target.exists() else ""
            if " ".join(quote.split()) not in body:
                bad.append(f"{src.relative_to(ROOT)}: {page}, \"{quote}\"")
            cited += 1
    assert cited >= 8
    assert not bad, bad


def tracked(folder: str) -> list[Path]:
    """The files under ROOT/folder, bytecode caches and logs (git-ignored) left out."""
    return sorted(p for p in (ROOT / folder).rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix not in {".pyc", ".log"})


RESULT_TEXTS = [p for p in tracked("benchmarks") if p.suffix in {".md", ".txt"}]
CARDS = [*(ROOT / "unmask" / "assets").glob("*/MODEL_CARD.md"),
         *(ROOT / "unmask" / "training").glob("*.template")]
TEXTS = [p for p in dict.fromkeys([*SOURCES, *RESULT_TEXTS, *CARDS]) if p.is_file()]
# A word of a file name that is a work session or an abbreviated commit (hex, a digit and a
# letter, 7-40 long) says when a result ran, not what it measures (`engine-row-groups.md` does).
SESSION_OR_COMMIT = re.compile(r"session\d+|(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}", re.I)
SCRIPT_PATH = re.compile(r"(?<![\w/.-])scripts/[\w/.-]*\w\.(?:py|sh)\b")


def test_scripts_and_results_are_named_after_what_they_measure() -> None:
    files = [*tracked("scripts"), *tracked("benchmarks")]
    assert len(files) > 100
    bad = [str(f.relative_to(ROOT)) for f in files
           if any(SESSION_OR_COMMIT.fullmatch(word) for part in f.relative_to(ROOT).parts
                  for word in re.split(r"[-_.\s]+", part))]
    assert not bad, f"named after a session or a commit: {bad}"


def test_cited_scripts_exist() -> None:
    """`scripts/bench/serving.sh` in a page, a result's command or a docstring: the file is there
    (scripts/ is laid out by purpose, docs/benchmarking.md; a move takes its citations along)."""
    cited = {(str(src.relative_to(ROOT)), path)
             for src in TEXTS for path in SCRIPT_PATH.findall(src.read_text())}
    assert len(cited) > 100
    missing = sorted(f"{src}: {path}" for src, path in cited if not (ROOT / path).is_file())
    assert not missing, missing


SESSION_CITATION = re.compile(r"\b[Ss]ession ?\d+")


def test_no_text_cites_an_issue_or_a_session() -> None:
    """An issue or work session's number means nothing to a reader without the tracker or the
    logs: say what it stood for (the change, the target), or the commit."""
    bad = [f"{src.relative_to(ROOT)}: {m.group()!r}" for src in TEXTS
           for pattern in (ISSUE_CITATION, SESSION_CITATION) for m in pattern.finditer(src.read_text())]
    assert not bad, bad
