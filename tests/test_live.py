"""The live view of `unmask serve`: its event stream, and the page in a real browser.

The browser test drives Debian's chromium (scripts/setup-browser.sh installs it; `.ci/run` runs
that first) through Playwright against a server started here on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import LiveServer

from unmask.api import LLM
from unmask.server.app import ServerConfig, build_app

CHROMIUM = "/usr/bin/chromium"
PROMPT = "What is 47 + 38?"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with LiveServer(build_app(LLM(), ServerConfig(decoder="threshold", max_running=4))) as s:
        yield s.url


def chat(base_url: str, prompt: str, decoder: str, max_tokens: int, seed: int = 0) -> dict:
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": prompt}], "decoder": decoder,
        "max_tokens": max_tokens, "seed": seed})
    assert r.status_code == 200, r.text
    return r.json()


def trace_events(base_url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base_url}/v1/unmask/trace", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]


def trace_error(base_url: str, body: dict) -> str:
    r = httpx.post(f"{base_url}/v1/unmask/trace", json=body, timeout=60)
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


# --- the stream --------------------------------------------------------------------------------
def test_stream_side_by_side_matches_the_api(base_url: str) -> None:
    events = trace_events(base_url, {"prompt": PROMPT, "decoders": ["static-1", "fast"],
                                     "max_tokens": 32, "seed": 0})
    assert [e["event"] for e in events[:2]] == ["layout", "layout"]
    assert {e["lane"] for e in events} == {0, 1}
    for lane, spec in enumerate(["static-1", "fast"]):
        mine = [e for e in events if e["lane"] == lane]
        steps = [e for e in mine if e["event"] == "step"]
        done = mine[-1]
        assert done["event"] == "done" and done["steps"] == len(steps)
        assert mine[0]["gen_length"] == 32 and mine[0]["decoder"] == spec
        api = chat(base_url, PROMPT, spec, 32)
        assert done["text"] == api["choices"][0]["message"]["content"]
        assert done["nfe"] == api["unmask"]["nfe"]
        assert done["token_forwards"] == api["unmask"]["token_forwards"]
        elapsed = [s["elapsed"] for s in steps]
        assert elapsed == sorted(elapsed)
    fast = [e for e in events if e["lane"] == 1 and e["event"] == "step"]
    assert any(e["suffix_kept"] is not None for e in fast)  # structured suffix: traced
    assert any(e["refreshed"] for e in fast)


def test_stream_carries_the_response_format(base_url: str) -> None:
    """A trace with a regular expression: every lane is held to it, and each lane's layout
    names the slots it constrains and those its scaffold fixes (the first step commits them)."""
    events = trace_events(base_url, {"prompt": PROMPT, "decoders": ["threshold", "static-1"],
                                     "max_tokens": 32, "regex": "ok: [0-9]+"})
    for lane in (0, 1):
        mine = [e for e in events if e["lane"] == lane]
        layout, first, done = mine[0], mine[1], mine[-1]
        assert layout["constrained"] == 32 and layout["scaffold"] == [0, 1, 2]  # "ok", ":", " "
        assert set(layout["scaffold"]) <= set(first["positions"])
        assert re.fullmatch("ok: [0-9]+", done["text"]), done["text"]
    plain = trace_events(base_url, {"prompt": PROMPT, "decoders": ["static-1"], "max_tokens": 8})
    assert plain[0]["constrained"] == 0 and plain[0]["scaffold"] == []


@pytest.mark.parametrize(("body", "needle"), [
    ({"prompt": PROMPT, "decoders": ["static-1"], "regex": "a(b"},
     "regex: invalid regular expression"),
    ({"prompt": PROMPT, "decoders": ["static-1", "static,steps=7x"]}, "decoder 2 ('static,steps=7x')"),
    ({"prompt": PROMPT, "decoders": ["nope"]}, "unknown decoder 'nope'"),
    ({"prompt": "   ", "decoders": ["static-1"]}, "empty prompt"),
    ({"prompt": PROMPT, "decoders": ["static-1"], "max_tokens": 100_000}, "max_sequence_length"),
    ({"prompt": PROMPT, "decoders": []}, "decoders"),
    ({"prompt": PROMPT, "decoders": [""]}, "empty decoder spec"),
    ({"prompt": PROMPT, "decoder": ""}, "empty decoder spec"),
    ({"prompt": PROMPT, "stream": False}, "always streams"),  # was accepted, and streamed
    ({"prompt": PROMPT, "stop": ["x"]}, "stop"),
])
def test_bad_input_is_a_400(base_url: str, body: dict, needle: str) -> None:
    assert needle in trace_error(base_url, body)
    assert httpx.get(f"{base_url}/health").json()["running"] == 0


def test_the_servers_spec_takes_max_tokens_as_on_the_other_routes() -> None:
    """With `serve --decoder fast,gen_length=64`, a trace without a decoder and with max_tokens
    128 was refused ("gen_length is set twice"): the server's spec was passed as the request's."""
    config = ServerConfig(decoder="threshold,gen_length=64", max_running=4)
    with LiveServer(build_app(LLM(), config)) as s:
        events = trace_events(s.url, {"prompt": PROMPT, "max_tokens": 128})
        assert events[0]["gen_length"] == 128 and events[-1]["event"] == "done", events[-1]
        assert chat(s.url, PROMPT, None, 128)["unmask"]["decoder"].startswith("threshold")


def test_page_and_assets_are_served_locally(base_url: str) -> None:
    page = httpx.get(base_url + "/").text
    assert "/static/canvas.js" in page and "/static/live.css" in page
    assert "http://" not in page and "https://" not in page
    for name in ("canvas.js", "live.js", "live.css"):
        r = httpx.get(f"{base_url}/static/{name}")
        assert r.status_code == 200 and "https://" not in r.text
    info = httpx.get(f"{base_url}/v1/unmask/decoders").json()
    assert {"exact", "fast"} <= set(info["presets"]) and "static-1" in info["methods"]


# --- the page in a browser ---------------------------------------------------------------------
def _browser_or_skip():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing and scripts/setup-browser.sh could not install it "
                    "(no apt-get or no root)")
    from playwright.sync_api import sync_playwright

    return sync_playwright()


def _open_page(p, base_url: str) -> tuple:
    """The browser, the live page once its decoder pickers are filled, and its JS errors."""
    browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                args=["--no-sandbox", "--disable-dev-shm-usage"])
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(base_url + "/")
    page.wait_for_selector("#pick-a option[value='fast']", state="attached")
    return browser, page, errors


def _run(page, expect_done: bool = True) -> None:
    page.click("#run")
    if expect_done:
        page.wait_for_selector('#lanes[data-state="done"] .player', timeout=20_000)


def _shown_error(page) -> str:
    page.wait_for_selector("#error:not([hidden])", timeout=10_000)
    return page.text_content("#error")


def test_page_side_by_side_in_a_browser(base_url: str, tmp_path: Path) -> None:
    specs, max_tokens, seed = ["static-1", "fast"], 64, 3
    with _browser_or_skip() as p:
        browser, page, errors = _open_page(p, base_url)
        page.fill("#prompt", PROMPT)
        page.fill("#spec-a", specs[0])
        page.check("#side")
        page.fill("#spec-b", specs[1])
        page.fill("#max-tokens", str(max_tokens))
        page.fill("#seed", str(seed))
        _run(page)
        shot = Path(os.environ.get("UNMASK_SCREENSHOT_DIR", tmp_path)) / "live-side-by-side.png"
        page.screenshot(path=str(shot), full_page=True)
        lanes = page.query_selector_all(".lane")
        assert len(lanes) == 2
        for lane, spec in zip(lanes, specs, strict=True):
            assert lane.get_attribute("data-state") == "done"
            assert lane.query_selector(".lane-decoder").text_content() == spec
            api = chat(base_url, PROMPT, spec, max_tokens, seed)
            assert lane.query_selector(".lane-text").text_content() == \
                api["choices"][0]["message"]["content"]
            assert int(lane.query_selector(".c-nfe").text_content()) == api["unmask"]["nfe"]
            steps = int(lane.query_selector(".c-steps").text_content())
            if spec == "static-1":  # a step per forward, each commits from its own forward
                assert steps == api["unmask"]["nfe"]
            assert api["unmask"]["nfe"] <= steps <= api["unmask"]["nfe"] + 1
            cells = lane.query_selector_all(".cell.committed")
            assert len(cells) == max_tokens
        # bad input: the server's error text is shown, and the page keeps working
        page.fill("#spec-b", "static,steps=7x")
        _run(page, expect_done=False)
        msg = trace_error(base_url, {"prompt": PROMPT, "decoders": ["static-1", "static,steps=7x"],
                                     "max_tokens": max_tokens, "seed": seed})
        assert _shown_error(page) == msg
        page.fill("#prompt", "  ")
        page.fill("#spec-b", "fast")
        _run(page, expect_done=False)
        page.wait_for_function("document.getElementById('error').textContent.includes('empty prompt')")
        page.fill("#prompt", PROMPT)
        page.fill("#max-tokens", "100000")
        _run(page, expect_done=False)
        page.wait_for_function("document.getElementById('error').textContent"
                               ".includes('max_sequence_length')")
        page.fill("#max-tokens", "32")
        page.uncheck("#side")
        page.select_option("#pick-a", "exact")
        assert page.input_value("#spec-a") == "exact"
        _run(page)
        assert page.is_hidden("#error")
        assert len(page.query_selector_all(".lane")) == 1
        api = chat(base_url, PROMPT, "exact", 32, seed)
        assert page.text_content(".lane-text") == api["choices"][0]["message"]["content"]
        assert errors == []
        browser.close()
    assert shot.stat().st_size > 10_000


def test_page_marks_the_scaffold_and_the_constrained_slots(base_url: str, tmp_path: Path) -> None:
    """The page's format field: a regular expression holds the lane, whose constrained slots
    and scaffold cells are marked (and said in the legend); a JSON schema that is not JSON is
    refused on the page in one line."""
    with _browser_or_skip() as p:
        browser, page, errors = _open_page(p, base_url)
        page.uncheck("#side")
        page.fill("#spec-a", "threshold")
        page.fill("#max-tokens", "32")
        page.fill("#format", "ok: [0-9]+")
        _run(page)
        shot = Path(os.environ.get("UNMASK_SCREENSHOT_DIR", tmp_path)) / "live-constrained.png"
        page.screenshot(path=str(shot), full_page=True)
        assert len(page.query_selector_all(".lane .cell.scaffold")) == 3
        assert len(page.query_selector_all(".lane .cell.constrained")) == 32
        assert re.fullmatch("ok: [0-9]+", page.text_content(".lane-text"))
        assert "fixed by the format's scaffold" in page.text_content(".legend")
        assert "3 fixed by its scaffold" in page.text_content(".lane-meta")
        page.fill("#format", "{not json")
        _run(page, expect_done=False)
        assert _shown_error(page).startswith("the JSON schema is not valid JSON")
        page.fill("#format", "")
        _run(page)
        assert page.query_selector_all(".lane .cell.constrained") == []
        assert errors == []
        browser.close()


def test_html_replay_plays_in_a_browser(tmp_path: Path) -> None:
    from unmask.trace import record, write_html

    out = tmp_path / "replay.html"
    trace = record(LLM(), PROMPT, ["static-1", "exact"], gen_length=32, block_length=16)
    write_html(trace, out)
    with _browser_or_skip() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-dev-shm-usage"])
        page = browser.new_page()
        page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:")
                   else route.continue_())  # no network
        page.goto(out.as_uri())
        page.wait_for_function("document.querySelectorAll('.lane[data-state=done]').length == 2",
                               timeout=15_000)
        assert page.get_attribute("input.frame", "max") == "32"
        texts = [e.text_content() for e in page.query_selector_all(".lane-text")]
        assert texts[0] == texts[1] == trace["events"][-1]["text"]
        browser.close()


def test_client_leaving_aborts_the_decode(base_url: str) -> None:
    body = {"prompt": PROMPT, "decoders": ["static-1"], "max_tokens": 512}
    with httpx.stream("POST", f"{base_url}/v1/unmask/trace", json=body, timeout=60) as r:
        seen: list[dict] = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen.append(json.loads(line[6:]))
            if len(seen) >= 3:
                break
    assert seen[0]["event"] == "layout" and seen[-1]["event"] == "step"
    deadline = time.monotonic() + 10
    while httpx.get(f"{base_url}/health").json()["running"]:
        assert time.monotonic() < deadline, "the decode went on after the client left"
        time.sleep(0.05)


def test_the_pages_defaults_answer_its_default_prompt_whole() -> None:
    """The page's default of 64 tokens cut its own default answer (about 75 tokens) short."""
    import re

    from unmask.server.live import STATIC

    html = (STATIC / "index.html").read_text()
    max_tokens = int(re.search(r'id="max-tokens"[^>]*value="(\d+)"', html)[1])
    prompt = re.search(r'<textarea id="prompt"[^>]*>([^<]*)</textarea>', html)[1]
    specs = re.findall(r'\["pick-[ab]", "spec-[ab]", "([^"]+)"\]', (STATIC / "live.js").read_text())
    assert prompt == PROMPT and specs == ["static-1", "fast"]
    llm = LLM()
    for spec in specs:
        g = llm.generate([prompt], spec, gen_length=max_tokens)[0]
        assert g.finish_reason == "eos", (spec, g.text)
