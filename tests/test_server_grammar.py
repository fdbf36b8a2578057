"""Structured output through `unmask serve`, driven by the real `openai` client: response_format
(json_object, json_schema, `parse` with a pydantic model) on both routes, the regular-expression
extension fields under SGLang's (`regex`) and vLLM's (`guided_regex`) names, streaming, the
length finish, and every refusal as one line with HTTP 400 naming its field.
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from helpers import LiveServer
from pydantic import BaseModel

from unmask.api import LLM
from unmask.server.app import ServerConfig, build_app

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"], "additionalProperties": False}


class Answer(BaseModel):
    answer: int


@pytest.fixture(scope="module")
def server():
    with LiveServer(build_app(LLM(), ServerConfig(decoder="threshold", max_running=16))) as s:
        yield s


def chat(client, **kw):
    return client.chat.completions.create(
        model="unmask-llada", messages=[{"role": "user", "content": "What is 47 + 38?"}],
        max_tokens=32, **kw)


def test_parse_with_a_pydantic_model(server: LiveServer) -> None:
    out = server.client().chat.completions.parse(
        model="unmask-llada", messages=[{"role": "user", "content": "What is 47 + 38?"}],
        response_format=Answer, max_tokens=64)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Answer)


@pytest.mark.parametrize("fmt", [
    {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}},
])
def test_response_format_on_both_routes(server: LiveServer, fmt: dict) -> None:
    client = server.client()
    text = chat(client, response_format=fmt, extra_body={"decoder": "balanced"}
                ).choices[0].message.content
    assert isinstance(json.loads(text), dict)
    done = client.completions.create(model="unmask-llada", prompt="What is 3 + 4?", max_tokens=32,
                                     extra_body={"response_format": fmt})
    assert isinstance(json.loads(done.choices[0].text), dict)


def test_streamed_output_is_valid(server: LiveServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    parts = chat(server.client(), response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert set(json.loads(text)) == {"answer"}


@pytest.mark.parametrize("name", ["regex", "guided_regex"])
def test_regex_extension_fields(server: LiveServer, name: str) -> None:
    pattern = r"(yes|no), [0-9]{1,3}"
    out = chat(server.client(), extra_body={name: pattern})
    assert re.fullmatch(pattern, out.choices[0].message.content)


def test_length_when_the_schema_cannot_close(server: LiveServer) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    out = server.client().chat.completions.create(
        model="unmask-llada", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        response_format=fmt)
    assert out.choices[0].finish_reason == "length"
    assert '{"answer":'.startswith(out.choices[0].message.content)


def test_length_penalty_is_an_extension_field_on_both_routes(server: LiveServer) -> None:
    """The length prior's weight reaches the constraint from either route: a heavy weight
    closes the integer where it may first close, a zero weight leaves the model's own digits."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    client = server.client()
    texts = {}
    for weight in (0.0, 100.0):
        body = {"length_penalty": weight, "decoder": "threshold,threshold=0.9"}
        texts[weight] = chat(client, response_format=fmt, extra_body=body).choices[0].message.content
        done = client.completions.create(model="unmask-llada", prompt="What is 47 + 38?",
                                         max_tokens=32, extra_body={"response_format": fmt, **body})
        assert set(json.loads(done.choices[0].text)) == {"answer"}
    assert re.fullmatch(r'\{"answer":-?[0-9]\}', texts[100.0]), texts
    assert texts[0.0] != texts[100.0]


def test_a_nan_length_penalty_is_a_400(server: LiveServer) -> None:
    """JSON's NaN literal (Python's json writes it; the openai client refuses to): one line."""
    body = ('{"model": "unmask-llada", "messages": [{"role": "user", "content": "hi"}], '
            '"response_format": {"type": "json_object"}, "length_penalty": NaN}')
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/json"}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "length_penalty", r.text
    assert "finite number" in err["message"] and "\n" not in err["message"]


@pytest.mark.parametrize(("kw", "param", "says"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "properties": {"a": {"type": 5}}}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "properties": {
            "a": {"type": "string", "format": "hostname"}}}}}},
     "response_format", "unsupported JSON schema feature: Format hostname"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "strict": False, "schema": SCHEMA}}}, "response_format", "strict: false"),
    ({"extra_body": {"regex": "a(b"}}, "regex", "invalid regular expression"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a"}}, "regex",
     "one constraint per request"),
    ({"response_format": {"type": "json_object"},
      "extra_body": {"decoder": "threshold,suppress_eos=true"}}, "response_format",
     "drop suppress_eos"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"length_penalty": -1}},
     "length_penalty", "length_penalty must be a number >= 0"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"length_penalty": "NaN"}},
     "length_penalty", "valid number"),
    ({"extra_body": {"length_penalty": 1}}, "length_penalty", "give a JSON schema"),
    # a string's maxLength makes states per character: refused before anything is built
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "object", "properties": {
            "a": {"type": "string", "maxLength": 100000}}, "required": ["a"]}}}},
     "response_format", "the response format is too large"),
    ({"extra_body": {"regex": "(ab|cd){5000}"}}, "regex", "the response format is too large"),
])
def test_bad_constraints_are_400s(server: LiveServer, kw: dict, param: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(server.client(), **kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param
    assert says in err["message"] and "\n" not in err["message"]


def test_only_a_constrained_request_takes_a_worker_thread_for_it(server: LiveServer,
                                                                 monkeypatch) -> None:
    """A request without a response format reaches the engine with no hop to a worker thread
    for a constraint (at a busy server each hop waits for the interpreter lock twice); one with
    a format compiles it there, off the event loop."""
    from unmask.server import intake

    hops: list[str] = []
    real = intake.run_in_threadpool

    async def counted(func, *args, **kwargs):
        hops.append(func.__name__)
        return await real(func, *args, **kwargs)

    monkeypatch.setattr(intake, "run_in_threadpool", counted)
    client = server.client()
    chat(client)
    assert hops == []
    chat(client, response_format={"type": "json_object"}, extra_body={"decoder": "balanced"})
    assert hops == ["request_constraint"]
