"""`unmask show` and `unmask models`: the weight estimate against the bytes a loaded model holds
(the shipped model and tiny random folders, by dtype and quantization), the fit verdict, the
listing of the embedded model, model folders and the hub cache, and bad input in one line."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import edit_config, tiny_model_dir

from unmask import show
from unmask.api import DEFAULT_MODEL
from unmask.checkpoint import load_model
from unmask.cli import main
from unmask.config import ModelConfig
from unmask.engine.graphs import CudaGraphs, store_width
from unmask.hub import SHIPPED
from unmask.quantize import quantize_model, weight_bytes
from unmask.show import Workload, estimate, verdict
from unmask.show import weight_bytes as estimated_weight_bytes

try:
    from unmask.quantize import torchao_version

    torchao_version()
    HAS_TORCHAO = True
except Exception:  # noqa: BLE001  (torchao missing or too old: the quantized cases skip)
    HAS_TORCHAO = False

CASES = [("float32", None), ("bfloat16", None), ("float16", None),
         pytest.param("float32", "int8", marks=pytest.mark.skipif(not HAS_TORCHAO, reason="torchao")),
         pytest.param("bfloat16", "int4", marks=pytest.mark.skipif(not HAS_TORCHAO, reason="torchao")),
         pytest.param("bfloat16", "w8a8", marks=pytest.mark.skipif(
             not torch.cpu._is_vnni_supported(), reason="no VNNI"))]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> list[Path]:
    tmp = tmp_path_factory.mktemp("models")
    return [DEFAULT_MODEL,
            tiny_model_dir(tmp, "llada", name="tied", weight_tying=True, mlp_hidden_size=96),
            tiny_model_dir(tmp, "Dream", name="dream", n_heads=4, n_kv_heads=2, d_model=64)]


@pytest.mark.parametrize(("dtype", "scheme"), CASES)
def test_the_weight_estimate_is_the_bytes_a_loaded_model_holds(folders, dtype, scheme) -> None:
    for folder in folders:
        model = load_model(folder, "cpu", dtype)
        if scheme is not None:
            quantize_model(model, scheme)
        config = ModelConfig.load(folder)
        assert estimated_weight_bytes(config, Workload(dtype, scheme)) == weight_bytes(model), folder


def test_working_memory_grows_with_batch_and_canvas() -> None:
    config = ModelConfig.load(DEFAULT_MODEL)
    one = estimate(config, Workload("float32", gen_length=64, prompt_length=64))
    four = estimate(config, Workload("float32", gen_length=64, prompt_length=64, batch=4))
    assert four.weights == one.weights
    assert (four.kv, four.logits, four.activations) == (4 * one.kv, 4 * one.logits, 4 * one.activations)
    # K/V: 128 positions x 4 layers x K and V x 4 heads x 32 wide x 4 bytes
    assert one.kv == 128 * 4 * 2 * 4 * 32 * 4


def test_the_verdict_names_the_first_cheaper_setting_that_fits() -> None:
    config = ModelConfig.load(DEFAULT_MODEL)
    work = Workload("float32")
    need = estimate(config, work).total
    assert verdict(config, work, need) == "fits"
    assert verdict(config, work, need - 1) == "does not fit, try --dtype bfloat16"
    bf16 = estimate(config, Workload("bfloat16")).total
    # on this toy the float32 working memory outweighs what int8 saves: int4 in bfloat16 is next
    assert estimate(config, Workload("float32", "int8")).total > bf16
    assert verdict(config, work, bf16 - 1) == "does not fit, try --dtype bfloat16 --quantize int4"
    int8 = estimate(config, Workload("float32", "int8")).total
    assert verdict(config, Workload("float32", batch=1, gen_length=8), int8) == "fits"
    assert verdict(config, work, 1).startswith("does not fit, even quantized int4")


def test_the_verdict_checks_the_context_first() -> None:
    config = ModelConfig.load(DEFAULT_MODEL)  # max_sequence_length 2,048
    work = Workload("float32", prompt_length=4000, gen_length=256)
    got = verdict(config, work, 1 << 50)
    assert got.startswith("does not fit the model's context: 4000 prompt + 256 generated need "
                          "4,256 positions, max_sequence_length is 2,048"), got


def test_the_verdict_shrinks_the_batch_before_the_weights() -> None:
    """At batch 3000 the canvases outweigh the weights: float32 at batch 1 fits, so the
    suggestion is the largest batch that fits in float32, not int4."""
    config = ModelConfig.load(DEFAULT_MODEL)
    work = Workload("float32", gen_length=1024, batch=3000)
    one = estimate(config, Workload("float32", gen_length=1024)).total
    free = 3 * one
    got = verdict(config, work, free)
    assert got.startswith("does not fit, try --batch ") and "quantize" not in got, got
    n = int(got.split()[-1])
    assert n > 1 and estimate(config, Workload("float32", gen_length=1024, batch=n)).total <= free
    assert estimate(config, Workload("float32", gen_length=1024, batch=n + 1)).total > free


def test_a_cuda_device_counts_the_k_v_store_cuda_graphs_preallocate(capsys, monkeypatch) -> None:
    """With CUDA graphs (auto or on) a model's K/V store holds every row at its
    full width on a CUDA device (CudaGraphs.store_capacity): the estimate and the verdict
    there count it; the CPU's, and a CUDA device's with graphs off, count the canvases."""
    sdar = SHIPPED["unmask-sdar"]
    config = ModelConfig.load(sdar)  # block-causal, context 2,048
    per_position = config.n_layers * 2 * config.n_kv_heads * config.head_dim * 4
    work = Workload("float32", gen_length=64, prompt_length=64, batch=3)
    canvas = estimate(config, work)
    assert canvas.kv == 3 * 128 * per_position
    width = CudaGraphs().store_capacity(load_model(sdar))[1]
    assert width == 2048
    assert estimate(config, work, "cuda:0").kv == 3 * width * per_position
    assert estimate(config, replace(work, cuda_graphs="off"), "cuda:0") == canvas
    assert estimate(config, replace(work, batch=1), "cuda:0").kv == width * per_position
    llada = ModelConfig.load(DEFAULT_MODEL)  # bidirectional: its buckets read the same store
    llada_width = store_width(llada, CudaGraphs().max_keys)
    llada_position = llada.n_layers * 2 * llada.n_kv_heads * llada.head_dim * 4
    assert llada_width > 128
    assert estimate(llada, work, "cuda:0").kv == 3 * llada_width * llada_position
    need = estimate(config, work, "cuda:0").total
    assert verdict(config, work, need, "cuda:0") == "fits"
    assert verdict(config, work, need - 1, "cuda:0").startswith("does not fit, try --batch 2")
    assert verdict(config, work, need - 1) == "fits"  # the CPU holds the canvases only

    work = replace(work, prefix_bytes=1 << 30)  # --prefix-cache-gib 1
    need = estimate(config, work, "cuda:0").total
    monkeypatch.setattr(show, "machine_memory", lambda: {"cpu": 1 << 40, "cuda:0": need})
    assert main(["show", str(sdar), "--json", "--batch", "3", "--gen-length", "64",
                 "--prompt-length", "64", "--dtype", "float32", "--prefix-cache-gib", "1"]) == 0
    fits = json.loads(capsys.readouterr().out)["fits"]
    assert (fits["cuda:0"]["total"], fits["cuda:0"]["verdict"]) == (need, "fits")
    assert fits["cpu"]["total"] == estimate(config, work).total
    assert fits["cpu"]["graph_store_width"] == 0
    assert main(["show", str(sdar), "--batch", "3", "--dtype", "float32"]) == 0
    assert ("CUDA graphs, calls in shape buckets: the K/V store preallocated, "
            "3 rows x 2,048 positions") in \
        capsys.readouterr().out
    assert main(["show", str(sdar), "--cuda-graphs", "off", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"]["cuda:0"]["graph_store_width"] == 0


def test_show_reports_the_model(capsys, folders) -> None:
    assert main(["show", str(folders[2]), "--json", "--batch", "2", "--gen-length", "32"]) == 0
    r = json.loads(capsys.readouterr().out)
    config = ModelConfig.load(folders[2])
    assert (r["family"], r["layers"], r["kv_heads"], r["dtype"]) == ("Dream", 2, 2, "float32")
    assert (r["mask_token_id"], r["eos_token_id"], r["chat_template"]) == (2, 1, True)
    assert r["parameters"] == sum(p.numel() for p in load_model(folders[2]).parameters())
    assert r["memory"]["weights"] == 4 * r["parameters"]
    assert r["memory"]["kv"] == estimate(config, Workload("float32", gen_length=32, batch=2)).kv
    assert r["fits"]["cpu"]["verdict"] == "fits" and r["fits"]["cpu"]["free"] > 2**20

    assert main(["show"]) == 0  # the embedded model, as text
    text = capsys.readouterr().out
    assert "chat template present" in text and "RAM available: fits" in text and "1,377,408" in text


def test_show_counts_active_parameters_of_a_mixture_of_experts(capsys, tmp_path: Path) -> None:
    """LLaDA2.0-mini's config alone (no weights needed): 8 of 256 routed experts per token in
    its 19 MoE layers, so 248 experts of 3 x 2048 x 512 weights each sit idle per layer; the
    model card's 16B total, 1.4B active. A dense model is all active."""
    data = Path(__file__).parent / "data"
    shutil.copy(data / "llada2-mini.config.json", tmp_path / "config.json")
    assert main(["show", str(tmp_path), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["parameters"] == 16_255_638_528
    assert r["active_parameters"] == r["parameters"] - 19 * 248 * 3 * 2048 * 512 == 1_432_968_192
    assert r["experts"] == "8 of 256 routed + 1 shared per token in 19 of 20 layers (groups: 4 of 8)"
    assert r["weights_by_dtype"] == {"float32": 4 * r["parameters"], "bfloat16": 2 * r["parameters"],
                                     "float16": 2 * r["parameters"]}
    assert main(["show", str(tmp_path)]) == 0
    assert "1.43B parameters active per token" in capsys.readouterr().out
    assert main(["show", "--json"]) == 0  # the embedded model: dense
    r = json.loads(capsys.readouterr().out)
    assert r["active_parameters"] == r["parameters"] and r["experts"] is None


@pytest.mark.parametrize(("argv", "expect"), [
    (["show", "NOWHERE"], "does not exist"),
    (["show", "--quantize", "int4"], "int4 needs the model in bfloat16"),
    (["models", "--dir", "NOWHERE"], "--dir names NOWHERE, which is not a folder"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, expect) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expect in err[0], err


def test_show_refuses_a_folder_that_is_not_a_dllm(tmp_path, capsys, folders) -> None:
    bert = tmp_path / "bert"
    shutil.copytree(folders[1], bert)
    edit_config(bert, model_type="bert")
    assert main(["show", str(bert)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model_type 'bert' is not supported" in err[0], err


def fake_hub_cache(root: Path, repo: str, folder: Path) -> Path:
    """huggingface_hub's cache layout for `repo` at one commit holding `folder`'s files."""
    commit = "f" * 40
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)
    (base / "blobs").mkdir()
    shutil.copytree(folder, base / "snapshots" / commit)
    return base / "snapshots" / commit


def test_models_lists_the_embedded_model_folders_and_the_hub_cache(tmp_path, monkeypatch, capsys,
                                                                   folders) -> None:
    from huggingface_hub import constants

    cache, mine = tmp_path / "hub", tmp_path / "mine"
    snapshot = fake_hub_cache(cache, "org/tiny-dream", folders[2])
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    mine.mkdir()
    shutil.copytree(folders[1], mine / "tied")
    shutil.copytree(folders[1], mine / "bert")
    edit_config(mine / "bert", model_type="bert")
    (mine / "notes").mkdir()  # no config.json: not a model, not mentioned
    monkeypatch.setenv("UNMASK_MODELS", str(mine))

    assert main(["models", "--json"]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(line) for line in out.splitlines()]
    assert [(r["name"], r["source"], r["family"]) for r in rows] == [
        ("unmask-llada", "embedded", "llada"), ("unmask-sdar", "embedded", "sdar"),
        ("org/tiny-dream", "hub cache", "Dream"), (str(mine / "tied"), "folder", "llada")]
    assert rows[2]["path"] == str(snapshot)
    assert rows[0]["parameters"] == 1_377_408 and rows[0]["dtype"] == "float32"
    assert rows[1]["parameters"] == 1_377_408 + 4 * 2 * 32  # + the q/k norms LLaDA lacks
    assert rows[3]["disk_bytes"] == sum(p.stat().st_size for p in (mine / "tied").iterdir())
    assert err.count("\n") == 1 and "left out 1 folder" in err and "bert" in err
    assert "notes" not in err

    # --dir replaces UNMASK_MODELS; a model folder itself may be named; the table form
    assert main(["models", "--dir", str(mine / "tied")]) == 0
    out = capsys.readouterr().out
    assert "shipped (default)" in out and "unmask-sdar" in out
    assert "org/tiny-dream" in out and "hub cache" in out
    assert "mine/tied" in out and "\u2026" not in out  # folded over lines in 80 columns, not cut
    assert "bert" not in out


@pytest.mark.parametrize("scheme", [None, pytest.param("int8", marks=pytest.mark.skipif(
    not HAS_TORCHAO, reason="torchao"))])
def test_the_weight_estimate_holds_for_a_model_of_a_few_hundred_mb(tmp_path, scheme) -> None:
    """The estimate at a size where rounding or a forgotten tensor would show: an 85M-parameter
    LLaDA folder (340 MB in float32), loaded and (int8) quantized."""
    folder = tiny_model_dir(tmp_path, "llada", name="big", d_model=768, n_heads=12, n_kv_heads=12,
                            n_layers=12, mlp_hidden_size=2048)
    model = load_model(folder, "cpu", "float32")
    if scheme is not None:
        quantize_model(model, scheme)
    held = weight_bytes(model)
    assert held > (80 << 20 if scheme else 300 << 20)
    assert estimated_weight_bytes(ModelConfig.load(folder), Workload("float32", scheme)) == held


def test_piped_models_never_wrap_a_name(tmp_path, monkeypatch, capsys, folders) -> None:
    """Off a terminal each model is one plain row, its name whole, however narrow the width."""
    long = tmp_path / ("a-model-folder-with-a-rather-long-name-" + "x" * 40)
    shutil.copytree(folders[1], long)
    monkeypatch.setenv("COLUMNS", "40")
    assert main(["models", "--dir", str(long)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["model", "family", "parameters", "dtype", "on", "disk", "where"]
    (row,) = [line for line in lines if str(long) in line]
    assert row.split()[:2] == [str(long), "llada"] and row.split()[-1] == "folder"
    assert any(line.split()[0] == "unmask-sdar" for line in lines[1:])
