"""A decoder spec means one thing through every door: parsed before the model is known (the
Python API, lm-eval's model args) or after (the CLI, a server, chat), a preset resolves against
the model where the model becomes known (`unmask.engine.layout.for_model`), and a key the caller
chose that cannot apply is refused the same way everywhere (docs/decoders.md, "Presets on each
family")."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from helpers import peaky_model, tiny_model_dir

from unmask.api import LLM
from unmask.cli import main
from unmask.decoding.params import PRESETS, DecodeParams, same_decoder
from unmask.engine import Engine
from unmask.engine.layout import for_model, model_defaults
from unmask.errors import DecoderMismatch

VOCAB, MASK, EOS = 64, 63, 1


@pytest.fixture(scope="module")
def sdar_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("doors"), "sdar")


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("family", ["sdar", "Fast_dLLM_Qwen", "llada"])
def test_a_preset_parsed_before_the_model_decodes_as_one_parsed_after(preset: str,
                                                                      family: str) -> None:
    model = peaky_model(family, 0, 4.0, VOCAB, MASK, EOS)
    before = for_model(DecodeParams.parse(preset), model)
    after = for_model(DecodeParams.parse(preset, **model_defaults(model)), model)
    assert same_decoder(before, after), (before, after)


def test_the_fast_dllm_v2_spec_parses_before_its_model_is_known() -> None:
    p = DecodeParams.parse("threshold,threshold=0.9,sub_block_length=8")
    # the published model's blocks, on a copy (peaky_model's models are shared)
    fd2 = copy.deepcopy(peaky_model("Fast_dLLM_Qwen", 0, 4.0, VOCAB, MASK, EOS))
    fd2.config.block_size = 32
    got = for_model(p, fd2)
    assert (got.cache, got.block_length, got.sub_block_length) == ("block", 32, 8)
    llada = peaky_model("llada", 0, 4.0, VOCAB, MASK, EOS)
    with pytest.raises(DecoderMismatch, match="^sub_block_length applies to block-causal models"):
        Engine(llada, mask_id=MASK, eos_id=EOS).add_request([5], p)


def test_a_chosen_key_still_refuses_what_a_preset_would_give_up() -> None:
    """Only the preset's own keys give way to the model's: the caller's are refused."""
    sdar = peaky_model("sdar", 0, 4.0, VOCAB, MASK, EOS)
    with pytest.raises(DecoderMismatch, match="^cache=entropy cannot apply"):
        for_model(DecodeParams.parse("balanced,cache=entropy"), sdar)
    with pytest.raises(DecoderMismatch, match="^suffix=structured cannot apply"):
        for_model(DecodeParams.parse("fast", explicit={"suffix": "structured"}), sdar)


@pytest.mark.parametrize("preset", ["balanced", "fast"])
def test_llm_generate_takes_a_preset_parsed_before_the_model(sdar_folder: Path,
                                                            preset: str) -> None:
    llm = LLM(sdar_folder, device="cpu")
    (want,) = llm.generate(["hi"], preset, gen_length=32)
    (got,) = llm.generate(["hi"], DecodeParams.parse(preset, gen_length=32))
    assert got.token_ids == want.token_ids


@pytest.mark.parametrize("block", ["32", "8"])
def test_a_typed_block_length_other_than_the_models_is_refused(
        sdar_folder: Path, block: str, capsys: pytest.CaptureFixture) -> None:
    """--block-length 32 equals the default block_length: it was taken for unset and dropped."""
    code = main(["generate", "--model", str(sdar_folder), "--gen-length", "32",
                 "--block-length", block, "hi"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"block_length={block} cannot apply: this model was trained with blocks of 4" in err
    llm = LLM(sdar_folder, device="cpu")
    with pytest.raises(DecoderMismatch, match=f"^block_length={block} cannot apply"):
        llm.generate("hi", "static-1", gen_length=32, block_length=int(block))
    with pytest.raises(DecoderMismatch, match=f"^block_length={block} cannot apply"):
        llm.generate("hi", DecodeParams.parse("static-1", gen_length=32).replace(
            block_length=int(block)))


@pytest.mark.parametrize("chosen", [5, "cache", {"nope"}])
def test_chosen_is_a_set_of_decoder_keys(chosen: object) -> None:
    from unmask.errors import SpecError

    with pytest.raises(SpecError, match="^chosen must be None or a set of decoder keys"):
        DecodeParams(chosen=chosen)
