"""int4 CPU linears calling torch's kernel without torchao's dispatch (unmask.int4call): the same
bits as torchao's call, and what `LLM` converts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import tiny_model_dir

from unmask.api import LLM
from unmask.checkpoint import load_model, save_checkpoint
from unmask.int4call import Int4Linear, call_int4_directly
from unmask.quantize import block_linears, quantize_model, quantized_scheme, weight_bytes


class _Stack(torch.nn.Module):
    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(256, 192, bias=bias)])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1), (1, 4), (3, 7), (2, 64)])
def test_int4_linear_gives_torchaos_bits(bias: bool, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    stack = _Stack(bias).to(torch.bfloat16)
    quantize_model(stack, "int4")
    through_torchao = stack.layers[0]
    direct = Int4Linear(through_torchao)
    x = torch.randn(*shape, 256, dtype=torch.bfloat16)  # (batch, positions, in)
    with torch.no_grad():
        want, got = through_torchao(x), direct(x)
    assert got.shape == want.shape == (*shape, 192) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert direct.weight is through_torchao.weight and direct.bias is through_torchao.bias


def test_int4_linear_refuses_other_weights() -> None:
    with pytest.raises(ValueError, match="Int4OpaqueTensor, got Parameter"):
        Int4Linear(torch.nn.Linear(8, 8))


@pytest.fixture(scope="module")
def dream(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("int4call"), "Dream")  # q/k/v with biases


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(3, 27).view(2, 12)  # (2, 12)
    pos = torch.arange(12).expand(2, -1)
    with torch.no_grad():
        return model(ids, pos, None)


def test_llm_calls_every_int4_layer_directly_with_torchaos_logits(dream: Path,
                                                                   tmp_path: Path) -> None:
    llm = LLM(dream, device="cpu", dtype="bfloat16", quantize="int4")
    linears = block_linears(llm.model)
    assert all(type(m) is Int4Linear for m in linears.values())
    assert llm.load_note.endswith(f", {len(linears)} int4 layers calling torch's kernel directly")
    through_torchao = load_model(dream, "cpu", "bfloat16", quantize="int4")
    assert torch.equal(_logits(llm.model), _logits(through_torchao))
    assert quantized_scheme(llm.model) == "int4"
    assert weight_bytes(llm.model) == weight_bytes(through_torchao)
    # a saved int4 folder holds torchao's tensors as before, and reloads converted
    saved = save_checkpoint(llm.model, tmp_path / "q", tokenizer_dir=dream)
    again = LLM(saved, device="cpu")
    assert all(type(m) is Int4Linear for m in block_linears(again.model).values())
    assert torch.equal(_logits(again.model), _logits(through_torchao))
    assert call_int4_directly(again.model) == 0  # nothing left to convert
