"""`--compile` (unmask.compiling): the compiled layers give the eager forward's tokens through the
engine, recompile a bounded number of times over varied calls, and a missing compiler is one
line.

Compiling on the CPU takes tens of seconds, so the compiled models are built once per module.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import EOS, MASK, VOCAB, peaky_model, tiny_model, tiny_model_dir

from unmask.api import LLM
from unmask.cli import main
from unmask.compiling import check_compile, compile_model, recompile_count
from unmask.decoding.params import DecodeParams
from unmask.engine import decode
from unmask.errors import InputError
from unmask.kv import Frame

SPECS = ("threshold,threshold=0.5", "fast,threshold=0.5",
         "freedave++,draft_steps=4,threshold=0.5", "threshold,threshold=0.5,cache=dual")
# prompts of 3-19 tokens in batches of 1, 3 and 4: one row, packed rows of several shape
# groups, padded rows of one (runner.py); with and without stored keys
LENGTHS = ((7,), (3, 12, 19), (10,) * 4)


@pytest.fixture(scope="module")
def models() -> dict[str, tuple[torch.nn.Module, torch.nn.Module] | int]:
    """(eager, compiled) of the same weights, per model type (copies: peaky_model is shared),
    and the recompilations before any of them ran ("before")."""
    out: dict = {"before": recompile_count()}
    for kind in ("llada", "Dream"):
        eager = peaky_model(kind, 0, 8.0, VOCAB, MASK, EOS)
        compiled = copy.deepcopy(eager)
        compile_model(compiled)  # compiles at the first call
        out[kind] = eager, compiled
    return out


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, MASK, size=n).tolist() for n in lengths]


def tokens(model: torch.nn.Module, spec: str, gen_length: int, lengths: tuple[int, ...],
           seed: int = 0) -> list[list[int]]:
    params = DecodeParams.parse(spec, gen_length=gen_length, block_length=8)
    return [r.token_ids for r in decode(model, params, prompts(lengths, seed), mask_id=MASK,
                                        eos_id=EOS)]


def check_same_tokens(eager: torch.nn.Module, compiled: torch.nn.Module) -> None:
    for spec in SPECS:
        for lengths in LENGTHS:
            assert tokens(compiled, spec, 24, lengths) == tokens(eager, spec, 24, lengths), \
                (spec, lengths)


def test_compiled_llada_decodes_the_eager_tokens(models):
    from torch._dynamo.utils import counters

    check_same_tokens(*models["llada"])
    # compiled code ran (a model left eager would pass the comparison)
    assert counters["frames"]["ok"] > 0


def test_recompilations_stay_bounded_over_varied_calls(models):
    """The LLaDA model's calls so far in this module and a round of other prompt lengths, batch
    sizes and gen_lengths recompile 10 times in all, the number measured from a fresh process:
    its 4 compiled functions (a layer's two graphs, split by the eager attention, in 4 frames)
    compile 3-4 times each (the first sizes, then symbolic sizes, 1 row vs several, packed vs
    padded attention output). A second round of yet other sizes and decoders compiles nothing.
    A layer index in the traced code made it 14 (each layer its own compilations; 2 layers
    here, 32 in LLaDA-8B); static shapes, one per new width."""
    _, compiled = models["llada"]
    for i, (spec, gen, lengths) in enumerate(
            [(s, g, n) for s in SPECS[:2] for g in (16, 40) for n in LENGTHS]):
        tokens(compiled, spec, gen, lengths, seed=i)
    first = recompile_count() - models["before"]
    assert first <= 10
    for i, (spec, gen, lengths) in enumerate(
            [(s, g, n) for s in SPECS for g in (24, 56) for n in ((2, 30), (8,) * 8, (25,))]):
        tokens(compiled, spec, gen, lengths, seed=100 + i)
    assert recompile_count() - models["before"] == first


@pytest.mark.slow
def test_compiled_dream_decodes_the_eager_tokens(models):
    check_same_tokens(*models["Dream"])


def test_compile_keeps_the_state_dict_and_refuses_unknown_and_cuda_graph_modes():
    model = copy.deepcopy(peaky_model("llada", 0, 8.0, VOCAB, MASK, EOS))
    keys = list(model.state_dict())
    with pytest.raises(InputError, match="unknown compile mode 'fastest'; valid: default"):
        compile_model(model, "fastest")
    with pytest.raises(InputError, match="'reduce-overhead' records CUDA graphs, .*; valid: "
                                         "default, .*max-autotune-no-cudagraphs"):
        compile_model(model, "reduce-overhead")
    compile_model(model, "max-autotune-no-cudagraphs")  # compiles lazily: nothing runs here
    assert list(model.state_dict()) == keys


@pytest.fixture
def no_cxx():
    """No C++ compiler, as inductor finds one: its search list (torch._inductor.config.cpp.cxx,
    $CXX or g++ by default) names one that does not exist."""
    from torch._inductor import config

    with config.patch({"cpp.cxx": (None, "no-such-c++-compiler")}):
        yield


def test_compile_without_a_cxx_compiler_is_one_line(no_cxx, capsys):
    with pytest.raises(InputError, match="--compile on cpu needs a C\\+\\+ compiler"):
        check_compile(torch.device("cpu"))
    assert main(["generate", "--compile", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("unmask: error: --compile on cpu needs a C++ compiler")
    assert "run without --compile" in err and "\n" not in err


def test_compile_on_an_unsupported_device_is_refused():
    with pytest.raises(InputError, match="--compile runs on cpu or cuda, not meta"):
        check_compile(torch.device("meta"))
    check_compile(torch.device("cpu"))  # this machine has g++


def test_llm_compiles_its_layers_only_when_asked(tmp_path):
    folder = tiny_model_dir(tmp_path)
    with pytest.raises(InputError, match="compile must be True or False, got 'yes'"):
        LLM(folder, device="cpu", compile="yes")
    blocks = [LLM(folder, device="cpu", compile=c).model.model.transformer.blocks for c in (False, True)]
    assert [b._compiled_call_impl is not None for b in blocks[0]] == [False, False]
    assert [b._compiled_call_impl is not None for b in blocks[1]] == [True, True]


def _forward(model: torch.nn.Module, frame: Frame | None) -> torch.Tensor:
    ids = torch.arange(3, 27).view(2, 12)
    with torch.no_grad():
        return model(ids, torch.arange(12).expand(2, 12), frame=frame)


@pytest.mark.parametrize("kind", ["llada", "Dream", "sdar"])
def test_layers_of_a_deeper_stack_reuse_the_compiled_code(kind):
    """A Frame tells layers apart by call order, so no layer index reaches the compiled code:
    after a 2-layer model, a 6-layer one of the same shapes compiles nothing (with a layer
    index the layers past the second recompiled, 4 times, for every family). SDAR's frameless
    forward, which attends with its block-causal mask, compiles to the eager logits."""
    _forward(compiled(tiny_model(kind, n_layers=2)), Frame())
    eager = tiny_model(kind, n_layers=6)
    deep = compiled(copy.deepcopy(eager))
    before = recompile_count()
    got = _forward(deep, Frame())
    assert recompile_count() == before
    torch.testing.assert_close(got, _forward(eager, Frame()), atol=1e-4, rtol=0)
    if kind == "sdar":
        torch.testing.assert_close(_forward(deep, None), _forward(eager, None), atol=1e-4, rtol=0)


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    compile_model(model)
    return model


def test_llm_compiles_an_int8_model_to_its_tokens(tmp_path):
    """LLM(quantize="int8", compile=True): torchao's Int8Tensor weights go through the compiled
    layers (compiled after quantization) and give the uncompiled int8 model's tokens (int8 runs
    in the checkpoint's float32 here)."""
    from torch._dynamo.utils import counters

    folder = tiny_model_dir(tmp_path)
    plain, fast = (LLM(folder, device="cpu", quantize="int8", compile=c) for c in (False, True))
    blocks = fast.model.model.transformer.blocks
    assert all(b._compiled_call_impl is not None for b in blocks)
    assert type(blocks[0].q_proj.weight).__name__ == "Int8Tensor"
    compiled_frames = counters["frames"]["ok"]
    prompts = ["hello", "what is 12 + 34?", "sort the list [3, 1, 2]"]
    for spec in ("threshold,threshold=0.5", "fast,threshold=0.5"):
        want = [g.token_ids for g in plain.generate(prompts, spec, gen_length=16, block_length=8)]
        assert [g.token_ids for g in fast.generate(prompts, spec, gen_length=16,
                                                   block_length=8)] == want, spec
    assert counters["frames"]["ok"] > compiled_frames  # compiled code ran


def test_compile_says_it_is_compiling(monkeypatch, capsys):
    """The first calls compile for 15-30 s with nothing on the screen."""
    import argparse

    from unmask import api
    from unmask.cli_args import load_llm

    made, real = [], api.LLM
    monkeypatch.setattr(api, "LLM", lambda *a, **k: made.append(k) or real.__new__(real))
    args = argparse.Namespace(threads=1, model=None, device=None, dtype=None, quantize=None,
                              compile=True, verbose=False)
    load_llm(args)
    assert made[0]["compile"] is True
    assert "note: --compile: compiling the model's layers on their first calls" in \
        capsys.readouterr().err
