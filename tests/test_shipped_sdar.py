"""The shipped block-diffusion model (`--model unmask-sdar`): an SDAR folder in the package, the two
shipped models together within 60 MB, and trained weights that show through the engine's block
decoding (a random SDAR model writes none of this)."""

from __future__ import annotations

import functools
import json

from unmask import LLM
from unmask.cli import main
from unmask.hub import SHIPPED
from unmask.tasks import TASKS

PROBLEM = "What is the sum of 60 and 9?"  # held out (tests/test_embedded_model.py)


@functools.cache
def llm() -> LLM:
    return LLM("unmask-sdar")


def test_sdar_model_is_shipped_beside_the_default_and_both_are_small() -> None:
    folder = SHIPPED["unmask-sdar"]
    files = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "MODEL_CARD.md"} <= files
    total = sum(p.stat().st_size for f in SHIPPED.values() for p in f.iterdir())
    assert total <= 60 * 2**20
    c = llm().config
    assert c.model_type == "sdar" and c.block_size == 4
    llada = SHIPPED["unmask-llada"]
    assert (folder / "tokenizer.json").read_bytes() == (llada / "tokenizer.json").read_bytes()


def test_sdar_model_solves_a_heldout_problem_block_by_block() -> None:
    ex = TASKS["math"].load("heldout", 50, seed=0)[0]
    assert ex.prompt == PROBLEM
    g = llm().generate([PROBLEM], "static-1", gen_length=256)[0]
    assert g.text.startswith("Add ") and "\nones: " in g.text, g.text
    assert TASKS["math"].check(ex, g.text), g.text
    assert g.finish_reason == "eos"


def test_generate_by_name(capsys) -> None:
    assert main(["generate", "--model", "unmask-sdar", "--json", PROBLEM]) == 0
    out = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert "#### 69" in out["text"], out["text"]


def test_package_data_ships_every_shipped_folder() -> None:
    """A wheel or sdist carries the shipped folders only if package-data names them (built and
    listed once by hand: both folders' five files are in the wheel and the sdist)."""
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    data = next(line for line in pyproject.splitlines() if line.startswith("unmask = ["))
    for folder in SHIPPED.values():
        assert f'"assets/{folder.name}/*"' in data, folder


def test_bench_records_the_block_length_the_model_decodes_in(tmp_path) -> None:
    """The model's block size, not the command's default 32, heads the table, and the recorded
    command reruns as it is (a --block-length 32 there is refused for a block model)."""
    md, js = tmp_path / "b.md", tmp_path / "b.json"
    argv = ["bench", "--model", "unmask-sdar", "--task", "math", "--n", "1", "--gen-length", "16",
            "--decoder", "threshold", "--warmup", "0", "--threads", "1"]
    assert main([*argv, "--markdown", str(md), "--json", str(js)]) == 0
    doc = json.loads(js.read_text())
    assert "block_length 4," in md.read_text().splitlines()[0]
    assert doc["block_length"] == 4 and "--block-length" not in doc["command"], doc["command"]
    assert main([*doc["command"].split()[1:], "--json", str(js)]) == 0
