"""w8a8 (unmask.rowint8): int8 weights and activations, one activation scale per row, on the CPU:
which layers, what they weigh, how close the logits stay, decoding through the engine alone
and in a batch, the refusals (no VNNI, not the CPU, saving)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import tiny_model_dir

from unmask import rowint8, weights
from unmask.api import LLM, InputError
from unmask.checkpoint import CheckpointError, save_checkpoint
from unmask.cli import main
from unmask.decoding.params import DecodeParams
from unmask.quantize import check_quantize, quantize_model, quantized_scheme, weight_bytes
from unmask.rowint8 import RowInt8Linear

needs_vnni = pytest.mark.skipif(not torch.cpu._is_vnni_supported(), reason="no VNNI here")
PROMPTS = ["hello", "what is 12 + 34?", "sort the list [3, 1, 2] to get a sorted list of numbers"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("m"), "Dream")  # q/k/v biases


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(folder, device="cpu", dtype="bfloat16", quantize="w8a8")


@needs_vnni
def test_block_linears_are_converted_and_weigh_a_byte_each(llm: LLM, folder: Path) -> None:
    plain = LLM(folder, device="cpu", dtype="bfloat16")
    layers = [m for m in llm.model.modules() if isinstance(m, RowInt8Linear)]
    assert layers and quantized_scheme(llm.model) == "w8a8"
    assert not any(type(m) is torch.nn.Linear for m in layers)
    assert "quantized w8a8 with oneDNN while loading" in llm.load_note
    assert weight_bytes(llm.model) < weight_bytes(plain.model)


@needs_vnni
def test_converting_while_loading_gives_the_layers_converting_after_does(llm: LLM,
                                                                         folder: Path) -> None:
    """The load converts each layer once its weight and bias are read (RowInt8Loader): the same
    packed layers, and logits, as converting the loaded model."""
    from unmask.checkpoint import load_model

    after = load_model(folder, "cpu", "bfloat16")
    quantize_model(after, "w8a8")
    ids, pos = torch.arange(3, 27).view(2, 12), torch.arange(12).expand(2, -1)  # (2, 12) each
    with torch.no_grad():
        assert torch.equal(llm.model(ids, pos), after(ids, pos))
    during = {n: m for n, m in llm.model.named_modules() if isinstance(m, RowInt8Linear)}
    want = {n: m for n, m in after.named_modules() if isinstance(m, RowInt8Linear)}
    assert during.keys() == want.keys() and len(during) == 7 * llm.config.n_layers
    for name, m in during.items():
        assert torch.equal(m.weight_scale, want[name].weight_scale), name
        assert (m.bias is None) == (want[name].bias is None), name
    assert not any(p.is_meta for p in llm.model.parameters())


@needs_vnni
def test_a_layer_is_quantized_a_slice_of_rows_at_a_time(monkeypatch) -> None:
    """A layer's int8 weights and scales are computed a slice of rows at a time (so converting
    holds a slice's float temporaries, not the weight's): the same scales, packed weights and
    outputs as computing them over the whole weight at once."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 200).to(torch.bfloat16)  # (out, in) = (200, 64)
    whole = RowInt8Linear(linear)
    monkeypatch.setattr(weights, "SLICE_BYTES", 64 * 2 * 48)  # 48 rows of bfloat16
    rows: list[int] = []
    quantize = rowint8.quantize_int8_rows
    monkeypatch.setattr(rowint8, "quantize_int8_rows",
                        lambda w: rows.append(w.shape[0]) or quantize(w))
    sliced = RowInt8Linear(linear)
    assert rows == [48, 48, 48, 48, 8]
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    assert torch.equal(sliced.weight_scale, whole.weight_scale)
    assert torch.equal(sliced(x), whole(x))


@needs_vnni
def test_logits_stay_close_to_bfloat16() -> None:
    """Measured on the embedded model (this prompt, a 96-position canvas, against its float32
    logits): max |diff| 0.51, mean 0.073, top-1 agreement 97.9% (bfloat16 alone: 0.23, 0.028,
    100%; weight-only int8 in float32: 0.18, 0.029, 100%). The bounds are about twice those."""
    embedded = LLM(device="cpu")
    ids = embedded.encode_prompt("What is 47 + 38?")
    ids = torch.tensor([ids + [embedded.config.mask_token_id] * (96 - len(ids))])  # (1, 96)
    pos = torch.arange(96)[None]
    quantized = copy.deepcopy(embedded.model).to(torch.bfloat16)
    quantize_model(quantized, "w8a8")
    with torch.no_grad():
        ref, out = embedded.model(ids, pos), quantized(ids, pos).float()  # (1, 96, V) each
    diff = (out - ref).abs()
    assert 0 < diff.max() <= 1.0 and diff.mean() <= 0.15
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95


@needs_vnni
@pytest.mark.parametrize("spec", ["static-1", "threshold,threshold=0.1", "fast"])
def test_a_prompt_alone_decodes_as_in_a_batch(llm: LLM, spec: str) -> None:
    params = DecodeParams.parse(spec, gen_length=16, block_length=8)
    together = llm.generate(PROMPTS, params, batch_size=len(PROMPTS))
    alone = [llm.generate(p, params)[0] for p in PROMPTS]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]


def test_a_cpu_without_vnni_is_refused_naming_it(monkeypatch) -> None:
    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    with pytest.raises(InputError, match=r"needs AVX512-VNNI or AVX-VNNI, which this CPU lacks "
                                         r".*use quantize int8, or int4$"):
        check_quantize("w8a8", torch.device("cpu"))


def test_off_the_cpu_is_refused() -> None:
    with pytest.raises(InputError, match=r"w8a8 runs on the CPU .*on cuda use quantize int8"):
        check_quantize("w8a8", torch.device("cuda"))


def test_cli_without_vnni_exits_2_before_loading(folder: Path, capsys, monkeypatch) -> None:
    from unmask import api

    monkeypatch.setattr(torch.cpu, "_is_vnni_supported", lambda: False)
    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(["generate", "hi", "--model", str(folder), "--quantize", "w8a8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "AVX512-VNNI" in err, err


@needs_vnni
def test_saving_is_refused_before_anything_is_written(llm: LLM, folder: Path,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "saved"
    with pytest.raises(CheckpointError, match="w8a8 model is not saved.*load it with quantize w8a8"):
        save_checkpoint(llm.model, out)
    assert not out.exists()


def test_compile_is_refused_before_loading(folder: Path, monkeypatch) -> None:
    """torch.compile fails on the packed int8 product mid-decode: refused at once instead."""
    from unmask import api

    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(InputError, match=r"w8a8 does not compile .*drop compile, or quantize int8"):
        LLM(folder, device="cpu", dtype="bfloat16", quantize="w8a8", compile=True)
