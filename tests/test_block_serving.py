"""A block-diffusion model (a tiny random SDAR folder) served by `unmask serve`: the real openai
client on loopback gets the offline tokens, streamed and not; a key that cannot apply is a 400;
the live view's trace route and `unmask trace` show its blocks filling."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers import LiveServer, tiny_model_dir

from unmask.api import LLM
from unmask.cli import main
from unmask.server.app import ServerConfig, build_app
from unmask.server.intake import request_params
from unmask.server.protocol import ChatCompletionRequest

PROMPT = "what is 12 + 34?"
MESSAGES = [{"role": "user", "content": PROMPT}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("sdar"), "sdar")


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return LLM(str(folder), device="cpu")


@pytest.fixture(scope="module")
def server(llm: LLM):
    with LiveServer(build_app(llm, ServerConfig(decoder="threshold", max_running=8))) as s:
        yield s


@pytest.mark.parametrize("spec", ["threshold", "freedave,draft_steps=3", "fast"])
def test_openai_client_streams_the_offline_tokens(server: LiveServer, llm: LLM, spec: str) -> None:
    body = ChatCompletionRequest(messages=MESSAGES, max_tokens=10, decoder=spec, seed=3)
    params = request_params(ServerConfig(), body, server.app.state.unmask.model_defaults)
    assert (params.block_length, params.cache, params.gen_length) == (4, "block", 12)
    (want,) = llm.generate([PROMPT], params)
    client = server.client()
    r = client.chat.completions.create(model="tiny-sdar", messages=MESSAGES, max_tokens=10, seed=3,
                                       extra_body={"decoder": spec})
    assert r.choices[0].message.content == want.text[: len(r.choices[0].message.content)]
    # the server stops a request at max_tokens (here inside the last block)
    assert r.usage.completion_tokens <= 10 and 0 < r.model_extra["unmask"]["nfe"] <= want.nfe
    chunks = list(client.chat.completions.create(
        model="tiny-sdar", messages=MESSAGES, max_tokens=10, seed=3, extra_body={"decoder": spec},
        stream=True))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "".join(deltas) == r.choices[0].message.content
    assert len(deltas) > 1  # committed text arrives block by block, not at the end


@pytest.mark.parametrize("decoder, needle", [
    ("threshold,cache=dual", "cache=dual cannot apply"),
    ("threshold,block_length=8", "block_length=8 cannot apply"),
    ("threshold,suffix=structured", "suffix=structured cannot apply"),
    ("threshold,sub_block_length=3", "sub_block_length (3) must divide block_length (4)"),
    ("threshold,sub_block_length=2", "sub_block_length cannot apply"),  # SDAR: no logit shift
    ("threshold,cache=sub_block", "cache=sub_block needs sub_block_length"),
])
def test_a_key_that_cannot_apply_is_a_400(server: LiveServer, decoder: str, needle: str) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": MESSAGES, "max_tokens": 8, "decoder": decoder})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"] == "decoder"
    assert not server.engine.has_unfinished


def test_live_trace_shows_blocks_filling(server: LiveServer) -> None:
    with httpx.stream("POST", f"{server.url}/v1/unmask/trace", timeout=60, json={
            "prompt": PROMPT, "decoders": ["static-1", "threshold"], "max_tokens": 12}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    steps = [e for e in events if e["event"] == "step" and e["lane"] == 0]
    blocks = [tuple(e["block"]) for e in steps]
    assert len(set(blocks)) > 1 and blocks == sorted(blocks)  # blocks fill left to right
    assert all(0 <= lo < hi <= 12 and hi - lo <= 4 for lo, hi in blocks)
    assert all(lo <= p < hi for e, (lo, hi) in zip(steps, blocks, strict=True)
               for p in e["positions"])
    assert [e["event"] for e in events if e["lane"] == 0][-1] == "done"


def test_cli_trace_runs(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "t.html"
    assert main(["trace", PROMPT, "--model", str(folder), "--decoder", "static-1", "--decoder",
                 "fast", "--gen-length", "12", "--out", str(out), "--json",
                 str(tmp_path / "t.json")]) == 0
    assert "static-1: " in capsys.readouterr().out and out.is_file()
