"""Checkpoint IO: save -> load is bit-exact, the folder has the keys and tensor names of
docs/design.md § Checkpoints, and every malformed folder fails with a CheckpointError that names
the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from unmask.checkpoint import CheckpointError, load_model, save_checkpoint
from unmask.config import ModelConfig
from unmask.models import build_model

LLADA_KEYS = ("d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size", "vocab_size",
              "embedding_size", "rope_theta", "rms_norm_eps", "max_sequence_length", "weight_tying",
              "mask_token_id", "eos_token_id", "include_bias")
QWEN2_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
              "intermediate_size", "vocab_size", "rope_theta", "rms_norm_eps",
              "max_position_embeddings", "tie_word_embeddings", "mask_token_id", "eos_token_id")


def _llada_names(n_layers: int, tied: bool) -> set[str]:
    names = {"model.transformer.wte.weight", "model.transformer.ln_f.weight"}
    if not tied:
        names.add("model.transformer.ff_out.weight")
    for i in range(n_layers):
        names |= {f"model.transformer.blocks.{i}.{m}.weight" for m in
                  ("attn_norm", "q_proj", "k_proj", "v_proj", "attn_out", "ff_norm", "ff_proj",
                   "up_proj", "ff_out")}
    return names


def _dream_names(n_layers: int, tied: bool) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not tied:
        names.add("lm_head.weight")
    for i in range(n_layers):
        p = f"model.layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"self_attn.{x}_proj.bias" for x in "qkv"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
    return names


def _logits(model, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    with torch.no_grad():
        return model(ids, torch.arange(9)[None].expand(2, 9))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_round_trip_bit_exact(tmp_path: Path, model_type: str, tied: bool) -> None:
    model = tiny_model(model_type, weight_tying=tied)
    save_checkpoint(model, tmp_path)
    loaded = load_model(tmp_path)
    assert type(loaded) is type(model)
    assert loaded.config.to_dict() == model.config.to_dict()
    assert not loaded.training
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert b[k].dtype == a[k].dtype and b[k].device.type == "cpu", k
        assert torch.equal(a[k], b[k]), k
    assert torch.equal(_logits(model), _logits(loaded))
    names = set(load_file(str(tmp_path / "model.safetensors")))
    expected = (_llada_names if model_type == "llada" else _dream_names)(model.config.n_layers, tied)
    assert names == expected


def test_llada_config_json_keys(tmp_path: Path) -> None:
    model = tiny_model("llada", mask_token_id=2, eos_token_id=1, max_sequence_length=96)
    save_checkpoint(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "llada"
    missing = [k for k in LLADA_KEYS if k not in raw]
    assert not missing, missing
    c = model.config
    for k in LLADA_KEYS:
        assert raw[k] == getattr(c, k), k
    assert raw["max_sequence_length"] == 96 and raw["mask_token_id"] == 2


def test_dream_config_json_uses_qwen2_keys(tmp_path: Path) -> None:
    model = tiny_model("Dream")
    save_checkpoint(model, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "Dream"
    missing = [k for k in QWEN2_KEYS if k not in raw]
    assert not missing, missing
    assert raw["hidden_size"] == model.config.d_model
    assert raw["num_key_value_heads"] == model.config.n_kv_heads
    assert ModelConfig.from_dict(raw).to_dict() == model.config.to_dict()


def test_loaded_weights_are_memory_mapped(tmp_path: Path) -> None:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    save_checkpoint(tiny_model("llada"), tmp_path)
    loaded = load_model(tmp_path)
    ptr = loaded.model.transformer.wte.weight.data_ptr()
    target = str((tmp_path / "model.safetensors").resolve())
    ranges = []
    for line in maps.read_text().splitlines():
        if line.rstrip().endswith(target):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((lo, hi))
    assert ranges, "model.safetensors is not mapped into memory at all"
    assert any(lo <= ptr < hi for lo, hi in ranges), "the loaded tensor is a copy, not the mapping"


def test_load_casts_dtype(tmp_path: Path) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    m = load_model(tmp_path, dtype="bfloat16")
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16}
    with pytest.raises(CheckpointError, match="float32"):
        load_model(tmp_path, dtype="int8")


# --- malformed folders -------------------------------------------------------------------------
def _rewrite_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        state = {k: f.get_tensor(k).clone() for k in f.keys()}
    edit(state)
    path.unlink()
    save_file(state, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("model_type, key", [
    ("llada", "model.transformer.blocks.1.up_proj.weight"),
    ("llada", "model.transformer.ff_out.weight"),
    ("Dream", "model.layers.0.self_attn.k_proj.bias"),
])
def test_missing_tensor_named(tmp_path: Path, model_type: str, key: str) -> None:
    save_checkpoint(tiny_model(model_type), tmp_path)
    _rewrite_tensors(tmp_path, lambda s: s.pop(key))
    with pytest.raises(CheckpointError, match="missing") as e:
        load_model(tmp_path)
    assert key in str(e.value)


@pytest.mark.parametrize("model_type, key", [
    ("llada", "model.transformer.blocks.0.k_proj.weight"),
    ("Dream", "model.layers.1.mlp.down_proj.weight"),
])
def test_wrong_shape_named(tmp_path: Path, model_type: str, key: str) -> None:
    save_checkpoint(tiny_model(model_type), tmp_path)

    def edit(s: dict) -> None:
        s[key] = torch.zeros(s[key].shape[0] + 1, s[key].shape[1])

    _rewrite_tensors(tmp_path, edit)
    with pytest.raises(CheckpointError, match="shape") as e:
        load_model(tmp_path)
    assert key in str(e.value)


def test_unexpected_tensor_named(tmp_path: Path) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    _rewrite_tensors(tmp_path, lambda s: s.__setitem__("model.transformer.extra.weight",
                                                       torch.zeros(2)))
    with pytest.raises(CheckpointError, match="model.transformer.extra.weight"):
        load_model(tmp_path)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_no_config_json(tmp_path: Path) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)


def test_malformed_json(tmp_path: Path) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llada", "d_model": ')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(tmp_path)


def test_unknown_model_type(tmp_path: Path) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert "gpt2" in msg and "llada" in msg and "Dream" in msg  # names the valid choices


def test_no_model_type(tmp_path: Path) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="model_type"):
        load_model(tmp_path)


def test_no_weights(tmp_path: Path) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="safetensors"):
        load_model(tmp_path)


@pytest.mark.parametrize("text", ["[1, 2]", "null", '"llada"'])
def test_config_json_not_an_object(tmp_path: Path, text: str) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupted_safetensors(tmp_path: Path, damage: str) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"garbage" * 10 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(tmp_path)


@pytest.mark.parametrize("key, value", [("d_model", "abc"), ("rope_theta", "x")])
def test_non_numeric_config_value_named(tmp_path: Path, key: str, value: str) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw[key] = value
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=key):
        load_model(tmp_path)


@pytest.mark.parametrize("change, word", [
    ({"n_heads": 3}, "divisible"),
    ({"d_model": 0}, "d_model"),
    ({"mask_token_id": 10_000}, "mask_token_id"),
])
def test_invalid_config_values(tmp_path: Path, change: dict, word: str) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=word):
        load_model(tmp_path)


# A LLaDA-format config.json as written for the public LLaDA modeling file (a 100M-parameter
# variant published with this config); that file builds 124,327,616 parameters from it.
PUBLIC_LLADA_CONFIG = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0,
    "architectures": ["LLaDAModelLM"], "attention_dropout": 0.0, "attention_layer_norm": False,
    "attention_layer_norm_with_affine": True,
    "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                 "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                 "AutoModel": "modeling_llada.LLaDAModelLM"},
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 448,
    "embedding_dropout": 0.0, "embedding_size": 126464, "eos_token_id": 126081,
    "flash_attention": False, "include_bias": False, "include_qkv_bias": False,
    "init_cutoff_factor": None, "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02,
    "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
    "mask_token_id": 126336, "max_sequence_length": 1024, "mlp_hidden_size": 768, "mlp_ratio": 2,
    "model_type": "llada", "multi_query_attention": None, "n_heads": 7, "n_kv_heads": 7,
    "n_layers": 6, "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0,
    "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": 10000.0,
    "scale_logits": False, "transformers_version": "4.46.3", "use_cache": False,
    "vocab_size": 126464, "weight_tying": False,
}


def test_public_llada_config_builds_same_model() -> None:
    config = ModelConfig.from_dict(PUBLIC_LLADA_CONFIG)
    with torch.device("meta"):
        model = build_model(config)
    assert sum(p.numel() for p in model.parameters()) == 124_327_616
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["model.transformer.blocks.0.ff_proj.weight"] == (768, 448)
    assert shapes["model.transformer.blocks.0.ff_out.weight"] == (448, 768)
    assert shapes["model.transformer.ff_out.weight"] == (126464, 448)
    # Unknown keys survive a round trip, so a re-saved folder still loads in the public file.
    out = config.to_dict()
    for k, v in PUBLIC_LLADA_CONFIG.items():
        assert out[k] == v, k
