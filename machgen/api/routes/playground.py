"""GET /: the playground page (one HTML file, static/playground.html)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse

PLAYGROUND = Path(__file__).resolve().parents[1] / "static" / "playground.html"
router = APIRouter()


@router.get("/", include_in_schema=False)
async def playground():
    return FileResponse(PLAYGROUND, media_type="text/html") if PLAYGROUND.exists() else HTMLResponse("machgen")
