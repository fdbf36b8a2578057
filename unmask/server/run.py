"""Running the server: arguments of `unmask serve`, uvicorn, and a graceful SIGTERM.

On SIGTERM (or Ctrl-C) uvicorn stops listening and closes idle connections (a request that
still reaches the app gets 503, /health "draining"), lets running requests finish for up to
--shutdown-timeout seconds, then exits 0. The app cuts off requests still running then, each
with its error event (a 503 when not streamed) and one log line, before uvicorn's own deadline
(CUT_GRACE later) would cancel their tasks mid-write. A second Ctrl-C forces the exit: the
engine thread is stopped first, and the exit is Ctrl-C's, without tracebacks.

With --ray the same app runs as --replicas engine replicas on Ray Serve (ray_serve.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket

from unmask.decoding.params import DEFAULT_DECODER
from unmask.errors import InputError

API_KEY_ENV = "UNMASK_API_KEY"  # unmask.server.access's, named here without importing fastapi
# Seconds after --shutdown-timeout at which uvicorn cancels what is left: the app's cut-off
# requests need them to send their error events and close.
CUT_GRACE = 2.0


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from unmask.cli_args import (
        add_graph_arguments,
        add_model_arguments,
        add_prefix_arguments,
        positive,
    )
    from unmask.server.admission import ADMISSION_PREFILL_TOKENS, DEFAULT_ADMISSION_WINDOW_MS

    add_model_arguments(p)
    add_prefix_arguments(p)
    add_graph_arguments(p)
    p.add_argument("--decoder", default=DEFAULT_DECODER,
                   help=f"default decoder spec of requests that send none (default: "
                        f"{DEFAULT_DECODER})")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=port, default=8000, help="port (default: 8000; 0 = any free)")
    p.add_argument("--max-running", type=positive, default=16,
                   help="requests decoded at once, all decoders together (default: 16)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="waiting requests before 429 (default: 256)")
    p.add_argument("--max-slots", type=positive, default=None,
                   help="canvas/K-V slots held at once (padded per decoder batch; default: no "
                        "limit); a request that could never fit is a 400, others wait")
    p.add_argument("--admission-window-ms", type=float, default=DEFAULT_ADMISSION_WINDOW_MS,
                   metavar="MS",
                   help=f"how long an idle engine waits for requests already inside the server "
                        f"before its first step, so that a burst is admitted together; a lone "
                        f"request never waits, nor one whose first step holds more than "
                        f"{ADMISSION_PREFILL_TOKENS} prompt tokens the prefix store does not "
                        f"(default: {DEFAULT_ADMISSION_WINDOW_MS:g}; 0: off)")
    p.add_argument("--no-joiners-first", dest="joiners_first", action="store_false",
                   help="requests joining a running batch take their first step with the batch "
                        "(default: alone, before the batch's next step, so that their first "
                        "text comes a batch step sooner)")
    p.add_argument("--model-name", default=None,
                   help="model id in /v1/models and responses (default: the folder's name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM; then each is cut "
                        "off with an error event (default: 30)")
    p.add_argument("--api-key", default=None,
                   help=f"routes under /v1/ need 'Authorization: Bearer KEY' (default: "
                        f"${API_KEY_ENV}, else none); /health, /metrics and the page at / stay "
                        f"open")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="an origin (https://host[:port], or * for any) whose pages may call this "
                        "server from a browser; repeat for several (default: none)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    r = p.add_argument_group("Ray Serve (needs unmask[ray]; see docs/serving.md, \"Ray Serve\")")
    r.add_argument("--ray", action="store_true",
                   help="serve with --replicas engine replicas on Ray Serve")
    r.add_argument("--replicas", type=positive, default=None,
                   help="engine replicas, each with its own engine (default: 1)")
    r.add_argument("--address", default=None,
                   help="Ray cluster to join: auto (the one `ray start` runs here) or "
                        "ray://HOST:PORT (default: start a local one)")
    r.add_argument("--cpus-per-replica", type=float, default=None,
                   help="CPUs Ray reserves per replica; also its torch threads unless --threads "
                        "(default: 1)")
    r.add_argument("--gpus-per-replica", type=float, default=None,
                   help="GPUs per replica, fractions allowed (0.5: two share a GPU); replicas "
                        "go to nodes with free GPUs (default: 0)")


RAY_ONLY = ("replicas", "address", "cpus_per_replica", "gpus_per_replica")


def port(text: str) -> int:
    """A TCP port for argparse: 0..65535 (uvicorn took 70000 as 70000 mod 65536, silently)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535 (0: any free), got {value}")
    return value


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: an address in use or not on this
    machine is then one line (exit 2) at once, not uvicorn's log and exit 3 after the load."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as e:
        raise InputError(f"--host {host!r}: {getattr(e, 'strerror', None) or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds its own
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from unmask.server.app import build_app
        from unmask.server.state import ServerConfig
    except ImportError as e:
        raise InputError(f"the server needs its extra: pip install 'unmask[serve]' ({e})") from None
    from unmask.cli_args import decoder_for, load_llm

    if args.max_queue < 0:
        raise InputError(f"--max-queue must be >= 0, got {args.max_queue}")
    config = ServerConfig(decoder=args.decoder, max_running=args.max_running,
                          max_queue=args.max_queue, max_slots=args.max_slots,
                          model_name=args.model_name, shutdown_timeout=args.shutdown_timeout,
                          api_key=api_key(args), cors_origins=tuple(args.cors_origin or ()),
                          admission_window_ms=args.admission_window_ms,
                          joiners_first=args.joiners_first)
    if getattr(args, "ray", False):
        return _run_ray(args, config)
    given = [n for n in RAY_ONLY if getattr(args, n, None) is not None]
    if given:
        raise InputError(f"--{given[0].replace('_', '-')} needs --ray")
    sock = listen(args.host, args.port)
    try:
        llm = load_llm(args)
        # a default the model cannot run, or a slot budget no request fits, fails here, once
        check_slots(config.max_slots, decoder_for(args.decoder, args, llm), llm.model)
    except BaseException:
        sock.close()
        raise
    app = build_app(llm, config)
    state = app.state.unmask

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            state.begin_shutdown()
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal once it has shut down, into asyncio's own handler,
            # which cancelled the app's tasks: a traceback each. A drained server exits 0, a
            # forced one 130 (run_serve's return, as for Ctrl-C).
            getattr(self, "_captured_signals", []).clear()
            if self.force_exit:
                # A second signal skips the app's shutdown, which stops the engine thread: the
                # process then ended inside a torch call on that thread and aborted (SIGABRT,
                # "terminate called without an active exception"). It stops after its step,
                # and the requests still open get their error events.
                state.engine.stop(timeout=5.0)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            await super().shutdown(sockets)
            if self.force_exit:  # uvicorn skips the app's side; left to exit, each task of it
                # would be cancelled with a traceback. The cut streams end within a moment.
                if self.server_state.tasks:
                    await asyncio.wait(self.server_state.tasks, timeout=1.0)
                await self.lifespan.shutdown()

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if sockets and not self.should_exit:  # uvicorn names the address only for its own
                logging.getLogger("uvicorn.error").info("%s", serving_line(state))
                self._log_started_message(sockets)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=args.shutdown_timeout + CUT_GRACE))
    # the server's own lines (a cut request, an engine failure) in uvicorn's format and stream
    ours = logging.getLogger("unmask.server")
    ours.handlers[:], ours.propagate = logging.getLogger("uvicorn").handlers, False
    server.run(sockets=[sock])
    return 130 if server.force_exit else 0


def check_slots(max_slots: int | None, params: object, model: object) -> None:
    """--max-slots must hold the smallest request of the default decoder: a one-token prompt
    and one block (a block-causal model's canvas runs to the end of its block). Below that the
    server would start and refuse every request."""
    from unmask.engine.layout import block_size_of, canvas_length

    need = 1 + canvas_length(1, params.block_length, block_size_of(model))
    if max_slots is not None and max_slots < need:
        raise InputError(f"--max-slots {max_slots} holds no request: the smallest one (a "
                         f"one-token prompt and a block of {params.block_length} generated "
                         f"positions with --decoder {params.spec}) takes {need} slots; give at "
                         f"least {need}, or drop --max-slots")


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the environment's (set but empty is refused by ServerConfig, not read
    as no key: a deployment that meant to set one would otherwise serve everyone)."""
    return args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)


def serving_line(state: object) -> str:
    """What the log says the server serves: model, decoder, dtype, device, threads, access."""
    import torch

    llm, config = state.llm, state.config
    weights = next(llm.model.parameters())
    cors = ", ".join(config.cors_origins) or "none"
    return (f"serving {state.model_name} ({llm.path}) with decoder {config.decoder}: "
            f"{str(weights.dtype).removeprefix('torch.')} on {weights.device}, "
            f"{torch.get_num_threads()} torch threads; API key "
            f"{'required on /v1/' if config.api_key else 'off'}; CORS origins: {cors}")


def _run_ray(args: argparse.Namespace, config: object) -> int:
    try:
        from unmask.server.ray_serve import run_ray
    except ImportError as e:
        raise InputError(f"--ray needs its extra: pip install 'unmask[ray]' ({e})") from None
    for name in ("cpus_per_replica", "gpus_per_replica"):
        value = getattr(args, name)
        if value is not None and value < 0:
            raise InputError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    args.replicas = args.replicas or 1
    args.cpus_per_replica = 1.0 if args.cpus_per_replica is None else args.cpus_per_replica
    args.gpus_per_replica = args.gpus_per_replica or 0.0
    args.server_config = config
    return run_ray(args)
