"""Running the server: arguments of `unmask serve`, uvicorn, and a graceful SIGTERM.

On SIGTERM (or Ctrl-C) uvicorn stops listening and closes idle connections (a request that
still reaches the app gets 503, /health "draining"), lets running requests finish for up to
--shutdown-timeout seconds, then exits 0; streams still running then are cut off (uvicorn
cancels them). A second Ctrl-C forces the exit: the engine thread is stopped first.

With --ray the same app runs as --replicas engine replicas on Ray Serve (ray_serve.py).
"""

from __future__ import annotations

import argparse
import socket

from unmask.decoding.params import DEFAULT_DECODER
from unmask.errors import InputError


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from unmask.cli_args import add_model_arguments, positive

    add_model_arguments(p)
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
    p.add_argument("--model-name", default=None,
                   help="model id in /v1/models and responses (default: the folder's name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds running requests get to finish on SIGTERM (default: 30)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    r = p.add_argument_group("Ray Serve (needs unmask[ray]; see the README's \"Ray Serve\")")
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
    from unmask.cli_args import load_llm

    if args.max_queue < 0:
        raise InputError(f"--max-queue must be >= 0, got {args.max_queue}")
    config = ServerConfig(decoder=args.decoder, max_running=args.max_running,
                          max_queue=args.max_queue, max_slots=args.max_slots,
                          model_name=args.model_name)
    if getattr(args, "ray", False):
        return _run_ray(args, config)
    given = [n for n in RAY_ONLY if getattr(args, n, None) is not None]
    if given:
        raise InputError(f"--{given[0].replace('_', '-')} needs --ray")
    sock = listen(args.host, args.port)
    try:
        llm = load_llm(args)
    except BaseException:
        sock.close()
        raise
    app = build_app(llm, config)
    state = app.state.unmask

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            state.draining = True
            super().handle_exit(sig, frame)
            if not self.force_exit:
                # uvicorn re-raises the signal once it has shut down; a drained server exits 0,
                # a forced one as the signal says (130 for Ctrl-C)
                getattr(self, "_captured_signals", []).clear()
            else:
                # A second signal skips the app's shutdown, which stops the engine thread: the
                # process then ended inside a torch call on that thread and aborted (SIGABRT,
                # "terminate called without an active exception"). It stops after its step.
                state.engine.stop(timeout=5.0)

        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if sockets and not self.should_exit:  # uvicorn names the address only for its own
                self._log_started_message(sockets)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=args.shutdown_timeout))
    server.run(sockets=[sock])
    return 0


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
