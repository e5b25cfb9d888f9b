"""machgen's jobs (images and videos alike): listed, read, cancelled, their files (with the key or by a
signed URL) and their Server-Sent Events."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator, Callable

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from machgen.api.incoming import caller, page, query
from machgen.api.jobs import result_stem
from machgen.api.media import sse
from machgen.api.pipeline import job_for
from machgen.api.routes.content import early_file, result_file, result_index
from machgen.api.schemas import ApiError, invalid, job_object
from machgen.api.state import ApiState, state_of
from machgen.api.store import Job

router = APIRouter()


@router.get("/v1/jobs")
async def list_jobs(request: Request):
    state = state_of(request)
    owner, _ = caller(state, request)
    limit, after, ascending, found = page(request, {"kind": str})
    if found.get("kind") not in (None, "image", "video"):
        raise invalid("kind", f"'kind' must be image or video, not {found['kind']!r}")
    return jobs_page(state, owner, found.get("kind"), limit, after, ascending, job_object)


def jobs_page(state: ApiState, owner: str, kind: str | None, limit: int, after: str | None, ascending: bool,
              as_object: Callable[[Job], dict[str, Any]]) -> dict[str, Any]:
    """OpenAI's list object of the caller's jobs (every one's where no key is needed), as this process runs
    them."""
    jobs = state.store.list(kind, owner if state.keys.required else None, limit + 1, after, ascending)
    data = [as_object(state.jobs.running[j.id].job if j.id in state.jobs.running else j) for j in jobs[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(jobs) > limit}


@router.get("/v1/jobs/{job_id}")
async def get_job(job_id: str, request: Request):
    return job_object(job_for(state_of(request), request, job_id))


@router.delete("/v1/jobs/{job_id}")
async def cancel_job(job_id: str, request: Request):
    state = state_of(request)
    job = job_for(state, request, job_id)
    await state.jobs.cancel(job.id)
    return job_object(state.store.get(job.id) or job)


@router.get("/v1/jobs/{job_id}/content")
async def job_content(job_id: str, request: Request):
    """A job's file: with the API key, or by a signed URL (result_url) that needs none until it expires."""
    state = state_of(request)
    signed = "signature" in request.query_params
    found = query(request, {"index": int, "early": int, **({"expires": str, "signature": str} if signed else {})})
    index = found.get("index", 0)
    if signed:
        problem = state.signer.check(request.url.path, dict(request.query_params), time.time())
        if problem is not None:
            raise ApiError(403, f"{problem}: ask for the image again, or download it with the API key",
                           param="signature", code="invalid_signature", kind="permission_error")
        job = state.store.get(job_id)
        if job is None:
            raise ApiError(404, f"no job with id '{job_id}'", param="id", code="not_found")
    else:
        job = job_for(state, request, job_id)
    if "early" in found:  # an explored variant's early image or clip, at the step it was scored
        return early_file(state, job, found["early"])
    index = result_index(job, index)
    return result_file(state, job, result_stem("video", index) if job.kind == "video" else f"image-{index}")


@router.get("/v1/jobs/{job_id}/events")
async def job_events(job_id: str, request: Request):
    state = state_of(request)
    job = job_for(state, request, job_id)

    async def events() -> AsyncIterator[bytes]:
        followed = state.jobs.events(job.id)
        if followed is None:  # finished before this process kept its events: its end alone
            yield sse(job.status if job.finished else "failed", job_object(job))
            return
        async for event, data in followed.follow():
            yield sse(event, data)

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
