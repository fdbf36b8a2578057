"""`unmask serve` against an adversarial client, on one live server on 127.0.0.1: values of the
wrong JSON type, numbers past any limit, malformed prompt lists, and the error body's `param`
for fields inside lists and unions. Each case here was a fault (a 500, a 200 for a value OpenAI
refuses, a param no client wrote, or engine work and /metrics counts for a refused request).
"""

from __future__ import annotations

import json

import httpx
import pytest
from helpers import LiveServer

from unmask import LLM
from unmask.engine import Engine
from unmask.server.app import ServerConfig, build_app

COMPLETIONS, CHAT, TRACE = "/v1/completions", "/v1/chat/completions", "/v1/unmask/trace"
USER = [{"role": "user", "content": "hi"}]
HUGE = 10**400  # a JSON integer Python parses (under its 4,300-digit limit), past any float


@pytest.fixture(scope="module")
def server():
    with LiveServer(build_app(LLM(), ServerConfig(decoder="threshold"))) as s:
        yield s


def post(server: LiveServer, path: str, body: object) -> httpx.Response:
    # json.dumps, not httpx's json=: it writes integers of any size, as a client may
    return httpx.post(f"{server.url}{path}", content=json.dumps(body).encode(), timeout=60,
                      headers={"content-type": "application/json"})


def error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    return err


def outcomes(server: LiveServer) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith("unmask_requests_total")}


# --- a max_tokens no float can hold --------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": HUGE}, "max_tokens"),
    (CHAT, {"messages": USER, "max_tokens": HUGE}, "max_tokens"),
    (CHAT, {"messages": USER, "max_completion_tokens": HUGE}, "max_completion_tokens"),
    (TRACE, {"prompt": "hi", "max_tokens": HUGE}, "max_tokens"),
], ids=["completions", "chat", "chat-max_completion_tokens", "trace"])
def test_huge_max_tokens_is_400_not_500(server: LiveServer, path: str, body: dict,
                                        param: str) -> None:
    """Was a 500 (OverflowError: the canvas arithmetic divides max_tokens as a float)."""
    err = error(post(server, path, body))
    assert err["param"] == param and "max_sequence_length is 2048" in err["message"], err
    assert not server.engine.has_unfinished


# --- values of the wrong JSON type ---------------------------------------------------------------
WRONG_TYPES = [
    (COMPLETIONS, {"prompt": "hi", "max_tokens": True}, "max_tokens"),  # was read as 1
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 8.0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream"),  # was a stream
    (COMPLETIONS, {"prompt": "hi", "n": "1"}, "n"),
    (COMPLETIONS, {"prompt": "hi", "seed": "7"}, "seed"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "echo": "false"}, "echo"),
    (COMPLETIONS, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    (CHAT, {"messages": USER, "max_completion_tokens": "8"}, "max_completion_tokens"),
    (TRACE, {"prompt": "hi", "chat": "no"}, "chat"),
]


@pytest.mark.parametrize("path,body,param", WRONG_TYPES,
                         ids=[f"{p[1:].replace('/', '-')}-{f}" for p, _, f in WRONG_TYPES])
def test_wrong_json_type_is_400(server: LiveServer, path: str, body: dict, param: str) -> None:
    """OpenAI refuses a value of the wrong JSON type; the server read "8" as 8, true as 1 and
    "yes" as true, and answered."""
    err = error(post(server, path, body))
    assert err["param"] == param, err


def test_integers_still_pass_as_floats(server: LiveServer) -> None:
    """The strict schema keeps JSON's one implicit widening: an integer temperature or top_p."""
    r = post(server, COMPLETIONS, {"prompt": "hi", "max_tokens": 8, "temperature": 0,
                                   "top_p": 1, "stream": False, "n": 1})
    assert r.status_code == 200, r.text


# --- param names the field the client wrote ------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, {"prompt": None}, "prompt"),  # was "prompt.str"
    (COMPLETIONS, {"prompt": ["a", 5]}, "prompt"),
    (COMPLETIONS, {"prompt": [5, [6]]}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "stop": [None]}, "stop"),  # was "stop.str"
    (COMPLETIONS, {"prompt": "hi", "stop": 5}, "stop"),
    (CHAT, {"messages": [{}]}, "messages[0].role"),  # was "messages.0.role"
    (CHAT, {"messages": [*USER, {"role": "user", "content": None}]}, "messages[1].content"),
    (CHAT, {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
     "messages[0].tool_calls"),
    (TRACE, {"prompt": "hi", "decoders": ["fast", None]}, "decoders[1]"),  # was "decoders.1"
])
def test_param_names_the_field(server: LiveServer, path: str, body: dict, param: str) -> None:
    """Fields inside lists read as the server's own errors write them (`prompt[1]`,
    `messages[0].content`), and a union that refuses a value is named, not its member type."""
    err = error(post(server, path, body))
    assert err["param"] == param, err
    assert err["message"].startswith(f"{param}: "), err
    if param in ("prompt", "stop"):
        assert "expected a string" in err["message"], err


# --- a bad prompt in a list refuses the request before any prompt is submitted ---------------------
@pytest.mark.parametrize("body,param,words", [
    ({"prompt": [[5, 6], [99999]], "max_tokens": 8}, "prompt[1]", "vocabulary (0..2047); got 99999"),
    ({"prompt": [[5, 6], [-1]], "max_tokens": 8}, "prompt[1]", "vocabulary (0..2047); got -1"),
    ({"prompt": [[5, 6], [5, 6], []], "max_tokens": 8}, "prompt[2]", "empty prompt"),
    ({"prompt": [[5, 6], [5, 2]], "max_tokens": 8}, "prompt[1]", "mask token (id 2) at position 1"),
    ({"prompt": ["hi", "what is <|mask|>?"], "max_tokens": 8}, "prompt[1]", "mask token"),
    ({"prompt": [[5, 6], [5] * 2030], "max_tokens": 32}, "max_tokens", "max_sequence_length"),
    ({"prompt": [[5, 6], [5] * 2030], "decoder": "threshold,gen_length=32"}, "prompt[1]",
     "max_sequence_length"),
], ids=["out-of-vocab", "negative", "empty", "mask-id", "mask-text", "too-long",
        "too-long-spec"])
def test_bad_prompt_in_a_list_submits_nothing(server: LiveServer, monkeypatch, body: dict,
                                              param: str, words: str) -> None:
    """The engine refused the bad prompt only once the ones before it were decoding: they were
    aborted, counted as `abort` in /metrics, and the 400 named no param."""
    added: list[int] = []
    real = Engine.add_request

    def add(self, *a, **kw):
        added.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(Engine, "add_request", add)
    before = outcomes(server)
    err = error(post(server, COMPLETIONS, body))
    assert err["param"] == param and words in err["message"], err
    assert added == [] and outcomes(server) == before
    assert not server.engine.has_unfinished


# --- values a client may write that would be silently ignored, or blamed on another field ---------
@pytest.mark.parametrize("path,raw,param", [
    (COMPLETIONS, b'{"prompt": "hi", "temperature": Infinity}', "temperature"),  # was "decoder"
    (COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (COMPLETIONS, b'{"prompt": "hi", "top_p": NaN}', "top_p"),
    (COMPLETIONS, b'{"prompt": "hi", "presence_penalty": NaN}', "presence_penalty"),
    (COMPLETIONS, b'{"prompt": "hi", "logprobs": 0}', "logprobs"),  # 0 still asks for one
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": 0}', "logprobs"),
], ids=["temperature-inf", "temperature-nan", "top_p-nan", "penalty-nan", "logprobs-0",
        "chat-logprobs-0"])
def test_a_value_is_refused_by_its_own_field(server: LiveServer, path: str, raw: bytes,
                                             param: str) -> None:
    r = httpx.post(f"{server.url}{path}", content=raw, timeout=60,
                   headers={"content-type": "application/json"})
    assert error(r)["param"] == param


@pytest.mark.parametrize("body,words", [
    ({"prompt": "hi", "top_p": 0.5}, "temperature 0 does not sample"),  # greedy would ignore it
    ({"prompt": "hi", "top_p": 0, "temperature": 1}, "greater than 0"),
    ({"prompt": "hi", "top_p": 1.5, "temperature": 1}, "less than or equal to 1"),
], ids=["greedy", "zero", "above-one"])
def test_top_p_that_cannot_sample_is_named(server: LiveServer, body: dict, words: str) -> None:
    err = error(post(server, COMPLETIONS, {**body, "max_tokens": 8}))
    assert err["param"] == "top_p" and words in err["message"], err


def test_trace_has_lanes_not_choices(server: LiveServer) -> None:
    err = error(post(server, TRACE, {"prompt": "hi", "max_tokens": 8, "n": 2}))
    assert err["param"] == "n" and "decoders" in err["message"], err


def test_logprobs_off_values_pass(server: LiveServer) -> None:
    for path, body in ((COMPLETIONS, {"prompt": "hi", "logprobs": None}),
                       (CHAT, {"messages": USER, "logprobs": False})):
        r = post(server, path, {**body, "max_tokens": 8})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw,content_type,words", [
    (b'{"prompt": "hi"}', "application/x-www-form-urlencoded", "content-type: application/json"),
    (b'{"prompt": "hi"}', None, "content-type: application/json"),
    (b"", "application/json", "request body is empty"),
    (b"[1]", "application/json", "a JSON object, not an array"),
    (b"null", "application/json", "a JSON object, not null"),
    (b'"hi"', "application/json", "a JSON object, not a string"),
    # was FastAPI's "There was an error parsing the body"
    (b'{"prompt": "\xff hi"}', "application/json",
     "request body is not valid UTF-8 (byte 0xff at offset 12): send JSON encoded in UTF-8"),
], ids=["curl-d-form", "no-content-type", "empty", "array", "null", "string", "not-utf-8"])
def test_a_body_that_is_no_json_object_says_so(server: LiveServer, raw: bytes,
                                               content_type: str | None, words: str) -> None:
    """pydantic's words were "Field required" and "Input should be a valid dictionary"."""
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(f"{server.url}{COMPLETIONS}", content=raw, headers=headers, timeout=60)
    err = error(r)
    assert words in err["message"] and err["param"] is None, err


def test_unknown_field_is_named_whatever_its_characters(server: LiveServer) -> None:
    """Union member tags are cut from a param; an unknown field's name is kept as written."""
    err = error(post(server, COMPLETIONS, {"prompt": "hi", "x-trace[id]": 1}))
    assert err["param"] == "x-trace[id]" and "unknown field" in err["message"], err
