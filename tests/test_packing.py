"""bfloat16 block weights prepacked for oneDNN on the CPU (unmask.packing): which layers, the
same logits as the plain weights, state_dict and save unchanged, and the one-line note where
the CPU has no bfloat16 kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_model, tiny_model_dir

from unmask import packing
from unmask.api import LLM
from unmask.checkpoint import load_model, save_checkpoint
from unmask.packing import PackedLinear, bf16_kernel
from unmask.quantize import block_linears, weight_bytes

needs_kernel = pytest.mark.skipif(not bf16_kernel(), reason="oneDNN has no bfloat16 kernel here")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("m"), "Dream")  # q/k/v biases: packed too


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    stack = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    return [m for m in stack.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]


@needs_kernel
def test_bfloat16_block_linears_are_packed_with_the_same_logits_and_state(folder: Path) -> None:
    llm = LLM(folder, device="cpu", dtype="bfloat16")
    plain = load_model(folder, "cpu", "bfloat16")
    packed = _blocks(llm.model)
    assert packed and all(type(m) is PackedLinear for m in packed)
    assert len(packed) == len(block_linears(plain))
    assert "linear layers prepacked for oneDNN" in llm.load_note
    ids = torch.randint(3, llm.config.vocab_size, (2, 12))  # (B, T)
    pos = torch.arange(12).expand(2, -1)
    with torch.no_grad():
        assert torch.equal(llm.model(ids, pos), plain(ids, pos))  # the same kernel, same values
    state, want = llm.model.state_dict(), plain.state_dict()
    assert list(state) == list(want) and all(torch.equal(state[k], want[k]) for k in want)
    assert weight_bytes(llm.model) == weight_bytes(plain)


@needs_kernel
def test_a_packed_model_saves_its_plain_weights(folder: Path, tmp_path: Path) -> None:
    llm = LLM(folder, device="cpu", dtype="bfloat16")
    again = load_model(save_checkpoint(llm.model, tmp_path / "out"), "cpu")
    plain = load_model(folder, "cpu", "bfloat16")
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(),
                                                 plain.state_dict().values(), strict=True))


@pytest.mark.parametrize("dtype, compile_", [("float32", False), ("bfloat16", True)])
def test_float32_and_compiled_models_keep_their_linears(folder: Path, dtype: str,
                                                        compile_: bool, monkeypatch) -> None:
    """Only an eager bfloat16 model is packed: torch.compile packs the weights it freezes its
    own way (the compile itself is not run here)."""
    from unmask import api

    monkeypatch.setattr(api, "compile_model", lambda model: None)
    monkeypatch.setattr(api, "check_compile", lambda device: None)
    llm = LLM(folder, device="cpu", dtype=dtype, compile=compile_)
    assert all(type(m) is torch.nn.Linear for m in _blocks(llm.model))
    assert "prepacked" not in llm.load_note


def test_without_a_bfloat16_kernel_nothing_is_packed_and_one_line_says_so(
        folder: Path, monkeypatch) -> None:
    monkeypatch.setattr(packing, "bf16_kernel", lambda: False)
    with pytest.warns(UserWarning) as caught:
        llm = LLM(folder, device="cpu", dtype="bfloat16")
    lines = [str(w.message) for w in caught if "bfloat16" in str(w.message)]
    assert len(lines) == 1 and "\n" not in lines[0]
    assert "neither AVX512-BF16 nor AMX" in lines[0] and "dtype float32" in lines[0]
    assert all(type(m) is torch.nn.Linear for m in _blocks(llm.model))


def test_a_float32_model_gets_no_bfloat16_note(folder: Path, monkeypatch, recwarn) -> None:
    monkeypatch.setattr(packing, "bf16_kernel", lambda: False)
    LLM(folder, device="cpu", dtype="float32")
    assert not [w for w in recwarn if "AVX512-BF16" in str(w.message)]


@needs_kernel
@pytest.mark.parametrize("rows", [16, 17, 33, 64])
def test_a_packed_row_does_not_depend_on_the_rows_beside_it(rows: int) -> None:
    """The runner gives every product the rows its kind needs so that a row's bits do not
    depend on its batch (docs/engine.md, "Batch invariance"): the packed product keeps that,
    and gives the plain product's bits."""
    from unmask.engine.product_rows import min_rows

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 768).to(torch.bfloat16)
    packed = PackedLinear(layer)
    x = torch.randn(96, 256, dtype=torch.bfloat16)  # (rows, in)
    whole = packed(x)
    assert rows >= min_rows("bfloat16 packed", x.device) and torch.equal(packed(x[:rows]), whole[:rows])
    assert torch.equal(whole, torch.nn.functional.linear(x, layer.weight, layer.bias))


_PEAK = """
import json, sys
from unmask.checkpoint import load_model
def status(key):
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith(key + ":")).split()[1]) * 1024
before = status("VmRSS")
model = load_model(sys.argv[1], "cpu", "bfloat16", pack=True)
print(json.dumps({"peak": status("VmHWM") - before}))
"""


@needs_kernel
def test_a_packing_load_holds_one_layer_of_plain_weights(tmp_path: Path) -> None:
    """From one bfloat16 file, a load that packs (what LLM asks) packs each layer as its
    weights are read: its peak (resident memory, in a fresh process, mapped pages included)
    stays near the weights' size, where packing the loaded model held the mapped file besides."""
    import json
    import subprocess
    import sys



    model = tiny_model("llada", d_model=512, n_heads=8, n_kv_heads=8, n_layers=8,
                       mlp_hidden_size=1536, vocab_size=512).to(torch.bfloat16)
    size = weight_bytes(model)  # 55.6 MB
    folder = save_checkpoint(model, tmp_path / "bf16")
    out = subprocess.run([sys.executable, "-c", _PEAK, str(folder)], check=True,
                         capture_output=True, text=True).stdout
    # measured: 69 MB (1.24x); loading, then packing: 124 MB (2.2x)
    assert json.loads(out)["peak"] < 1.5 * size
    packed = load_model(folder, "cpu", "bfloat16", pack=True)
    assert all(isinstance(m, PackedLinear) for m in _blocks(packed))
