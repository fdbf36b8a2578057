"""`unmask serve`: the OpenAI-compatible server (install with `pip install 'unmask[serve]'`).

- protocol.py      request bodies (pydantic) and the OpenAI error object
- async_engine.py  the engine on its own thread, fed by the event loop
- metrics.py       Prometheus metrics
- app.py           the FastAPI app: routes, streaming, stop strings, cancellation
- live.py          the live view: the page at / and its event stream (static/: its JS and CSS)
- run.py           uvicorn with graceful shutdown, and the CLI's arguments
"""
