"""`unmask serve --ray`: the app on Ray Serve with engine replicas.

The quick tests run the pieces without Ray: the in-process ASGI call a replica answers through,
and the merging of the replicas' metrics. The slow ones start a local Ray cluster on 127.0.0.1
(2 engine replicas) and check it against the single-process server: the same responses through
the real `openai` client, a replica killed under load (no request lost), and a clean teardown.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import tempfile
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from helpers import LiveServer

from unmask.api import LLM
from unmask.server.app import ServerConfig, build_app
from unmask.server.ray_serve import HTTPHead, HTTPRequest, asgi_call, asgi_read, free_port, merge_metrics

PROMPTS = ["What is 12 + 34?", "What is 47 + 38?", "Sort 5, 2, 9.", "What is 7 * 8?"]
# (decoder, temperature, seed, max_tokens, stop): greedy and seeded sampling, a stop string
CASES = [("threshold", None, None, 64, None), ("static,steps=16", 0.7, 3, 32, None),
         ("fast", None, None, 64, ["\n"]), ("threshold", 1.0, 11, 32, None)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


# --- without Ray ----------------------------------------------------------------------------------
def _completion_request(**body) -> HTTPRequest:
    return HTTPRequest("POST", "/v1/completions", headers=[(b"content-type", b"application/json")],
                       body=json.dumps(body).encode())


def test_asgi_call_streams_and_a_client_leaving_aborts(llm: LLM) -> None:
    app = build_app(llm, ServerConfig())
    state = app.state.unmask

    async def main() -> None:
        async with app.router.lifespan_context(app):
            parts = [p async for p in asgi_call(app, _completion_request(
                prompt=PROMPTS[0], max_tokens=32, stream=True))]
            head, body = parts[0], b"".join(parts[1:])
            assert isinstance(head, HTTPHead) and head.status == 200
            assert head.header(b"content-type").startswith(b"text/event-stream")
            assert body.endswith(b"data: [DONE]\n\n")
            # static-1 over 512 tokens runs long: leave after the head, as a client that hangs up
            gen = asgi_call(app, _completion_request(prompt=PROMPTS[1], max_tokens=512,
                                                     decoder="static-1", stream=True))
            assert (await gen.__anext__()).status == 200
            await gen.aclose()
            for _ in range(100):
                if state.engine.engine.n_running == 0 and state.engine.engine.n_waiting == 0:
                    break
                await asyncio.sleep(0.05)
            assert state.engine.engine.n_running == 0
            status = [p async for p in asgi_call(app, HTTPRequest("GET", "/nope"))][0].status
            assert status == 404

    asyncio.run(main())
    metrics = dict(_samples(_metrics_text(state)))
    assert metrics[('unmask_requests_total', (("outcome", "abort"),))] == 1.0


def _metrics_text(state) -> str:
    from prometheus_client import generate_latest

    return generate_latest(state.metrics.registry).decode()


def _samples(text: str):
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            yield (s.name, tuple(sorted(s.labels.items()))), s.value


def test_merge_metrics_labels_each_replica() -> None:
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    texts = {}
    for name, n in (("engine-0", 2), ("engine-1", 3)):
        r = CollectorRegistry()
        Counter("unmask_requests", "Finished", ["outcome"], registry=r).labels("stop").inc(n)
        texts[name] = generate_latest(r).decode()
    merged = generate_latest(merge_metrics(texts)).decode()
    assert merged.count("# TYPE unmask_requests_total counter") == 1
    got = dict(_samples(merged))
    assert got[("unmask_requests_total", (("outcome", "stop"), ("replica", "engine-0")))] == 2
    assert got[("unmask_requests_total", (("outcome", "stop"), ("replica", "engine-1")))] == 3
    assert "_created" not in merged


class _FakeEngine:
    """An engine replica's handle that answers every request 200 `{}` and keeps its body."""

    deployment_name = "engine-0"

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.http = self  # handle.options(stream=True).http.remote(req)

    def options(self, **_: Any) -> _FakeEngine:
        return self

    def remote(self, req: HTTPRequest) -> AsyncIterator[HTTPHead | bytes]:
        self.bodies.append(req.body)

        async def reply() -> AsyncIterator[HTTPHead | bytes]:
            yield HTTPHead(200, [(b"content-type", b"application/json")])
            yield b"{}"

        return reply()


@pytest.fixture
def ingress(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, _FakeEngine]:
    """The ingress's FastAPI app, on an Ingress with a fake engine handle and a 64-byte body
    limit, found the way Serve finds it on a replica: no cluster."""
    from ray import serve

    from unmask.server.ray_serve import Ingress, ingress_api

    engine = _FakeEngine()
    replica = Ingress.func_or_class.__bases__[0]([engine], 64)  # the class under Serve's wrapper
    monkeypatch.setattr(serve, "get_replica_context", lambda: SimpleNamespace(servable_object=replica))
    return ingress_api, engine


def _body_in_chunks(app: Any, chunks: list[bytes], read: list[int]) -> Any:
    """`app`, sent the request body as these chunks; `read` gets the size of each one it reads."""
    async def call(scope: dict, receive: Any, send: Any) -> None:
        todo = list(chunks)

        async def chunk() -> dict:
            if not todo:
                return await receive()
            read.append(len(todo[0]))
            return {"type": "http.request", "body": todo.pop(0), "more_body": bool(todo)}

        await app(scope, chunk, send)
    return call


@pytest.mark.parametrize("length, chunks, want, reads", [
    (65, [b"x" * 65], 413, 0),  # a Content-Length over the limit: refused before any read
    (64, [b"x" * 64], 200, 1),
    (None, [b"x" * 16] * 10, 413, 5),  # chunked: refused once it passes 64 bytes, not at the end
    (None, [b"x" * 16] * 4, 200, 4),
])
def test_ingress_refuses_a_body_over_the_limit_before_reading_it(
        ingress: tuple[Any, _FakeEngine], length: int | None, chunks: list[bytes], want: int,
        reads: int) -> None:
    app, engine = ingress
    headers = [(b"content-length", str(length).encode()) if length is not None
               else (b"transfer-encoding", b"chunked")]
    read: list[int] = []
    status, body = asyncio.run(asgi_read(_body_in_chunks(app, chunks, read),
                                         HTTPRequest("POST", "/v1/completions", headers=headers)))
    assert (status, len(read)) == (want, reads)
    if want == 413:
        error = json.loads(body)["error"]
        assert error["type"] == "invalid_request_error"
        assert "exceeds this server's limit of 64 bytes" in error["message"]
        assert engine.bodies == []
    else:
        assert engine.bodies == [b"".join(chunks)]


def test_ingress_router_errors_are_openai_errors(ingress: tuple[Any, _FakeEngine]) -> None:
    app, engine = ingress
    status, body = asyncio.run(asgi_read(app, HTTPRequest("OPTIONS", "/v1/completions")))
    assert status == 405
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("method OPTIONS is not allowed for /v1/completions; allowed: ")
    assert engine.bodies == []


@pytest.mark.parametrize("argv, needle", [
    (["--replicas", "2"], "--replicas needs --ray"),
    (["--address", "auto"], "--address needs --ray"),
    (["--ray", "--cpus-per-replica", "-1"], "--cpus-per-replica must be >= 0"),
])
def test_cli_ray_flags_are_checked_before_starting(argv: list[str], needle: str,
                                                  capsys: pytest.CaptureFixture) -> None:
    from unmask.cli import main

    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


# --- servers ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_url(llm: LLM):
    """The single-process server (uvicorn on a thread): the reference."""
    with LiveServer(build_app(llm, ServerConfig())) as s:
        yield s.url


def _descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    start: dict[int, str] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(d.name))
        start[int(d.name)] = fields[19]
    out, todo = {}, [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = start[c]
            todo.append(c)
    return out


def _alive(procs: dict[int, str]) -> list[int]:
    alive = []
    for pid, started in procs.items():
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[19] == started and fields[0] != "Z":
            alive.append(pid)
    return alive


class RayCluster:
    """A local Ray cluster started by this process, with the app deployed on 2 replicas."""

    def __init__(self) -> None:
        import ray

        from unmask.server.ray_serve import RayServeOptions, deploy

        ray.init(num_cpus=4, object_store_memory=80 * 2**20, include_dashboard=False,
                 _temp_dir=tempfile.mkdtemp(prefix="ur", dir="/tmp"), log_to_driver=False)
        opts = RayServeOptions(replicas=2, cpus_per_replica=1, threads=1, server=ServerConfig(),
                               health_check_period_s=1, shutdown_timeout_s=5)
        self.url = deploy(opts, "127.0.0.1", free_port("127.0.0.1"))
        self.procs: dict[int, str] = {}
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        import ray
        from ray import serve

        self.procs = _descendants(os.getpid())
        self.closed = True
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster():
    c = RayCluster()
    yield c
    c.close()


def _client(url: str, timeout: float = 60) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=timeout, max_retries=0)


def _complete(client: openai.OpenAI, prompt: str, case, stream: bool) -> tuple[str, str | None]:
    """(text, finish_reason) of a completion; a stream's finish_reason comes from its last
    chunk, None if that never came."""
    decoder, temperature, seed, max_tokens, stop = case
    kw = dict(model="unmask-llada", prompt=prompt, max_tokens=max_tokens, stop=stop,
              temperature=temperature, seed=seed, extra_body={"decoder": decoder})
    kw = {k: v for k, v in kw.items() if v is not None}
    if not stream:
        c = client.completions.create(**kw).choices[0]
        return c.text, c.finish_reason
    text, finish = "", None
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    return text, finish


def _chat(client: openai.OpenAI, prompt: str, stream: bool) -> tuple[str, str | None]:
    kw = dict(model="unmask-llada", max_tokens=64, seed=5, temperature=0.5,
              messages=[{"role": "user", "content": prompt}])
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        return c.message.content, c.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


# --- on Ray -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ray_replicas_answer_as_the_single_process_server(cluster: RayCluster,
                                                           plain_url: str) -> None:
    plain, ray_ = _client(plain_url), _client(cluster.url)
    for prompt in PROMPTS[:2]:
        for case in CASES:
            for stream in (False, True):
                want = _complete(plain, prompt, case, stream=False)
                assert want[1] is not None
                assert _complete(ray_, prompt, case, stream) == want, (prompt, case, stream)
        for stream in (False, True):
            assert _chat(ray_, prompt, stream) == _chat(plain, prompt, stream=False)
    # errors are app.py's, byte for byte
    for body in ({"prompt": "hi", "model": "nope"}, {"prompt": "hi", "decoder": "nope"},
                 {"prompt": "hi", "logprobs": 2}, {"prompt": ""}):
        a = httpx.post(f"{plain_url}/v1/completions", json=body, timeout=30)
        b = httpx.post(f"{cluster.url}/v1/completions", json=body, timeout=30)
        assert (b.status_code, b.json()) == (a.status_code, a.json()), body
        assert a.status_code in (400, 404)
    assert httpx.get(f"{cluster.url}/v1/models").json()["data"][0]["id"] == "unmask-llada"


def _health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=30).json()


def _replica_metric(url: str, name: str, replica: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(rf'^{name}\{{[^}}]*replica="{replica}"[^}}]*\}} (\S+)',
                                             text, re.M))


@pytest.mark.slow
def test_a_replica_killed_under_load_loses_no_request(cluster: RayCluster,
                                                        plain_url: str) -> None:
    case = ("static-1", None, None, 96, None)  # ~100 forwards: the kill lands mid-request
    plain = _client(plain_url)
    expected = {p: _complete(plain, p, case, stream=False) for p in PROMPTS}
    health = _health(cluster.url)
    assert health["status"] == "ok" and len(health["replicas"]) == 2
    victim = health["replicas"][0]
    assert victim["replica"] == "engine-0"

    jobs = [(PROMPTS[i % len(PROMPTS)], i % 2 == 1) for i in range(40)]  # odd ones stream
    outcomes: list[str] = []
    lock = threading.Lock()
    completed = threading.Semaphore(0)

    def worker() -> None:
        client = _client(cluster.url, timeout=60)
        while True:
            with lock:
                if not jobs:
                    return
                prompt, stream = jobs.pop()
            t0 = time.monotonic()
            try:
                got = _complete(client, prompt, case, stream)
                outcome = "completed" if got == expected[prompt] else "garbled"
            except openai.APITimeoutError:
                outcome = "hung"
            except Exception:  # noqa: BLE001 - an error that reached the client
                outcome = "failed"
            if time.monotonic() - t0 > 60:
                outcome = "hung"
            with lock:
                outcomes.append(outcome)
            completed.release()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in range(6):  # steady load first
        assert completed.acquire(timeout=120)
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a client thread hangs"

    counts = Counter(outcomes)
    sent, lost = 40, 40 - counts["completed"] - counts["failed"]
    failures = _replica_metric(cluster.url, "unmask_ray_replica_failures_total", "engine-0")
    retries = float(re.search(r"^unmask_ray_retries_total (\S+)",
                              httpx.get(f"{cluster.url}/metrics").text, re.M).group(1))
    print(f"\nfault: sent={sent} completed={counts['completed']} failed={counts['failed']} "
          f"lost={lost} (garbled={counts['garbled']} hung={counts['hung']}); "
          f"ingress: replica failures={failures:.0f} retried={retries:.0f}")
    assert lost == 0, counts
    assert counts["garbled"] == 0 and counts["hung"] == 0, counts
    # Whether a request was on the victim when it died depends on timing (0 ingress-seen
    # failures happens when the kill lands between its requests); that the kill took effect is
    # checked below: the replica comes back with a new pid.

    # Serve restarts it; it says ok with a new pid, and serves again
    deadline = time.monotonic() + 90
    while True:
        reps = {r["replica"]: r for r in _health(cluster.url)["replicas"]}
        if reps["engine-0"].get("status") == "ok" and reps["engine-0"]["pid"] != victim["pid"]:
            break
        assert time.monotonic() < deadline, reps
        time.sleep(0.5)
    print(f"engine-0 back after {time.monotonic() - killed:.1f} s (pid {victim['pid']} -> "
          f"{reps['engine-0']['pid']})")
    client = _client(cluster.url)
    for _ in range(20):
        assert _complete(client, PROMPTS[0], case, stream=False) == expected[PROMPTS[0]]
        if _replica_metric(cluster.url, "unmask_requests_total", "engine-0") > 0:
            break  # counters start again at 0 in the new process: it served this one
    else:
        pytest.fail("the restarted replica got no request")


@pytest.mark.slow
def test_ray_ingress_refuses_big_bodies_and_wrong_methods(cluster: RayCluster) -> None:
    """The ingress's body limit and router errors on a live replica, behind Serve's proxy."""
    limit, url = ServerConfig().max_body_bytes, f"{cluster.url}/v1/completions"
    big = b"x" * (limit + 1)
    for content in (big, iter([big[:limit], big[limit:]])):  # with a Content-Length, then chunked
        r = httpx.post(url, content=content, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 413, r.text
        assert f"limit of {limit} bytes" in r.json()["error"]["message"]
    r = httpx.request("OPTIONS", url, timeout=30)
    assert r.status_code == 405, r.text
    assert r.json()["error"]["message"].startswith("method OPTIONS is not allowed")
    assert httpx.get(f"{cluster.url}/v1/models", timeout=30).status_code == 200


@pytest.mark.slow
def test_shutdown_leaves_no_ray_process(cluster: RayCluster) -> None:
    assert _health(cluster.url)["status"] == "ok"
    cluster.close()
    assert len(cluster.procs) >= 5  # gcs, raylet, controller, proxy, replicas...
    deadline = time.monotonic() + 30
    while (alive := _alive(cluster.procs)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, [Path(f"/proc/{p}/cmdline").read_bytes()[:80] for p in alive]
