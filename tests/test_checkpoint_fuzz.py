"""Hostile and careless model folders and `unmask train` flags: each is refused up front with an
UnmaskError naming what is wrong (CLI: exit 2), never a traceback, a hang or a huge allocation."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch
from helpers import edit_config, tiny_model, tiny_tokenizer_dir
from safetensors.torch import load_file, save_file

from unmask.checkpoint import CheckpointError, load_model, save_checkpoint
from unmask.errors import InputError, UnmaskError


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    save_checkpoint(tiny_model("llada"), tmp_path)
    return tmp_path


@pytest.mark.parametrize("change, words", [
    ({"n_layers": 10**12}, "n_layers must be an integer in 1..4,096"),  # was a multi-minute hang
    ({"d_model": 10**12}, "d_model must be an integer in 1.."),  # was a RuntimeError
    ({"mlp_hidden_size": 2**63}, "mlp_hidden_size"),  # was a TypeError
    ({"vocab_size": True}, "'vocab_size' must be int, got True"),  # was loaded as vocab_size 1
    ({"mask_token_id": True}, "'mask_token_id' must be int"),
    ({"d_model": float("inf")}, "'d_model' must be int"),  # was an OverflowError
    ({"rope_theta": 0}, "rope_theta must be a positive number"),  # were NaN logits, empty text
    ({"rope_theta": float("nan")}, "'rope_theta' must be float"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a positive number"),
    ({"mask_token_id": 1, "eos_token_id": 1}, "both 1"),  # was garbage output
    ({"vocab_size": 50, "embedding_size": 300, "eos_token_id": 60}, "could never predict"),
    ({"d_model": ...}, "config.json has no 'd_model'"),  # was unmask's default 256
    ({"mask_token_id": ...}, "config.json has no 'mask_token_id'"),  # was id 2, silently
    ({"mlp_hidden_size": None, "mlp_ratio": "x"}, "'mlp_ratio' must be a number"),
])
def test_bad_config_value_refused(folder: Path, change: dict, words: str) -> None:
    edit_config(folder, **change)
    with pytest.raises(CheckpointError, match=words.replace("(", r"\(").replace(".", r"\.")):
        load_model(folder)


@pytest.mark.parametrize("text", [b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000])
def test_config_json_not_utf8_or_too_deep(folder: Path, text: bytes) -> None:
    (folder / "config.json").write_bytes(text)  # were UnicodeDecodeError / RecursionError
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(folder)


def test_a_file_is_not_a_model_folder(folder: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a folder"):  # was "does not exist"
        load_model(folder / "config.json")


def _edit_weights(folder: Path, name: str, edit) -> None:
    state = load_file(str(folder / "model.safetensors"))
    state[name] = edit(state[name])
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


Q = "model.transformer.blocks.0.q_proj.weight"


@pytest.mark.parametrize("edit", [lambda t: t.long(), lambda t: t > 0, lambda t: t.to(torch.complex64)],
                         ids=["int64", "bool", "complex"])
def test_non_float_weights_refused(folder: Path, edit) -> None:
    _edit_weights(folder, Q, edit)  # were cast silently: int64 weights truncate to garbage
    with pytest.raises(CheckpointError, match=f"{Q}.*must be floating point"):
        load_model(folder)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", [None, "bfloat16", "float16"])
def test_non_finite_weights_refused(folder: Path, value: float, dtype: str | None) -> None:
    _edit_weights(folder, Q, lambda t: t.clone().index_fill_(0, torch.tensor([3]), value))
    with pytest.raises(CheckpointError, match=f"{Q}.*NaN or infinite"):  # was empty output
        load_model(folder, dtype=dtype)


def test_valid_weights_in_other_float_dtypes_still_load(folder: Path) -> None:
    ref = load_model(folder)
    _edit_weights(folder, Q, lambda t: t.double())
    assert torch.equal(load_model(folder).state_dict()[Q], ref.state_dict()[Q])


# ------------------------------------------------------------------------------ unmask train


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def _train(tok_dir: Path, out: Path, *extra: str) -> None:
    from unmask.training.train import add_train_arguments, run_train

    args = add_train_arguments(argparse.ArgumentParser()).parse_args([
        "--tokenizer", str(tok_dir), "--out", str(out), "--d-model", "32", "--n-layers", "1",
        "--n-heads", "2", "--mlp-hidden", "64", "--batch-tokens", "512", "--code-frac", "0",
        "--eval-every", "1", "--eval-batches", "1", "--solve-every", "0", "--threads", "1",
        "--max-steps", "1", *extra])
    run_train(args)


@pytest.mark.parametrize("extra, words", [
    (["--eval-every", "0"], "--eval-every must be an integer >= 1"),  # were ZeroDivisionError
    (["--log-every", "0"], "--log-every"),
    (["--eval-batches", "0"], "--eval-batches"),
    (["--batch-tokens", "0"], "--batch-tokens must be an integer >= 1"),  # was ValueError
    (["--batch-tokens", str(10**12)], "--batch-tokens must be at most"),  # was a hang
    (["--threads", "x"], "--threads must be 'auto' or an integer"),  # was ValueError
    (["--threads", "100000"], "--threads 100000: this process may run on"),  # was a segfault
    (["--lr", "nan"], "--lr must be a number > 0"),
    (["--warmup", "2"], "--warmup"),  # were silently accepted
    (["--grad-clip", "0"], "--grad-clip"),
    (["--code-frac", "2"], "--code-frac"),
    (["--weight-decay", "nan"], "--weight-decay"),  # was a NaN loss
    (["--seed", str(2**70)], "--seed"),  # was an OverflowError
    (["--vocab-size", str(10**9)], "--vocab-size"),  # was a Rust abort, after minutes
    (["--max-seq-len", "8"], "longer than --max-seq-len 8"),  # trained past the model's length
    (["--buckets", "100000000-100000000:1", "--max-seq-len", "200000000"], "GiB to train"),
    (["--buckets", "0-0:1"], "no math answer in 10,000 fits a canvas of 0"),  # was a hang
    (["--d-model", str(1 << 20)], "GiB to train"),  # was an allocation of 4 TiB
    (["--n-layers", str(10**12)], "n_layers must be an integer in 1.."),  # was a hang
])
def test_train_bad_flags_refused(tok_dir: Path, tmp_path: Path, extra: list[str], words: str) -> None:
    with pytest.raises(UnmaskError, match=words.replace("(", r"\(").replace(".", r"\.")):
        _train(tok_dir, tmp_path / "run", *extra)


def test_train_bucket_weights_must_not_all_be_zero() -> None:
    from unmask.training.train import parse_buckets

    with pytest.raises(InputError, match="sum to 0"):  # was a ValueError from random.choices
        parse_buckets("5-10:0")


def test_train_unusable_paths_refused_before_training(tok_dir: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for extra, words in [(["--out", str(a_file)], "--out"),  # were FileExistsError, NotADirectoryError
                         (["--export", str(a_file)], "--export"),  # after the whole run
                         (["--tokenizer", str(a_file)], "--tokenizer")]:
        with pytest.raises(InputError, match=words):
            _train(tok_dir, tmp_path / "run", *extra)
    assert not (tmp_path / "run" / "state.pt").exists()  # refused before training


def test_train_export_never_deletes_a_folder_that_is_not_a_model(tok_dir: Path, tmp_path: Path) -> None:
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(InputError, match="not a model folder"):  # was shutil.rmtree'd
        _train(tok_dir, tmp_path / "run", "--export", str(precious))
    assert (precious / "notes.txt").read_text() == "keep me"
    _train(tok_dir, tmp_path / "run", "--export", str(tmp_path / "new"))
    _train(tok_dir, tmp_path / "run2", "--export", str(tmp_path / "new"))  # an earlier export: replaced
    assert (tmp_path / "new" / "model.safetensors").is_file()


def test_train_corrupt_tokenizer_named(tmp_path: Path) -> None:
    bad = tmp_path / "tok"
    bad.mkdir()
    (bad / "tokenizer.json").write_text("{bad")
    with pytest.raises(CheckpointError, match="not a readable tokenizer"):  # was a tokenizers Exception
        _train(bad, tmp_path / "run")


# --- tokenizer files and the chat template (unmask.api) --------------------------------------------
@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    from helpers import tiny_model_dir

    return tiny_model_dir(tmp_path)


@pytest.mark.parametrize("name, text", [
    ("tokenizer.json", "{}"),  # was a tokenizers exception, exit 1
    ("tokenizer.json", "not json"),
    ("tokenizer_config.json", "[1, 2]"),  # was an AttributeError
    ("tokenizer_config.json", '{"model_max_length": "x"}'),  # failed at the first encode
])
def test_damaged_tokenizer_files_are_named(model_dir: Path, name: str, text: str) -> None:
    from unmask.api import LLM

    (model_dir / name).write_text(text)
    with pytest.raises(CheckpointError, match="tokenizer.json or tokenizer_config.json cannot be loaded"):
        LLM(model_dir)


def test_a_tokenizer_larger_than_the_embedding_is_refused_at_load(tmp_path: Path) -> None:
    """Tokens past the embedding used to fail every ordinary prompt as 'not in the model's
    vocabulary'."""
    from unmask.api import LLM

    small = tiny_tokenizer_dir(tmp_path / "small")  # ~300 tokens
    save_checkpoint(tiny_model("llada", vocab_size=200), small)
    with pytest.raises(CheckpointError, match=r"the tokenizer has [\d,]+ tokens, more than the "
                                              r"model's embedding_size 200"):
        LLM(small)


@pytest.mark.parametrize("template, words", [
    ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
    ("{% for m in messages %}{{ m['content'] }", "TemplateSyntaxError"),  # a broken template
    ("{{ messages[5]['content'] }}", "failed on these messages"),
])
def test_a_failing_chat_template_is_an_input_error(model_dir: Path, template: str, words: str,
                                                   capsys: pytest.CaptureFixture) -> None:
    from unmask.api import LLM
    from unmask.cli import main

    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match=words):  # was jinja2's exception, or an IndexError
        LLM(model_dir).encode_prompt("hi")
    assert main(["generate", "--model", str(model_dir), "--gen-length", "8", "--block-length", "8",
                 "hi"]) == 2
    assert "chat_template" in capsys.readouterr().err
    assert LLM(model_dir).encode_prompt("hi", chat=False)  # the raw prompt never reads it


def test_no_chat_template_is_said_not_silent(model_dir: Path,
                                             capsys: pytest.CaptureFixture) -> None:
    """A checkpoint without a chat template (a base model) used to get the raw prompt with chat
    on (the default), silently: now the CLI and the API say so, and --raw / chat=False is quiet."""
    from unmask.api import LLM
    from unmask.cli import main

    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    argv = ["generate", "--model", str(model_dir), "--gen-length", "8", "--block-length", "8", "hi"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "note:" in err and "has no chat template" in err and "--raw" in err
    assert main([*argv, "--raw"]) == 0
    assert "chat template" not in capsys.readouterr().err
    out = model_dir.parent / "t.html"
    assert main(["trace", "--model", str(model_dir), "--gen-length", "8", "--block-length", "8",
                 "--out", str(out), "hi"]) == 0
    assert "has no chat template" in capsys.readouterr().err
    assert main(["bench", "--model", str(model_dir), "--task", "math", "--n", "1", "--gen-length",
                 "8", "--block-length", "8", "--decoder", "static-1", "--warmup", "0"]) == 0
    err = capsys.readouterr().err
    assert "has no chat template" in err and "--raw" not in err  # bench has no raw flag
    llm = LLM(model_dir)
    with pytest.warns(UserWarning, match="has no chat template"):
        chat = llm.encode_prompt("hi")
    assert chat == llm.encode_prompt("hi", chat=False)  # the prompt as written, as the note says
