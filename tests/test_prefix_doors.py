"""Prefix reuse at every door: the server's usage (`prompt_tokens_details.cached_tokens`,
streamed too, read by the real openai client) and /metrics, `LLM.generate` across calls, `unmask
chat` between turns, the flags, and `unmask show`'s budget. Reuse changes no token anywhere."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from helpers import LiveServer, tiny_model_dir

from unmask.api import LLM
from unmask.chat import Chat
from unmask.decoding.params import DecodeParams
from unmask.server.app import ServerConfig, build_app

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = ("You are a careful assistant. Answer with the number only, and check the sum twice "
          "before you answer.")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("sdar"), "sdar")


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def test_usage_reports_cached_tokens_streamed_or_not(folder: Path) -> None:
    """The same system prompt twice: the second request reads its blocks from the store
    (usage says how many, the stream's usage chunk too) and answers as the first server
    without a store does."""
    on, off = LLM(str(folder), device="cpu"), LLM(str(folder), device="cpu", prefix_cache=False)
    config = ServerConfig(decoder="threshold", max_running=4)
    with LiveServer(build_app(on, config)) as s, LiveServer(build_app(off, config)) as t:
        kw = dict(model="tiny-sdar", max_tokens=8, seed=3)
        first = s.client().chat.completions.create(messages=messages("what is 1 + 2?"), **kw)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = s.client().chat.completions.create(messages=messages("what is 3 + 4?"), **kw)
        cached = second.usage.prompt_tokens_details.cached_tokens
        n = second.usage.prompt_tokens
        assert 0 < cached < n and cached % 4 == 0
        plain = t.client().chat.completions.create(messages=messages("what is 3 + 4?"), **kw)
        assert plain.usage.prompt_tokens_details.cached_tokens == 0
        assert second.choices[0].message.content == plain.choices[0].message.content
        chunks = list(s.client().chat.completions.create(
            messages=messages("what is 5 + 6?"), stream=True,
            stream_options={"include_usage": True}, **kw))
        usage = chunks[-1].usage
        assert usage.prompt_tokens_details.cached_tokens >= cached
        metrics = httpx.get(f"{s.url}/metrics", timeout=10).text
        hits = float(metrics.split("\nunmask_prefix_hit_tokens_total ")[1].split()[0])
        assert hits >= 2 * cached
        assert "unmask_prefix_stored_bytes" in metrics and "unmask_prefix_budget_bytes" in metrics
        assert "unmask_prefix" not in httpx.get(f"{t.url}/metrics", timeout=10).text


def test_generate_reuses_across_calls(folder: Path) -> None:
    llm = LLM(str(folder), device="cpu")
    params = DecodeParams.parse("threshold", gen_length=8, block_length=4)
    prompt = SYSTEM + " What is 2 + 2?"
    (first,) = llm.generate([prompt], params)
    (second,) = llm.generate([prompt], params)
    assert first.cached_tokens == 0 and second.cached_tokens > 0
    assert second.token_forwards < first.token_forwards
    assert (second.token_ids, second.nfe) == (first.token_ids, first.nfe)
    cold = LLM(str(folder), device="cpu", prefix_cache=False)
    (plain,) = cold.generate([prompt], params)
    assert plain.cached_tokens == 0 and plain.token_ids == first.token_ids


def test_chat_reuses_its_history(folder: Path) -> None:
    llm = LLM(str(folder), device="cpu")
    chat = Chat(llm, DecodeParams.parse("threshold", gen_length=8, block_length=4), io.StringIO())
    chat.answer(SYSTEM)
    assert chat.stats.cached_tokens == 0
    chat.answer("and what is 2 + 2?")
    assert chat.stats.cached_tokens > 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "unmask.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


@pytest.mark.parametrize("value, needle", [("0", "positive number of GiB"),
                                           ("-1", "positive number of GiB"),
                                           ("nan", "positive number of GiB"),
                                           ("lots", "not a number of GiB"),
                                           ("1e9", "exceeds the memory free")])
def test_bad_budgets_exit_2_in_one_line(folder: Path, value: str, needle: str) -> None:
    r = run_cli("generate", "hi", "--model", str(folder), "--device", "cpu", "--threads", "1",
                "--prefix-cache-gib", value)
    assert_one_line(r, needle)


@pytest.mark.parametrize("command", [["serve", "--port", "1"], ["chat"]])
@pytest.mark.parametrize("value, needle", [("nan", "positive number of GiB"),
                                           ("1e9", "exceeds the memory free")])
def test_serve_and_chat_refuse_bad_budgets_in_one_line(folder: Path, command: list[str],
                                                       value: str, needle: str) -> None:
    """Before any port is bound or any turn read: the budget past free memory is refused once
    the model is loaded (its free memory is what is left then)."""
    r = run_cli(*command, "--model", str(folder), "--threads", "1", "--prefix-cache-gib", value)
    assert_one_line(r, needle)


def assert_one_line(r: subprocess.CompletedProcess, needle: str) -> None:
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "Traceback" not in r.stderr


def test_a_budget_for_a_bidirectional_model_is_refused_by_name(tmp_path: Path) -> None:
    llada = tiny_model_dir(tmp_path, "llada")
    r = run_cli("generate", "hi", "--model", str(llada), "--device", "cpu", "--threads", "1",
                "--prefix-cache-gib", "0.1")
    assert r.returncode == 2 and "block-causal models" in r.stderr, r.stderr


def test_show_counts_the_budget_of_a_block_causal_model(capsys) -> None:
    import json

    from unmask.cli import main

    assert main(["show", "unmask-sdar", "--json", "--prefix-cache-gib", "0.5"]) == 0
    r = json.loads(capsys.readouterr().out)["memory"]
    assert r["prefix"] == 1 << 29
    assert r["total"] == r["weights"] + r["kv"] + r["logits"] + r["activations"] + (1 << 29)
    assert main(["show", "unmask-llada", "--json", "--prefix-cache-gib", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["memory"]["prefix"] == 0  # no store: no reuse
    assert main(["show", "unmask-sdar"]) == 0
    assert "prefix store" in capsys.readouterr().out  # the default share of the RAM available


def test_bench_serve_sends_a_shared_system_prompt_and_counts_reuse(folder: Path,
                                                                     tmp_path: Path) -> None:
    import json

    from unmask.cli import main

    system = tmp_path / "system.txt"
    system.write_text(SYSTEM)
    out = tmp_path / "report.json"
    llm = LLM(str(folder), device="cpu")
    with LiveServer(build_app(llm, ServerConfig(decoder="threshold", max_running=4))) as s:
        assert main(["bench-serve", "--url", s.url, "--system", str(system), "--n", "4",
                     "--concurrency", "1", "--max-tokens", "8", "--warmup", "0",
                     "--json", str(out)]) == 0
    cell = json.loads(out.read_text())["cells"][0]
    reqs = cell["requests"]
    assert reqs[0]["cached_tokens"] == 0 and all(r["cached_tokens"] > 0 for r in reqs[1:])
    assert cell["cached_tokens"] == sum(r["cached_tokens"] for r in reqs)
    assert cell["prefill_forwards"] == sum(r["prompt_tokens"] - r["cached_tokens"] for r in reqs)
    assert "--system" in json.loads(out.read_text())["command"]
    assert main(["bench-serve", "--system", str(tmp_path / "none.txt")]) == 2
    # the warm-up sends the system prompt too: on a fresh server (a new LLM: the store is its)
    # every measured request reads it
    fresh = LLM(str(folder), device="cpu")
    with LiveServer(build_app(fresh, ServerConfig(decoder="threshold", max_running=4))) as s:
        assert main(["bench-serve", "--url", s.url, "--system", str(system), "--n", "2",
                     "--concurrency", "1", "--max-tokens", "8", "--warmup", "1",
                     "--json", str(out)]) == 0
    shared = min(r["cached_tokens"] for r in reqs[1:])  # the system prompt's blocks, at least
    warm = json.loads(out.read_text())["cells"][0]["requests"]
    assert all(r["cached_tokens"] >= shared for r in warm)


def test_fresh_prompts_give_each_run_its_own_prompts_on_every_server() -> None:
    from unmask.bench.serve import n_prompts, plan_cells, run_slices
    from unmask.cli import build_parser

    args = build_parser().parse_args(["bench-serve", "--url", "a=http://x", "--url", "b=http://y",
                                      "--concurrency", "1,4", "--rounds", "2", "--n", "3",
                                      "--fresh-prompts"])
    cells = plan_cells(args)
    runs = run_slices(cells, args)
    by_cell = {(c.server.name, c.concurrency, r): runs[(c.decoders, c.concurrency, r)]
               for c in cells for r in range(2)}
    assert sorted(set(by_cell.values())) == [0, 1, 2, 3]  # one slice per concurrency and round
    assert all(by_cell[("a", c, r)] == by_cell[("b", c, r)] for c in (1, 4) for r in range(2))
    assert n_prompts(cells, args) == 3 * 5  # and one slice for the warm-up
    args.fresh_prompts = False
    assert run_slices(cells, args) == {} and n_prompts(cells, args) == 3


def test_the_live_trace_says_how_many_prompt_tokens_were_reused(folder: Path) -> None:
    import json

    llm = LLM(str(folder), device="cpu")

    def trace() -> list[dict]:
        with httpx.stream("POST", f"{s.url}/v1/unmask/trace", timeout=60, json={
                "prompt": SYSTEM, "decoders": ["threshold"], "max_tokens": 8}) as r:
            assert r.status_code == 200
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]

    with LiveServer(build_app(llm, ServerConfig(decoder="threshold"))) as s:
        first, second = trace(), trace()
    steps = [[e["cached_tokens"] for e in t if e["event"] == "step"] for t in (first, second)]
    assert set(steps[0]) == {0} and steps[1][0] > 0 and len(set(steps[1])) == 1
    assert "metaText(ev.cached_tokens)" in (ROOT / "unmask/server/static/canvas.js").read_text()


def test_bench_serve_turns_resend_the_conversation_and_reuse_it(folder: Path,
                                                                 tmp_path: Path) -> None:
    """3-turn chats: turn k sends the k questions and the server's k - 1 answers, so its prompt
    grows, and the turns after the first read the conversation's blocks from the store."""
    import json

    from unmask.cli import main

    out = tmp_path / "report.json"
    llm = LLM(str(folder), device="cpu")
    with LiveServer(build_app(llm, ServerConfig(decoder="threshold", max_running=4))) as s:
        assert main(["bench-serve", "--url", s.url, "--turns", "3", "--n", "2",
                     "--concurrency", "2", "--max-tokens", "8", "--warmup", "0",
                     "--json", str(out)]) == 0
    reqs = json.loads(out.read_text())["cells"][0]["requests"]
    assert sorted(r["turn"] for r in reqs) == [0, 0, 1, 1, 2, 2]
    by_turn = {t: [r for r in reqs if r["turn"] == t] for t in range(3)}
    assert all(r["cached_tokens"] == 0 for r in by_turn[0])
    assert all(r["cached_tokens"] > 0 for t in (1, 2) for r in by_turn[t])
    for i in (0, 1):  # each conversation's prompt grows turn by turn
        sizes = [r["prompt_tokens"] for t in range(3) for r in by_turn[t] if r["index"] == i]
        assert sizes == sorted(sizes) and len(set(sizes)) == 3
    assert main(["bench-serve", "--turns", "2", "--endpoint", "completions"]) == 2
