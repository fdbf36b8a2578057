"""Running the server: arguments of `unmask serve`, uvicorn, and a graceful SIGTERM.

On SIGTERM (or Ctrl-C) the server stops admitting (new requests get 503 and /health says
"draining"), lets running requests finish for up to --shutdown-timeout seconds, then exits;
requests still running then are aborted and their clients get an error, never silence.
"""

from __future__ import annotations

import argparse

from unmask.errors import InputError


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    from unmask.cli import add_model_arguments, positive

    add_model_arguments(p)
    p.add_argument("--decoder", default="threshold",
                   help="default decoder spec of requests that send none (default: threshold)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 = any free)")
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


def run_serve(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from unmask.server.app import ServerConfig, build_app
    except ImportError as e:
        raise InputError(f"the server needs its extra: pip install 'unmask[serve]' ({e})") from None
    from unmask.api import LLM

    if args.max_queue < 0:
        raise InputError(f"--max-queue must be >= 0, got {args.max_queue}")
    config = ServerConfig(decoder=args.decoder, max_running=args.max_running,
                          max_queue=args.max_queue, max_slots=args.max_slots,
                          model_name=args.model_name)
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    app = build_app(llm, config)
    state = app.state.unmask

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            state.draining = True
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal once it has shut down; a drained server exits 0.
            getattr(self, "_captured_signals", []).clear()

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                   timeout_graceful_shutdown=args.shutdown_timeout))
    server.run()
    return 0
