"""`unmask serve`'s limits and error shapes, against live servers on 127.0.0.1: what a request
may ask for (prompts, characters, messages, body bytes, lanes against the engine's capacity),
text that is not Unicode, unknown routes, and that neither a long prompt list nor a slow
tokenization outlives its client or stalls the event loop.
"""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest
from helpers import LiveServer

from unmask import LLM
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, Request
from unmask.server.app import build_app
from unmask.server.protocol import MAX_PROMPTS
from unmask.server.state import MAX_BODY_BYTES, ServerConfig


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.fixture(scope="module")
def server(llm: LLM):
    with LiveServer(build_app(llm, ServerConfig(decoder="threshold"))) as s:
        yield s


@pytest.fixture(scope="module")
def slotted(llm: LLM):
    """--max-running 4 --max-queue 1 --max-slots 70: two 3-token prompts with a 32-token canvas
    (2 x 35 slots) run at once, not three."""
    with LiveServer(build_app(llm, ServerConfig(decoder="threshold", max_running=4, max_queue=1,
                                                max_slots=70))) as s:
        yield s


@pytest.fixture(scope="module")
def small(llm: LLM):
    """A server that holds two requests at most: one decoding, one waiting."""
    with LiveServer(build_app(llm, ServerConfig(decoder="threshold", max_running=1,
                                                max_queue=1))) as s:
        yield s


def post_json(url: str, body: dict, timeout: float = 60) -> httpx.Response:
    """POST with json.dumps's ASCII escapes, so lone surrogates travel as JSON writes them."""
    return httpx.post(url, content=json.dumps(body).encode(), timeout=timeout,
                      headers={"content-type": "application/json"})


def error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def wait_idle(server: LiveServer, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while server.engine.has_unfinished:
        assert time.monotonic() < deadline, "the engine is still busy"
        time.sleep(0.02)


# --- prompts per request, and the engine's capacity ------------------------------------------------
def test_prompt_list_over_the_limit_is_400(server: LiveServer) -> None:
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"prompt": [[5, 6, 7]] * (MAX_PROMPTS + 1), "max_tokens": 8})
    err = error(r, 400)
    assert err["param"] == "prompt" and f"the limit is {MAX_PROMPTS}" in err["message"]
    assert not server.engine.has_unfinished


def test_client_leaving_during_submission_stops_it(server: LiveServer, monkeypatch) -> None:
    """Each prompt of a list is one engine round trip, which waits for the step in flight: a
    client that leaves while they are submitted gets the rest dropped and the rest aborted."""
    real_step, real_add = Engine.step, Engine.add_request
    added = []

    def slow_step(self):
        time.sleep(0.05)
        return real_step(self)

    def add(self, *a, **kw):
        added.append(1)
        return real_add(self, *a, **kw)

    monkeypatch.setattr(Engine, "step", slow_step)
    monkeypatch.setattr(Engine, "add_request", add)
    # without its admission window: an idle engine would take all 64 before its first step
    monkeypatch.setattr(server.app.state.unmask.engine, "window", 0.0)
    body = {"prompt": [[5, 6, 7]] * MAX_PROMPTS, "max_tokens": 32, "decoder": "static-1"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    # Submitting all 64 takes >= 64 steps (3.2 s); the client left after 0.5 s.
    wait_idle(server, 1.5)
    assert len(added) < MAX_PROMPTS / 2


def test_more_prompts_than_the_engine_holds_is_400_not_429(small: LiveServer) -> None:
    """--max-running 1 --max-queue 1: three prompts could never be admitted together (a 429
    would have the client retry forever); two can."""
    r = httpx.post(f"{small.url}/v1/completions", timeout=60,
                   json={"prompt": [[5, 6, 7]] * 3, "max_tokens": 8})
    msg = error(r, 400)["message"]
    assert "at most 2" in msg and "--max-running 1" in msg and "--max-queue 1" in msg
    r = httpx.post(f"{small.url}/v1/unmask/trace", timeout=60,
                   json={"prompt": "hi", "decoders": ["threshold", "fast", "exact"]})
    assert "at most 2" in error(r, 400)["message"]
    ok = httpx.post(f"{small.url}/v1/completions", timeout=60,
                    json={"prompt": [[5, 6, 7]] * 2, "max_tokens": 8})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_prompts_past_the_slot_budget_are_400_not_429(slotted: LiveServer) -> None:
    """Under --max-slots fewer than --max-running prompts run at once: four prompts are more than
    the 2 that fit + 1 waiting, so the fourth would get a 429 that no retry cures."""
    params = DecodeParams.parse("threshold,gen_length=32")
    reqs = [Request([5, 6, 7], params) for _ in range(4)]
    assert slotted.engine.scheduler.admitted_when_idle(reqs) == 2  # what the server counts by
    body = {"prompt": [[5, 6, 7]] * 4, "max_tokens": 32}
    with pytest.raises(openai.BadRequestError) as e:
        slotted.client().completions.create(model="unmask-llada", **body)
    msg = e.value.body["message"]
    assert "--max-slots 70" in msg and "runs 2 of them at once" in msg and "--max-queue 1" in msg
    assert "send at most 3" in msg
    assert not slotted.engine.has_unfinished  # refused before any was submitted
    # Four decoder lanes, each its own batch of 2 + 32 slots: the same count per decoder group.
    r = httpx.post(f"{slotted.url}/v1/unmask/trace", timeout=60,
                   json={"prompt": "hi", "chat": False, "max_tokens": 32,
                         "decoders": ["threshold", "static-1", "static", "freedave"]})
    assert "send at most 3" in error(r, 400)["message"]
    # A prompt that could not fit even alone keeps the engine's own message.
    r = httpx.post(f"{slotted.url}/v1/completions", timeout=60,
                   json={"prompt": [[5, 6, 7], [5] * 40], "max_tokens": 32})
    assert "exceeds the engine's slot budget 70" in error(r, 400)["message"]
    ok = slotted.client().completions.create(model="unmask-llada", prompt=[[5, 6, 7]] * 3,
                                             max_tokens=32)
    assert len(ok.choices) == 3


def requests_by_outcome(server: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {m[1]: float(m[2]) for m in re.finditer(
        r'^unmask_requests_total\{outcome="(\w+)"\} (\S+)$', text, re.M)}


def test_trace_lanes_aborted_by_a_429_are_counted(llm: LLM) -> None:
    """A trace whose second lane gets a 429 aborts the lane already submitted, and /metrics
    counts it (abort), as /v1/completions counts the prompts of a list cut short by a 429:
    every request the engine saw has an outcome."""
    with LiveServer(build_app(llm, ServerConfig(decoder="threshold", max_running=1,
                                                max_queue=1))) as s:
        busy = s.client().completions.create(model="unmask-llada", prompt="hi", max_tokens=512,
                                             stream=True, extra_body={"decoder": "static-1"})
        try:
            deadline = time.monotonic() + 30
            while s.engine.n_running < 1:
                assert time.monotonic() < deadline, "the busy request never ran"
                time.sleep(0.01)
            # lane 0 waits behind the busy request; lane 1 finds the queue full
            r = httpx.post(f"{s.url}/v1/unmask/trace", timeout=60,
                           json={"prompt": "hi", "decoders": ["threshold", "fast"],
                                 "max_tokens": 16})
            assert error(r, 429)["type"] == "rate_limit_error"
            assert requests_by_outcome(s) == {"rejected": 1.0, "abort": 1.0}
        finally:
            busy.close()
        wait_idle(s, 5)


# --- sizes: body bytes, prompt characters, messages -------------------------------------------------
def test_oversized_body_is_413(server: LiveServer) -> None:
    big = {"prompt": "hello world " * 1_000_000, "max_tokens": 32}  # 12 MB
    r = httpx.post(f"{server.url}/v1/completions", json=big, timeout=60)
    assert str(MAX_BODY_BYTES) in error(r, 413)["message"]

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(MAX_BODY_BYTES // 100_000 + 1):
            yield b" " * 100_000

    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert str(MAX_BODY_BYTES) in error(r, 413)["message"]

    def small_chunks():  # a chunked body under the limit reaches the route whole
        yield b'{"prompt": [5, 6, 7], '
        yield b'"max_tokens": 8}'

    r = httpx.post(f"{server.url}/v1/completions", content=small_chunks(), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


def test_prompt_too_many_characters_is_400(server: LiveServer, llm: LLM) -> None:
    """A prompt with more characters than max_sequence_length tokens could cover is refused
    before it is tokenized, saying the limit."""
    state = server.app.state.unmask
    limit = llm.config.max_sequence_length * state.chars_per_token
    text = "x" * (limit + 1)
    for path, body, param in (
            ("/v1/completions", {"prompt": text}, "prompt"),
            ("/v1/completions", {"prompt": ["hi", text]}, "prompt[1]"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]},
             "messages"),
            ("/v1/unmask/trace", {"prompt": text}, "prompt")):
        err = error(httpx.post(server.url + path, json=body, timeout=60), 400)
        assert err["param"] == param and f"the limit is {limit}" in err["message"], err
    n = llm.config.max_sequence_length
    msgs = [{"role": "user", "content": "hi"}] * (n + 1)
    err = error(httpx.post(f"{server.url}/v1/chat/completions", json={"messages": msgs},
                           timeout=60), 400)
    assert err["param"] == "messages" and f"the limit is {n} messages" in err["message"]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 8}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}),
    ("/v1/unmask/trace", {"prompt": "hi", "max_tokens": 8}),
], ids=["completions", "chat", "trace"])
def test_tokenizing_does_not_block_the_event_loop(server: LiveServer, llm: LLM, monkeypatch,
                                                   path: str, body: dict) -> None:
    """While one request's prompt is being tokenized (made slow here), /health answers."""
    started = threading.Event()

    def slowed(real):
        def slow(*a, **kw):
            started.set()
            time.sleep(1.0)
            return real(*a, **kw)
        return slow

    # chats (and chat=True prompts) are tokenized by LLM.chat_tokens, other prompts by the tokenizer
    monkeypatch.setattr(llm.tokenizer, "encode", slowed(llm.tokenizer.encode))
    monkeypatch.setattr(llm.chat_tokens, "encode", slowed(llm.chat_tokens.encode))
    out: list[httpx.Response] = []
    t = threading.Thread(target=lambda: out.append(httpx.post(server.url + path, json=body,
                                                              timeout=60)))
    t.start()
    try:
        assert started.wait(10)
        t0 = time.perf_counter()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        assert time.perf_counter() - t0 < 0.5
    finally:
        t.join(60)
    assert out and out[0].status_code == 200, out


def test_client_leaving_during_tokenization_stops_it(server: LiveServer, llm: LLM,
                                                     monkeypatch) -> None:
    real, calls = llm.tokenizer.encode, []

    def slow(*a, **kw):
        calls.append(1)
        time.sleep(0.4)
        return real(*a, **kw)

    monkeypatch.setattr(llm.tokenizer, "encode", slow)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", timeout=0.3,
                   json={"prompt": ["one", "two", "three", "four", "five"], "max_tokens": 8})
    time.sleep(1.5)  # all five would take 2 s
    assert len(calls) <= 2
    assert not server.engine.has_unfinished


# --- text that is not Unicode ---------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "\udfff"]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "name": "\udc00"}]},
     "messages[0].name"),
    ("/v1/unmask/trace", {"prompt": "\ud800"}, "prompt"),
], ids=["prompt", "prompt-list", "stop", "chat-content", "chat-name", "trace"])
def test_lone_surrogate_is_400(server: LiveServer, path: str, body: dict, param: str) -> None:
    err = error(post_json(server.url + path, body), 400)
    assert err["param"] == param
    assert "not valid Unicode text" in err["message"] and "lone surrogate" in err["message"]


# --- routes ---------------------------------------------------------------------------------------
def test_unknown_route_and_method_are_openai_errors(server: LiveServer) -> None:
    err = error(httpx.get(f"{server.url}/v1/nope", timeout=10), 404)
    assert "GET /v1/nope" in err["message"] and err["type"] == "invalid_request_error"
    r = httpx.delete(f"{server.url}/v1/completions", timeout=10)
    err = error(r, 405)
    assert "DELETE" in err["message"] and "/v1/completions" in err["message"]
    assert r.headers["allow"] == "POST"
    with pytest.raises(openai.NotFoundError) as e:  # the client's own view of a 404
        server.client().post("/nope", cast_to=object)
    assert "/v1/nope" in e.value.body["message"]


def test_models_retrieve(server: LiveServer) -> None:
    client = server.client()
    m = client.models.retrieve("unmask-llada")
    assert (m.id, m.object, m.owned_by) == ("unmask-llada", "model", "unmask")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4")
    assert e.value.body["param"] == "model" and "'gpt-4' does not exist" in e.value.body["message"]


def test_a_chat_template_that_raises_is_a_400(tmp_path) -> None:
    """A template's own raise_exception (roles that must alternate, say) is about the messages:
    a 400 carrying its message (it was a 500)."""
    from helpers import tiny_model_dir

    folder = tiny_model_dir(tmp_path)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{% if messages[0]['role'] != 'user' %}"
                            "{{ raise_exception('the first message must be the user\\'s') }}"
                            "{% endif %}{{ messages[0]['content'] }}")
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    with LiveServer(build_app(LLM(folder), ServerConfig(decoder="static-1"))) as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=60, json={
            "max_tokens": 8, "messages": [{"role": "assistant", "content": "hi"}]})
        e = error(r, 400)
        assert "the first message must be the user's" in e["message"] and e["param"] == "messages"
        ok = s.client().chat.completions.create(model=s.client().models.list().data[0].id,
                                                max_tokens=8,
                                                messages=[{"role": "user", "content": "hi"}])
        assert ok.choices[0].finish_reason in ("stop", "length")


# --- who may call: the API key and CORS ------------------------------------------------------------
def test_api_key_guards_the_v1_routes_and_cors_answers_preflights(llm: LLM) -> None:
    """The server served anyone who could reach its port. With a key, /v1/ routes (OpenAI's and
    the live view's) are a 401 in OpenAI's error body without it; /health, /metrics and the page
    stay open. CORS preflights from a listed origin are answered before the key is asked for."""
    config = ServerConfig(decoder="threshold", api_key="s3cret-key",
                          cors_origins=("https://ui.example",))
    with LiveServer(build_app(llm, config)) as s:
        with pytest.raises(openai.AuthenticationError) as refused:
            s.client().completions.create(model="unmask-llada", prompt="hi", max_tokens=8)
        assert refused.value.status_code == 401
        assert refused.value.body["code"] == "invalid_api_key"
        for header in ({}, {"Authorization": "Bearer s3cret-ke"}, {"Authorization": "s3cret-key"},
                       {"Authorization": "Bearer s3cret-key2"}):
            r = httpx.get(f"{s.url}/v1/models", headers=header, timeout=10)
            assert error(r, 401)["code"] == "invalid_api_key", header
        r = httpx.post(f"{s.url}/v1/unmask/trace", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 401
        for path in ("/health", "/metrics", "/"):
            assert httpx.get(f"{s.url}{path}", timeout=10).status_code == 200, path
        from openai import OpenAI

        keyed = OpenAI(base_url=f"{s.url}/v1", api_key="s3cret-key", max_retries=0, timeout=120)
        ok = keyed.completions.create(model="unmask-llada", prompt="hi", max_tokens=8)
        assert ok.choices[0].finish_reason in ("stop", "length")

        def preflight(origin: str) -> httpx.Response:
            return httpx.options(f"{s.url}/v1/chat/completions", timeout=10, headers={
                "Origin": origin, "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type"})

        allowed = preflight("https://ui.example")
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://ui.example"
        assert "access-control-allow-origin" not in preflight("https://evil.example").headers
        answer = httpx.get(f"{s.url}/v1/models", timeout=10, headers={
            "Origin": "https://ui.example", "Authorization": "Bearer s3cret-key"})
        assert answer.headers["access-control-allow-origin"] == "https://ui.example"


@pytest.mark.parametrize("change, words", [
    ({"api_key": ""}, "API key"), ({"api_key": "two words"}, "API key"),
    ({"cors_origins": ("ui.example",)}, "--cors-origin 'ui.example'"),
    ({"cors_origins": ("https://ui.example/app",)}, "no path"),
    ({"shutdown_timeout": float("nan")}, "--shutdown-timeout"),
    ({"shutdown_timeout": float("inf")}, "--shutdown-timeout"),
    ({"shutdown_timeout": -1.0}, "--shutdown-timeout"),
])
def test_access_and_shutdown_settings_are_validated(change: dict, words: str) -> None:
    from unmask.errors import InputError

    with pytest.raises(InputError, match=re.escape(words)):
        ServerConfig(**change)


@pytest.mark.parametrize("argv, env, words", [
    (["--shutdown-timeout", "nan"], {}, "--shutdown-timeout must be a number of seconds >= 0"),
    (["--shutdown-timeout", "-1"], {}, "--shutdown-timeout must be a number of seconds >= 0"),
    ([], {"UNMASK_API_KEY": ""}, "$UNMASK_API_KEY"),  # set but empty is no silent "open"
    (["--cors-origin", "*", "--cors-origin", "ftp://x"], {}, "--cors-origin 'ftp://x'"),
    (["--model-name", ""], {}, "--model-name '': the id clients send as `model` must not be "
                               "empty"),  # was silently the folder's name
    (["--model-name", " "], {}, "--model-name ' '"),
])
def test_serve_refuses_bad_settings_in_one_line_before_loading(argv, env, words, capsys,
                                                              monkeypatch) -> None:
    from unmask import api
    from unmask.cli import main

    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(api.LLM, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_the_api_key_comes_from_the_flag_or_the_environment(monkeypatch) -> None:
    from unmask.cli import build_parser
    from unmask.server.run import api_key

    monkeypatch.setenv("UNMASK_API_KEY", "from-env")
    assert api_key(build_parser().parse_args(["serve"])) == "from-env"
    assert api_key(build_parser().parse_args(["serve", "--api-key", "flag"])) == "flag"
    monkeypatch.delenv("UNMASK_API_KEY")
    assert api_key(build_parser().parse_args(["serve"])) is None


def test_serve_refuses_at_start_what_no_request_could_use(capsys) -> None:
    """A default decoder the model cannot run started a server that gave every request a 400
    (generate refused it); --max-slots below the smallest request started one that served
    nothing. Both exit 2 after the load, the decoder with the very line generate prints."""
    from unmask.cli import main

    spec = ["--decoder", "threshold,cache=block", "--threads", "1"]
    assert main(["generate", *spec, "hi"]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith("unmask: error: --decoder 'threshold,cache=block': cache=block "
                           "applies to block-causal models"), said
    assert main(["serve", "--port", "0", *spec]) == 2
    assert capsys.readouterr().err.strip() == said
    assert main(["serve", "--port", "0", "--threads", "1", "--max-slots", "10"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-slots 10 holds no request: the smallest one " \
        "(a one-token prompt and a block of 32 generated positions with " \
        "--decoder static-1,early_exit=true) " \
        "takes 33 slots; give at least 33" in err, err
