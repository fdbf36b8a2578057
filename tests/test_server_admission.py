"""The admission window (unmask.server.admission): an idle engine waits, up to its window, for
the requests already inside the server, so that a burst is admitted in one step, unless those it
has taken hold more prompt tokens than its bound that the prefix store does not; a lone request
and a running batch never wait; and the count of requests on their way to the engine is
released on every path, or every later idle step would wait its whole window."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from helpers import LiveServer, tiny_model

from unmask import LLM
from unmask.decoding.params import DecodeParams
from unmask.engine import Engine, SchedulerConfig
from unmask.engine.prefix_store import PrefixStore
from unmask.errors import InputError
from unmask.server.app import build_app
from unmask.server.engine_client import EngineClient, Handle, Submission
from unmask.server.metrics import ServerMetrics
from unmask.server.state import ServerConfig

LONG = 60.0  # a window no test may wait out: a test that waited it would time out instead


@functools.cache
def model():
    return tiny_model("llada")  # vocabulary 300, mask 2, eos 1


def item(prompt: list[int], gen: int = 16) -> Submission:
    return Submission(prompt, DecodeParams.parse("static-1", gen_length=gen, block_length=8),
                      "prompt")


def door_with(window: float) -> EngineClient:
    client = EngineClient(Engine(model(), SchedulerConfig()), ServerMetrics(), window=window)
    client.start()
    return client


@pytest.fixture
def door() -> Iterator[EngineClient]:
    client = door_with(LONG)
    yield client
    client.stop()


async def first_event(h: Handle, timeout: float = 20.0):
    return await asyncio.wait_for(h.events.get(), timeout)


def test_a_burst_is_admitted_in_one_step(door: EngineClient) -> None:
    """Two requests inside the server: the first to reach the engine thread waits for the
    second, and both begin in the same step."""

    async def run() -> None:
        first, second = door.arrivals.ticket(), door.arrivals.ticket()
        a = (await door.submit([item([5, 6, 7])], "choices", arrival=first))[0]
        await asyncio.sleep(0.3)  # the second is still "tokenizing"
        assert door.engine.model_calls == 0 and a.events.empty()
        b = (await door.submit([item([8, 9])], "choices", arrival=second))[0]
        await first_event(a)
        await first_event(b)
        assert a.request.started == b.request.started  # one step admitted both
        assert door.arrivals.pending == 0

    asyncio.run(run())


def test_without_a_window_the_burst_is_split() -> None:
    """The same burst with the window off: the first request steps alone."""
    client = door_with(0.0)
    try:
        async def run() -> None:
            first, second = client.arrivals.ticket(), client.arrivals.ticket()
            a = (await client.submit([item([5, 6, 7])], "choices", arrival=first))[0]
            await first_event(a)
            b = (await client.submit([item([8, 9])], "choices", arrival=second))[0]
            await first_event(b)
            assert a.request.started < b.request.started

        asyncio.run(run())
    finally:
        client.stop()


def test_a_lone_request_does_not_wait(door: EngineClient) -> None:
    """Nothing else on its way: the request steps at once, with or without its own ticket,
    and with n choices (the ticket goes with the last)."""

    async def run() -> None:
        t0 = time.monotonic()
        for tickets in (0, 1):
            arrival = door.arrivals.ticket() if tickets else None
            hs = await door.submit([item([5, 6, 7]), item([5, 6, 7])], "choices",
                                   arrival=arrival)
            for h in hs:
                while not (await first_event(h)).finished:
                    pass
        assert time.monotonic() - t0 < LONG / 4 and door.arrivals.pending == 0

    asyncio.run(run())


def test_a_running_batch_does_not_wait(door: EngineClient) -> None:
    """A request decoding while another is still inside the server keeps stepping."""

    async def run() -> None:
        h = (await door.submit([item([5, 6, 7], gen=32)], "choices"))[0]
        assert not (await first_event(h)).finished  # its first step: it is running
        held = door.arrivals.ticket()  # a request that arrives and is still on its way
        try:
            while not (await first_event(h)).finished:
                pass
        finally:
            held.release()

    asyncio.run(run())


# --- the bound: prompt tokens the prefix store does not hold -----------------------------------
BOUND = 8  # a lone 18-token prompt passes it; two whose first 16 tokens are stored do not
STORED = list(range(10, 27))  # 17 tokens: its first four blocks of 4 end up in the store


@functools.cache
def sdar():
    return tiny_model("sdar")  # blocks of 4


def sdar_door(store: PrefixStore | None) -> EngineClient:
    engine = Engine(sdar(), SchedulerConfig(), prefix=store)
    client = EngineClient(engine, ServerMetrics(), window=LONG, bound=BOUND)
    client.start()
    return client


def sdar_item(prompt: list[int]) -> Submission:
    return Submission(prompt, DecodeParams.parse("static-1", gen_length=8, block_length=4),
                      "prompt")


async def finish(h: Handle) -> None:
    while not (await first_event(h)).finished:
        pass


async def burst_of_two(door: EngineClient, prompts: list[list[int]]) -> tuple[Handle, Handle]:
    """Two requests inside the server; the second reaches the engine once the first has had
    time to step alone, or has been waited for."""
    first, second = door.arrivals.ticket(), door.arrivals.ticket()
    a = (await door.submit([sdar_item(prompts[0])], "choices", arrival=first))[0]
    await asyncio.sleep(0.3)
    b = (await door.submit([sdar_item(prompts[1])], "choices", arrival=second))[0]
    await finish(a)
    await finish(b)
    return a, b


def test_a_long_unstored_prompt_is_not_waited_for() -> None:
    """Past the bound with its first request (no store: every prompt token is prefilled), the
    engine steps at once instead of waiting its window for the request still on its way."""
    door = sdar_door(None)
    try:
        a, b = asyncio.run(burst_of_two(door, [STORED + [30], STORED + [31]]))
        assert a.request.started < b.request.started and door.arrivals.pending == 0
    finally:
        door.stop()


def test_a_burst_after_a_stored_prefix_is_still_admitted_in_one_step() -> None:
    """The same two prompts once the store holds their first 16 tokens: what is left to
    prefill (2 tokens each) is within the bound, so the engine waits and admits both at once."""
    store = PrefixStore(4, 1 << 30)
    door = sdar_door(store)
    try:
        async def run() -> tuple[Handle, Handle]:
            await finish((await door.submit([sdar_item(STORED)], "choices"))[0])
            assert store.held(STORED + [30]) == 16
            return await burst_of_two(door, [STORED + [30], STORED + [31]])

        a, b = asyncio.run(run())
        assert a.request.started == b.request.started
        assert a.request.cached_tokens == b.request.cached_tokens == 16
    finally:
        door.stop()


def test_a_ticket_is_released_once() -> None:
    door = EngineClient(Engine(model(), SchedulerConfig()), ServerMetrics())
    t = door.arrivals.ticket()
    door.arrivals.ticket()
    t.release()
    t.release()
    assert door.arrivals.pending == 1


# --- the count over HTTP: released on every path ---------------------------------------------
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


def settle(server: LiveServer, seconds: float = 10.0) -> int:
    """The count once the server has finished with what it was sent (0 unless it is stuck)."""
    arrivals = server.app.state.unmask.engine.arrivals
    deadline = time.monotonic() + seconds
    while arrivals.pending and time.monotonic() < deadline:
        time.sleep(0.02)
    return arrivals.pending


def test_the_count_is_released_on_every_path(llm: LLM) -> None:
    config = ServerConfig(decoder="static-1", max_running=1, max_queue=0,
                          admission_window_ms=1000, api_key="k3y")
    auth = {"Authorization": "Bearer k3y"}
    url = "/v1/completions"
    ok = {"prompt": "Hello", "max_tokens": 8}
    with LiveServer(build_app(llm, config)) as s, httpx.Client(base_url=s.url, timeout=60,
                                                               headers=auth) as c:
        paths = {
            "done": lambda: c.post(url, json=ok),
            "streamed": lambda: c.post(url, json={**ok, "stream": True}),
            "chat": lambda: c.post("/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": "Hi"}],
                                         "max_tokens": 8}),
            "trace": lambda: c.post("/v1/unmask/trace", json={"prompt": "Hi", "max_tokens": 8}),
            "400 field": lambda: c.post(url, json={**ok, "temperature": -1}),
            "400 spec": lambda: c.post(url, json={**ok, "decoder": "nope"}),
            "400 engine": lambda: c.post(url, json={"prompt": [[299999]], "max_tokens": 8}),
            "404 model": lambda: c.post(url, json={**ok, "model": "other"}),
            "400 body": lambda: c.post(url, content=b"{not json",
                                       headers={"content-type": "application/json"}),
            "401": lambda: httpx.post(s.url + url, json=ok, timeout=60),
            "413": lambda: c.post(url, content=b"x" * (config.max_body_bytes + 1)),
        }
        for name, send in paths.items():
            r = send()
            want = int(name.split()[0]) if name[0].isdigit() else 200
            assert r.status_code == want, (name, r.text)
            assert settle(s) == 0, name
        # a client that leaves while its request runs, and one refused by the full engine (429)
        body = {"prompt": "Hello", "max_tokens": 256}
        with pytest.raises(httpx.ReadTimeout):
            c.post(url, json=body, timeout=0.3)
        assert settle(s) == 0, "left"
        hold = threading.Thread(target=c.post, args=(url,), kwargs={"json": body})
        hold.start()
        deadline = time.monotonic() + 10
        while not s.engine.has_unfinished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert c.post(url, json=ok).status_code == 429
        hold.join()
        assert settle(s) == 0, "429"
        # a server shutting down refuses (503) without leaving the count raised
        s.app.state.unmask.draining = True
        assert c.post(url, json=ok).status_code == 503
        assert settle(s) == 0, "503"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "max_tokens": 64, "stream": True}),
    ("/v1/unmask/trace", {"prompt": "Hello", "max_tokens": 64}),
])
def test_a_running_request_is_no_longer_counted(llm: LLM, path: str, body: dict) -> None:
    """Its ticket goes to the engine with it, not at the end of its stream: a stream that held
    it would make every idle step wait its window while the stream lasts."""
    config = ServerConfig(decoder="static-1", admission_window_ms=1000)
    with LiveServer(build_app(llm, config)) as s, httpx.stream(
            "POST", s.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        next(r.iter_lines())  # the chat's role chunk, or the trace's layout: before any step
        assert s.app.state.unmask.engine.arrivals.pending == 0
        assert s.app.state.unmask.engine.arrivals.pending == 0


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "1001"])
def test_serve_refuses_a_bad_window_in_one_line(value: str, capsys, monkeypatch) -> None:
    from unmask import api
    from unmask.cli import main

    monkeypatch.setattr(api.LLM, "__init__", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", "--port", "0", "--admission-window-ms", value]) == 2
    err = capsys.readouterr().err
    assert "--admission-window-ms must be a number of milliseconds in 0..1000" in err
    assert len(err.strip().splitlines()) == 1, err


def test_the_window_setting_is_validated() -> None:
    with pytest.raises(InputError, match="--admission-window-ms"):
        ServerConfig(admission_window_ms=True)
    assert ServerConfig(admission_window_ms=0).admission_window_ms == 0
