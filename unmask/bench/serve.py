"""`unmask bench-serve`: load a running `unmask serve` (or any OpenAI-compatible server) with
streamed requests and measure what its clients see.

A *cell* is one server URL, one decoder (or several mixed) and one concurrency. Each cell sends
`--n` held-out prompts, either `--concurrency` at a time (a new request as soon as one finishes)
or at Poisson arrival times (`--rate` requests/s, seeded; `--concurrency` then caps how many are
in flight). With several cells (URLs x decoders x concurrencies) and `--rounds R`, every round
runs every cell once, in an order rotated by one cell per round, so drift on a shared machine
hits all cells alike; a cell's numbers pool its rounds.

Metrics of a cell (BENCHMARKS.md § Serving; docs/design.md § Metrics for TPF and useful tokens):
- **req/s**: completed requests / wall seconds, the wall time of a run being from its first
  request sent to its last response received (summed over rounds).
- **tokens/s**: useful tokens, i.e. the sum of the responses' `usage.completion_tokens` (text up
  to the first EOS or stop string), / wall seconds: an aggregate rate, not the per-prompt median
  TPS of `unmask bench`.
- **TTFT**: time from sending the request to the first streamed chunk with text.
- **latency**: time from sending the request to the end of its stream.
Percentiles interpolate linearly between the order statistics (numpy's default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from unmask.errors import InputError, SpecError, is_bearer_token

DEFAULT_URL = "http://127.0.0.1:8000"
DEFAULT_MAX_TOKENS = 256
KEY_ENV = "OPENAI_API_KEY"  # what OpenAI's own clients read


# --------------------------------------------------------------------------- arguments


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") \
            from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"values must be positive integers, got {text!r}")
    return values


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def add_bench_serve_arguments(p: argparse.ArgumentParser) -> None:
    from unmask.bench.cli import _non_negative
    from unmask.cli_args import positive

    p.add_argument("--url", action="append", default=None, metavar="[NAME=]URL",
                   help=f"server base URL (default: {DEFAULT_URL}); repeat to compare servers "
                        "side by side (the first is the baseline of the 'x' column)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat",
                   help="/v1/chat/completions (default) or /v1/completions (raw prompt)")
    p.add_argument("--task", default="math", choices=["math", "code"],
                   help="held-out prompts to send (default: math)")
    p.add_argument("--n", type=positive, default=32, help="requests per cell (default: 32)")
    p.add_argument("--decoder", action="append", default=None, metavar="SPEC",
                   help="decoder spec sent with each request (default: the server's); repeat to "
                        "run each in turn, or with --mix all in one run")
    p.add_argument("--mix", action="store_true",
                   help="with several --decoder: mix them in one run (request i gets decoder "
                        "i mod D) instead of one cell each")
    # Unset by default, as the CLI's decoder-key flags (unmask.cli_args.DECODER_FLAGS): a typed value
    # must agree with a spec's gen_length, the default yields to it.
    p.add_argument("--max-tokens", type=_int_list, default=None, metavar="N[,N...]",
                   help=f"max_tokens of each request (default: {DEFAULT_MAX_TOKENS}, or the "
                        "gen_length a --decoder spec sets, which must agree with a typed value); "
                        "several values are mixed in one run, in equal shares (seeded order), "
                        "and reported per value")
    p.add_argument("--concurrency", type=_int_list, default=None, metavar="N[,N...]",
                   help="requests in flight at once (default: 1, or no cap with --rate); several "
                        "values: one cell each")
    p.add_argument("--rate", type=_positive_float, default=None, metavar="R",
                   help="Poisson arrivals at R requests/s (seeded by --seed) instead of a fixed "
                        "concurrency")
    p.add_argument("--rounds", type=positive, default=1,
                   help="times each cell runs, cells interleaved in rotated order (default: 1)")
    p.add_argument("--warmup", type=_non_negative, default=1,
                   help="untimed requests per server and decoder before measuring (default: 1)")
    p.add_argument("--seed", type=int, default=0,
                   help="selects prompts, the max_tokens order and arrival times (default: 0)")
    p.add_argument("--timeout", type=_positive_float, default=300.0,
                   help="seconds a request may take before it counts as an error (default: 300)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"sent as a Bearer token, for a server started with --api-key "
                        f"(default: ${KEY_ENV}, else none)")
    p.add_argument("--fresh-prompts", action="store_true",
                   help="every run (a cell's round) sends prompts of its own, the same on every "
                        "server, none sent twice to one server (a server that reuses prefixes "
                        "then reuses only what the prompts share: --system)")
    p.add_argument("--turns", type=positive, default=1,
                   help="each request a conversation of this many turns (chat endpoint): turn k "
                        "sends the questions and the server's answers so far and one more "
                        "question; every turn is measured (default: 1)")
    p.add_argument("--system", default=None, metavar="FILE",
                   help="a system prompt every request starts with (a shared prefix: the "
                        "chat endpoint sends it as the system message, completions prepend it)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="write the report (cells and every request) as JSON")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="tokens/s and latency vs concurrency (matplotlib)")


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Server:
    name: str
    url: str


@dataclass(frozen=True)
class Cell:
    server: Server
    decoders: tuple[str | None, ...]  # None: the server's default decoder
    concurrency: int | None  # None: no cap (Poisson arrivals only)
    # Per decoder: the gen_length its spec decides (its requests go without max_tokens), or None
    # (max_tokens decides). Empty: None for all.
    gen_lengths: tuple[int | None, ...] = ()

    def gen_length(self, decoder: int) -> int | None:
        return self.gen_lengths[decoder] if self.gen_lengths else None

    @property
    def label(self) -> str:
        conc = "inf" if self.concurrency is None else str(self.concurrency)
        return f"{self.server.name} | {decoders_label(self.decoders)} | c={conc}"


def decoders_label(decoders: tuple[str | None, ...]) -> str:
    return " + ".join(d or "(server default)" for d in decoders)


@dataclass(frozen=True)
class Job:
    """One request of a run: what to send, and when (offset from the run's start)."""

    index: int
    prompt: str
    decoder: str | None
    max_tokens: int  # the length the request asks for (what the report records)
    offset: float
    send_max_tokens: bool = True  # False: the decoder spec's own gen_length decides
    system: str | None = None  # the shared system prompt (--system)
    follow_ups: tuple[str, ...] = ()  # the next turns' questions (--turns)
    history: tuple[tuple[str, str], ...] = ()  # (question, answer) of the turns before


@dataclass
class Outcome:
    """What one request saw (seconds relative to the run's start; None where it never came)."""

    index: int
    decoder: str | None
    max_tokens: int
    offset: float
    sent: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, read from the server's prefix store
    token_forwards: int | None = None
    text: str = ""  # what was streamed (reuse on vs off: the same text)
    nfe: int | None = None
    tpf: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    round: int = 0
    turn: int = 0


def parse_servers(urls: list[str] | None) -> list[Server]:
    servers = []
    for i, text in enumerate(urls or [DEFAULT_URL]):
        name, sep, url = text.partition("=")
        if not sep or "://" in name:
            name, url = (f"server{i + 1}" if urls and len(urls) > 1 else "server"), text
        if not url.startswith(("http://", "https://")):
            raise InputError(f"--url {text}: not an http(s) URL; e.g. {DEFAULT_URL} or "
                             f"NAME={DEFAULT_URL}")
        servers.append(Server(name, url.rstrip("/")))
    if len({s.name for s in servers}) < len(servers):
        raise InputError("two --url share a name; give each NAME=URL its own NAME")
    return servers


def plan_cells(args: argparse.Namespace) -> list[Cell]:
    servers = parse_servers(args.url)
    decoders: list[str | None] = list(args.decoder) if args.decoder else [None]
    if args.decoder:
        from unmask.decoding.params import DecodeParams

        for spec in args.decoder:  # a bad spec fails before any request is sent
            DecodeParams.parse(spec)
    if args.mix and len(decoders) < 2:
        raise InputError("--mix needs at least two --decoder specs to mix")
    # Cells are keyed by what they send, so a repeated decoder or concurrency would pool two runs
    # into one cell and report it with twice --n requests. (In a --mix a repeat is a weight: the
    # decoder gets that many shares of the run's requests.)
    if not args.mix:
        _refuse_repeats("--decoder", args.decoder or [],
                        "each is one cell; to measure a cell again use --rounds")
    _refuse_repeats("--concurrency", args.concurrency or [],
                    "each is one cell; to measure a cell again use --rounds")
    groups = [tuple(decoders)] if args.mix else [(d,) for d in decoders]
    concs: list[int | None] = list(args.concurrency) if args.concurrency else (
        [None] if args.rate else [1])
    own = spec_gen_lengths(args.decoder or [], args.max_tokens)
    return [Cell(s, g, c, tuple(own.get(d) for d in g)) for s in servers for g in groups
            for c in concs]


def _refuse_repeats(flag: str, values: list[Any], why: str) -> None:
    seen: set[Any] = set()
    for v in values:
        if v in seen:
            raise InputError(f"{flag} {v!r} is given twice; {why}")
        seen.add(v)


def spec_gen_lengths(specs: list[str], max_tokens: list[int] | None) -> dict[str, int]:
    """The specs whose own gen_length decides their requests' length (sent without max_tokens).

    The server takes a request's own spec with its max_tokens (rounded up to block_length) as
    an explicit gen_length: a spec that sets another one is a 400 for every request. So, as the
    CLI's flags (docs/cli.md, "a flag left out is only a default"): a typed --max-tokens (max_tokens
    not None) that does not fit a spec is an error here, before anything is sent; the untyped
    default yields to a spec's gen_length."""
    from unmask.decoding.params import DecodeParams

    own: dict[str, int] = {}
    for spec in specs:
        base = DecodeParams.parse(spec)
        for m in max_tokens or [DEFAULT_MAX_TOKENS]:
            rounded = base.canvas_for(m)  # as request_params does
            try:
                DecodeParams.parse(spec, explicit={"gen_length": rounded})  # what the server does
                continue
            except SpecError as e:
                error = e
            try:  # a default loses to the spec's own key: what it gives is the spec's gen_length
                written: int | None = DecodeParams.parse(spec, gen_length=rounded).gen_length
            except SpecError:
                written = None  # the spec sets none, and cannot take this one (e.g. its steps)
            if written is not None and max_tokens is None:
                own[spec] = written
                break
            flag = f"--max-tokens {m}" + ("" if max_tokens else " (the default)")
            asks = f" (asks for gen_length {rounded} at block_length {base.block_length})" \
                if rounded != m else ""
            if written is not None:
                raise InputError(f"{flag}{asks} conflicts with gen_length={written} in --decoder "
                                 f"{spec!r}: the server would refuse every request; drop "
                                 f"--max-tokens (the spec's gen_length decides) or make them "
                                 f"agree")
            raise InputError(f"{flag}{asks} does not fit --decoder {spec!r}: {error}; type a "
                             f"--max-tokens it fits, or set gen_length in the spec")
    return own


def arrival_offsets(n: int, rate: float | None, seed: int) -> list[float]:
    """Send times (seconds from the run's start) of n requests: all at 0 without a rate, else a
    Poisson process of `rate` requests/s (exponential gaps, seeded); the first is sent at 0."""
    if rate is None:
        return [0.0] * n
    rng = random.Random(f"arrivals:{seed}")
    t, out = 0.0, []
    for i in range(n):
        out.append(t)
        if i < n - 1:
            t += rng.expovariate(rate)
    return out


def max_tokens_order(n: int, values: list[int], seed: int) -> list[int]:
    """Each value in equal shares (as near as n allows), in a seeded order."""
    order = [values[i % len(values)] for i in range(n)]
    if len(values) > 1:
        random.Random(f"max_tokens:{seed}").shuffle(order)
    return order


def make_jobs(prompts: list[str], cell: Cell, args: argparse.Namespace) -> list[Job]:
    offsets = arrival_offsets(len(prompts), args.rate, args.seed)
    turns = getattr(args, "turns", 1)
    n = len(prompts) // turns  # with --turns, prompts[k * n + i] is job i's question k
    tokens = max_tokens_order(n, max_tokens_values(args), args.seed)
    offsets = offsets[:n]
    jobs = []
    for i, p in enumerate(prompts[:n]):
        k = i % len(cell.decoders)
        own = cell.gen_length(k)
        jobs.append(Job(i, p, cell.decoders[k], tokens[i] if own is None else own, offsets[i],
                        send_max_tokens=own is None, system=getattr(args, "system_text", None),
                        follow_ups=tuple(prompts[k * n + i] for k in range(1, turns))))
    return jobs


def max_tokens_values(args: argparse.Namespace) -> list[int]:
    return args.max_tokens or [DEFAULT_MAX_TOKENS]


def read_system(path: str | None) -> str | None:
    """The --system file's text (None: no system prompt)."""
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"--system {path}: {e.strerror if isinstance(e, OSError) else e}") \
            from None
    if not text.strip():
        raise InputError(f"--system {path} is empty")
    return text.strip()


def load_prompts(task: str, n: int, seed: int) -> list[str]:
    from unmask.bench.tasks import load_task

    return [ex.prompt for ex in load_task(task, n, seed=seed).examples]


# --------------------------------------------------------------------------- one request


def request_body(job: Job, endpoint: str) -> dict[str, Any]:
    body: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}
    if job.send_max_tokens:
        body["max_tokens"] = job.max_tokens
    if endpoint == "chat":
        system = [] if job.system is None else [{"role": "system", "content": job.system}]
        history = [{"role": role, "content": text} for q, a in job.history
                   for role, text in (("user", q), ("assistant", a))]
        body["messages"] = [*system, *history, {"role": "user", "content": job.prompt}]
    else:
        body["prompt"] = (job.system or "") + job.prompt
    if job.decoder is not None:
        body["decoder"] = job.decoder
    return body


def auth_headers(args: argparse.Namespace) -> dict[str, str]:
    """The Authorization header of --api-key, else of $OPENAI_API_KEY (none when neither is
    set, or set empty); a key that cannot be a header value is refused."""
    key, where = ((args.api_key, "--api-key") if args.api_key is not None
                  else (os.environ.get(KEY_ENV), f"${KEY_ENV}"))
    if not key:
        return {}
    if not is_bearer_token(key):
        raise InputError(f"{where}: an API key is sent as an HTTP header, so it must be "
                         "printable ASCII without spaces")
    return {"Authorization": f"Bearer {key}"}


def endpoint_path(endpoint: str) -> str:
    return "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"


def _chunk_text(payload: dict[str, Any]) -> str:
    text = ""
    for choice in payload.get("choices") or []:
        delta = choice.get("delta")
        text += (delta.get("content") or "") if isinstance(delta, dict) else (choice.get("text") or "")
    return text


async def send(client: Any, url: str, job: Job, endpoint: str, start: float,
               timeout: float) -> Outcome:
    """Send one streamed request; never raises (a failure is the outcome's `error`)."""
    out = Outcome(job.index, job.decoder, job.max_tokens, job.offset)
    out.sent = time.perf_counter() - start
    try:
        await asyncio.wait_for(_stream(client, url + endpoint_path(endpoint),
                                       request_body(job, endpoint), out, start), timeout)
    except asyncio.TimeoutError:
        out.error = f"timeout after {timeout:g} s"
    except Exception as e:  # noqa: BLE001 - a client-side failure is a measured error
        out.error = f"{type(e).__name__}: {e}"
    if out.error is None and out.finish_reason is None:
        out.error = "the stream ended without a finish_reason"
    if out.error is None:
        out.latency = time.perf_counter() - start - out.sent
    return out


async def _stream(client: Any, url: str, body: dict[str, Any], out: Outcome, start: float) -> None:
    async with client.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            raw = (await resp.aread()).decode("utf-8", "replace")
            try:
                msg = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = raw[:200]
            out.error = f"HTTP {resp.status_code}: {msg}"
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            payload = json.loads(data)
            if "error" in payload:
                out.error = f"server: {payload['error'].get('message')}"
                return
            text = _chunk_text(payload)
            if out.ttft is None and text:
                out.ttft = time.perf_counter() - start - out.sent
            out.text += text
            for choice in payload.get("choices") or []:
                out.finish_reason = choice.get("finish_reason") or out.finish_reason
            if payload.get("usage"):
                out.completion_tokens = int(payload["usage"]["completion_tokens"])
                out.prompt_tokens = int(payload["usage"]["prompt_tokens"])
                details = payload["usage"].get("prompt_tokens_details") or {}
                out.cached_tokens = int(details.get("cached_tokens") or 0)
            if payload.get("unmask"):
                out.nfe, out.tpf = payload["unmask"].get("nfe"), payload["unmask"].get("tpf")
                out.token_forwards = payload["unmask"].get("token_forwards")


# --------------------------------------------------------------------------- one run


async def run_jobs(client: Any, url: str, jobs: list[Job], endpoint: str,
                   concurrency: int | None, timeout: float,
                   on_done: Any = None) -> tuple[list[Outcome], float]:
    """Send `jobs` (each at its offset, at most `concurrency` in flight); (outcomes, wall s)."""
    gate = asyncio.Semaphore(concurrency or len(jobs) or 1)
    start = time.perf_counter()

    async def one(job: Job) -> list[Outcome]:
        delay = job.offset - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        outs = []
        async with gate:  # a conversation holds its place: its turns follow one another
            for turn, question in enumerate((job.prompt, *job.follow_ups)):
                if turn:
                    job = replace(job, prompt=question, follow_ups=(),
                                  history=(*job.history, (job.prompt, outs[-1].text)))
                out = await send(client, url, job, endpoint, start, timeout)
                out.turn = turn
                outs.append(out)
                if on_done is not None:
                    on_done(out)
                if out.error:
                    break
        return outs

    convs = await asyncio.gather(*(one(j) for j in jobs))
    return [o for outs in convs for o in outs], time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between order statistics; None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(outcomes: list[Outcome], wall: float) -> dict[str, Any]:
    """A cell's metrics from its requests (all rounds) and its wall seconds (summed)."""
    ok = [o for o in outcomes if o.error is None]
    lat = [o.latency for o in ok if o.latency is not None]
    ttft = [o.ttft for o in ok if o.ttft is not None]
    tokens = sum(o.completion_tokens for o in ok)
    nfes = [o.nfe for o in ok if o.nfe is not None]
    s: dict[str, Any] = {
        "n": len(outcomes), "completed": len(ok), "errors": len(outcomes) - len(ok),
        "wall_s": wall, "req_per_s": len(ok) / wall if wall > 0 else 0.0,
        "useful_tokens": tokens, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "nfe_mean": sum(nfes) / len(nfes) if nfes else None,
        "cached_tokens": sum(o.cached_tokens for o in ok),
        # the prompt positions the server forwarded: its prompt tokens less those it reused
        "prefill_forwards": sum(o.prompt_tokens - o.cached_tokens for o in ok),
        "token_forwards": sum(o.token_forwards or 0 for o in ok),
    }
    for name, xs in (("ttft", ttft), ("latency", lat)):
        for q in (50, 95, 99):
            s[f"{name}_p{q}"] = percentile(xs, q)
    first_errors = sorted({o.error for o in outcomes if o.error})[:3]
    if first_errors:
        s["error_examples"] = first_errors
    return s


def groups(outcomes: list[Outcome], key: str) -> dict[str, dict[str, Any]]:
    """Latency and TTFT p50 of the completed requests, by `key` (max_tokens or decoder)."""
    out: dict[str, dict[str, Any]] = {}
    for value in sorted({getattr(o, key) for o in outcomes}, key=str):
        mine = [o for o in outcomes if getattr(o, key) == value and o.error is None]
        out[str(value)] = {"completed": len(mine),
                           "latency_p50": percentile([o.latency for o in mine], 50),
                           "ttft_p50": percentile([o.ttft for o in mine if o.ttft is not None], 50),
                           "useful_tokens": sum(o.completion_tokens for o in mine)}
    return out


# --------------------------------------------------------------------------- the benchmark


class Progress:
    """One line on stderr per finished cell run; a live request count when stderr is a tty."""

    def __init__(self, total_runs: int) -> None:
        self.total_runs, self.done_runs = total_runs, 0
        self.tty = sys.stderr.isatty()
        self.label, self.n, self.done = "", 0, 0

    def start(self, label: str, n: int) -> None:
        self.label, self.n, self.done = label, n, 0

    def request_done(self, out: Outcome) -> None:
        self.done += 1
        if self.tty:
            print(f"\r[{self.done_runs + 1}/{self.total_runs}] {self.label}: "
                  f"{self.done}/{self.n}", end="", file=sys.stderr, flush=True)

    def run_done(self, outs: list[Outcome], wall: float) -> None:
        self.done_runs += 1
        errors = sum(o.error is not None for o in outs)
        print(f"{chr(13) if self.tty else ''}[{self.done_runs}/{self.total_runs}] {self.label}: "
              f"{len(outs) - errors}/{len(outs)} ok in {wall:.2f} s", file=sys.stderr, flush=True)


async def check_servers(client: Any, servers: list[Server]) -> dict[str, Any]:
    """Every server answers /v1/models before the run; their model ids."""
    models = {}
    for s in servers:
        try:
            r = await client.get(s.url + "/v1/models", timeout=10.0)
            if r.status_code == 401:
                why = ("it refused the key given" if "Authorization" in client.headers
                       else "it needs an API key")
                raise InputError(f"--url {s.url}: the server answers 401 Unauthorized: {why}; "
                                 f"pass --api-key KEY or set ${KEY_ENV}")
            r.raise_for_status()
            models[s.name] = [m.get("id") for m in r.json().get("data", [])]
        except InputError:
            raise
        except Exception as e:  # noqa: BLE001 - reported as bad input: nothing was measured
            why = (str(e).strip().splitlines() or ["no message"])[0]  # httpx adds a help line
            hint = ("give the server's root URL, without /v1" if s.url.rstrip("/").endswith("/v1")
                    else "start one with `unmask serve`")
            raise InputError(f"--url {s.url}: no OpenAI-compatible server answers there "
                             f"({type(e).__name__}: {why}); {hint}") from None
    return models


async def warm_up(client: Any, cells: list[Cell], prompts: list[str],
                  args: argparse.Namespace) -> None:
    seen = set()
    for cell in cells:
        for k, d in enumerate(cell.decoders):
            if (cell.server, d) in seen:
                continue
            seen.add((cell.server, d))
            own = cell.gen_length(k)
            for i in range(args.warmup):
                # with the runs' system prompt: a server's first measured requests then meet
                # what its later ones do (a prefix store already holding the shared prompt)
                job = Job(-1, prompts[-1 - i % len(prompts)], d,
                          max(max_tokens_values(args)) if own is None else own, 0.0,
                          send_max_tokens=own is None, system=getattr(args, "system_text", None))
                out = await send(client, cell.server.url, job, args.endpoint,
                                 time.perf_counter(), args.timeout)
                if out.error:
                    raise InputError(f"warm-up request to {cell.server.url} "
                                     f"({decoders_label((d,))}) failed: {out.error}")


async def bench(args: argparse.Namespace, cells: list[Cell], prompts: list[str],
                ) -> dict[str, Any]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=10.0)
    headers = auth_headers(args)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        models = await check_servers(client, sorted({c.server for c in cells},
                                                     key=lambda s: s.name))
        await warm_up(client, cells, prompts, args)
        results: dict[Cell, tuple[list[Outcome], float]] = {c: ([], 0.0) for c in cells}
        runs = run_slices(cells, args)
        progress = Progress(len(cells) * args.rounds)
        for rnd in range(args.rounds):
            shift = rnd % len(cells)
            for cell in cells[shift:] + cells[:shift]:
                k = runs.get((cell.decoders, cell.concurrency, rnd), 0)
                per_run = args.n * args.turns
                jobs = make_jobs(prompts[k * per_run : (k + 1) * per_run], cell, args)
                progress.start(cell.label, len(jobs) * args.turns)
                outs, wall = await run_jobs(client, cell.server.url, jobs, args.endpoint,
                                            cell.concurrency, args.timeout, progress.request_done)
                progress.run_done(outs, wall)
                for o in outs:
                    o.round = rnd
                prev, w = results[cell]
                results[cell] = (prev + outs, w + wall)
    return {"models": models, "cells": [cell_report(c, *results[c]) for c in cells]}


def run_slices(cells: list[Cell], args: argparse.Namespace) -> dict[tuple, int]:
    """With --fresh-prompts, the slice of n prompts each (decoders, concurrency, round) sends,
    the same for every server; else none (every run sends the first n)."""
    if not args.fresh_prompts:
        return {}
    keys = dict.fromkeys((c.decoders, c.concurrency) for c in cells)
    return {(*key, rnd): rnd * len(keys) + i for rnd in range(args.rounds)
            for i, key in enumerate(keys)}


def n_prompts(cells: list[Cell], args: argparse.Namespace) -> int:
    """Prompts a run loads: n, or with --fresh-prompts n per run and n for the warm-up."""
    runs = run_slices(cells, args)
    return args.n * getattr(args, "turns", 1) * (len(runs) + 1 if runs else 1)


def cell_report(cell: Cell, outs: list[Outcome], wall: float) -> dict[str, Any]:
    rep: dict[str, Any] = {"server": cell.server.name, "url": cell.server.url,
                           "decoder": decoders_label(cell.decoders),
                           "concurrency": cell.concurrency, **summarize(outs, wall)}
    if len({o.max_tokens for o in outs}) > 1:
        rep["by_max_tokens"] = groups(outs, "max_tokens")
    if len(cell.decoders) > 1:
        rep["by_decoder"] = groups(outs, "decoder")
    rep["requests"] = [asdict(o) for o in outs]
    return rep


# --------------------------------------------------------------------------- reporting


def with_ratios(cells: list[dict[str, Any]]) -> None:
    """`x_baseline`: tokens/s over the first server's at the same decoder and concurrency."""
    base = {(c["decoder"], c["concurrency"]): c["tokens_per_s"] for c in cells
            if c["server"] == cells[0]["server"]}
    for c in cells:
        b = base.get((c["decoder"], c["concurrency"]))
        c["x_baseline"] = c["tokens_per_s"] / b if b else None


def _fmt(v: Any, spec: str) -> str:
    return "n/a" if v is None else spec.format(v)


def markdown_table(cells: list[dict[str, Any]]) -> str:
    cols = [("server", "server", "{}"), ("decoder", "decoder", "`{}`"),
            ("concurrency", "conc.", "{}"), ("completed", "done", "{}"), ("errors", "err", "{}"),
            ("req_per_s", "req/s", "{:.2f}"), ("tokens_per_s", "tokens/s", "{:.1f}"),
            ("x_baseline", "x", "{:.2f}x"), ("prefill_forwards", "prefill fw", "{}"),
            ("cached_tokens", "cached", "{}"),
            ("ttft_p50", "TTFT p50 s", "{:.3f}"), ("ttft_p95", "p95", "{:.3f}"),
            ("ttft_p99", "p99", "{:.3f}"), ("latency_p50", "latency p50 s", "{:.3f}"),
            ("latency_p95", "p95", "{:.3f}"), ("latency_p99", "p99", "{:.3f}")]
    rows = [[_fmt(c.get(k) if k != "concurrency" or c[k] else "inf", f) for k, _, f in cols]
            for c in cells]
    lines = ["| " + " | ".join(h for _, h, _ in cols) + " |",
             "|" + "|".join("---:" if f.startswith("{:") or k in ("concurrency", "completed",
                                                                      "errors") else ":---"
                            for k, _, f in cols) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    extra = [_groups_lines(c) for c in cells if c.get("by_max_tokens") or c.get("by_decoder")]
    return "\n".join(lines + ([""] + [e for e in extra if e] if extra else [])) + "\n"


def _groups_lines(c: dict[str, Any]) -> str:
    parts = []
    for key, what in (("by_max_tokens", "max_tokens"), ("by_decoder", "decoder")):
        for value, g in (c.get(key) or {}).items():
            parts.append(f"{what} {value}: {g['completed']} done, latency p50 "
                         f"{_fmt(g['latency_p50'], '{:.3f}')} s, TTFT p50 "
                         f"{_fmt(g['ttft_p50'], '{:.3f}')} s")
    conc = c["concurrency"] or "inf"
    return f"- {c['server']} | `{c['decoder']}` | c={conc}: " + "; ".join(parts)


def plot_cells(cells: list[dict[str, Any]], out: str) -> None:
    import matplotlib

    from unmask.bench.plot import plot_path

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120)
    try:
        series: dict[str, list[dict[str, Any]]] = {}
        for c in cells:
            if c["concurrency"] is not None:
                series.setdefault(f"{c['server']} | {c['decoder']}", []).append(c)
        for i, (label, cs) in enumerate(series.items()):
            cs = sorted(cs, key=lambda c: c["concurrency"])
            xs = [c["concurrency"] for c in cs]
            ax1.plot(xs, [c["tokens_per_s"] for c in cs], marker="o", color=f"C{i}", label=label)
            # A cell with no completed request has no latency: a 0 s point would read as the
            # fastest cell of the plot, so it is left out (NaN: a gap in the line).
            for key, marker, ls in (("latency_p50", "o", "-"), ("latency_p99", "x", "--")):
                ys = [math.nan if c[key] is None else c[key] for c in cs]
                if not all(math.isnan(y) for y in ys):
                    ax2.plot(xs, ys, marker=marker, ls=ls, color=f"C{i}",
                             label=f"{label} {key.removeprefix('latency_')}")
        for ax, ylabel in ((ax1, "useful tokens/s (completion tokens / wall s)"),
                           (ax2, "latency s")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (requests in flight)")
            ax.set_ylabel(ylabel)
            ax.grid(True, alpha=0.3)
        ax1.legend(fontsize=7)
        if ax2.lines:
            ax2.legend(fontsize=6)
        else:
            ax2.text(0.5, 0.5, "no request completed", ha="center", va="center",
                     transform=ax2.transAxes, color="grey")
        fig.tight_layout()
        fig.savefig(plot_path(out), bbox_inches="tight")
    finally:
        plt.close(fig)


def command_line(args: argparse.Namespace) -> str:
    """The canonical command that reproduces these measurements (output files left out)."""
    argv = ["unmask", "bench-serve"]
    for u in args.url or [DEFAULT_URL]:
        argv += ["--url", u]
    argv += ["--endpoint", args.endpoint, "--task", args.task, "--n", str(args.n)]
    if args.system:
        argv += ["--system", args.system]
    if args.fresh_prompts:
        argv.append("--fresh-prompts")
    if args.turns > 1:
        argv += ["--turns", str(args.turns)]
    for d in args.decoder or []:
        argv += ["--decoder", d]
    if args.mix:
        argv.append("--mix")
    if args.max_tokens:  # typed only: typed, it would have to agree with a spec's gen_length
        argv += ["--max-tokens", ",".join(map(str, args.max_tokens))]
    if args.concurrency:
        argv += ["--concurrency", ",".join(map(str, args.concurrency))]
    if args.rate:
        argv += ["--rate", f"{args.rate:g}"]
    argv += ["--rounds", str(args.rounds), "--warmup", str(args.warmup), "--seed", str(args.seed),
             "--timeout", f"{args.timeout:g}"]
    return shlex.join(argv)


def run_bench_serve(args: argparse.Namespace) -> int:
    from unmask.bench.cli import check_outputs

    try:
        import httpx  # noqa: F401
    except ImportError:
        raise InputError("bench-serve needs httpx: pip install httpx") from None
    cells = plan_cells(args)
    if args.plot and all(c.concurrency is None for c in cells):
        # The plot's x axis is the concurrency; --rate alone leaves every cell uncapped.
        raise InputError("--plot draws each cell at its --concurrency, and --rate without "
                         "--concurrency has none; add --concurrency N[,N...] or drop --plot")
    check_outputs(args, ("json", "plot"))
    if args.turns > 1 and args.endpoint != "chat":
        raise InputError("--turns needs the chat endpoint (a conversation's turns are messages); "
                         "drop --endpoint completions or --turns")
    args.system_text = read_system(args.system)
    prompts = load_prompts(args.task, n_prompts(cells, args), args.seed)
    started = time.time()
    doc = asyncio.run(bench(args, cells, prompts))
    with_ratios(doc["cells"])
    doc = {"command": command_line(args), "task": args.task,
           "endpoint": args.endpoint, "n": args.n, "rounds": args.rounds, "rate": args.rate,
           "max_tokens": max_tokens_values(args), "seed": args.seed, "started": started, **doc}
    print(markdown_table(doc["cells"]), end="")
    sys.stdout.flush()
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    if args.plot:
        plot_cells(doc["cells"], args.plot)
    check_some_completed(doc["cells"], args.json)
    return 0


def check_some_completed(cells: list[dict[str, Any]], json_path: str | None) -> None:
    """A cell none of whose requests completed measured nothing, so the run is not a success:
    an InputError (exit 2) after the report is written (it holds each request's error). Exit 2
    as a failed warm-up: what failed is the server or what it was asked, not unmask."""
    empty = [c for c in cells if c["completed"] == 0]
    if not empty:
        return
    c = empty[0]
    conc = c["concurrency"] or "inf"
    first = " ".join((c.get("error_examples") or ["no error recorded"])[0].split())[:200]
    k = len(empty) - 1
    more = f" (and {k} more cell{'s' if k > 1 else ''})" if k else ""
    where = f"--json {json_path} has" if json_path else "--json FILE records"
    raise InputError(f"no request of cell {c['server']} | {c['decoder']} | c={conc} completed "
                     f"(0 of {c['n']}; first error: {first}){more}; {where} every request's "
                     f"error")


__all__ = ["Cell", "Job", "Outcome", "arrival_offsets", "percentile", "run_bench_serve",
           "summarize"]
