"""Checkpoint IO: save -> load is bit-exact (one file or shards), the folder has the public
checkpoints' config keys and tensor names, and every malformed folder (sharded ones too) fails
with a CheckpointError that names the problem."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import edit_config, tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from unmask.checkpoint import INDEX, CheckpointError, load_model, save_checkpoint
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


# --- sharded folders -----------------------------------------------------------------------------
def _sharded(folder: Path, model_type: str = "llada") -> dict[str, str]:
    """A tiny model saved in shards of at most 20 KB; returns the index's weight_map."""
    save_checkpoint(tiny_model(model_type), folder, max_shard_size=20_000)
    return json.loads((folder / INDEX).read_text())["weight_map"]


def _write_index(folder: Path, weight_map: dict[str, str]) -> None:
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_sharded_round_trip_bit_exact(tmp_path: Path, model_type: str) -> None:
    model = tiny_model(model_type)
    weight_map = _sharded(tmp_path, model_type)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and not (tmp_path / "model.safetensors").exists()
    assert sorted(set(weight_map.values())) == [f.name for f in files]
    for f in files:  # each shard holds exactly what the index says, within the limit
        held = set(load_file(str(f)))
        assert held == {k for k, v in weight_map.items() if v == f.name}
        assert sum(t.numel() * t.element_size() for t in load_file(str(f)).values()) <= 20_000 \
            or len(held) == 1
    loaded = load_model(tmp_path)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    save_checkpoint(model, tmp_path)  # back to one file: the shards and index are gone
    assert [p.name for p in tmp_path.glob("*.safetensors")] == ["model.safetensors"]
    assert not (tmp_path / INDEX).exists()


def test_sharded_tensors_stay_memory_mapped(tmp_path: Path) -> None:
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("needs /proc/self/maps (Linux)")
    weight_map = _sharded(tmp_path)
    loaded = load_model(tmp_path)
    target = str((tmp_path / weight_map["model.transformer.wte.weight"]).resolve())
    ptr = loaded.model.transformer.wte.weight.data_ptr()
    ranges = [tuple(int(x, 16) for x in line.split()[0].split("-"))
              for line in maps.read_text().splitlines() if line.rstrip().endswith(target)]
    assert any(lo <= ptr < hi for lo, hi in ranges), "the loaded tensor is a copy, not the mapping"


def test_shard_listed_but_missing(tmp_path: Path) -> None:
    weight_map = _sharded(tmp_path)
    gone = weight_map["model.transformer.blocks.1.q_proj.weight"]
    (tmp_path / gone).unlink()
    with pytest.raises(CheckpointError, match=f"lists {gone}, which is not in"):
        load_model(tmp_path)


def test_file_not_in_index(tmp_path: Path) -> None:
    _sharded(tmp_path)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="model.safetensors is not listed in"):
        load_model(tmp_path)


def test_tensor_in_another_file_than_listed(tmp_path: Path) -> None:
    weight_map = _sharded(tmp_path)
    key = "model.transformer.blocks.0.k_proj.weight"
    other = next(f for f in sorted(set(weight_map.values())) if f != weight_map[key])
    _write_index(tmp_path, {**weight_map, key: other})
    with pytest.raises(CheckpointError, match=key):
        load_model(tmp_path)


def test_tensor_not_in_index(tmp_path: Path) -> None:
    weight_map = _sharded(tmp_path)
    key = "model.transformer.ln_f.weight"
    _write_index(tmp_path, {k: v for k, v in weight_map.items() if k != key})
    with pytest.raises(CheckpointError, match=f"holds tensor {key!r}, which {INDEX} does not list"):
        load_model(tmp_path)


def test_tensor_in_two_files(tmp_path: Path) -> None:
    save_checkpoint(tiny_model("llada"), tmp_path)
    key = "model.transformer.ln_f.weight"
    save_file({key: load_file(str(tmp_path / "model.safetensors"))[key]}, str(tmp_path / "x.safetensors"))
    with pytest.raises(CheckpointError, match=f"{key!r} is in both"):
        load_model(tmp_path)


@pytest.mark.parametrize("text", ["{not json", '{"metadata": {}}', '{"weight_map": {"a": 1}}',
                                  '{"weight_map": {"a": "../model.safetensors"}}'])
def test_malformed_index(tmp_path: Path, text: str) -> None:
    _sharded(tmp_path)
    (tmp_path / INDEX).write_text(text)
    with pytest.raises(CheckpointError, match=INDEX):
        load_model(tmp_path)


@pytest.mark.parametrize("size", [0, -5, 1.5, "2GB"])
def test_bad_max_shard_size(tmp_path: Path, size) -> None:
    with pytest.raises(CheckpointError, match="max_shard_size"):
        save_checkpoint(tiny_model("llada"), tmp_path, max_shard_size=size)


def test_loading_a_model_does_not_import_dynamo() -> None:
    """nn.Embedding's normal_ init, run on the meta device where load_model builds, imported
    torch._dynamo: ~1 s of every model load (the CLI's, the server's start). In a fresh process,
    since other tests may import it."""
    code = "import sys; from unmask import LLM; LLM(); print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stdout + out.stderr


# --- dtypes, key names and bounds -----------------------------------------------------------------
def test_tensor_of_an_unreadable_dtype_named(tmp_path: Path) -> None:
    """A dtype safetensors has a name for but cannot read (FP6) was a raw SafetensorError."""
    save_checkpoint(tiny_model("llada"), tmp_path)
    path, key = tmp_path / "model.safetensors", "model.transformer.ln_f.weight"
    state = load_file(str(path))
    header, blobs, offset = {}, [], 0
    for name, t in state.items():
        data = b"\x01" * (t.numel() * 3 // 4) if name == key else t.numpy().tobytes()
        header[name] = {"dtype": "F6_E2M3" if name == key else "F32", "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
        blobs.append(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert "model.safetensors" in msg and repr(key) in msg and "F6_E2M3" in msg, msg
    assert "\n" not in msg


@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_transformers_5_dtype_key_is_torch_dtype(tmp_path: Path, model_type: str) -> None:
    """transformers 5 writes `dtype` where 4.x wrote `torch_dtype`; it was refused as unknown."""
    save_checkpoint(tiny_model(model_type), tmp_path)
    edit_config(tmp_path, torch_dtype=..., dtype="bfloat16")
    loaded = load_model(tmp_path, dtype="float32")
    assert loaded.config.torch_dtype == "bfloat16"
    edit_config(tmp_path, torch_dtype="bfloat16")  # both, agreeing
    assert load_model(tmp_path, dtype="float32").config.torch_dtype == "bfloat16"
    edit_config(tmp_path, torch_dtype="float32")
    with pytest.raises(CheckpointError, match="'dtype' = \"bfloat16\" and 'torch_dtype' = "
                                              "\"float32\" disagree"):
        load_model(tmp_path)
    edit_config(tmp_path, torch_dtype=..., dtype="int8")
    with pytest.raises(CheckpointError, match="config key 'dtype' = \"int8\" is not supported"):
        load_model(tmp_path)


def test_save_records_the_dtype_it_writes(tmp_path: Path) -> None:
    """A float32 folder loaded in bfloat16 and saved wrote bfloat16 weights under a config that
    said float32, so it reloaded in float32: twice the memory, no more precision."""
    save_checkpoint(tiny_model("llada"), tmp_path / "a")
    model = load_model(tmp_path / "a", dtype="bfloat16")
    save_checkpoint(model, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert model.config.torch_dtype == "float32"  # the caller's config is not changed
    with pytest.warns(UserWarning, match="bfloat16"):
        again = load_model(tmp_path / "b")
    for k, v in model.state_dict().items():
        assert again.state_dict()[k].dtype == torch.bfloat16 and torch.equal(again.state_dict()[k], v)


@pytest.mark.parametrize("model_type, change, words", [
    ("Dream", {"hidden_size": "abc"}, "config key 'hidden_size' must be int"),
    ("Dream", {"num_hidden_layers": 10**12}, "num_hidden_layers must be an integer in 1..4,096"),
    ("Dream", {"num_attention_heads": 3},
     "hidden_size (32) must be divisible by num_attention_heads (3)"),
    ("Dream", {"num_key_value_heads": 3},
     "num_attention_heads (4) must be divisible by num_key_value_heads (3)"),
    ("Dream", {"intermediate_size": 0}, "intermediate_size must be an integer in 1.."),
    ("Dream", {"max_position_embeddings": 1.5}, "config key 'max_position_embeddings' must be int"),
    ("Dream", {"tie_word_embeddings": "no"}, "config key 'tie_word_embeddings' must be bool"),
    ("llada", {"include_qkv_bias": "no"}, "config key 'include_qkv_bias' must be bool"),
])
def test_errors_name_the_key_as_config_json_spells_it(tmp_path: Path, model_type: str,
                                                       change: dict, words: str) -> None:
    """Dream's errors named unmask's field names (d_model, n_layers...), which its file lacks."""
    save_checkpoint(tiny_model(model_type), tmp_path)
    edit_config(tmp_path, **change)
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path)
    msg = str(e.value)
    assert words in msg, msg
    internal = {"d_model", "n_heads", "n_kv_heads", "n_layers", "mlp_hidden_size",
                "max_sequence_length", "weight_tying", "qkv_bias"}
    assert not {w.strip("'(),") for w in msg.split()} & internal, msg


@pytest.mark.parametrize("model_type, key", [("llada", "max_sequence_length"),
                                             ("Dream", "max_position_embeddings")])
def test_max_sequence_length_is_bounded(tmp_path: Path, model_type: str, key: str) -> None:
    """10**30 was accepted; a long gen_length then died allocating numpy arrays."""
    save_checkpoint(tiny_model(model_type), tmp_path)
    edit_config(tmp_path, **{key: 10**30})
    with pytest.raises(CheckpointError, match=f"{key} must be an integer in 1..268,435,456"):
        load_model(tmp_path)
    edit_config(tmp_path, **{key: 1 << 28})
    assert load_model(tmp_path).config.max_sequence_length == 1 << 28


def test_finite_weights_that_overflow_float16_are_named_as_such(tmp_path: Path) -> None:
    """They were called 'NaN or infinite ... the checkpoint is damaged'."""
    save_checkpoint(tiny_model("llada"), tmp_path)
    key = "model.transformer.blocks.0.q_proj.weight"
    _rewrite_tensors(tmp_path, lambda s: s[key].view(-1).__setitem__(5, 1e5))
    with pytest.raises(CheckpointError) as e:
        load_model(tmp_path, dtype="float16")
    msg = str(e.value)
    assert key in msg and "overflow torch.float16" in msg and "1e+05" in msg, msg
    assert "damaged" not in msg
    assert load_model(tmp_path).state_dict()[key].view(-1)[5] == 1e5  # fine in float32


def test_linear_rope_scaling_needs_its_factor() -> None:
    """{"type": "linear"} with no factor ran unscaled (a factor of 1.0, silently); transformers
    refuses it."""
    from unmask.config import ConfigError

    base = tiny_model("Dream").config
    for scaling, factor in (({"type": "linear", "factor": 2.0}, 2.0), ({"rope_type": "default"}, 1.0)):
        assert dataclasses.replace(base, rope_scaling=scaling).rope_factor() == factor
    with pytest.raises(ConfigError, match="rope_scaling.*linear with a positive factor"):
        dataclasses.replace(base, rope_scaling={"type": "linear"})


def test_a_broken_weights_file_or_shape_names_the_folder(tmp_path) -> None:
    """The safetensors and shape errors named a file or a tensor, not which folder holds it."""
    import json
    import shutil

    from helpers import tiny_model_dir

    from unmask.checkpoint import CheckpointError, load_model

    good = tiny_model_dir(tmp_path, "llada")
    corrupt, shaped = tmp_path / "corrupt", tmp_path / "shaped"
    for folder in (corrupt, shaped):
        shutil.copytree(good, folder)
    (corrupt / "model.safetensors").write_bytes(b"\0" * 100)
    config = json.loads((shaped / "config.json").read_text())
    (shaped / "config.json").write_text(json.dumps({**config, "mlp_hidden_size": 2 * config[
        "mlp_hidden_size"]}))
    with pytest.raises(CheckpointError, match=f"^{corrupt}: model.safetensors is not a readable"):
        load_model(corrupt)
    with pytest.raises(CheckpointError, match=f"^{shaped}: tensor '.*' has shape"):
        load_model(shaped)
