"""Python function completion from the CPython standard library found on this machine.

Prompt = the function's signature line(s) plus its docstring; response = the rest of the body.
Only small functions are kept (body <= ``MAX_BODY_CHARS`` characters, roughly <= 200 BPE
tokens). The split is by *file*: a stdlib file whose relative path hashes to 0 mod 10 is
held out, so no held-out function (nor any other function of its file) ever reaches training.
The checker only asks that the completion parses as the body of the prompt's function.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import random
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Split = Literal["train", "heldout"]

MAX_BODY_CHARS = 600
MIN_BODY_CHARS = 20
MAX_PROMPT_CHARS = 700
# Directories that are tests, vendored third-party code or platform-specific noise.
_SKIP_PARTS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo", "ensurepip",
               "__pycache__"}


@dataclass(frozen=True)
class CodeExample:
    """One function: ``prompt`` (signature + docstring), ``response`` (body), its source file."""

    prompt: str
    response: str
    source: str
    answer: None = None
    family: str = "code"


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def file_is_heldout(rel_path: str) -> bool:
    """Stable hash of the file's path relative to the stdlib root; 0 mod 10 means held out."""
    h = int.from_bytes(hashlib.blake2b(rel_path.encode(), digest_size=8).digest(), "little")
    return h % 10 == 0


def _functions_in(source: str, rel: str) -> list[CodeExample]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines()
    out: list[CodeExample] = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body
        if len(body) < 2 or ast.get_docstring(node, clean=False) is None:
            continue
        doc, first = body[0], body[1]
        # Prompt: from the decorator-free "def" line to the end of the docstring.
        prompt_lines = lines[node.lineno - 1 : doc.end_lineno]
        body_lines = lines[first.lineno - 1 : node.end_lineno]
        if not body_lines or doc.end_lineno is None or first.lineno <= doc.end_lineno:
            continue  # e.g. `"""doc"""; return x` on one line
        text = "\n".join(prompt_lines + body_lines)
        dedented = textwrap.dedent(text)
        n_prompt = len(prompt_lines)
        split_lines = dedented.split("\n")
        prompt = "\n".join(split_lines[:n_prompt]) + "\n"
        response = "\n".join(split_lines[n_prompt:])
        if not (MIN_BODY_CHARS <= len(response) <= MAX_BODY_CHARS) or len(prompt) > MAX_PROMPT_CHARS:
            continue
        if "\t" in text or not prompt.startswith(("def ", "async def ")):
            continue
        if not _parses(prompt, response):
            continue
        out.append(CodeExample(prompt=prompt, response=response, source=rel))
    return out


_CACHE_FORMAT = 1  # bump when extraction rules change


def _cache_path() -> Path:
    """Per-interpreter cache of the (slow, ~5-10 s) stdlib scan, keyed by path, version, rules."""
    key = f"{stdlib_dir()}|{sys.version}|{_CACHE_FORMAT}|{MAX_BODY_CHARS}|{MIN_BODY_CHARS}|{MAX_PROMPT_CHARS}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "unmask" / f"stdlib_functions_{digest}.json"


@functools.cache
def _all_functions() -> tuple[tuple[CodeExample, ...], tuple[CodeExample, ...]]:
    """(train, heldout) functions from the stdlib, in a deterministic order (cached on disk)."""
    path = _cache_path()
    try:
        raw = json.loads(path.read_text())
        return tuple(CodeExample(**c) for c in raw["train"]), tuple(CodeExample(**c) for c in raw["heldout"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    train, held = _scan_stdlib()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fields = ("prompt", "response", "source")
        tmp.write_text(json.dumps({"train": [{f: getattr(c, f) for f in fields} for c in train],
                                   "heldout": [{f: getattr(c, f) for f in fields} for c in held]}))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home only costs the rescan next time
    return train, held


def _scan_stdlib() -> tuple[tuple[CodeExample, ...], tuple[CodeExample, ...]]:
    root = stdlib_dir()
    train: list[CodeExample] = []
    held: list[CodeExample] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _SKIP_PARTS.intersection(rel.split("/")):
            continue
        try:
            src = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (held if file_is_heldout(rel) else train).extend(_functions_in(src, rel))
    # The stdlib repeats some functions verbatim across files: drop from training any function
    # whose prompt a held-out file also has, and keep one copy of each prompt per split.
    held = list({c.prompt: c for c in held}.values())
    held_prompts = {c.prompt for c in held}
    train = [c for c in {c.prompt: c for c in train}.values() if c.prompt not in held_prompts]
    return tuple(train), tuple(held)


def all_examples(split: Split) -> list[CodeExample]:
    train, held = _all_functions()
    return list(held if split == "heldout" else train)


def make_split(split: Split, n: int | None = None, seed: int = 0) -> list[CodeExample]:
    """Up to ``n`` distinct functions of ``split`` (all when ``n`` is None), shuffled by ``seed``."""
    xs = all_examples(split)
    random.Random(seed).shuffle(xs)
    return xs if n is None else xs[:n]


# The confirmation split (unmask.tasks.strata has the math one): held-out functions that no
# tuning or reported run drew. Every committed code run took the first <= 96 of the seed-0 or
# seed-1 shuffle; the first CONFIRM_RESERVE of each are left out.
CONFIRM_RESERVE = 128
_RESERVED_SEEDS = (0, 1)


def make_confirm(n: int | None = None, seed: int = 0) -> list[CodeExample]:
    """Up to ``n`` held-out functions outside every tuning draw, shuffled by their own seed."""
    reserved = {c.prompt for s in _RESERVED_SEEDS for c in make_split("heldout", CONFIRM_RESERVE, s)}
    xs = [c for c in all_examples("heldout") if c.prompt not in reserved]
    random.Random(f"unmask-confirm/{seed}").shuffle(xs)
    return xs if n is None else xs[:n]


def _parses(prompt: str, body: str) -> bool:
    try:
        ast.parse(prompt + body)
    except (SyntaxError, ValueError):
        return False
    return True


def check(prompt: str, text: str) -> bool:
    """True iff ``text`` parses as (the rest of) the body of the function begun by ``prompt``."""
    if not text.strip():
        return False
    return _parses(prompt, text.rstrip() + "\n")
