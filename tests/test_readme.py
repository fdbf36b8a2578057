"""The README's examples do what it says they do.

An example that claims an output is a fenced code block (bash or python) followed by a block
whose info string is `text output`: the lines it shows, `...` standing for lines left out. Each
such example runs here (a bash example's `unmask` commands, without its install steps) on the
shipped model, and its stdout must show those lines, in order, whole.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)


def examples() -> list[tuple[str, str, str]]:
    """(language, code, claimed output) of each example that claims an output."""
    blocks = [(m[1].strip(), m[2]) for m in FENCE.finditer(README.read_text())]
    return [(lang, code, claim) for (lang, code), (info, claim) in zip(blocks, blocks[1:], strict=False)
            if info == "text output"]


def commands(code: str) -> list[tuple[list[str], str | None]]:
    """A bash example's `unmask` commands as (argv, stdin) (pip and venv steps left out): a
    command fed by `printf '...' |` gets what that printf prints as its stdin."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        for part in line.split("&&"):
            feed, _, command = part.rpartition("|") if "| unmask" in part else ("", "", part)
            words = shlex.split(command, comments=True)
            if words and Path(words[0]).name == "unmask":
                stdin = None
                if feed:
                    printf = shlex.split(feed)
                    assert printf[0] == "printf", f"only printf feeds an example: {feed!r}"
                    stdin = subprocess.run(printf, capture_output=True, text=True,
                                           check=True).stdout
                out.append(([sys.executable, "-m", "unmask.cli", *words[1:]], stdin))
    return out


def shows(output: str, claim: str) -> bool:
    """Whether output's lines hold the claimed runs of lines in order: a run that a `...` line
    does not precede starts the output, one that none follows ends it."""
    lines = [x.rstrip() for x in output.rstrip("\n").splitlines()]
    parts = claim.rstrip("\n").split("\n")
    runs: list[list[str]] = [[]]
    for line in parts:
        if line.strip() == "...":
            runs.append([])
        else:
            runs[-1].append(line.rstrip())
    at = 0
    for i, run in enumerate(runs):
        if not run:
            continue
        starts = [j for j in range(at, len(lines) - len(run) + 1) if lines[j:j + len(run)] == run]
        if i == 0:
            starts = [j for j in starts if j == 0]
        if i == len(runs) - 1:
            starts = [j for j in starts if j + len(run) == len(lines)]
        if not starts:
            return False
        at = starts[0] + len(run)
    return True


def test_the_claim_matcher() -> None:
    out = "a\nb\nc\nd\n"
    assert shows(out, "a\n...\nd") and shows(out, "a\nb\n...") and shows(out, "...\nc\nd")
    assert not shows(out, "b\n...") and not shows(out, "a\nc\n...") and not shows(out, "...\nc")
    assert not shows(out, "a\n...\nd\n...\nc")


def test_the_readme_has_examples_with_outputs() -> None:
    langs = [lang for lang, _, _ in examples()]
    assert "bash" in langs and "python" in langs, langs


@pytest.mark.parametrize("lang, code, claim", examples(),
                         ids=[f"{lang}-{i}" for i, (lang, _, _) in enumerate(examples())])
def test_readme_example_prints_what_it_claims(lang: str, code: str, claim: str,
                                              tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a shared machine: one thread is fastest
    runs = ([([sys.executable, "-c", code], None)] if lang == "python" else commands(code))
    assert runs, f"no command to run in {code!r}"
    for argv, stdin in runs:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, env=env,
                              cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    assert shows(done.stdout, claim), f"README claims:\n{claim}\ngot:\n{done.stdout}"


def test_every_request_field_is_documented() -> None:
    """max_completion_tokens worked but was in no field list: each field of the OpenAI request
    bodies is named in docs/serving.md's section on the server."""
    from unmask.server.protocol import ChatCompletionRequest, CompletionRequest

    page = README.parent / "docs" / "serving.md"
    section = page.read_text().split("## Serving: `unmask serve`")[1].split("\n## ")[0]
    for body in (CompletionRequest, ChatCompletionRequest):
        for name in body.model_fields:
            assert f"`{name}`" in section or f"`{name}." in section, name
