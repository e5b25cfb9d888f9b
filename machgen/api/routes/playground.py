"""GET /: the playground page (one HTML file, static/playground.html); GET /world: the world playground, a live
realtime session steered by the keyboard and forked into futures side by side (static/world.html)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse

STATIC = Path(__file__).resolve().parents[1] / "static"
PLAYGROUND = STATIC / "playground.html"
WORLD = STATIC / "world.html"
router = APIRouter()


@router.get("/", include_in_schema=False)
async def playground():
    return FileResponse(PLAYGROUND, media_type="text/html") if PLAYGROUND.exists() else HTMLResponse("machgen")


@router.get("/world", include_in_schema=False)
async def world():
    return FileResponse(WORLD, media_type="text/html") if WORLD.exists() else HTMLResponse("machgen")
