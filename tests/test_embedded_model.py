"""The shipped default model: loads offline from the package, is small, and its trained weights
show (the worked-solution format of the training data). These are the tests that need trained
weights; a random model fails them."""

from __future__ import annotations

import functools

from unmask import LLM
from unmask.api import DEFAULT_MODEL
from unmask.tasks import TASKS

# A held-out problem (never in training: see unmask/tasks/math.py for the split).
PROBLEM = "What is the sum of 60 and 9?"


@functools.cache
def llm() -> LLM:
    return LLM()  # no path: the embedded model


def test_heldout_problem_is_heldout() -> None:
    heldout = {ex.prompt for ex in TASKS["math"].load("heldout", 50, seed=0)}
    assert PROBLEM in heldout


def test_default_model_is_shipped_and_small() -> None:
    files = {p.name for p in DEFAULT_MODEL.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "MODEL_CARD.md"} <= files
    assert sum(p.stat().st_size for p in DEFAULT_MODEL.iterdir()) <= 60 * 2**20
    c = llm().config
    assert c.model_type == "llada" and c.max_sequence_length >= 1024 + 64


def test_default_model_writes_the_worked_format() -> None:
    """Trained weights: a held-out addition gets the column-by-column solution layout, ones then
    tens, and a closing `So ...` line (the random init produces none of this)."""
    g = llm().generate([PROBLEM], "static-1", gen_length=128, block_length=32)[0]
    assert g.text.startswith("Add "), g.text
    assert "column by column" in g.text.splitlines()[0]
    assert "\nones: " in g.text and "\ntens: " in g.text and "\nSo " in g.text


def test_default_model_solves_a_heldout_problem() -> None:
    ex = TASKS["math"].load("heldout", 50, seed=0)[0]
    assert ex.prompt == PROBLEM
    g = llm().generate([PROBLEM], "static-1", gen_length=256, block_length=32)[0]
    assert TASKS["math"].check(ex, g.text), g.text


def test_default_model_solves_at_long_canvases() -> None:
    """Trained with canvases up to 1024: the same problem at gen_length 1024 (early exit only
    skips the EOS padding; the text before the first EOS is static-1's)."""
    ex = TASKS["math"].load("heldout", 50, seed=0)[0]
    g = llm().generate([PROBLEM], "static-1,early_exit=true", gen_length=1024, block_length=32)[0]
    assert TASKS["math"].check(ex, g.text), g.text


def test_default_model_completes_a_heldout_function() -> None:
    """Code: the first held-out stdlib function gets a body that parses under its signature (the
    model card's code bar is this, over many functions; a random init writes no Python)."""
    ex = TASKS["code"].load("heldout", 1, seed=0)[0]
    g = llm().generate([ex.prompt], "static-1,early_exit=true", gen_length=256, block_length=32)[0]
    assert g.text.strip(), "empty body"
    assert TASKS["code"].check(ex, g.text), g.text
