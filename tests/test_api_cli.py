"""The Python API and the CLI on a tiny random model folder written by unmask itself."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import edit_config, tiny_model_dir

from unmask.api import LLM, InputError
from unmask.checkpoint import CheckpointError
from unmask.cli import main
from unmask.decoding.params import DecodeParams, SpecError

PROMPTS = ["hello", "what is 12 + 34?", "sort the list [3, 1, 2] to get a sorted list of numbers",
           "def"]
JSON_KEYS = {"text", "token_ids", "nfe", "token_forwards", "tpf", "tps", "seconds", "finish_reason",
             "useful", "cached_tokens"}


@pytest.fixture(scope="module")
def llada_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "llada")


@pytest.fixture(scope="module")
def dream_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("models"), "Dream")


@pytest.fixture(scope="module")
def llms(llada_dir: Path, dream_dir: Path) -> dict[str, LLM]:
    return {"llada": LLM(llada_dir, device="cpu"), "Dream": LLM(dream_dir, device="cpu")}


def test_fixture_folder_layout(llada_dir: Path, dream_dir: Path) -> None:
    for d in (llada_dir, dream_dir):
        names = {p.name for p in d.iterdir()}
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
        assert "chat_template" in json.loads((d / "tokenizer_config.json").read_text())


# --- API -----------------------------------------------------------------------------------------
# A random model is unsure of everything: the default tau 0.9 falls back to one token per step,
# tau 0.1 commits several per step, so both threshold branches meet batch padding.
@pytest.mark.parametrize("spec", ["static-1", "threshold", "threshold,threshold=0.1"])
@pytest.mark.parametrize("model_type", ["llada", "Dream"])
def test_batch_equals_alone(llms: dict[str, LLM], model_type: str, spec: str) -> None:
    llm = llms[model_type]
    lengths = {len(llm.encode_prompt(p)) for p in PROMPTS}
    assert len(lengths) == len(PROMPTS)  # really different lengths, so the batch is padded
    params = DecodeParams.parse(spec, gen_length=16, block_length=8)
    together = llm.generate(PROMPTS, params, batch_size=len(PROMPTS))
    alone = [llm.generate(p, params)[0] for p in PROMPTS]
    assert [g.token_ids for g in together] == [g.token_ids for g in alone]
    assert [g.text for g in together] == [g.text for g in alone]
    for g in together:
        assert len(g.token_ids) == 16
        assert llm.config.mask_token_id not in g.token_ids
        assert g.nfe >= 1 and g.token_forwards >= g.nfe
        if spec == "static-1":
            assert g.nfe == 16
    if spec.endswith("0.1"):
        assert min(g.nfe for g in together) < 16  # parallel commits really happened


def test_generate_result_fields(llms: dict[str, LLM]) -> None:
    g = llms["llada"].generate("hello", "static-1", gen_length=16, block_length=8)[0]
    assert set(g.to_dict()) == JSON_KEYS
    assert g.tpf == pytest.approx(16 / g.nfe)
    assert g.seconds > 0 and g.tps >= 0


def test_chat_template_applied(llms: dict[str, LLM]) -> None:
    llm = llms["llada"]
    chat = llm.encode_prompt("hello")
    raw = llm.encode_prompt("hello", chat=False)
    assert chat != raw and len(chat) > len(raw)
    assert chat[0] == llm.tokenizer.convert_tokens_to_ids("<|bos|>")


def test_api_errors(llms: dict[str, LLM], tmp_path: Path) -> None:
    llm = llms["llada"]
    with pytest.raises(InputError, match="empty prompt"):
        llm.generate("   ", "static-1", gen_length=16, block_length=8)
    with pytest.raises(InputError, match="max_sequence_length"):
        llm.generate("hello", "static-1", gen_length=512, block_length=8)
    with pytest.raises(SpecError):
        llm.generate("hello", "nope")
    with pytest.raises(CheckpointError):
        LLM(tmp_path / "missing", device="cpu")


# --- CLI -----------------------------------------------------------------------------------------
def test_cli_generate_json(llada_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["generate", "--model", str(llada_dir), "--decoder", "static-1", "--gen-length", "16",
                 "--block-length", "8", "--json", "hello"])
    out = capsys.readouterr().out
    assert code == 0
    lines = out.strip().splitlines()
    assert len(lines) == 1
    obj = json.loads(lines[0])
    assert set(obj) == JSON_KEYS
    assert len(obj["token_ids"]) == 16 and obj["nfe"] == 16
    assert isinstance(obj["text"], str)
    assert obj["token_forwards"] >= obj["nfe"]
    # the CLI and the API agree
    llm = LLM(llada_dir, device="cpu")
    assert obj["token_ids"] == llm.generate("hello", "static-1", gen_length=16, block_length=8)[0].token_ids


def test_cli_generate_text(llada_dir: Path, capsys: pytest.CaptureFixture) -> None:
    code = main(["generate", "--model", str(llada_dir), "--decoder", "threshold", "--gen-length", "16",
                 "--block-length", "8", "hello", "what is 1 + 2?"])
    cap = capsys.readouterr()
    assert code == 0
    assert "NFE" in cap.err and "threshold" in cap.err
    # Several answers are told apart: a header names each one's prompt, a blank line between.
    lines = cap.out.splitlines()
    assert lines[0] == "=== [1/2] hello"
    second = lines.index("=== [2/2] what is 1 + 2?")
    assert lines[second - 1] == ""


def test_cli_generate_json_several_prompts(llada_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--model", str(llada_dir), "--gen-length", "16", "--block-length", "8",
                 "--json", "hello", "what is 1 + 2?"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and all(set(json.loads(ln)) == JSON_KEYS for ln in lines)


def _make_broken(root: Path, kind: str, llada_dir: Path) -> Path:
    import shutil

    d = root / kind
    shutil.copytree(llada_dir, d)
    if kind == "no-config":
        (d / "config.json").unlink()
    elif kind == "bad-json":
        (d / "config.json").write_text("{not json")
    elif kind == "unknown-type":
        raw = json.loads((d / "config.json").read_text())
        raw["model_type"] = "mamba"
        (d / "config.json").write_text(json.dumps(raw))
    elif kind == "missing-tensor":
        from safetensors.torch import load_file, save_file

        state = load_file(str(d / "model.safetensors"))
        del state["model.transformer.blocks.0.q_proj.weight"]
        save_file(state, str(d / "model.safetensors"))
    elif kind == "no-tokenizer":
        (d / "tokenizer.json").unlink()
    return d


def _run_error(argv: list[str], capsys: pytest.CaptureFixture, one_line: bool = True) -> str:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse-level errors
        code = e.code
    cap = capsys.readouterr()
    assert code == 2, (code, cap.err)
    err = cap.err.strip()
    assert "Traceback" not in cap.err and "Traceback" not in cap.out
    assert err, "no message"
    if one_line:
        assert len(err.splitlines()) == 1, err
        assert err.startswith("unmask: error:"), err
    return err.splitlines()[-1]


@pytest.mark.parametrize("kind, needle", [
    ("missing", "does not exist"),
    ("no-config", "config.json"),
    ("bad-json", "JSON"),
    ("unknown-type", "mamba"),
    ("missing-tensor", "model.transformer.blocks.0.q_proj.weight"),
    ("no-tokenizer", "tokenizer.json"),
])
def test_cli_bad_model_folder(kind: str, needle: str, llada_dir: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture) -> None:
    d = tmp_path / "missing" if kind == "missing" else _make_broken(tmp_path, kind, llada_dir)
    err = _run_error(["generate", "--model", str(d), "--gen-length", "16", "--block-length", "8",
                      "hello"], capsys)
    assert needle in err
    assert err.count(str(d)) <= 1, err  # "D: D has no config.json" named the folder twice


@pytest.mark.parametrize("args, needle", [
    (["--decoder", "nope"], "static-1"),
    (["--decoder", "static-1,bogus=1"], "temperature"),
    (["--decoder", "static-1,steps"], "key=value"),
    (["--gen-length", "20", "--block-length", "8"], "multiple"),
    (["--decoder", "static,steps=3", "--gen-length", "16", "--block-length", "8"], "steps"),
    (["--decoder", "static-1,temperature=-0.5"], ">= 0"),
])
def test_cli_bad_spec(args: list[str], needle: str, llada_dir: Path,
                      capsys: pytest.CaptureFixture) -> None:
    base = ["generate", "--model", str(llada_dir)]
    if "--gen-length" not in args:
        base += ["--gen-length", "16", "--block-length", "8"]
    err = _run_error(base + args + ["hello"], capsys)
    assert needle in err


def test_a_long_prompt_brings_no_tokenizer_warning(
        capfd: pytest.CaptureFixture) -> None:
    """transformers warned first that the prompt "will result in indexing errors" (it never
    reaches the model: the engine refuses it, naming both lengths)."""
    from unmask.api import DEFAULT_MODEL, load_tokenizer

    capfd.readouterr()
    tok = load_tokenizer(DEFAULT_MODEL)  # a fresh tokenizer: transformers warns once each
    assert len(tok.encode("x " * 3000, add_special_tokens=False)) > 2048
    assert capfd.readouterr().err == ""


def test_threads_past_the_cpus_is_a_one_line_error(capsys: pytest.CaptureFixture) -> None:
    """--threads 100000 was a segfault (exit 139) inside the OpenMP runtime."""
    import torch

    before = torch.get_num_threads()
    err = _run_error(["generate", "--threads", "100000", "--gen-length", "32", "hi"], capsys)
    assert "--threads 100000" in err and "valid: 1.." in err
    assert torch.get_num_threads() == before


def test_physical_cores_count_hyperthread_siblings_once(tmp_path: Path) -> None:
    """Four logical CPUs on two cores (two hyperthreads each): two cores; unreadable: None."""
    from unmask.api import physical_cores

    for cpu, core in enumerate([0, 0, 1, 1]):
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text("0\n")
        (topology / "core_id").write_text(f"{core}\n")
    assert physical_cores({0, 1, 2, 3}, tmp_path) == 2
    assert physical_cores({0, 2}, tmp_path) == 2
    assert physical_cores({0, 1}, tmp_path) == 1
    assert physical_cores({0, 4}, tmp_path) is None  # cpu4 has no topology


def test_default_threads_one_per_core_one_for_a_tiny_model(monkeypatch: pytest.MonkeyPatch) -> None:
    import unmask.api as api

    monkeypatch.setattr(api, "allowed_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(api, "physical_cores", lambda cpus: 2)
    assert api.default_threads(api.TINY_MODEL_PARAMS)[0] == 2
    n, why = api.default_threads(api.TINY_MODEL_PARAMS - 1)
    assert n == 1 and "parameters" in why and "2 physical core(s)" in why
    monkeypatch.setattr(api, "physical_cores", lambda cpus: None)  # no topology: the CPUs
    n, why = api.default_threads(api.TINY_MODEL_PARAMS)
    assert n == 4 and "unreadable" in why


@pytest.mark.parametrize("typed", [None, "1"])
def test_load_llm_sets_threads_and_verbose_says_why(typed: str | None, llada_dir: Path,
                                                    capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --threads torch's own default (every logical CPU) ran a tiny model 15x slower on
    a loaded 2-core machine; the choice is made in load_llm, and --verbose says it."""
    import torch

    import unmask.api as api

    monkeypatch.setattr(api, "allowed_cpus", lambda: {0, 1})
    monkeypatch.setattr(api, "physical_cores", lambda cpus: 2)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        argv = ["generate", "--model", str(llada_dir), "--gen-length", "16", "--block-length", "8",
                "--verbose", "hi"] + (["--threads", typed] if typed else [])
        assert main(argv) == 0
        assert torch.get_num_threads() == 1  # the tiny model's default, or the typed value
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert "note: 1 CPU thread(s): " + ("--threads" if typed else "the model has") in err, err


def test_encode_prompt_refuses_a_non_string(llms: dict[str, LLM]) -> None:
    with pytest.raises(InputError, match="must be a string, got int"):  # was AttributeError
        llms["llada"].encode_prompt(5)


@pytest.mark.parametrize("damage", ["config-array", "garbage-weights"])
def test_cli_corrupted_model_folder(damage: str, llada_dir: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture) -> None:
    d = _make_broken(tmp_path, "copy", llada_dir)
    if damage == "config-array":
        (d / "config.json").write_text("[1, 2]")
    else:
        (d / "model.safetensors").write_bytes(b"garbage" * 10)
    _run_error(["generate", "--model", str(d), "--gen-length", "16", "--block-length", "8", "hi"],
               capsys)


def test_cli_empty_prompt(llada_dir: Path, capsys: pytest.CaptureFixture) -> None:
    err = _run_error(["generate", "--model", str(llada_dir), "--gen-length", "16", "--block-length",
                      "8", "  "], capsys)
    assert "empty prompt" in err


def test_cli_too_long(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    d = tiny_model_dir(tmp_path, "llada", max_sequence_length=24)
    err = _run_error(["generate", "--model", str(d), "--gen-length", "16", "--block-length", "8",
                      "sort the list [3, 1, 2] to get a sorted list"], capsys)
    assert "max_sequence_length" in err and "24" in err


@pytest.mark.parametrize("flag", ["--gen-length", "--block-length"])
def test_cli_nonpositive_length(flag: str, llada_dir: Path, capsys: pytest.CaptureFixture) -> None:
    err = _run_error(["generate", "--model", str(llada_dir), flag, "0", "hello"], capsys,
                     one_line=False)
    assert flag in err and "positive" in err


def test_cli_argparse_errors_are_one_line(llada_dir: Path, capsys: pytest.CaptureFixture) -> None:
    _run_error(["generate", "--model", str(llada_dir), "--gen-length", "0", "hello"], capsys)


def test_cli_help_lists_commands(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "eval", "bench", "train"):
        assert cmd in out, cmd


def test_cli_help_documents_exit_codes_and_decoders(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "exit codes:" in out and "2    bad input" in out and "1    a bug" in out
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps help text
    defaults = DecodeParams()
    assert f"else {defaults.gen_length})" in out and f"else {defaults.block_length})" in out
    from unmask.decoding.params import METHODS, PRESETS

    for name in (*METHODS, *PRESETS):
        assert name in out, name


def test_cli_bug_keeps_its_traceback(llada_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ValueError that is not an UnmaskError is a bug in unmask: not 'bad input, exit 2'."""
    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("an internal bug")

    monkeypatch.setattr(LLM, "generate", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        main(["generate", "--model", str(llada_dir), "--gen-length", "16", "--block-length", "8",
              "hello"])


def test_cli_bug_exits_1_with_traceback() -> None:
    import subprocess
    import sys

    code = ("import sys, unmask.cli as c\n"
            "def bad(args):\n    raise KeyError('an internal bug')\n"
            "c.cmd_generate = bad\n"
            "sys.exit(c.main(['generate', 'hi']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r
    assert "Traceback" in r.stderr and "an internal bug" in r.stderr


def test_cli_prompt_not_utf8(llada_dir: Path, capsys: pytest.CaptureFixture) -> None:
    import os

    bad = os.fsdecode(b"\xff\xfe")  # what argv holds for `unmask generate $'\\xff\\xfe'`
    err = _run_error(["generate", "--model", str(llada_dir), "--gen-length", "16",
                      "--block-length", "8", "hello", bad], capsys)
    assert "prompt 2 of 2" in err and "UTF-8" in err and "\\xff\\xfe" in err


@pytest.mark.parametrize("device", ["tpu", "foo", "cuda:99", "xla"])
def test_cli_bad_device(device: str, llada_dir: Path, capsys: pytest.CaptureFixture) -> None:
    err = _run_error(["generate", "--model", str(llada_dir), "--device", device, "--gen-length", "16",
                      "--block-length", "8", "hello"], capsys)
    assert device in err and "valid here: cpu" in err


def test_api_bad_device(llada_dir: Path) -> None:
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(InputError, match="no usable CUDA.*valid here: cpu"):
            LLM(llada_dir, device="cuda")
    with pytest.raises(InputError, match="valid here"):
        LLM(llada_dir, device="tpu")
    assert LLM(llada_dir, device="cpu").device.type == "cpu"


def test_spec_and_flag_conflict_is_an_error(capsys) -> None:
    """`--decoder static-1,gen_length=64 --gen-length 256` used to decode 64 silently."""
    assert main(["generate", "hi", "--decoder", "static-1,gen_length=64", "--gen-length", "256"]) == 2
    err = capsys.readouterr().err
    assert "gen_length is set twice" in err and len(err.strip().splitlines()) == 1
    p = DecodeParams.parse("static-1,gen_length=64", explicit={"gen_length": 64})
    assert p.gen_length == 64  # agreeing values are fine
    assert DecodeParams.parse("static-1", explicit={"gen_length": 96}).gen_length == 96
    assert DecodeParams.parse("static-1,gen_length=64", gen_length=256).gen_length == 64  # a default


def test_every_decoder_key_flag_is_explicit_only_when_typed() -> None:
    """eval/bench's --block-length and --seed, and trace's --gen-length and --block-length, used to
    be spec defaults: a spec key silently beat the typed flag. A flag named after a decoder key
    defaults to None in every command, so that parse_decoder can tell typed from unset."""
    import argparse

    from unmask.cli import build_parser
    from unmask.cli_args import DECODER_FLAGS, parse_decoder

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    found = set()
    for command, parser in sub.choices.items():
        if command in ("train", "bench-serve"):  # their --seed is a run's seed, not a decoder key
            continue
        for action in parser._actions:
            if action.dest in DECODER_FLAGS:
                assert action.default is None, f"{command} --{action.dest} has a default"
                found.add((command, action.dest))
    assert found >= {("generate", "gen_length"), ("generate", "block_length"),
                     ("trace", "gen_length"), ("trace", "block_length"), ("eval", "block_length"),
                     ("eval", "seed"), ("bench", "gen_length"), ("bench", "seed")}
    typed = argparse.Namespace(gen_length=None, block_length=64, seed=None)
    with pytest.raises(SpecError, match="block_length is set twice"):
        parse_decoder("threshold,block_length=16", typed)
    p = parse_decoder("threshold,seed=3", typed, gen_length=128, block_length=32, seed=0)
    assert (p.gen_length, p.block_length, p.seed) == (128, 64, 3)  # the spec beats a default


def test_generate_shows_progress_on_a_terminal(monkeypatch) -> None:
    import io

    from unmask.cli import decode_progress

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Tty()
    monkeypatch.setattr(sys, "stderr", err)
    llm = LLM()
    with decode_progress(64) as on_event:
        assert on_event is not None
        llm.generate(["What is 4 + 5?"], "static-1", gen_length=64, on_event=on_event)
    assert "decoding" in err.getvalue()
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: no bar, no callback
    with decode_progress(64) as on_event:
        assert on_event is None


@pytest.mark.parametrize("call,match", [
    (lambda llm: llm.generate(["hi"], "static-1", batch_size=-1), "batch_size"),
    (lambda llm: llm.generate(["hi"], "static-1", batch_size=0), "batch_size"),
    (lambda llm: llm.generate(3, "static-1"), "prompts"),
    (lambda llm: llm.generate(b"hi", "static-1"), "prompts"),
    (lambda llm: llm.generate(None, "static-1"), "prompts"),
    (lambda llm: llm.generate(["ok", 7], "static-1"), "prompt 1"),
    (lambda llm: llm.generate(["ok", "  "], "static-1"), "prompt 1"),
    (lambda llm: llm.generate(["hi"], "static-1", gen_length=64.0), "gen_length"),
    (lambda llm: llm.generate(["hi"], "static-1", warp=3), "warp"),
    (lambda llm: llm.generate(["hi"], DecodeParams(), warp=3), "warp"),
    (lambda llm: llm.generate(["hi"], 42), "params"),
])
def test_python_api_bad_arguments_name_the_argument(call, match) -> None:
    """Each used to return [] silently or raise an unrelated TypeError/AttributeError."""
    from unmask.errors import UnmaskError

    with pytest.raises(UnmaskError, match=match):
        call(LLM())


@pytest.mark.parametrize("kw,match", [
    (dict(temperature=float("inf")), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(entropy_tau=float("nan")), "entropy_tau"), (dict(threshold=True), "threshold"),
    (dict(gen_length=True), "gen_length"), (dict(suffix_local="4"), "suffix_local"),
    # the server refuses these as its seed field; a spec accepted them (2**64 and 0 shared noise)
    (dict(seed=-1), "seed"), (dict(seed=2**63), "seed"), (dict(seed=10**400), "seed"),
])
def test_params_refuse_values_that_cannot_decode(kw, match) -> None:
    with pytest.raises(SpecError, match=match):
        DecodeParams(**kw)


def test_replace_rebuilds_the_spec() -> None:
    """`parse("threshold").replace(threshold=0.5).spec` used to stay "threshold"."""
    p = DecodeParams.parse("threshold").replace(threshold=0.5)
    assert p.spec == "threshold,threshold=0.5"
    assert DecodeParams.parse(p.spec) == DecodeParams.parse("threshold,threshold=0.5")
    with pytest.raises(SpecError, match="decoder spec is a string"):
        DecodeParams.parse(None)  # type: ignore[arg-type]


# --- the model folder as a whole -----------------------------------------------------------------
def _copy_with_config(src: Path, dst: Path, **change) -> Path:
    import shutil

    shutil.copytree(src, dst)
    edit_config(dst, **change)
    return dst


def test_tokenizer_mask_token_must_be_the_configs(llada_dir: Path, tmp_path: Path) -> None:
    """A config naming another mask id than its tokenizer loaded silently: the canvas was then
    filled with an ordinary token."""
    folder = _copy_with_config(llada_dir, tmp_path / "m", mask_token_id=3)
    with pytest.raises(CheckpointError, match="config.json's mask_token_id is 3, but the "
                                              "tokenizer's mask token '<|mask|>' is id 2"):
        LLM(folder, device="cpu")


def test_tokenizer_eos_other_than_the_configs_is_a_warning(llada_dir: Path,
                                                           tmp_path: Path) -> None:
    """Another EOS loaded silently; it is a warning, not an error: a chat checkpoint may name its
    turn-end token as the tokenizer's EOS, and generation follows the config."""
    folder = _copy_with_config(llada_dir, tmp_path / "m", eos_token_id=0)
    with pytest.warns(UserWarning, match="config.json's eos_token_id is 0, but the tokenizer's "
                                         "eos token '<|eos|>' is id 1; generation stops at id 0"):
        assert LLM(folder, device="cpu").config.eos_token_id == 0


def test_tokenizer_without_a_mask_token_is_not_compared(llada_dir: Path, tmp_path: Path) -> None:
    """The published LLaDA tokenizer names no mask token; the config's id is then the one."""
    folder = _copy_with_config(llada_dir, tmp_path / "m", mask_token_id=3)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    del settings["mask_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    assert LLM(folder, device="cpu").config.mask_token_id == 3


def test_tokenizer_larger_than_vocab_size_refused(llms: dict[str, LLM], llada_dir: Path,
                                                  tmp_path: Path) -> None:
    """Only embedding_size was compared: tokens past vocab_size can never be generated."""
    tokenizer = llms["llada"].tokenizer
    n = len(tokenizer)
    folder = _copy_with_config(llada_dir, tmp_path / "m", vocab_size=n - 10)  # embedding_size: n
    with pytest.raises(CheckpointError, match=f"the tokenizer has {n:,} tokens, more than the "
                                              f"model's vocab_size {n - 10:,}"):
        LLM(folder, device="cpu")
    # the mask alone past vocab_size is fine: it is read, never predicted
    folder = _copy_with_config(llada_dir, tmp_path / "m2", vocab_size=n - 1, mask_token_id=n - 1)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["mask_token"] = tokenizer.convert_ids_to_tokens(n - 1)
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    assert LLM(folder, device="cpu").tokenizer.mask_token_id == n - 1


def test_a_lone_surrogate_in_a_prompt_is_an_input_error(llms: dict[str, LLM]) -> None:
    """It reached the tokenizer, which raised a TypeError."""
    llm = llms["llada"]
    with pytest.raises(InputError, match=r"prompt 1 is not valid UTF-8 text: it contains a lone "
                                         r"surrogate \(U\+D800\) at character 3"):
        llm.generate(["ok", "hi \ud800 there"], "static-1", gen_length=16, block_length=8)
    with pytest.raises(InputError, match="lone surrogate"):
        llm.encode_prompt("\udcff")


@pytest.mark.parametrize("path", [5, b"/tmp", 1.5, ["x"]])
def test_llm_path_that_is_not_a_path_is_an_input_error(path) -> None:
    with pytest.raises(InputError, match=f"a folder path \\(str or os.PathLike\\), got "
                                         f"{type(path).__name__}"):
        LLM(path)


def test_llm_path_expands_the_home_folder(llada_dir: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    shutil.copytree(llada_dir, tmp_path / "m")
    monkeypatch.setenv("HOME", str(tmp_path))
    llm = LLM("~/m", device="cpu")
    assert llm.path == tmp_path / "m"


def test_an_empty_spec_is_an_error_not_the_default(llms: dict[str, LLM]) -> None:
    """LLM.generate(p, "") decoded with the default decoder, where --decoder '' is an error."""
    with pytest.raises(SpecError, match="empty decoder spec"):
        llms["llada"].generate(["hi"], "", gen_length=8, block_length=8)


def test_chat_must_be_a_bool(llms: dict[str, LLM]) -> None:
    """chat="no" (from a config file, say) was truthy: the template was applied."""
    llm = next(iter(llms.values()))
    for bad in ("no", "false", 0, None):
        with pytest.raises(InputError, match=f"^chat must be True or False, got {bad!r}$"):
            llm.generate("hello", "static-1", chat=bad, gen_length=8, block_length=8)
        with pytest.raises(InputError, match="^chat must be True or False"):
            llm.encode_prompt("hello", chat=bad)


def test_json_says_which_token_ids_are_the_answer(capsys) -> None:
    """token_ids is the whole canvas; `useful` says how many of them the answer is."""
    import json

    from unmask.cli import main

    assert main(["generate", "What is 2 + 3?", "--decoder", "static-1", "--gen-length", "64",
                 "--threads", "1", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    llm = LLM()
    assert d["finish_reason"] == "eos" and len(d["token_ids"]) == 64
    assert d["token_ids"][d["useful"]] == llm.config.eos_token_id
    assert d["text"] == llm.detokenize(d["token_ids"][: d["useful"]])
