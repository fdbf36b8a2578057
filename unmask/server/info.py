"""GET /health, GET /metrics, GET /v1/models and /v1/models/{id}: what a load balancer, a
Prometheus server and an OpenAI client ask of a server before they send it work."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from unmask.server.errors import APIError
from unmask.server.state import ServerState, State

router = APIRouter()


@router.get("/health")
async def health(state: State) -> JSONResponse:
    door = state.engine
    if door.error is not None or not door.alive:
        return JSONResponse({"status": "engine stopped"}, 503)
    if state.draining:
        return JSONResponse({"status": "draining"}, 503)
    return JSONResponse({"status": "ok", "running": door.n_running, "waiting": door.n_waiting})


@router.get("/metrics")
async def prometheus(state: State) -> Response:
    return Response(generate_latest(state.engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(state: State) -> dict:
    return {"object": "list", "data": [_model_card(state)]}


@router.get("/v1/models/{model:path}")  # :path: an id may contain "/" (org/name)
async def model(model: str, state: State) -> dict:
    if model != state.model_name:
        raise APIError(404, f"model {model!r} does not exist; this server serves "
                            f"{state.model_name!r}", param="model")
    return _model_card(state)


def _model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": int(state.started),
            "owned_by": "unmask"}
