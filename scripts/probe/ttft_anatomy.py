"""Where a streamed request's time to first token goes through `unmask serve`: one request's
life stamped at each hand-off, for the shared-prompt workload of scripts/bench/prefix_reuse.sh
(the shared ~540-token system prompt + a math question, unmask-sdar, 32 tokens, the server's
default decoder, one torch thread) at concurrency 16, with the prefix store on and off.

Two servers of the tree on PYTHONPATH (or this one) run as separate processes, as
`unmask serve` runs them, with stamps added from outside (`stamped_serve` wraps the functions
each hand-off goes through; nothing of the server is changed). The client is bench-serve's own
(`unmask.bench.serve.run_jobs`, its TTFT: sending the request to the first streamed chunk with
text). Every clock is `time.perf_counter` (CLOCK_MONOTONIC: one clock for all processes). The
stamps, per request:

  sent       the client sends it (bench-serve's clock starts)
  recv       the server's ASGI app is called for it (HTTP read and parsed by uvicorn)
  body       the route runs (the body validated by pydantic)
  ids        the chat template and tokenizing are done (a worker thread), back on the loop
  put        the route hands the request to the engine thread (EngineClient._add)
  taken      the engine thread adds it to the engine (between steps: after the step in flight)
  admitted   the step that admits it begins (Request.started)
  stepped    the engine thread hands on the event of that step (its first forward is done)
  committed  the engine thread hands on the event of the step that commits its first leading
             token (the first text a stream can send)
  delta      the event loop has that text (completions._events yields it)
  written    the server writes the SSE chunk with it (the ASGI send)
  client     the client reads it (bench-serve's TTFT ends)

    .venv/bin/python scripts/probe/ttft_anatomy.py [--tree NAME=PATH[:SWITCH]]... \
        [--flags NAME='SERVE FLAGS']... [--rounds 4]

Each --tree serves two servers (store off and on) of the tree at PATH (default: this one; a
SWITCH sets that server's sys.setswitchinterval; --flags adds `unmask serve` flags to them);
every server gets the same questions, in rotated order. Prints a markdown table of each stage's
median milliseconds per server, for the requests of a run's first wave (sent together) and the
later ones (each sent as one finishes) apart, then how each first wave was admitted (the groups
that began in one step, and when): benchmarks/probe/ttft-anatomy.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = ROOT / "benchmarks/data/shared-system-prompt.txt"
STAGES = ("sent", "recv", "body", "ids", "put", "taken", "admitted", "stepped", "committed", "delta",
          "written", "client")
current: contextvars.ContextVar[dict] = contextvars.ContextVar("ttft_stamps")


# --------------------------------------------------------------------------- the server side


def stamped_serve(out: str, argv: list[str]) -> int:
    """`unmask serve argv` with each request's stamps written to `out` (JSON) when it stops."""
    from unmask.bench.serve import _chunk_text
    from unmask.server import app as app_mod
    from unmask.server import completions, engine_client
    from unmask.server.engine_client import EngineClient

    records: list[dict] = []
    by_id: dict[str, dict] = {}
    steps: list[tuple[float, float]] = []
    now = time.perf_counter

    build = app_mod.build_app

    def build_app(*a: Any, **k: Any) -> Any:
        inner = build(*a, **k)

        async def app(scope: dict, receive: Any, send: Any) -> None:
            if scope["type"] != "http" or scope["path"] != "/v1/chat/completions":
                await inner(scope, receive, send)
                return
            rec = {"recv": now()}
            records.append(rec)
            current.set(rec)

            async def stamped_send(message: dict) -> None:
                await send(message)
                if "written" not in rec and message["type"] == "http.response.body":
                    data = message.get("body", b"").decode()
                    if data.startswith("data: {") and _chunk_text(json.loads(data[6:])):
                        rec["written"] = now()

            await inner(scope, receive, stamped_send)

        app.state = inner.state
        return app

    app_mod.build_app = build_app

    route = completions._respond

    async def respond(state: Any, body: Any, ids: Any, request: Any, chat: bool) -> Any:
        rec = current.get()
        rec["ids"] = now()
        rec["question"] = body.messages[-1].text()
        return await route(state, body, ids, request, chat)

    completions._respond = respond

    # the route's entry is stamped by the first await it makes: encode_chat's hop
    encode = completions.run_in_threadpool

    async def run_in_threadpool(func: Any, *a: Any, **k: Any) -> Any:
        rec = current.get(None)
        if rec is not None and "body" not in rec:
            rec["body"] = now()
        return await encode(func, *a, **k)

    completions.run_in_threadpool = run_in_threadpool

    add = EngineClient._add

    async def _add(self: EngineClient, item: Any, ids: Any, *rest: Any) -> Any:
        rec = current.get()
        rec["put"] = now()
        h = await add(self, item, ids, *rest)
        rec["id"] = h.request.request_id
        return h

    EngineClient._add = _add

    apply = EngineClient._apply

    def _apply(self: EngineClient, kind: str, arg: Any) -> None:
        t = now()
        apply(self, kind, arg)
        if kind == "add":
            by_id.setdefault(arg[2], {})["taken"] = t  # arg: (ids, params, request_id, ...)

    EngineClient._apply = _apply

    dispatch = EngineClient._dispatch

    def _dispatch(self: EngineClient, events: list) -> None:
        t = now()
        for ev in events:
            h = self._handles.get(ev.request_id)
            rec = by_id.setdefault(ev.request_id, {})
            if h is not None and "admitted" not in rec and h.request.started is not None:
                rec["admitted"] = h.request.started
            if "stepped" not in rec:
                rec["stepped"] = t
            if ev.prefix > 0 and "committed" not in rec:
                rec["committed"], rec["steps"] = t, ev.step
        dispatch(self, events)

    EngineClient._dispatch = _dispatch

    step = engine_client.Engine.step

    def timed_step(self: Any) -> Any:
        t0 = now()
        try:
            return step(self)
        finally:
            steps.append((t0, now()))

    engine_client.Engine.step = timed_step

    events = completions._events

    async def _events(state: Any, c: Any, request: Any) -> Any:
        rec = by_id.setdefault(c.request.request_id, {})
        async for delta in events(state, c, request):
            if delta and "delta" not in rec:
                rec["delta"] = now()
            yield delta

    completions._events = _events

    from unmask.cli import main

    if os.environ.get("TTFT_SWITCH"):
        sys.setswitchinterval(float(os.environ["TTFT_SWITCH"]))

    try:
        return main(["serve", *argv])
    finally:
        merged = []
        for rec in records:
            rec.update(by_id.get(rec.get("id"), {}))
            merged.append(rec)
        Path(out).write_text(json.dumps({"requests": merged, "steps": steps}))


# --------------------------------------------------------------------------- the client side


def start_server(tree: str, port: int, extra: list[str], out: str) -> subprocess.Popen:
    """A stamped `unmask serve` of `tree` (run from /, so that PYTHONPATH picks the tree)."""
    argv = [sys.executable, __file__, "--serve", out, "--", "--model", "unmask-sdar",
            "--threads", "1", "--port", str(port), "--max-running", "16",
            "--log-level", "warning", *extra]
    env = dict(os.environ, PYTHONPATH=tree.split(":")[0])
    if ":" in tree:  # PATH:SECONDS, the interpreter's switch interval (sys.setswitchinterval)
        env["TTFT_SWITCH"] = tree.split(":")[1]
    return subprocess.Popen(argv, cwd="/", env=env)


def wait_healthy(port: int) -> None:
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server on port {port} did not start")


async def load(url: str, questions: list[str], system: str, conc: int) -> list[dict]:
    """Send the questions through bench-serve's client, `conc` at a time; each one's client
    stamps (sent, first text read) by question."""
    import httpx

    from unmask.bench.serve import Job, run_jobs

    jobs = [Job(i, q, None, 32, 0.0, system=system) for i, q in enumerate(questions)]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300, connect=10)) as c:
        t0 = time.perf_counter()  # run_jobs's start, the moment after (no await between)
        outs, _ = await run_jobs(c, url, jobs, "chat", conc, 300)
    return [{"question": questions[o.index], "sent": t0 + o.sent,
             "client": None if o.ttft is None else t0 + o.sent + o.ttft,
             "wave": "first" if o.index < conc else "later", "error": o.error} for o in outs]


def stage_table(runs: dict[str, list[dict]], steps: dict[str, list[list[float]]]) -> str:
    """Each stage's median milliseconds, per server and wave: the first `concurrency` requests
    of a run arrive together, the later ones one at a time as earlier ones finish."""
    head = ["server", "requests", "step p50 ms", "steps to first token p50"] + [
        f"{a} -> {b}" for a, b in pairwise(STAGES)] + ["TTFT p50"]
    lines = ["| " + " | ".join(head) + " |", "|:---|" + "---:|" * (len(head) - 1)]
    for name, recs in runs.items():
        ok = [r for r in recs if all(r.get(s) is not None for s in STAGES)]
        step_ms = statistics.median(1000 * (b - a) for a, b in steps[name])
        for wave in ("all", "first", "later"):
            rs = [r for r in ok if wave in ("all", r["wave"])]
            cells = [f"{name} ({wave})", str(len(rs)), f"{step_ms:.1f}",
                     f"{statistics.median(r['steps'] for r in rs):g}"]
            for a, b in pairwise(STAGES):
                cells.append(f"{1000 * statistics.median(r[b] - r[a] for r in rs):.1f}")
            cells.append(f"{1000 * statistics.median(r['client'] - r['sent'] for r in rs):.1f}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def first_waves(runs: dict[str, list[dict]]) -> str:
    """Per server and run, the groups its first wave was admitted in: "16 at 62" is 16 requests
    whose first step began 62 ms after they were sent; and that wave's TTFT p50."""
    lines = ["| server | " + " | ".join(f"run {i + 1}" for i in range(_most_runs(runs))) + " |",
             "|:---|" + "---|" * _most_runs(runs)]
    for name, recs in runs.items():
        cells = []
        for wave in _waves(recs):
            t0 = min(r["sent"] for r in wave)
            groups = Counter(round(1000 * (r["admitted"] - t0)) for r in wave)
            ttft = statistics.median(1000 * (r["client"] - r["sent"]) for r in wave)
            cells.append(" + ".join(f"{n} at {t}" for t, n in sorted(groups.items()))
                         + f" (TTFT p50 {ttft:.0f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _waves(recs: list[dict]) -> list[list[dict]]:
    """A server's first waves, one per run, in the order sent (those with every stamp)."""
    first = sorted((r for r in recs if r["wave"] == "first"
                    and all(r.get(s) is not None for s in STAGES)), key=lambda r: r["sent"])
    waves: list[list[dict]] = []
    for r in first:  # a wave is sent within a millisecond; runs are seconds apart
        if not waves or r["sent"] - waves[-1][0]["sent"] > 0.5:
            waves.append([])
        waves[-1].append(r)
    return waves


def _most_runs(runs: dict[str, list[dict]]) -> int:
    return max(len(_waves(recs)) for recs in runs.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--tree", action="append", metavar="NAME=PATH",
                   help="a tree to serve (repeat to put trees side by side; default: this one)")
    p.add_argument("--flags", action="append", default=[], metavar="NAME=FLAGS",
                   help="more `unmask serve` flags for tree NAME's servers, e.g. "
                        "after='--admission-window-ms 10'")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--n", type=int, default=32, help="requests per run")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--port", type=int, default=8961)
    p.add_argument("--json", help="write every request's stamps here")
    p.add_argument("rest", nargs="*")
    args = p.parse_args()
    if args.serve:
        raise SystemExit(stamped_serve(args.serve, args.rest))
    from unmask.bench.serve import load_prompts

    system = SYSTEM.read_text().strip()
    trees = dict(t.split("=", 1) for t in args.tree or [f"this={ROOT}"])
    flags = {name: shlex.split(f) for name, f in (t.split("=", 1) for t in args.flags)}
    servers = {f"{t}-{store}": (path, (["--no-prefix-cache"] if store == "off" else [])
                                + flags.get(t, []))
               for t, path in trees.items() for store in ("off", "on")}
    names = list(servers)
    port = {name: args.port + i for i, name in enumerate(names)}
    tmp = Path(tempfile.mkdtemp())
    procs = {name: start_server(path, port[name], extra,
                                str(tmp / f"{name}.json"))
             for name, (path, extra) in servers.items()}
    client: dict[str, list[dict]] = {name: [] for name in names}
    load_avg = [os.getloadavg()[0]]
    try:
        for name in names:
            wait_healthy(port[name])
        questions = load_prompts("math", args.n * (args.rounds + 1), 0)
        for name in names:  # warm-up: one run each (the store then holds the system prompt)
            asyncio.run(load(f"http://127.0.0.1:{port[name]}", questions[-args.n:], system,
                             args.concurrency))
        for rnd in range(args.rounds):  # every server the same questions, in rotated order
            shift = rnd % len(names)
            qs = questions[rnd * args.n:(rnd + 1) * args.n]
            for name in names[shift:] + names[:shift]:
                client[name] += asyncio.run(load(f"http://127.0.0.1:{port[name]}", qs, system,
                                                 args.concurrency))
            load_avg.append(os.getloadavg()[0])
    finally:
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:  # a server that does not stop is killed
                proc.kill()
    runs, steps = {}, {}
    for name in names:
        stamps = json.loads((tmp / f"{name}.json").read_text())
        steps[name] = stamps["steps"]
        by_q = {r.get("question"): r for r in stamps["requests"]}
        runs[name] = [{**by_q.get(c["question"], {}), **c} for c in client[name]
                      if c["error"] is None]
    print(f"Load average (1 min) at the start and after each round: "
          f"{', '.join(f'{x:.2f}' for x in load_avg)}\n")
    print(stage_table(runs, steps))
    print("\nHow each run's first wave was admitted (milliseconds after it was sent):\n")
    print(first_waves(runs))
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "steps": steps}))


if __name__ == "__main__":
    main()
