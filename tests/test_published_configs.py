"""The published config.json files of LLaDA-8B-Instruct, LLaDA-1.5, Dream-v0-Instruct-7B and
SDAR-4B/8B-Chat (tests/data; SDAR's from JetAstra/SDAR training/model/SDAR-*-Chat/): every key
honoured or refused with one line, and tiny random models with their exact key sets and real
vocabularies, saved sharded in bfloat16, load, round-trip bit-exact and generate with every
decoder (SDAR: with every decoder that applies to a block-causal model)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers import DECODERS, tiny_tokenizer_dir

import unmask
from unmask.checkpoint import INDEX, CheckpointError, load_model, save_checkpoint
from unmask.cli import main
from unmask.config import ConfigError, ModelConfig, json_keys
from unmask.decoding.params import DecodeParams
from unmask.errors import InputError
from unmask.models import build_model

DATA = Path(__file__).parent / "data"
PUBLISHED = {  # fixture -> (parameters of the full-size model, vocabulary)
    "llada-8b-instruct": (8_015_581_184, 126_464),
    "llada-1.5": (8_015_581_184, 126_464),
    "dream-v0-instruct-7b": (7_615_616_512, 152_064),
    # the published model.safetensors.index.json's total_size / 2 (bfloat16), and its tensor names
    "sdar-4b-chat": (4_411_424_256, 151_936),
    "sdar-8b-chat": (8_190_735_360, 151_936),
}
BIDIRECTIONAL = [name for name in PUBLISHED if not name.startswith("sdar")]
# The published architecture shrunk: same key set, head/kv-head ratio and vocabulary.
TINY = {
    "llada": {"d_model": 32, "n_heads": 4, "n_kv_heads": 4, "n_layers": 2, "mlp_hidden_size": 64},
    "Dream": {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "num_hidden_layers": 2, "intermediate_size": 64},
    # head_dim set apart from hidden_size / heads (8), as SDAR-4B's 128 is from 2560 / 32
    "sdar": {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 1,
             "num_hidden_layers": 2, "intermediate_size": 64, "head_dim": 16},
}
SHARD = 4 << 20  # bytes: the bf16 embedding and LM head (~8 MiB each) get a shard of their own

# One unsupported value per key that selects something unmask does not build.
REFUSED = {
    "llada": {
        "activation_type": "gelu", "alibi": True, "attention_layer_norm": True,
        "bias_for_layer_norm": True, "block_group_size": 2, "block_type": "sequential",
        "clip_qkv": 8.0, "input_emb_norm": True, "layer_norm_type": "default",
        "layer_norm_with_affine": False, "multi_query_attention": True, "rope": False,
        "scale_logits": True, "include_bias": True, "torch_dtype": "int8",
        "some_new_key": 1,
    },
    "Dream": {
        "hidden_act": "gelu", "use_sliding_window": True, "torch_dtype": "int8",
        "rope_scaling": {"type": "yarn", "factor": 4.0}, "embedding_size": 152_064,
        "some_new_key": 1,
    },
    "sdar": {
        "hidden_act": "gelu", "use_sliding_window": True, "attention_bias": True,
        "torch_dtype": "int8", "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
        "block_size": 0, "head_dim": 0, "embedding_size": 152_064, "some_new_key": 1,
    },
}


def published(name: str) -> dict:
    return json.loads((DATA / f"{name}.config.json").read_text())


@pytest.mark.parametrize("name", PUBLISHED)
def test_every_published_key_honoured(name: str) -> None:
    raw = published(name)
    config = ModelConfig.from_dict(raw)
    n_params, vocab = PUBLISHED[name]
    assert config.vocab_size == config.embedding_size == vocab
    assert config.torch_dtype == "bfloat16"
    assert config.rope_full_precision == (config.model_type == "llada")
    with torch.device("meta"):
        assert sum(p.numel() for p in build_model(config).parameters()) == n_params
    assert config.to_dict() == raw  # written back exactly, so a re-saved folder is the same


@pytest.mark.parametrize("model_type", REFUSED)
def test_every_variant_key_has_a_refusal_test(model_type: str) -> None:
    assert set(json_keys(model_type).variants) <= set(REFUSED[model_type])


def _refused_cases() -> list[tuple[str, str, object]]:
    names = {"llada": "llada-8b-instruct", "Dream": "dream-v0-instruct-7b", "sdar": "sdar-8b-chat"}
    return [(names[t], k, v) for t, keys in REFUSED.items() for k, v in keys.items()]


@pytest.mark.parametrize("name, key, value", _refused_cases())
def test_refused_key_named_in_one_line(name: str, key: str, value: object) -> None:
    raw = {**published(name), key: value}
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_dict(raw)
    msg = str(e.value)
    assert key in msg and json.dumps(value) in msg.replace("'", '"'), msg
    assert "\n" not in msg


@pytest.mark.parametrize("name, key, value", [c for c in _refused_cases()
                                              if c[1] in ("alibi", "torch_dtype", "rope_scaling")])
def test_cli_refused_key_exits_2(name: str, key: str, value: object, tmp_path: Path,
                                 capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**published(name), key: value}))
    assert main(["generate", "--model", str(tmp_path), "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("unmask: error:") and len(err.splitlines()) == 1, err
    assert key in err


def tiny_published(name: str) -> torch.nn.Module:
    """A random bfloat16 model with `name`'s config.json, shrunk to TINY dimensions."""
    raw = published(name)
    config = ModelConfig.from_dict({**raw, **TINY[raw["model_type"]]})
    torch.manual_seed(0)
    model = build_model(config)
    model.init_weights(std=0.3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(std=0.3)
    return model.to(torch.bfloat16).eval()


@pytest.fixture(scope="module", params=list(PUBLISHED))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(model, its sharded checkpoint folder with a tokenizer)."""
    model = tiny_published(request.param)
    out = tmp_path_factory.mktemp(request.param)
    tok = tiny_tokenizer_dir(out / "tok")
    # The tiny tokenizer's EOS and mask are ids 1 and 2, not the published ones: a tokenizer
    # naming other tokens than config.json is refused, so this one names none.
    settings = json.loads((tok / "tokenizer_config.json").read_text())
    for key in ("eos_token", "pad_token", "mask_token"):
        del settings[key]
    (tok / "tokenizer_config.json").write_text(json.dumps(settings))
    save_checkpoint(model, out, tokenizer_dir=tok, max_shard_size=SHARD)
    return model, out


def _load(path: Path, **kw) -> torch.nn.Module:
    with pytest.warns(UserWarning, match="bfloat16"):  # says what it runs in on the CPU
        return load_model(path, **kw)


def test_sharded_round_trip_bit_exact(folder, tmp_path: Path) -> None:
    model, path = folder
    index = json.loads((path / INDEX).read_text())
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert len(shards) >= 3 and shards == sorted(set(index["weight_map"].values()))
    assert set(index["weight_map"]) == set(model.state_dict())
    state = model.state_dict()
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in state.values())
    loaded = _load(path)
    assert loaded.config.to_dict() == model.config.to_dict()
    for k, v in loaded.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, state[k]), k
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(9)[None].expand(2, 9)
    with torch.no_grad():
        assert torch.equal(model(ids, pos), loaded(ids, pos))
    save_checkpoint(loaded, tmp_path, max_shard_size=SHARD)  # saved again: the same files
    for name in shards:
        assert (tmp_path / name).read_bytes() == (path / name).read_bytes(), name
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads(
        (path / "config.json").read_text())


@pytest.mark.parametrize("folder", BIDIRECTIONAL, indirect=True)
def test_generate_with_every_decoder(folder) -> None:
    model, path = folder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = unmask.LLM(path, device="cpu")
    assert {p.dtype for p in llm.model.parameters()} == {torch.bfloat16}
    mask = llm.config.mask_token_id
    for spec in [*DECODERS.values(), "fast"]:
        params = DecodeParams.parse(spec, gen_length=16, block_length=8)
        (g,) = llm.generate("what is 12 + 34?", params)
        assert len(g.token_ids) == 16 and mask not in g.token_ids, spec
        assert all(0 <= t < llm.config.vocab_size for t in g.token_ids), spec
        assert g.nfe >= 1


@pytest.mark.parametrize("folder", [n for n in PUBLISHED if n not in BIDIRECTIONAL], indirect=True)
def test_block_model_generates_with_every_decoder(folder) -> None:
    """An SDAR folder loads (model and tokenizer), runs forwards and generates with every decoder
    in its own blocks; a block length other than its own is one line."""
    model, path = folder
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = unmask.LLM(path, device="cpu")
    assert llm.config.block_size == 4 and llm.config.head_dim == 16
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(llm.model(ids, torch.arange(5)[None]), model(ids, torch.arange(5)[None]))
    mask = llm.config.mask_token_id
    for spec in [*DECODERS.values(), "exact", "balanced", "fast"]:
        (g,) = llm.generate("what is 12 + 34?", spec, gen_length=16)
        assert len(g.token_ids) == 16 and mask not in g.token_ids, spec
        assert g.nfe >= 1
    with pytest.raises(InputError, match="block_length=8 cannot apply"):
        llm.generate("what is 12 + 34?", DecodeParams.parse("static", gen_length=16, block_length=8))


def test_float32_on_request(folder) -> None:
    model, path = folder
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no dtype warning when the caller chose the dtype
        loaded = load_model(path, dtype="float32")
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    with pytest.raises(CheckpointError, match="int8"):
        load_model(path, dtype="int8")


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_config_as_transformers_5_writes_it(name: str) -> None:
    """transformers 5 saves `dtype` for 4.x's `torch_dtype`; such a config was refused."""
    raw = published(name)
    raw["dtype"] = raw.pop("torch_dtype")
    assert ModelConfig.from_dict(raw).torch_dtype == "bfloat16"


# The published tokenizers' size and special tokens (tokenizer.json, tokenizer_config.json):
# LLaDA's names <|endoftext|> (126081) its EOS and no mask token; Dream's (Qwen2's vocabulary
# plus two tokens) names <|endoftext|> (151643) and <|mask|> (151666).
PUBLISHED_TOKENIZERS = {
    "llada-8b-instruct": (126_349, {126_081: "<|endoftext|>", 126_336: "<|mdm_mask|>"},
                          {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}),
    "dream-v0-instruct-7b": (151_667, {151_643: "<|endoftext|>", 151_666: "<|mask|>"},
                             {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
                              "mask_token": "<|mask|>"}),
}
PUBLISHED_TOKENIZERS["llada-1.5"] = PUBLISHED_TOKENIZERS["llada-8b-instruct"]
# SDAR's (Qwen3's vocabulary plus <|MASK|>) names <|endoftext|> (151643) and <|MASK|> (151669).
PUBLISHED_TOKENIZERS["sdar-8b-chat"] = (
    151_670, {151_643: "<|endoftext|>", 151_669: "<|MASK|>"},
    {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "mask_token": "<|MASK|>"})
PUBLISHED_TOKENIZERS["sdar-4b-chat"] = PUBLISHED_TOKENIZERS["sdar-8b-chat"]


def _word_tokenizer(out: Path, size: int, specials: dict[int, str], settings: dict) -> Path:
    """A word-level tokenizer of `size` tokens with `specials` at their ids."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {specials.get(i, f"w{i}"): i for i in range(size)}
    tok = Tokenizer(WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = Whitespace()
    out.mkdir(parents=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **settings}))
    return out


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_tokenizers_agree_with_their_configs(name: str, tmp_path: Path) -> None:
    """The load-time comparison of tokenizer and config passes the published pairs, and would
    refuse one whose special token differs."""
    from unmask.api import check_tokenizer, load_tokenizer

    config = ModelConfig.from_dict(published(name))
    size, specials, settings = PUBLISHED_TOKENIZERS[name]
    tok = load_tokenizer(_word_tokenizer(tmp_path / "ok", size, specials, settings))
    assert len(tok) == size and tok.eos_token_id == config.eos_token_id
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the published pairs agree: not even a warning
        check_tokenizer(tok, config, tmp_path)
    wrong = load_tokenizer(_word_tokenizer(tmp_path / "bad", size, specials,
                                           {**settings, "eos_token": "w5"}))
    with pytest.warns(UserWarning, match=f"eos_token_id is {config.eos_token_id}, but the "
                                         "tokenizer's eos token 'w5' is id 5"):
        check_tokenizer(wrong, config, tmp_path)
