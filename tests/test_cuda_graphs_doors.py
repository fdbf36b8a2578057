"""`--cuda-graphs` at every door (unmask/engine/graphs.py): `LLM(cuda_graphs=...)`, `unmask
generate` and `unmask serve`. On a machine without a CUDA device, `on` is refused before any
request in one line saying what works instead (exit 2), `auto` decodes eagerly and the same
tokens as `off`, and a bad mode is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_model_dir

from unmask.api import LLM
from unmask.decoding.params import DecodeParams
from unmask.errors import InputError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("sdar"), "sdar")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "unmask.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_llm_refuses_on_without_a_device_and_auto_decodes_as_off(folder: Path) -> None:
    with pytest.raises(InputError, match="--cuda-graphs on: they need a CUDA device"):
        LLM(str(folder), device="cpu", cuda_graphs="on")
    with pytest.raises(InputError, match="cuda_graphs must be one of auto, on, off"):
        LLM(str(folder), device="cpu", cuda_graphs=True)
    params = DecodeParams.parse("threshold", gen_length=8, block_length=4)
    auto, off = (LLM(str(folder), device="cpu", cuda_graphs=m) for m in ("auto", "off"))
    got = [g.token_ids for g in auto.generate_ids([[5, 6, 7]], params)]
    assert got == [g.token_ids for g in off.generate_ids([[5, 6, 7]], params)]


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve", "--port", "0"]])
def test_the_commands_refuse_on_without_a_device_in_one_line(folder: Path, command) -> None:
    r = run_cli(*command, "--model", str(folder), "--device", "cpu", "--threads", "1",
                "--cuda-graphs", "on")
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.strip().splitlines() if "cuda" in ln.lower()]
    assert len(lines) == 1 and "use --cuda-graphs auto or off" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_the_clis_modes_are_the_engines() -> None:
    """The CLI spells the modes itself (the engine's module loads torch); they must agree."""
    from unmask.cli_args import CUDA_GRAPH_MODES
    from unmask.engine.graphs import MODES

    assert CUDA_GRAPH_MODES == MODES
