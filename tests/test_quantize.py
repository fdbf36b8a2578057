"""Weight-only int8 / int4 quantization (unmask.quantize, torchao) on tiny random LLaDA and Dream
models and on the embedded model: what is quantized, what it weighs, how close its logits stay,
decoding through the engine, save and reload, and the refusals."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_model, tiny_model_dir

from unmask import weights
from unmask.api import LLM, InputError
from unmask.checkpoint import CheckpointError, save_checkpoint
from unmask.cli import main
from unmask.decoding.params import DecodeParams
from unmask.quantize import (
    INT4_CPU_ROW_BLOCK,
    QUANTIZED_FILE,
    LoadQuantizer,
    block_linears,
    check_quantize,
    quantize_model,
    quantized_scheme,
    weight_bytes,
)

KINDS = ("llada", "Dream")
# int4 runs in bfloat16 only (unmask.quantize); int8 in the checkpoint's float32
DTYPE = {"int8": torch.float32, "int4": torch.bfloat16}
CLASS = {"int8": "Int8Tensor", "int4": "Int4OpaqueTensor"}
PROMPTS = ["hello", "what is 12 + 34?", "sort the list [3, 1, 2] to get a sorted list of numbers"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: tiny_model_dir(root, kind) for kind in KINDS}


def _quantized(kind: str, scheme: str, **overrides) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the float model, a quantized copy) of a tiny random `kind` model in the scheme's dtype."""
    model = tiny_model(kind, **overrides).to(DTYPE[scheme])
    quantized = copy.deepcopy(model)
    quantize_model(quantized, scheme)
    return model, quantized


# --- what is quantized, and what it weighs ----------------------------------------------------------
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("kind", KINDS)
def test_block_linears_are_quantized_and_nothing_else(kind: str, scheme: str) -> None:
    model, quantized = _quantized(kind, scheme)
    linears = block_linears(quantized)
    assert len(linears) == 7 * model.config.n_layers  # q, k, v, out; gate, up, down
    for name, m in linears.items():
        assert type(m.weight).__name__ == CLASS[scheme], name
    assert quantized_scheme(quantized) == scheme and quantized_scheme(model) is None
    floats = dict(model.named_parameters())
    kept = {n: p for n, p in quantized.named_parameters()
            if n.removesuffix(".weight") not in linears}
    # embeddings, norms, biases and the LM head: plain tensors, as they were
    assert any("embed" in n or "wte" in n for n in kept) and any("norm" in n for n in kept)
    assert any(n in ("lm_head.weight", "model.transformer.ff_out.weight") for n in kept)
    for name, p in kept.items():
        assert type(p) is torch.nn.Parameter and torch.equal(p, floats[name]), name


@pytest.mark.parametrize("scheme, bytes_per_weight", [
    # int8 values + a float32 scale and an int8 zero point (0: symmetric) per row
    ("int8", lambda out, inp: out * inp + (4 + 1) * out),
    # 4-bit values + a bfloat16 scale and zero point per group of 128 inputs
    ("int4", lambda out, inp: out * inp // 2 + 2 * 2 * out * inp // 128),
])
def test_weight_bytes_counts_the_packed_tensors(scheme: str, bytes_per_weight) -> None:
    model, quantized = _quantized("llada", scheme, d_model=128, n_heads=4, n_kv_heads=4,
                                  mlp_hidden_size=256)
    linears = block_linears(model)
    float_linears = sum(m.weight.numel() * m.weight.element_size() for m in linears.values())
    packed = sum(bytes_per_weight(m.out_features, m.in_features) for m in linears.values())
    assert weight_bytes(quantized) == weight_bytes(model) - float_linears + packed
    # on the quantized layers: 3.86x less for int8 from float32, 3.76x for int4 from bfloat16
    assert float_linears / packed > 3.7


def test_quantizing_on_the_cpu_lets_go_of_the_mapped_checkpoint(folders) -> None:
    """load_model leaves the weights as views of the memory-mapped file: the tensors kept as
    they were are copied out, so the mapping (and the float weights' pages) can go."""
    from unmask.checkpoint import load_model

    model = load_model(folders["llada"], "cpu")
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    quantize_model(model, "int8")
    kept = {n: p for n, p in model.named_parameters() if type(p) is torch.nn.Parameter}
    assert len(kept) == 2 * model.config.n_layers + 3  # two norms a block; wte, ln_f, ff_out
    for name, p in kept.items():
        assert p.data_ptr() != before[name][0] and torch.equal(p, before[name][1]), name


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantizing_while_loading_gives_the_weights_quantizing_after_does(folders, scheme: str) -> None:
    from unmask.checkpoint import load_model

    dtype = DTYPE[scheme]
    after = load_model(folders["llada"], "cpu", dtype)
    quantize_model(after, scheme)
    during = load_model(folders["llada"], "cpu", dtype, quantize=scheme)
    want = after.state_dict()
    for key, t in during.state_dict().items():
        assert type(t) is type(want[key]), key
        assert all(torch.equal(a, b) for a, b in zip(_parts(t), _parts(want[key]), strict=True)), key
    assert weight_bytes(during) == weight_bytes(after)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_weight_is_quantized_a_slice_of_rows_at_a_time(tmp_path: Path, monkeypatch,
                                                         scheme: str) -> None:
    """On the CPU a load quantizes a block linear's weight a slice of rows at a time, so it holds
    one slice's float temporaries, not the whole weight's; the slices joined are the bytes that
    quantizing the whole weight after the load gives, and save to the same file (int4 slices
    start on torch's 64-row packing blocks: slices of 32 or 96 rows pack to other bytes). MLP
    rows 352: five slices of 64 and a tail of 32."""
    from unmask.checkpoint import load_model

    folder = tiny_model_dir(tmp_path, "llada", d_model=128, mlp_hidden_size=352)
    dtype = DTYPE[scheme]
    after = load_model(folder, "cpu", dtype)
    quantize_model(after, scheme)
    monkeypatch.setattr(weights, "SLICE_BYTES", 1)  # the fewest rows a slice may have
    rows: list[int] = []
    whole = LoadQuantizer._quantize
    monkeypatch.setattr(LoadQuantizer, "_quantize",
                        lambda self, key, t: rows.append(t.shape[0]) or whole(self, key, t))
    during = load_model(folder, "cpu", dtype, quantize=scheme)
    assert max(rows) == INT4_CPU_ROW_BLOCK and 32 in rows
    assert len(rows) > len(block_linears(during))
    want = after.state_dict()
    for key, t in during.state_dict().items():
        assert type(t) is type(want[key]) and t.shape == want[key].shape, key
        assert all(torch.equal(a, b) for a, b in zip(_parts(t), _parts(want[key]), strict=True)), key
    saved = [save_checkpoint(m, tmp_path / name) / QUANTIZED_FILE
             for name, m in (("during", during), ("after", after))]
    assert saved[0].read_bytes() == saved[1].read_bytes()


class _Reader:
    """safetensors' open file, recording the tensors read whole (name: the buffer's address)."""

    def __init__(self, handle, whole: dict[str, int]) -> None:
        self.handle, self.whole = handle, whole

    def __enter__(self) -> _Reader:
        self.handle.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.handle.keys()

    def get_slice(self, name: str):  # for its shape: reading a slice through it reads the whole
        return self.handle.get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        t = self.handle.get_tensor(name)
        self.whole[name] = t.data_ptr()
        return t


def _recording(monkeypatch) -> dict[str, int]:
    """What load_model reads whole from here on (_Reader)."""
    from unmask import checkpoint

    whole: dict[str, int] = {}
    real = checkpoint.safe_open
    monkeypatch.setattr(checkpoint, "safe_open", lambda *a, **k: _Reader(real(*a, **k), whole))
    return whole


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_block_weight_is_never_read_whole(tmp_path: Path, monkeypatch, scheme: str) -> None:
    """A load that quantizes on the CPU reads each block linear weight from its file a slice of
    rows at a time, each slice quantized before the next is read: no float copy of a whole
    weight is made, nor a buffer of one (the other tensors are read whole)."""
    import os

    from unmask.checkpoint import load_model

    folder = tiny_model_dir(tmp_path, "llada", d_model=128, mlp_hidden_size=352)
    monkeypatch.setattr(weights, "SLICE_BYTES", 1)
    whole = _recording(monkeypatch)
    reads: list[int] = []
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, at: reads.append(len(bufs[0]))
                        or preadv(fd, bufs, at))
    model = load_model(folder, "cpu", DTYPE[scheme], quantize=scheme)
    targets = {f"{name}.weight": m for name, m in block_linears(model).items()}
    assert whole.keys() == model.state_dict().keys() - targets.keys()
    slices = sum(-(-m.out_features // INT4_CPU_ROW_BLOCK) for m in targets.values())
    assert len(reads) == slices  # 64 rows a read
    assert max(reads) == INT4_CPU_ROW_BLOCK * 352 * 4  # float32 rows of ff_out's 352 inputs


@pytest.mark.parametrize("scheme", ["int8", pytest.param("w8a8", marks=pytest.mark.skipif(
    not torch.cpu._is_vnni_supported(), reason="no VNNI here"))])
def test_a_converting_load_keeps_the_other_tensors_as_read(folders, monkeypatch,
                                                           scheme: str) -> None:
    """The tensors a quantizing load keeps as they are (embeddings, norms, head) are the buffers
    it read them into: not copied after the load (a copy of each on the load's peak), since
    they are not views of a mapped file."""
    from unmask.checkpoint import load_model

    whole = _recording(monkeypatch)
    model = load_model(folders["llada"], "cpu", quantize=scheme)
    kept = {k: t for k, t in model.state_dict().items() if type(t) is torch.Tensor}
    assert kept and all(t.data_ptr() == whole[k] for k, t in kept.items())


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a torchao tensor is made of (packed values, scales...), or [t]."""
    if type(t) in (torch.Tensor, torch.nn.Parameter):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names]


_PEAK = """
import json, sys, torch
from unmask.quantize import torchao_version
from unmask.checkpoint import load_model
torchao_version()
def status(key):
    with open("/proc/self/status") as f:
        return int(next(x for x in f if x.startswith(key + ":")).split()[1]) * 1024
before = status("VmRSS")
model = load_model(sys.argv[1], "cpu", quantize=sys.argv[2])
print(json.dumps({"peak": status("VmHWM") - before}))
"""


@pytest.mark.parametrize("scheme", ["int8", pytest.param("w8a8", marks=pytest.mark.skipif(
    not torch.cpu._is_vnni_supported(), reason="no VNNI here"))])
@pytest.mark.parametrize("shard", [8 << 20, None], ids=["shards", "one file"])
def test_quantizing_while_loading_holds_one_tensor_of_float_weights(tmp_path: Path,
                                                                    shard: int | None,
                                                                    scheme: str) -> None:
    """int8 or w8a8 from a float32 folder, in shards or one file: the load's peak (resident
    memory, in a fresh process, mapped files' pages included) stays well under the float
    weights' size: each tensor is read into its own buffer and quantized (w8a8: each layer once
    its tensors are read), and the buffer freed (quantizing after the load held them all;
    reading through the file's mapping held the file's pages to its end)."""
    import json
    import subprocess

    model = tiny_model("llada", d_model=512, n_heads=8, n_kv_heads=8, n_layers=8,
                       mlp_hidden_size=1536, vocab_size=512)
    float_size = weight_bytes(model)  # 8 layers of 3.4M float32 weights: 110 MB
    folder = save_checkpoint(model, tmp_path / "f32", max_shard_size=shard)
    out = subprocess.run([sys.executable, "-c", _PEAK, str(folder), scheme], check=True,
                         capture_output=True, text=True).stdout
    # measured, int8: one file 159 MB through the mapping, shards 58 MB; both 55 MB read by pread
    # (28 MB of int8 weights, a tensor, torchao's temporaries)
    assert json.loads(out)["peak"] < 0.6 * float_size


# --- numerics ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def embedded() -> LLM:
    return LLM(device="cpu")


# Measured on the embedded model (this prompt, a 96-position canvas): int8 max |diff| 0.18 of a
# largest logit 19.8, mean 0.029, top-1 agreement 100%; int4 (bfloat16) max 2.4, mean 0.37,
# 95.8% (bfloat16 alone: 0.23, 0.028, 100%). The bounds are about twice those.
@pytest.mark.parametrize("scheme, max_diff, mean_diff, agree", [
    ("int8", 0.4, 0.06, 0.98),
    ("int4", 5.0, 0.75, 0.9),
])
def test_logits_stay_close_to_float32(embedded: LLM, scheme: str, max_diff: float,
                                      mean_diff: float, agree: float) -> None:
    ids = embedded.encode_prompt("What is 47 + 38?")
    ids = torch.tensor([ids + [embedded.config.mask_token_id] * (96 - len(ids))])  # (1, 96)
    pos = torch.arange(96)[None]
    model = embedded.model
    quantized = copy.deepcopy(model).to(DTYPE[scheme])
    quantize_model(quantized, scheme)
    with torch.no_grad():
        ref, out = model(ids, pos), quantized(ids, pos).float()  # (1, 96, V) each
    diff = (out - ref).abs()
    assert 0 < diff.max() <= max_diff and diff.mean() <= mean_diff
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= agree


# --- through the engine ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llms(folders: dict[str, Path]) -> dict[tuple[str, str], LLM]:
    return {(kind, scheme): LLM(folders[kind], device="cpu", dtype=str(DTYPE[scheme])[6:],
                                quantize=scheme)
            for kind in KINDS for scheme in ("int8", "int4")}


@pytest.mark.parametrize("spec", ["static-1", "threshold,threshold=0.1", "exact", "balanced", "fast"])
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_alone_decodes_as_in_a_batch(llms, kind: str, scheme: str, spec: str) -> None:
    llm = llms[kind, scheme]
    assert quantized_scheme(llm.model) == scheme
    params = DecodeParams.parse(spec, gen_length=16, block_length=8)
    together = llm.generate(PROMPTS, params, batch_size=len(PROMPTS))
    alone = [llm.generate(p, params)[0] for p in PROMPTS]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert all(llm.config.mask_token_id not in g.token_ids for g in together)


def test_the_load_note_reports_the_weights_before_and_after(llms) -> None:
    llm = llms["llada", "int8"]
    after = weight_bytes(llm.model)
    assert llm.load_note.startswith(f"weights {after / 2**20:,.1f} MiB quantized int8 with torchao")
    assert llm.load_note.endswith("MiB before)")


# --- save and reload ------------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("kind", KINDS)
def test_save_and_reload_round_trips_tokens(llms, folders, kind: str, scheme: str,
                                            tmp_path: Path) -> None:
    llm = llms[kind, scheme]
    out = save_checkpoint(llm.model, tmp_path / "q", tokenizer_dir=folders[kind])
    assert (out / QUANTIZED_FILE).is_file() and not list(out.glob("*.safetensors"))
    again = LLM(out, device="cpu")
    assert quantized_scheme(again.model) == scheme
    assert again.model.config.torch_dtype == str(DTYPE[scheme])[6:]
    assert weight_bytes(again.model) == weight_bytes(llm.model)
    assert f"(saved quantized as {scheme})" in again.load_note
    params = DecodeParams.parse("threshold,threshold=0.1", gen_length=16, block_length=8)
    assert ([g.token_ids for g in again.generate(PROMPTS, params)]
            == [g.token_ids for g in llm.generate(PROMPTS, params)])
    assert LLM(out, device="cpu", quantize=scheme).load_note == again.load_note
    other = "int4" if scheme == "int8" else "int8"
    with pytest.raises(InputError, match=f"saved quantized as {scheme}"):
        LLM(out, device="cpu", quantize=other)


def test_a_saved_quantized_folder_runs_in_its_dtype(llms, folders, tmp_path: Path) -> None:
    out = save_checkpoint(llms["Dream", "int8"].model, tmp_path / "q", tokenizer_dir=folders["Dream"])
    with pytest.raises(CheckpointError, match="runs in the dtype it was saved in, torch.bfloat16"):
        LLM(out, device="cpu", dtype="bfloat16")


def test_saving_a_float_model_over_a_quantized_folder_leaves_one_set(llms, folders,
                                                                    tmp_path: Path) -> None:
    out = save_checkpoint(llms["llada", "int8"].model, tmp_path / "q", tokenizer_dir=folders["llada"])
    save_checkpoint(tiny_model("llada", vocab_size=llms["llada", "int8"].config.vocab_size), out)
    assert not (out / QUANTIZED_FILE).exists() and (out / "model.safetensors").is_file()
    assert quantized_scheme(LLM(out, device="cpu").model) is None


def test_a_folder_with_both_weight_sets_is_refused(llms, folders, tmp_path: Path) -> None:
    out = save_checkpoint(llms["llada", "int8"].model, tmp_path / "q", tokenizer_dir=folders["llada"])
    (out / "model.safetensors").write_bytes((folders["llada"] / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="keep one set"):
        LLM(out, device="cpu")


# --- refusals: one line saying what works instead -------------------------------------------------
def test_an_unknown_scheme_names_the_valid_ones() -> None:
    with pytest.raises(InputError, match=r"'int3' is not a quantization scheme; valid: int8, int4"):
        check_quantize("int3", torch.device("cpu"))


def test_without_torchao_the_message_says_how_to_install_it(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao raises ImportError
    with pytest.raises(InputError, match=r"pip install 'unmask\[quant\]'"):
        check_quantize("int8", torch.device("cpu"))


@pytest.mark.parametrize("device, capability, words", [
    ("cuda", (7, 5), "compute capability 8.0 or newer"),
    ("mps", None, "int4 runs on cpu and cuda, not mps: use quantize int8"),
])
def test_int4_where_no_int4_kernel_runs(monkeypatch, device: str, capability, words: str) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    with pytest.raises(InputError, match=words):
        check_quantize("int4", torch.device(device))
    check_quantize("int8", torch.device(device))  # int8 is plain torch ops: it runs there


def test_int4_on_an_x86_cpu_without_avx2_is_refused_in_one_line(monkeypatch) -> None:
    """torch's int4 CPU kernel without AVX2 or AVX-512 is its scalar fallback, slower than the
    bfloat16 weights it would replace: refused, naming what is missing and what to use."""
    from unmask import quantize

    monkeypatch.setattr(quantize.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(InputError, match=r"neither AVX2 nor AVX-512\): use quantize int8$"):
        check_quantize("int4", torch.device("cpu"))
    check_quantize("int8", torch.device("cpu"))


def test_int4_needs_bfloat16() -> None:
    model = tiny_model("llada")
    with pytest.raises(InputError, match="int4 needs a model in bfloat16, this one is in float32"):
        quantize_model(model, "int4")
    assert quantized_scheme(model) is None


def test_int4_refuses_a_width_no_group_size_divides() -> None:
    model = tiny_model("llada", d_model=48, n_heads=4, n_kv_heads=4).to(torch.bfloat16)
    with pytest.raises(InputError, match="has 48, which none divides: use quantize int8"):
        quantize_model(model, "int4")


def test_a_quantized_model_is_not_quantized_again() -> None:
    _, quantized = _quantized("llada", "int8")
    with pytest.raises(InputError, match=r"already quantized \(int8\)"):
        quantize_model(quantized, "int4")


def _exit_2_one_line(argv: list[str], capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("unmask: error:"), err
    return err


@pytest.mark.parametrize("command", [["generate", "hi"], ["serve", "--port", "0"]])
def test_cli_bad_scheme_exits_2_before_loading(command: list[str], folders, capsys,
                                               monkeypatch) -> None:
    from unmask import api

    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    err = _exit_2_one_line([*command, "--model", str(folders["llada"]), "--quantize", "int3"], capsys)
    assert "'int3' is not a quantization scheme; valid: int8, int4" in err


def test_cli_int4_on_float32_exits_2(folders, capsys) -> None:
    err = _exit_2_one_line(["generate", "hi", "--model", str(folders["llada"]), "--quantize", "int4"],
                           capsys)
    assert "load it with dtype bfloat16, or use quantize int8" in err


def test_cli_generate_quantized_notes_the_weights(folders, capsys) -> None:
    assert main(["generate", "hi", "--model", str(folders["Dream"]), "--quantize", "int4",
                 "--dtype", "bfloat16", "--gen-length", "8", "--block-length", "8", "--json"]) == 0
    err = capsys.readouterr().err
    assert "note: weights" in err and "quantized int4 with torchao" in err
    assert "before), " in err and "int4 layers calling torch's kernel directly; process resident " in err
