"""GET /health (ready when Triton is) and GET /metrics (Prometheus: the registry app.py made, on the app's
state)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from machgen.api.state import state_of

router = APIRouter()


@router.get("/health")
async def health(request: Request):
    ready = await state_of(request).triton.ready()
    return JSONResponse({"status": "ok" if ready else "triton_unavailable", "triton": ready},
                        status_code=200 if ready else 503)


@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request):
    from prometheus_client import generate_latest

    return Response(generate_latest(request.app.state.registry), media_type="text/plain; version=0.0.4")
