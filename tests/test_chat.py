"""`unmask chat`: a piped session answers as `LLM.generate` does for the same conversation and
decoder, its commands change what they say, bad input is one line and the session goes on,
Ctrl-C stops an answer and not the session, and /watch's canvas reads at 80 columns."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from unmask.api import LLM
from unmask.chat import CanvasView, Chat
from unmask.decoding.params import DEFAULT_DECODER, DecodeParams

ROOT = Path(__file__).resolve().parents[1]
SAMPLED = "static-1,temperature=0.9"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu")


def run_chat(stdin: bytes, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "unmask.cli", "chat", "--device", "cpu",
                           "--threads", "1", *flags], input=stdin, capture_output=True,
                          env=env, timeout=300)


def settings(p: DecodeParams) -> str:
    return (f"decoder {p.spec}: gen_length {p.gen_length}, block_length {p.block_length}, "
            f"seed {p.seed}")


def test_a_piped_session_answers_as_generate_does(llm: LLM) -> None:
    first, second, third = "What is 2 + 3?", "And what is 7 + 8?", "Sort 5, 2, 9."
    stdin = "\n".join([
        first, "/stats", "/length abc", "/foo", "/decoder nope,gen_length=8",
        "/decoder static-1", "/length 64", second, "/reset", f"/decoder {SAMPLED}", "/seed 3",
        "/watch", "/watch", third,
    ]).encode() + b"\n\xff bad bytes\n/bye\nnot read\n"
    r = run_chat(stdin, "--history")  # the shipped model's own default is no history (below)
    assert r.returncode == 0, r.stderr

    a1 = llm.generate(first, DEFAULT_DECODER)[0]
    greedy = DecodeParams.parse("static-1", gen_length=64)
    turns = [{"role": "user", "content": first}, {"role": "assistant", "content": a1.text},
             {"role": "user", "content": second}]
    a2 = llm.generate_ids([llm.encode_messages(turns)], greedy)[0]
    assert a2.text != llm.generate(second, greedy)[0].text  # the history is what makes a2
    sampled = DecodeParams.parse(SAMPLED, gen_length=64).replace(seed=3)
    a3 = llm.generate(third, sampled)[0]
    assert a3.text != llm.generate(third, sampled.replace(seed=0))[0].text  # /seed matters
    out = r.stdout.decode()
    stats = f"NFE {a1.nfe} | TPF {a1.tpf:.2f} | "
    expected = [a1.text, stats, settings(DecodeParams.parse("static-1")), settings(greedy), a2.text,
                "conversation cleared", settings(DecodeParams.parse(SAMPLED, gen_length=64)),
                settings(sampled), "watch on", "watch off", a3.text]
    at = 0
    for part in expected:  # in order; the stats line's numbers after TPF are timings
        found = out.find(part + ("" if part == stats else "\n"), at)
        assert found == at, (part, out[at:])
        at = out.index("\n", found + len(part) - 1) + 1 if part == stats else found + len(part) + 1
    assert out[at:] == ""  # the bad line is refused and /bye ends the session before "not read"
    errors = r.stderr.decode().splitlines()
    assert [e.split(":")[0] for e in errors] == ["error"] * 4, errors
    assert "/length takes an integer >= 1, got 'abc'" in errors[0]
    assert "unknown command '/foo'" in errors[1] and "/decoder" in errors[1]
    assert "unknown decoder 'nope'" in errors[2]
    assert "not valid UTF-8" in errors[3]


def test_a_model_trained_on_single_questions_answers_each_message_alone(llm: LLM) -> None:
    """The shipped models were trained on single questions: with its history a second message
    got an empty answer (or the first question's). Chat says so once and answers each alone;
    --history keeps the conversation."""
    first, second = "What is 2 + 3?", "What is 7 + 8?"
    r = run_chat(f"{first}\n{second}\n".encode(), "--decoder", "static-1", "--gen-length", "64")
    assert r.returncode == 0, r.stderr
    alone = [llm.generate(q, "static-1", gen_length=64)[0].text for q in (first, second)]
    assert r.stdout.decode() == "".join(a + "\n" for a in alone)
    assert "15" in alone[1]
    (note,) = r.stderr.decode().splitlines()
    assert note == ("note: unmask-llada was trained on single questions (generation_config.json: "
                    "trained_on_single_turns), so each message is answered alone; --history "
                    "sends the conversation anyway")
    kept = run_chat(f"{first}\n{second}\n".encode(), "--decoder", "static-1", "--gen-length",
                    "64", "--history")
    assert kept.returncode == 0 and kept.stderr == b"", kept.stderr
    assert kept.stdout.decode().startswith(alone[0] + "\n")
    assert kept.stdout.decode() != r.stdout.decode()


def test_a_model_without_the_key_keeps_its_history(tmp_path: Path) -> None:
    import shutil

    from unmask.api import DEFAULT_MODEL
    from unmask.chat import keeps_history

    plain = tmp_path / "plain"
    shutil.copytree(DEFAULT_MODEL, plain)
    (plain / "generation_config.json").unlink()
    assert keeps_history(LLM(plain), None) and not keeps_history(LLM(plain), False)
    assert not keeps_history(LLM(DEFAULT_MODEL), None) and keeps_history(LLM(DEFAULT_MODEL), True)


def test_a_decoder_the_model_cannot_run_exits_2_at_start() -> None:
    """It printed an error per line and exited 0; generate refuses it with exit 2."""
    r = run_chat(b"hi\nhello\n", "--decoder", "threshold,cache=block")
    assert r.returncode == 2 and r.stdout == b"", r.stdout
    assert r.stderr.decode().strip() == (
        "unmask: error: --decoder 'threshold,cache=block': cache=block applies to block-causal "
        "models (config block_size) only; this model is bidirectional: drop cache")


def test_eof_in_the_middle_of_a_line_is_answered(llm: LLM) -> None:
    r = run_chat(b"/length 32\nhello", "--decoder", "static-1")
    assert r.returncode == 0, r.stderr
    answer = llm.generate("hello", "static-1", gen_length=32)[0].text
    assert r.stdout.decode() == settings(DecodeParams.parse("static-1", gen_length=32)) + "\n" + answer + "\n"


def test_the_model_as_a_positional_argument(llm: LLM) -> None:
    """`unmask chat MODEL` as `unmask chat --model MODEL` (the issue's synopsis)."""
    from unmask.api import DEFAULT_MODEL

    r = run_chat(b"hello", str(DEFAULT_MODEL), "--decoder", "static-1", "--gen-length", "32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == llm.generate("hello", "static-1", gen_length=32)[0].text + "\n"


@pytest.mark.parametrize("flags", [["--decoder", "nope"], ["--gen-length", "0"],
                                   ["--decoder", "static-1,gen_length=64", "--gen-length", "32"],
                                   ["some/where", "--model", "else/where"]])
def test_bad_flags_exit_2_in_one_line(flags: list[str]) -> None:
    r = run_chat(b"hello\n", *flags)
    assert r.returncode == 2 and r.stdout == b""
    assert len(r.stderr.decode().strip().splitlines()) == 1, r.stderr


def test_ctrl_c_stops_the_answer_not_the_session(llm: LLM) -> None:
    params = DecodeParams.parse("static-1", gen_length=32)
    chat = Chat(llm, params, io.StringIO())
    step, calls = chat.engine.step, []

    def step_then_ctrl_c():
        calls.append(1)
        if len(calls) == 4:  # Ctrl-C as the user sends it, mid-answer
            signal.raise_signal(signal.SIGINT)
        return step()

    chat.engine.step = step_then_ctrl_c
    full = llm.generate("hello", params)[0]
    # what the process had (a job started in the background of a shell inherits SIG_IGN)
    before = signal.getsignal(signal.SIGINT)
    stopped = chat.answer("hello")
    assert chat.stats.finish_reason == "abort" and chat.stats.nfe == 4
    assert full.text.startswith(stopped) and len(stopped) < len(full.text)
    assert chat.history == [] and not chat.engine.has_unfinished
    assert signal.getsignal(signal.SIGINT) is before  # given back
    chat.engine.step = step
    assert chat.answer("hello") == full.text  # the session goes on, the same engine answers
    assert chat.stats.finish_reason == full.finish_reason and chat.stats.nfe == full.nfe
    assert chat.out.getvalue() == stopped + "\n" + full.text + "\n"


@pytest.mark.parametrize("width", [80, 20])
def test_watch_draws_the_canvas_within_the_width(llm: LLM, width: int) -> None:
    params = DecodeParams.parse("static-1", gen_length=64)
    console = Console(record=True, width=width, file=io.StringIO())
    out = io.StringIO()
    chat = Chat(llm, params, out, console=console)
    chat.command("/watch")
    answer = chat.answer("What is 2 + 3?")
    assert answer == llm.generate("What is 2 + 3?", params)[0].text
    assert out.getvalue().endswith(answer + "\n")  # the answer follows the view, whole
    frames = console.export_text()
    lines = frames.splitlines()
    assert max(map(len, lines)) <= width
    assert sum("NFE" in line for line in lines) == chat.stats.nfe  # a frame a step (a forward each)
    last = frames[frames.rindex("static-1"):]
    flat = "".join(last.splitlines()[1:]) if width == 80 else "".join(
        line for line in last.splitlines() if "NFE" not in line)
    shown = answer.replace("\n", "\u21b5")
    assert shown.replace(" ", "") in flat.replace(" ", "")  # wrapped lines joined back
    assert "\u2591" not in flat and "\u2592" not in flat  # every position committed


def test_watch_on_a_terminal_is_a_live_view(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    params = DecodeParams.parse("static-1", gen_length=32)
    console = Console(record=True, width=80, file=io.StringIO(), force_terminal=True)
    chat = Chat(llm, params, io.StringIO(), console=console)
    chat.command("/watch")
    view_frames: list[str] = []
    render = CanvasView.__rich_console__

    def counted(self, c, options):
        view_frames.append("frame")
        return render(self, c, options)

    monkeypatch.setattr(CanvasView, "__rich_console__", counted)
    chat.answer("hello")
    assert len(view_frames) >= chat.stats.nfe  # redrawn each step, in place
    text = console.export_text()
    assert text.count("NFE") < len(view_frames)  # not a frame printed per step
