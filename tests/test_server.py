"""`unmask serve` against live servers on 127.0.0.1, driven by the real `openai` client.

Every response must equal what `LLM.generate` gives offline for the same prompt, decoder and
seed (streamed or not, alone or under load); every bad request gets its status and an OpenAI
error body; nothing a client does takes the server down.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers import LiveServer
from hypothesis import given, settings
from hypothesis import strategies as st

from unmask import LLM
from unmask.api import useful_length
from unmask.engine import decoder as decoder_mod
from unmask.server.app import ServerConfig, build_app
from unmask.server.protocol import CompletionRequest
from unmask.tasks import TASKS

PROMPTS = ["What is 47 + 38?", "Sort these numbers: 5, 2, 9, 14, 3.", "What is 12 * 3 + 7?",
           "What is 305 - 17?"]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.fixture(scope="module")
def server(llm: LLM):
    with LiveServer(build_app(llm, ServerConfig(decoder="threshold", max_running=16))) as s:
        yield s


def offline(llm: LLM, prompt: str, spec: str, max_tokens: int, chat: bool = True,
            seed: int | None = None, **fields) -> str:
    from unmask.server.intake import request_params
    from unmask.server.protocol import CompletionRequest

    body = CompletionRequest(prompt=prompt, max_tokens=max_tokens, decoder=spec, seed=seed,
                             **fields)
    return llm.generate([prompt], request_params(ServerConfig(), body), chat=chat)[0].text


# --- responses equal offline decoding --------------------------------------------------------------
@pytest.mark.parametrize("spec", ["threshold", "fast", "exact", "static-1,temperature=0.7"])
def test_openai_client_matches_offline(server: LiveServer, llm: LLM, spec: str) -> None:
    client = server.client()
    prompt = PROMPTS[0]
    extra = {"decoder": spec}
    want_chat = offline(llm, prompt, spec, 64, chat=True, seed=11)
    want_raw = offline(llm, prompt, spec, 64, chat=False, seed=11)
    messages = [{"role": "user", "content": prompt}]

    r = client.chat.completions.create(model="unmask-llada", messages=messages, max_tokens=64,
                                       seed=11, extra_body=extra)
    assert r.choices[0].message.content == want_chat
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.model_extra["unmask"]["nfe"] > 0

    chunks = list(client.chat.completions.create(
        model="unmask-llada", messages=messages, max_tokens=64, seed=11, extra_body=extra,
        stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want_chat
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [r.choices[0].finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].usage == r.usage

    c = client.completions.create(model="unmask-llada", prompt=prompt, max_tokens=64, seed=11,
                                  extra_body=extra)
    assert c.choices[0].text == want_raw
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        model="unmask-llada", prompt=prompt, max_tokens=64, seed=11, extra_body=extra,
        stream=True) if ch.choices)
    assert streamed == want_raw


@pytest.mark.parametrize("max_tokens", [1, 5])
def test_max_tokens_is_a_hard_cap(server: LiveServer, llm: LLM, max_tokens: int) -> None:
    """max_tokens 1 returned 32 tokens (the canvas is rounded up to block_length): OpenAI
    clients take it as a hard limit. The decoder decodes its canvas (the `unmask` field says
    which) but at most max_tokens tokens come back, streamed or not, counted so in usage."""
    client = server.client()
    prompt, spec = PROMPTS[1], "static-1"
    from unmask.server.intake import request_params

    params = request_params(ServerConfig(), CompletionRequest(prompt=prompt, max_tokens=max_tokens,
                                                              decoder=spec))
    assert params.gen_length == 32
    full = llm.generate([prompt], params, chat=False)[0]
    ids = full.token_ids[: useful_length(full.token_ids, llm.config.eos_token_id)]
    assert len(ids) > max_tokens  # the answer is longer than the cap
    want = llm.detokenize(ids[:max_tokens])
    r = client.completions.create(model="unmask-llada", prompt=prompt, max_tokens=max_tokens,
                                  extra_body={"decoder": spec})
    assert r.choices[0].text == want
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == max_tokens
    assert r.model_extra["unmask"]["gen_length"] == 32
    chunks = list(client.completions.create(
        model="unmask-llada", prompt=prompt, max_tokens=max_tokens, stream=True,
        stream_options={"include_usage": True}, extra_body={"decoder": spec}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == max_tokens
    chat = client.chat.completions.create(
        model="unmask-llada", messages=[{"role": "user", "content": prompt}],
        max_completion_tokens=max_tokens, extra_body={"decoder": spec})
    assert chat.usage.completion_tokens <= max_tokens
    assert len(llm.tokenizer.encode(chat.choices[0].message.content,
                                    add_special_tokens=False)) <= max_tokens + 1
    assert chat.id.startswith("chatcmpl-") and r.id.startswith("cmpl-")  # as OpenAI's


def test_steps_are_checked_against_the_requests_canvas() -> None:
    """steps=2 fits one block of 32 (max_tokens 20) but not the default canvas of 128 (4 blocks):
    a request's spec is checked against the canvas its max_tokens makes; without max_tokens the
    default canvas refuses it."""
    from unmask.server.errors import APIError
    from unmask.server.intake import request_params

    config = ServerConfig(decoder="threshold")
    p = request_params(config, CompletionRequest(prompt="hi", max_tokens=20,
                                                 decoder="static,steps=2"))
    assert (p.gen_length, p.steps) == (32, 2)
    with pytest.raises(APIError, match="steps"):
        request_params(config, CompletionRequest(prompt="hi", decoder="static,steps=2"))


def test_top_p_samples_as_the_decoder_does(server: LiveServer, llm: LLM) -> None:
    """OpenAI's top_p is the decoder's top_p (it was refused as "not implemented", though the
    spec grammar has it); 1, which clients send by default, changes nothing."""
    from unmask.server.intake import request_params

    body = CompletionRequest(prompt="hi", temperature=0.8, top_p=0.5)
    assert request_params(ServerConfig(decoder="threshold"), body).top_p == 0.5
    off = CompletionRequest(prompt="hi", top_p=1)
    assert request_params(ServerConfig(decoder="threshold"), off) == request_params(
        ServerConfig(decoder="threshold"), CompletionRequest(prompt="hi"))
    client = server.client()
    want = offline(llm, PROMPTS[0], "static-1", 64, chat=False, seed=11, temperature=0.8,
                   top_p=0.5)
    got = client.completions.create(model="unmask-llada", prompt=PROMPTS[0], max_tokens=64,
                                    seed=11, temperature=0.8, top_p=0.5,
                                    extra_body={"decoder": "static-1"})
    assert got.choices[0].text == want


def test_n_choices_decode_with_seed_plus_j(server: LiveServer, llm: LLM) -> None:
    """n was refused. Choice i * n + j is prompt i decoded with seed + j, so choice j = 0 is the
    answer with n = 1; usage counts each prompt's tokens once; streamed choices add up to the
    non-streamed ones."""
    client = server.client()
    spec, prompts = "static-1,temperature=0.8", PROMPTS[:2]
    r = client.completions.create(model="unmask-llada", prompt=prompts, n=3, max_tokens=32,
                                  seed=7, extra_body={"decoder": spec})
    assert [c.index for c in r.choices] == list(range(6))
    texts = [c.text for c in r.choices]
    assert texts == [offline(llm, p, spec, 32, chat=False, seed=7 + j)
                     for p in prompts for j in range(3)]
    assert len(set(texts)) > 2  # the seeds do differ
    one = client.completions.create(model="unmask-llada", prompt=prompts, max_tokens=32,
                                    seed=7, extra_body={"decoder": spec})
    assert r.usage.prompt_tokens == one.usage.prompt_tokens
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    whole = client.chat.completions.create(model="unmask-llada", messages=msgs, n=2,
                                           max_tokens=32, seed=7, extra_body={"decoder": spec})
    streamed = ["", ""]
    for c in client.chat.completions.create(model="unmask-llada", messages=msgs, n=2,
                                            max_tokens=32, seed=7, stream=True,
                                            extra_body={"decoder": spec}):
        for ch in c.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert streamed == [c.message.content for c in whole.choices]


def test_concurrent_mixed_load(server: LiveServer, llm: LLM) -> None:
    """32 concurrent clients, mixed decoders, prompts and lengths, half of them streaming: every
    response arrives, complete, and equals its offline result (batch invariance under load)."""
    held_out = [ex.prompt for ex in TASKS["math"].load("heldout", 8)]
    jobs = []
    for i in range(32):
        spec = ["threshold", "fast", "exact", "threshold,cache=entropy"][i % 4]
        jobs.append((held_out[i % 8], spec, [32, 64][(i // 4) % 2], i % 2 == 0))
    want = {}
    for spec in {j[1] for j in jobs}:
        for n in (32, 64):
            ps = sorted({j[0] for j in jobs if j[1] == spec and j[2] == n})
            if ps:
                from unmask.server.intake import request_params

                params = request_params(ServerConfig(), CompletionRequest(
                    prompt="x", max_tokens=n, decoder=spec))
                for p, g in zip(ps, llm.generate(ps, params, batch_size=8), strict=True):
                    want[(p, spec, n)] = g.text
    client = server.client(timeout=300)

    def run(job) -> str:
        prompt, spec, n, stream = job
        kw = dict(model="unmask-llada", messages=[{"role": "user", "content": prompt}],
                  max_tokens=n, extra_body={"decoder": spec})
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            assert chunks[-1].choices[0].finish_reason in ("stop", "length")
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return client.chat.completions.create(**kw).choices[0].message.content

    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(run, jobs, timeout=600))
    for job, text in zip(jobs, got, strict=True):
        assert text == want[job[:3]], job


def test_stop_strings_cut_and_stop_decoding(server: LiveServer, llm: LLM) -> None:
    client = server.client()
    msgs = [{"role": "user", "content": PROMPTS[0]}]
    full = client.chat.completions.create(model="unmask-llada", messages=msgs, max_tokens=128,
                                          extra_body={"decoder": "static-1"})
    text = full.choices[0].message.content
    assert "tens" in text
    cut = client.chat.completions.create(model="unmask-llada", messages=msgs, max_tokens=128,
                                         stop=["tens"], extra_body={"decoder": "static-1"})
    assert cut.choices[0].message.content == text[: text.index("tens")]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.model_extra["unmask"]["nfe"] < full.model_extra["unmask"]["nfe"]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="unmask-llada", messages=msgs, max_tokens=128, stop=["tens"], stream=True,
        extra_body={"decoder": "static-1"}) if c.choices)
    assert streamed == cut.choices[0].message.content


class _CharLLM:
    """Just what TextStream reads of an LLM: ids 1-4 spell a, b, c and "ab"; 0 is EOS."""

    SPELL = ["", "a", "b", "c", "ab"]
    config = type("Config", (), {"eos_token_id": 0})()
    tokenizer = type("Tok", (), {"encode": staticmethod(lambda text, **kw: list(text))})()

    def detokenize(self, ids: list[int]) -> str:
        return "".join(self.SPELL[i] for i in ids)


@settings(max_examples=300, deadline=None)
@given(canvas=st.lists(st.integers(0, 4), min_size=2, max_size=24), data=st.data())
def test_streamed_text_with_stops_is_the_final_text(canvas: list[int], data) -> None:
    """Commits in any order, steps of any size: the streamed deltas add up to the answer, so
    nothing sent is ever cut later, and the answer depends on the final text alone: the text up
    to EOS, cut before the stop that ends first (ties: the one that starts first), as for text
    written left to right. (It was cut before the earliest-starting stop of the first step
    that held one, so two stops completed in one step could answer otherwise than in two.) The
    search for stops reads only the unsent text, on the invariant that the sent text never ends
    where a stop could begin."""
    from unmask.engine.request import StepEvent
    from unmask.server.output import TextStream

    llm = _CharLLM()
    spelled = llm.detokenize(canvas)  # stops cut from the whole text occur in it (unless EOS)
    cut_out = st.tuples(st.integers(0, len(spelled)), st.integers(1, 8)).map(
        lambda ij: spelled[ij[0]: ij[0] + ij[1]] or "a")
    stops = data.draw(st.lists(cut_out | st.text("abc", min_size=1, max_size=8), min_size=1,
                               max_size=4))
    order = data.draw(st.permutations(range(len(canvas))))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(canvas) - 1), max_size=len(canvas))))
    text = TextStream(llm, len(canvas), stops)
    full = llm.detokenize(canvas[: useful_length(canvas, 0)])
    ends = [(i + len(s), i) for s in stops if (i := full.find(s)) >= 0]
    want = full[: min(ends)[1]] if ends else full
    done, streamed = [False] * len(canvas), ""
    for step, (a, b) in enumerate(zip([0, *cuts], [*cuts, len(canvas)], strict=True)):
        for p in order[a:b]:
            done[p] = True
        prefix = next((i for i, d in enumerate(done) if not d), len(canvas))
        ev = StepEvent("r", step, list(order[a:b]), [canvas[p] for p in order[a:b]], [], True,
                       False, (0, len(canvas)), prefix, 0, 0, 0)
        streamed += text.update(ev)
        if text.stop_hit:
            streamed += text.finish(None)
            break
    else:
        streamed += text.finish(canvas)
    assert text.stop_hit == bool(ends)
    assert streamed == want


def test_a_step_committing_past_the_prefix_detokenizes_nothing() -> None:
    """TextStream.update: the text is a function of the committed prefix, so a step whose commits
    all lie past it sends nothing and does not detokenize again; the next step that extends the
    prefix sends the text of both."""
    from unmask.engine.request import StepEvent
    from unmask.server.output import TextStream

    llm = _CharLLM()
    calls = []
    spell = llm.detokenize
    llm.detokenize = lambda ids: calls.append(ids) or spell(ids)
    text = TextStream(llm, 4, None)

    def step(i: int, positions: list[int], prefix: int) -> str:
        return text.update(StepEvent("r", i, positions, [1] * len(positions), [], True, False,
                                     (0, 4), prefix, 0, 0, 0))

    assert step(0, [0], 1) == "a" and len(calls) == 1
    assert step(1, [2], 1) == "" and len(calls) == 1  # past the prefix: nothing to make
    assert step(2, [1], 3) == "aa" and len(calls) == 2


def test_stream_disconnect_aborts(server: LiveServer) -> None:
    """A streaming client that leaves mid-answer has its request aborted: the running count
    drops and the engine makes no more model calls for it."""
    body = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 1024,
            "stream": True, "decoder": "static-1"}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/chat/completions",
                                                       json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.engine.n_running == 1
    deadline = time.monotonic() + 10
    while server.engine.n_running or server.engine.has_unfinished:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)
    calls = server.engine.model_calls
    time.sleep(0.5)
    assert server.engine.model_calls == calls
    health = httpx.get(f"{server.url}/health").json()
    assert health["running"] == 0


def test_non_streaming_disconnect_aborts(server: LiveServer) -> None:
    body = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 1024,
            "decoder": "static-1"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=1.0)
    deadline = time.monotonic() + 10
    while server.engine.has_unfinished:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.05)


# --- errors ---------------------------------------------------------------------------------------
BAD = [
    ("not json", b"{bad", 400, None),
    ("missing field", {"max_tokens": 8}, 400, "prompt"),
    ("unknown field", {"prompt": "hi", "foo": 1}, 400, "foo"),
    ("top_p", {"prompt": "hi", "top_p": 0.5}, 400, "top_p"),
    ("logprobs", {"prompt": "hi", "logprobs": 3}, 400, "logprobs"),
    ("penalty", {"prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("n", {"prompt": "hi", "n": 0}, 400, "n"),
    ("n x prompts", {"prompt": ["hi"] * 9, "n": 8}, 400, "n"),  # 72 choices, over 64
    ("echo", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("bad spec", {"prompt": "hi", "decoder": "warp-drive"}, 400, "decoder"),
    # "" used to mean the server's spec, where " " was an error
    ("empty spec", {"prompt": "hi", "decoder": ""}, 400, "decoder"),
    ("bad spec key", {"prompt": "hi", "decoder": "threshold,threshold=2"}, 400, "decoder"),
    ("too long", {"prompt": "hi", "max_tokens": 5000}, 400, None),
    ("negative tokens", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("wrong type", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("empty prompt", {"prompt": "   "}, 400, "prompt"),
    ("wrong model", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests(server: LiveServer, name, body, status, param) -> None:
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(
        body, bytes) else {"json": body}
    r = httpx.post(f"{server.url}/v1/completions", timeout=30, **kw)
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param:
        assert err["param"] == param or param in err["message"]
    if name == "too long":
        assert "max_sequence_length" in err["message"]


def test_bad_chat_requests(server: LiveServer) -> None:
    for body, param in (({"messages": []}, "messages"),
                        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, "tools"),
                        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": ""}]}, "messages")):
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400, body
        assert param in (r.json()["error"]["param"] or "") + r.json()["error"]["message"]


def test_a_block_causal_cache_on_a_bidirectional_model_is_a_400(server: LiveServer) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
        "decoder": "threshold,cache=sub_block,sub_block_length=4"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("cache=sub_block applies to block-causal")


def test_chat_content_parts_and_developer_role(server: LiveServer) -> None:
    """OpenAI clients send content as a list of parts and system instructions as `developer`:
    text parts read as their text joined by newlines, developer as system (both were 400s)."""
    client = server.client()

    def answer(messages: list[dict]) -> str:
        r = client.chat.completions.create(model="unmask-llada", messages=messages,
                                           max_tokens=32, seed=5)
        return r.choices[0].message.content

    plain = answer([{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "What is 47 + 38?\nShow the sum."}])
    parts = answer([{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                    {"role": "user", "content": [{"type": "text", "text": "What is 47 + 38?"},
                                                 {"type": "text", "text": "Show the sum."}]}])
    assert parts == plain and plain
    # the rendered prompts are equal too, not only the answers
    sent = [{"role": "developer", "content": [{"type": "text", "text": "x"}]},
            {"role": "user", "content": "y"}]
    from unmask.server.protocol import ChatMessage
    assert [ChatMessage(**m).for_template() for m in sent] == [
        {"role": "system", "content": "x"}, {"role": "user", "content": "y"}]


@pytest.mark.parametrize("content,param,words", [
    ([{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}],
     "messages[0].content[1].type", "only text content parts"),
    ([{"type": "text", "text": 5}], "messages[0].content[0].text", "expected a string"),
    ([{"type": "text", "text": "hi", "cache_control": {}}], "messages[0].content[0].cache_control",
     "unknown field"),
    ([{"text": "hi"}], "messages[0].content[0].type", "only text content parts"),
    ([{"type": "text", "text": "\ud800"}], "messages[0].content[0].text", "lone surrogate"),
    ([], "messages", "empty messages"),
    (5, "messages[0].content", "list of content parts"),
], ids=["image", "text-not-str", "extra-key", "no-type", "surrogate", "empty-list", "int"])
def test_bad_content_parts_are_named(server: LiveServer, content, param: str, words: str) -> None:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 8}
    # json.dumps escapes a lone surrogate as JSON allows (\\ud800); httpx's json= cannot encode it
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                   content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err


def test_queue_full_is_429(llm: LLM) -> None:
    with LiveServer(build_app(llm, ServerConfig(decoder="static-1", max_running=1,
                                                max_queue=1))) as s:
        body = {"prompt": "hi", "max_tokens": 128}

        def post(_):
            return httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)

        with ThreadPoolExecutor(4) as pool:
            rs = list(pool.map(post, range(4)))
        codes = sorted(r.status_code for r in rs)
        # Adds that reach the engine between two steps all see the queue: one waits, the rest
        # (at least one of four) are turned away at once.
        assert codes.count(429) >= 1 and codes.count(200) >= 1
        assert set(codes) <= {200, 429}
        limited = next(r for r in rs if r.status_code == 429)
        assert limited.headers["Retry-After"] == "1"
        assert limited.json()["error"]["type"] == "rate_limit_error"


def test_engine_failure_is_500_and_the_server_keeps_serving(server: LiveServer, monkeypatch) -> None:
    real = decoder_mod.Decoder.step

    def step(self, b, trace=False):
        if self.params.remasking == "topk_margin":
            raise RuntimeError("kaput")
        return real(self, b, trace)

    monkeypatch.setattr(decoder_mod.Decoder, "step", step)
    client = server.client()
    bad = httpx.post(f"{server.url}/v1/completions", json={
        "prompt": "hi", "max_tokens": 16, "decoder": "threshold,remasking=topk_margin"}, timeout=30)
    assert bad.status_code == 500
    assert "kaput" in bad.json()["error"]["message"]
    ok = client.completions.create(model="unmask-llada", prompt="hi", max_tokens=16)
    assert ok.choices[0].finish_reason in ("stop", "length")
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_models_health_metrics(server: LiveServer) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["unmask-llada"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("unmask_queue_depth", "unmask_running_requests", "unmask_requests_total",
                 "unmask_model_calls_total", "unmask_token_forwards_total", "unmask_tpf",
                 "unmask_useful_tokens_per_second", "unmask_request_latency_seconds_bucket",
                 "unmask_time_to_first_token_seconds_bucket"):
        assert name in text, name


# --- fuzzing the schema: no input gives a 5xx -----------------------------------------------------
def test_fuzz_openapi_schema_no_5xx(llm: LLM, tmp_path) -> None:
    """schemathesis generates requests from the server's own OpenAPI schema (boundary values,
    then random ones; a bounded number per operation): none may get a 5xx."""
    with LiveServer(build_app(llm, ServerConfig(decoder="fast"))) as s:
        out = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run",
             f"{s.url}/openapi.json", "--checks", "not_a_server_error", "--max-examples", "25",
             "--seed", "1", "--request-timeout", "120", "--phases", "examples,coverage,fuzzing",
             "--generation-database", "none"],
            capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
        # every operation was exercised (completions, chat, models, health, metrics); the output
        # names operations only in its warnings, so count them
        ops = re.search(r"Selected:\s*(\d+)/(\d+)\s+Tested:\s*(\d+)\b", out.stdout)
        assert ops, out.stdout[-3000:]
        selected, total, tested = map(int, ops.groups())
        assert selected == total == tested >= 5, out.stdout[-3000:]  # every operation was fuzzed
        assert httpx.get(f"{s.url}/health").json()["status"] == "ok"


# --- shutdown --------------------------------------------------------------------------------------
@contextlib.contextmanager
def serve_process(tmp_path, *argv: str):
    """`unmask serve --port 0 ...` in a process of its own: (process, url, log path); killed on
    the way out if still running."""
    path = tmp_path / "server.log"
    log = open(path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "unmask.cli", "serve", "--port", "0",
                             "--threads", "1", *argv], stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            # as from a terminal: a shell's background job ignores SIGINT
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not (m := re.search(r"running on http://127\.0\.0\.1:(\d+)", path.read_text())):
            assert time.monotonic() < deadline and proc.poll() is None, "server did not start"
            time.sleep(0.2)
        assert int(m[1]) > 0
        yield proc, f"http://127.0.0.1:{m[1]}", path
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()


def _stream_in_thread(url: str, body: dict, lines: list[str]) -> threading.Thread:
    def stream() -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                lines.extend(x for x in r.iter_lines() if x)
        except httpx.TransportError:
            lines.append("cut")
    t = threading.Thread(target=stream)
    t.start()
    # running: static-1 sends its first text only once the canvas's start is committed
    while not lines and httpx.get(f"{url}/health", timeout=5).json()["running"] == 0:
        time.sleep(0.02)
    return t


def test_sigterm_finishes_running_requests_then_exits(tmp_path) -> None:
    """Also: --port 0 takes a free port and the log names it (the socket is bound before the
    model loads, and uvicorn names only addresses it bound itself)."""
    with serve_process(tmp_path, "--decoder", "static-1") as (proc, url, _):
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200
        lines: list[str] = []
        t = _stream_in_thread(url, {"prompt": "hi", "max_tokens": 256, "stream": True}, lines)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert lines[-1] == "data: [DONE]"  # the running request finished
        finish = [json.loads(x[6:]) for x in lines if x.startswith("data: {")][-1]
        assert finish["choices"][0]["finish_reason"] in ("stop", "length")
        assert proc.wait(30) == 0
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health", timeout=1)


def test_a_second_ctrl_c_quits_at_once_without_aborting(tmp_path) -> None:
    """A second SIGINT (uvicorn: "CTRL+C to force quit") with streams open skipped the app's
    shutdown, so the process ended inside a torch call on the engine thread: SIGABRT,
    "terminate called without an active exception". It now exits as Ctrl-C does."""
    with serve_process(tmp_path, "--decoder", "static-1") as (proc, url, log):
        lines: list[str] = []
        t = _stream_in_thread(url, {"prompt": "hi", "max_tokens": 1024, "stream": True}, lines)
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        while "Shutting down" not in log.read_text():  # uvicorn took the first one
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130  # the shell's way of saying SIGINT
        t.join(30)
        text = log.read_text()
        assert "terminate called" not in text
        # it printed 6 tracebacks (asyncio cancelling the app's tasks); the cut stream gets the
        # error event, and the log one line
        assert "Traceback" not in text and "Exception in ASGI" not in text, text
        assert len(re.findall("cut off cmpl-", text)) == 1, text
        assert json.loads(lines[-1].removeprefix("data: "))["error"]["type"] == "server_error"


def test_streams_past_the_shutdown_timeout_end_with_an_error_event(tmp_path) -> None:
    """A stream still running at --shutdown-timeout was cancelled by uvicorn (~50 log lines, the
    connection closed before [DONE]): the app now cuts it first, with the error event it
    promises, and one log line. Also: the log names what is served."""
    with serve_process(tmp_path, "--decoder", "static-1", "--shutdown-timeout", "1") as (
            proc, url, log):
        lines: list[str] = []
        t = _stream_in_thread(url, {"prompt": "hi", "max_tokens": 1024, "stream": True}, lines)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(30) == 0
        err = json.loads(lines[-1].removeprefix("data: "))["error"]
        assert "--shutdown-timeout (1 s) has passed" in err["message"], lines[-1]
        text = log.read_text()
        assert "Traceback" not in text and "Cancel" not in text, text
        assert len(re.findall("cut off cmpl-", text)) == 1, text
        assert re.search(r"serving unmask-llada \(.*default_model\) with decoder static-1: "
                         r"float32 on cpu, 1 torch threads; API key off", text), text


@pytest.mark.parametrize("argv, words", [
    (["--port", "70000"], "must be a port in 0..65535"),  # uvicorn served on 70000 mod 65536
    (["--host", "no.such.host.invalid"], "--host 'no.such.host.invalid'"),
])
def test_serve_address_errors_are_one_line(argv: list[str], words: str, capsys) -> None:
    from unmask.cli import main

    try:
        code = main(["serve", *argv])
    except SystemExit as e:  # argparse's own refusals exit from inside
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_serve_on_a_port_in_use_is_one_line_before_loading(capsys, monkeypatch) -> None:
    """Was uvicorn's log line and exit 3, after the model had loaded."""

    from unmask import api
    from unmask.cli import main

    monkeypatch.setattr(api.LLM, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and len(err.strip().splitlines()) == 1, err


def test_window_gauges_fall_to_zero_when_idle() -> None:
    """The "last 10 s" gauges were set when a sample arrived, so an idle server kept showing its
    last busy window's rates for ever; they are read when scraped."""
    from prometheus_client import generate_latest

    from unmask.server.metrics import ServerMetrics

    def gauges(m: ServerMetrics) -> dict[str, float]:
        text = generate_latest(m.registry).decode()
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line.startswith(("unmask_model_calls_per_second", "unmask_tpf",
                                    "unmask_useful_tokens_per_second"))}

    m = ServerMetrics(window=0.2)
    m.engine_totals(model_calls=4, token_forwards=100)
    m.finished("stop", nfe=4, decided=8, useful=6)
    busy = gauges(m)
    assert busy == {"unmask_model_calls_per_second": 20.0, "unmask_useful_tokens_per_second": 30.0,
                    "unmask_tpf": 2.0}
    time.sleep(0.3)
    assert gauges(m) == dict.fromkeys(busy, 0.0)


def test_a_cut_chat_request_is_logged_by_its_response_id(llm: LLM, caplog) -> None:
    """The log said `cut off cmpl-X` for a chat completion whose id is chatcmpl-X."""
    import logging

    ids: list[str] = []

    with LiveServer(build_app(llm, ServerConfig(decoder="static-1"))) as s:
        def chat() -> None:
            stream = s.client().chat.completions.create(
                model="unmask-llada", messages=[{"role": "user", "content": "hi"}],
                max_tokens=1024, stream=True)
            with contextlib.suppress(Exception):  # the cut ends the stream with an error
                for c in stream:
                    ids.append(c.id)

        t = threading.Thread(target=chat)
        t.start()
        deadline = time.monotonic() + 60
        while not ids and time.monotonic() < deadline:
            time.sleep(0.05)
        with caplog.at_level(logging.WARNING, logger="unmask.server"):
            s.app.state.unmask.engine.cut_all("a test's cut")
            t.join(60)
    assert ids and ids[0].startswith("chatcmpl-")
    assert f"cut off {ids[0]}: a test's cut" in caplog.text, caplog.text
