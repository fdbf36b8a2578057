"""`unmask serve --ray`: the OpenAI-compatible server on Ray Serve, with N engine replicas.

Deployments of the Serve application "unmask":

- `engine-0` ... `engine-{N-1}`: one deployment per engine replica, one replica each. A replica
  hosts the whole single-process app, `build_app(llm, config)` (its own EngineClient and
  Engine), and answers raw HTTP requests through an in-process ASGI call (`asgi_call`), sending
  the response back as a stream: its head (status, headers), then its body chunks.
- `ingress`: the FastAPI ingress Serve's HTTP proxy sends every request to. It forwards the
  request's method, path, headers and body to the engine replica with the fewest requests in
  flight and streams the bytes back (SSE chunk by chunk). Routes, errors, streaming and stop
  strings are app.py's: nothing is handled twice. The ingress does refuse a body over the
  replicas' --max-body-bytes itself (app.py's BodyLimit), before reading it, as it would
  otherwise hold the whole body in memory and send it on.

Failover. When a replica dies before any byte of a response has left the ingress, the ingress
sends the request to another replica; outputs are batch-invariant, so the client gets the tokens
the first replica would have given. A stream that already sent text ends with an OpenAI error
event (no `[DONE]`), which the client raises. A replica that failed is skipped while Serve
restarts it, and used again once its /health says ok.

/health and /metrics are answered by the ingress from every replica: /health lists each one
(status, pid, node) and is 200 while at least one is ok; /metrics holds every replica's
samples, labelled `replica="engine-i"`, plus the ingress's own counters.

Why a deployment per replica, not one deployment with N replicas: Ray's router cannot address a
given replica, and the ingress must (to gather /metrics and /health, and to route around a
replica that died while Serve restarts it). The cost: Ray's autoscaling does not apply; the
replica count is --replicas.
"""

# No `from __future__ import annotations`: FastAPI must see the ingress's real annotations
# (Request) after serve.ingress has rewritten its methods.
import asyncio
import itertools
import json
import logging
import os
import signal
import socket
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from unmask.server.errors import BodyLimit, http_error
from unmask.server.protocol import error_body
from unmask.server.state import ServerConfig

log = logging.getLogger("unmask.server")

APP_NAME = "unmask"
# What a replica's death looks like to the caller of its handle.
REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.NodeDiedError)


@dataclass
class RayServeOptions:
    replicas: int = 1
    cpus_per_replica: float = 1.0
    gpus_per_replica: float = 0.0
    model: str | None = None  # checkpoint folder, on every node (default: the embedded model)
    device: str | None = None
    dtype: str | None = None
    quantize: str | None = None  # int8 | int4: weight-only, at each replica's load
    compile: bool = False  # each replica compiles its model's layers (unmask.compiling)
    prefix_cache: bool = True  # each replica keeps its own prefix store (docs/engine.md)
    prefix_cache_gib: float | None = None
    threads: int | None = None  # torch threads per replica (default: max(1, cpus_per_replica))
    server: ServerConfig = field(default_factory=ServerConfig)
    health_check_period_s: float = 1.0
    shutdown_timeout_s: float = 30.0  # running requests' time to finish when a replica stops

    @property
    def engine_capacity(self) -> int:
        """Requests one engine replica takes at once: running plus queued (then 429)."""
        return self.server.max_running + self.server.max_queue


# --- one HTTP request through an ASGI app, in this process ---------------------------------------
@dataclass
class HTTPRequest:
    method: str
    path: str
    query: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytes = b""


@dataclass
class HTTPHead:
    status: int
    headers: list[tuple[bytes, bytes]]

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


_background: set[asyncio.Task] = set()  # apps still finishing after their caller left


async def asgi_call(app: Any, req: HTTPRequest) -> AsyncIterator[HTTPHead | bytes]:
    """Yield the response's head, then its body chunks. Closing the generator early is the
    client leaving: the app's next `receive()` says `http.disconnect`."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": req.method, "scheme": "http", "path": req.path,
             "raw_path": req.path.encode(), "root_path": "", "query_string": req.query,
             "headers": list(req.headers), "client": ("127.0.0.1", 0),
             "server": ("127.0.0.1", 80)}
    sent: asyncio.Queue[dict | None] = asyncio.Queue()
    left = asyncio.Event()
    body = [req.body]

    async def receive() -> dict:
        if body:
            return {"type": "http.request", "body": body.pop(), "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, sent.put)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    _background.add(task)
    task.add_done_callback(_background.discard)
    started = False
    try:
        while (msg := await sent.get()) is not None:
            if msg["type"] == "http.response.start":
                started = True
                yield HTTPHead(msg["status"], [(bytes(k), bytes(v)) for k, v in msg["headers"]])
            elif msg["type"] == "http.response.body":
                if msg.get("body"):
                    yield bytes(msg["body"])
                if not msg.get("more_body", False):
                    break
    finally:
        left.set()
    if not started:  # the app failed without answering
        await task
        raise RuntimeError(f"{req.method} {req.path}: the app sent no response")


async def asgi_read(app: Any, req: HTTPRequest) -> tuple[int, bytes]:
    status, chunks = 0, []
    async for part in asgi_call(app, req):
        if isinstance(part, HTTPHead):
            status = part.status
        else:
            chunks.append(part)
    return status, b"".join(chunks)


def _is_stream(head: HTTPHead) -> bool:
    return (head.header(b"content-type") or b"").startswith(b"text/event-stream")


async def _awaitable(x: Any) -> Any:
    return await x


def merge_metrics(texts: dict[str, str]) -> CollectorRegistry:
    """One registry holding every replica's samples, each labelled with its replica's name."""
    families: dict[str, Any] = {}
    for name, text in texts.items():
        for fam in text_string_to_metric_families(text):
            if fam.name.endswith("_created"):  # a replica's start time, not a sum across them
                continue
            samples = [s._replace(labels={**s.labels, "replica": name}) for s in fam.samples]
            if fam.name in families:
                families[fam.name].samples.extend(samples)
            else:
                fam.samples = samples
                families[fam.name] = fam

    class Merged:
        def collect(self) -> list:
            return list(families.values())

    registry = CollectorRegistry()
    registry.register(Merged())
    return registry


# --- an engine replica -----------------------------------------------------------------------------
@serve.deployment(max_ongoing_requests=512)
class EngineReplica:
    """The single-process app with its own engine, behind Serve."""

    async def __init__(self, opts: RayServeOptions) -> None:
        from unmask.api import LLM, set_threads
        from unmask.server.app import build_app

        # the replica's own machine: the count is checked against the CPUs it may run on there
        set_threads(opts.threads or max(1, int(opts.cpus_per_replica)),
                    "--threads" if opts.threads else "--cpus-per-replica")
        llm = LLM(opts.model, device=opts.device, dtype=opts.dtype, quantize=opts.quantize,
                  compile=opts.compile, prefix_cache=opts.prefix_cache,
                  prefix_cache_gib=opts.prefix_cache_gib)
        self.app = build_app(llm, opts.server)
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()  # starts the engine thread

    async def http(self, req: HTTPRequest) -> AsyncIterator[HTTPHead | bytes]:
        async for part in asgi_call(self.app, req):
            yield part

    async def health(self) -> dict:
        status, body = await asgi_read(self.app, HTTPRequest("GET", "/health"))
        return {**json.loads(body), "http_status": status, "pid": os.getpid(),
                "node": ray.get_runtime_context().get_node_id()}

    async def metrics(self) -> str:
        return (await asgi_read(self.app, HTTPRequest("GET", "/metrics")))[1].decode()

    async def check_health(self) -> None:
        """Serve's periodic check: raising makes Serve replace this replica."""
        h = await self.health()
        if h["http_status"] != 200:
            raise RuntimeError(f"engine replica unhealthy: {h['status']}")

    async def __del__(self) -> None:
        await self.lifespan.__aexit__(None, None, None)  # drains, stops the engine thread


# --- the ingress -------------------------------------------------------------------------------------
class ReplicaPool:
    """The ingress's view of the engine replicas: requests in flight, and which are down."""

    def __init__(self, handles: list[DeploymentHandle]) -> None:
        self.handles = handles
        self.names = [h.deployment_name for h in handles]
        self.in_flight = [0] * len(handles)
        self.down = [False] * len(handles)
        self._turn = itertools.count()
        self._probes: dict[int, asyncio.Task] = {}

    def pick(self, tried: set[int]) -> int:
        """The up replica with the fewest requests in flight (ties in rotation), not tried yet;
        a down one if none is up (its handle waits for Serve's restart)."""
        n = len(self.handles)
        fresh = [i for i in range(n) if i not in tried] or list(range(n))
        up = [i for i in fresh if not self.down[i]]
        start = next(self._turn)
        return min(up or fresh, key=lambda i: (self.in_flight[i], (i - start) % n))

    def failed(self, i: int) -> None:
        self.down[i] = True
        if i not in self._probes:
            self._probes[i] = asyncio.create_task(self._probe(i))

    async def _probe(self, i: int) -> None:
        try:
            while True:
                await asyncio.sleep(0.5)
                try:
                    h = await asyncio.wait_for(_awaitable(self.handles[i].health.remote()), 5)
                except Exception:  # noqa: BLE001 - still restarting
                    continue
                if h.get("http_status") == 200:
                    self.down[i] = False
                    return
        finally:
            del self._probes[i]


class ReplicaBodyLimit:
    """app.py's BodyLimit (a body over the limit is a 413 before it is read), at the limit of the
    ingress replica serving the request: serve.ingress freezes the app when this module is
    imported, before build_ray_app knows the options. The replica is found the way Serve finds
    its routes' `self`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan runs before the replica context exists
            await self.app(scope, receive, send)
            return
        limit = serve.get_replica_context().servable_object.max_body_bytes
        await BodyLimit(self.app, limit)(scope, receive, send)


ingress_api = FastAPI(title="unmask on Ray Serve", version="0.1.0")
ingress_api.add_middleware(ReplicaBodyLimit)
# Wrong methods (and unknown routes) in app.py's OpenAI error body, not FastAPI's {"detail": ...}.
ingress_api.add_exception_handler(HTTPException, http_error)


@ingress_api.exception_handler(Exception)
async def _internal(request: Request, e: Exception) -> JSONResponse:
    log.exception("ingress error")
    return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error"), 500)


@serve.deployment(name="ingress", ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
@serve.ingress(ingress_api)
class Ingress:
    def __init__(self, engines: list[DeploymentHandle], max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes  # the replicas' own limit (ReplicaBodyLimit)
        self.pool = ReplicaPool(engines)
        r = self.registry = CollectorRegistry()
        self.retries = Counter("unmask_ray_retries", "Requests sent again to another replica "
                               "after theirs died before answering", registry=r)
        self.failures = Counter("unmask_ray_replica_failures", "Requests whose replica died, "
                                "by replica", ["replica"], registry=r)
        self.cut = Counter("unmask_ray_streams_cut", "Streams ended with an error event "
                           "because their replica died after sending text", registry=r)

    @ingress_api.get("/health")
    async def health(self) -> JSONResponse:
        async def one(i: int) -> dict:
            name = self.pool.names[i]
            try:
                h = await asyncio.wait_for(_awaitable(self.pool.handles[i].health.remote()), 2)
            except Exception as e:  # noqa: BLE001 - reported as that replica's state
                return {"replica": name, "status": f"unavailable ({type(e).__name__})"}
            return {"replica": name, **h}

        replicas = await asyncio.gather(*(one(i) for i in range(len(self.pool.handles))))
        ok = sum(r.get("http_status") == 200 for r in replicas)
        status = "ok" if ok == len(replicas) else "degraded" if ok else "no replica is ok"
        return JSONResponse({"status": status, "replicas": replicas}, 200 if ok else 503)

    @ingress_api.get("/metrics")
    async def metrics(self) -> Response:
        async def one(i: int) -> str:
            try:
                return await asyncio.wait_for(_awaitable(self.pool.handles[i].metrics.remote()), 2)
            except Exception:  # noqa: BLE001 - a replica that is down has no samples now
                return ""

        texts = await asyncio.gather(*(one(i) for i in range(len(self.pool.handles))))
        merged = merge_metrics(dict(zip(self.pool.names, texts, strict=True)))
        body = generate_latest(merged) + generate_latest(self.registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @ingress_api.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(self, request: Request, path: str) -> Response:
        req = HTTPRequest(request.method, f"/{path}", request.url.query.encode(),
                          list(request.headers.raw), await request.body())
        pool, tried = self.pool, set()
        for attempt in itertools.count(1):
            i = pool.pick(tried)
            tried.add(i)
            pool.in_flight[i] += 1
            gen = pool.handles[i].options(stream=True).http.remote(req)
            try:
                head, first = await self._start(gen)
                break
            except REPLICA_GONE as e:
                pool.in_flight[i] -= 1
                self._replica_died(i, e)
                if attempt >= max(2, len(pool.handles)):
                    return JSONResponse(error_body("every engine replica failed this request",
                                                   "server_error"), 503)
                self.retries.inc()
            except BaseException:
                pool.in_flight[i] -= 1
                gen.cancel()
                raise
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers
                   if k.lower() != b"content-length"}
        if not _is_stream(head):  # the whole body is in `first`
            pool.in_flight[i] -= 1
            return Response(b"".join(first), head.status, headers)
        return StreamingResponse(self._relay(i, gen, first), head.status, headers)

    async def _start(self, gen: Any) -> tuple[HTTPHead, list[bytes]]:
        """The head and what may still be retried: a whole plain body, or a stream's first chunk
        (nothing has reached the client until then)."""
        head = await gen.__anext__()
        if not _is_stream(head):
            return head, [chunk async for chunk in gen]
        try:
            return head, [await gen.__anext__()]
        except StopAsyncIteration:
            return head, []

    async def _relay(self, i: int, gen: Any, first: list[bytes]) -> AsyncIterator[bytes]:
        try:
            for chunk in first:
                yield chunk
            try:
                async for chunk in gen:
                    yield chunk
            except REPLICA_GONE as e:
                self._replica_died(i, e)
                self.cut.inc()
                err = error_body(f"the engine replica serving this stream failed "
                                 f"({type(e).__name__}); the text above is incomplete",
                                 "server_error")
                yield f"data: {json.dumps(err)}\n\n".encode()
        finally:
            self.pool.in_flight[i] -= 1
            gen.cancel()  # the client left: the replica's app sees a disconnect and aborts

    def _replica_died(self, i: int, e: BaseException) -> None:
        name = self.pool.names[i]
        log.warning("engine replica %s failed a request: %s", name, type(e).__name__)
        self.failures.labels(name).inc()
        self.pool.failed(i)


# --- deploying --------------------------------------------------------------------------------------
def build_ray_app(opts: RayServeOptions) -> serve.Application:
    actor = {"num_cpus": opts.cpus_per_replica, "num_gpus": opts.gpus_per_replica}
    engines = [EngineReplica.options(
        name=f"engine-{i}", num_replicas=1, ray_actor_options=actor,
        max_ongoing_requests=opts.engine_capacity + 8,  # + /health, /metrics calls
        health_check_period_s=opts.health_check_period_s,
        graceful_shutdown_timeout_s=opts.shutdown_timeout_s).bind(opts)
        for i in range(opts.replicas)]
    return Ingress.options(graceful_shutdown_timeout_s=opts.shutdown_timeout_s,
                           max_ongoing_requests=opts.replicas * opts.engine_capacity + 64,
                           ).bind(engines, opts.server.max_body_bytes)


def deploy(opts: RayServeOptions, host: str = "127.0.0.1", port: int = 8000,
           name: str = APP_NAME, route_prefix: str = "/") -> str:
    """Start Serve's HTTP proxy on host:port (if Serve is not running yet) and deploy the app on
    the connected Ray cluster; returns its base URL once every replica is up."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_ray_app(opts), name=name, route_prefix=route_prefix)
    return f"http://{host}:{port}{route_prefix.rstrip('/')}"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_ray(args: Any) -> int:
    """`unmask serve --ray`: deploy, serve until SIGINT/SIGTERM, then take the app down (and the
    local cluster, when this command started it)."""
    opts = RayServeOptions(
        replicas=args.replicas, cpus_per_replica=args.cpus_per_replica,
        gpus_per_replica=args.gpus_per_replica, model=args.model, device=args.device,
        dtype=args.dtype, quantize=args.quantize, compile=args.compile, threads=args.threads,
        prefix_cache=args.prefix_cache, prefix_cache_gib=args.prefix_cache_gib,
        server=args.server_config, shutdown_timeout_s=args.shutdown_timeout)
    local = args.address is None
    init: dict[str, Any] = {"include_dashboard": False, "logging_level": args.log_level.upper()}
    if local:
        init["object_store_memory"] = 256 * 2**20  # requests and chunks are small
    ray.init(address=args.address, **init)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        port = args.port or free_port(args.host)
        url = deploy(opts, args.host, port)
        print(f"unmask: {opts.replicas} engine replica(s) on Ray Serve at {url} "
              f"(Ctrl-C to stop)", flush=True)
        stop.wait()
    finally:
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
    return 0
