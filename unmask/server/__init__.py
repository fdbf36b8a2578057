"""`unmask serve`: the OpenAI-compatible server (install with `pip install 'unmask[serve]'`).

- protocol.py       request bodies (pydantic) and the OpenAI error object
- state.py          the server's config and state, as the routes read it
- engine_client.py  the one door into the engine (EngineClient: checks, submits, aborts, counts
                    outcomes) and the engine's thread; the concurrency rule is its docstring
- admission.py      the admission window: the requests on their way to the engine, which an
                    idle engine waits for so that a burst is admitted in one step
- output.py         a request's text as it grows (TextStream), usage and unmask's numbers
- intake.py         a request body before the engine: early checks, token ids, decoder params
- errors.py         every error in OpenAI's error body; the body size limit (413)
- app.py            build_app: the engine, its door, the routes
- completions.py    POST /v1/completions and /v1/chat/completions: streaming, stop strings
- info.py           /health, /metrics, /v1/models
- live.py           the live view: the page at / and its event stream (static/: its JS and CSS)
- metrics.py        Prometheus metrics
- run.py            uvicorn with graceful shutdown, and the CLI's arguments
- ray_serve.py      the same app as N engine replicas on Ray Serve
"""
