"""A job's files as routes answer them: its results (images, videos, thumbnails) and an explore's early
pictures or clips."""

from __future__ import annotations

from fastapi.responses import FileResponse, Response

from machgen.api.explore import EARLY_FILE
from machgen.api.schemas import MEDIA_TYPES, ApiError, invalid
from machgen.api.state import ApiState
from machgen.api.store import Job


def result_file(state: ApiState, job: Job, stem: str):
    """The job's result file named ``stem``.EXTENSION, with the media type of its extension."""
    if job.status != "completed":
        raise ApiError(409 if not job.finished else 404, f"job {job.id} is {job.status}: it has no content"
                       + (" yet" if not job.finished else ""), code="not_ready")
    name = next((name for name in job.outputs if name.rsplit(".", 1)[0] == stem), None)
    if name is None:
        raise ApiError(404, f"the results of job {job.id} have expired", code="expired")
    media_type = MEDIA_TYPES[name.rsplit(".", 1)[1]]
    path = state.store.result_path(job.id, name)
    if path is not None:  # from disk: range requests (a player seeking in a video) are answered
        return FileResponse(path, media_type=media_type)
    return Response(stored_result(state, job, name), media_type=media_type)


def stored_result(state: ApiState, job: Job, name: str) -> bytes:
    data = state.store.read_result(job.id, name)
    if data is None:
        raise ApiError(404, f"the results of job {job.id} have expired", code="expired")
    return data


def early_file(state: ApiState, job: Job, index: int) -> Response:
    """An explore job's variant ``index``: its early picture or clip, at the step it was scored."""
    variants = len(job.request.get("seeds") or ())
    if not job.request.get("explore") or not 0 <= index < variants:
        raise invalid("early", f"'early' is an explored variant's index, in [0, {variants - 1}], of an "
                               f"explore job")
    extension = "mp4" if job.kind == "video" else "png"
    data = state.store.read_result(job.id, EARLY_FILE.format(index=index, extension=extension))
    if data is None:
        raise ApiError(404 if job.finished else 409, f"job {job.id} has no early {job.kind} {index}"
                       + ("" if job.finished else " yet"), code="not_ready")
    return Response(data, media_type=MEDIA_TYPES[extension])


def result_index(job: Job, index: int) -> int:
    if not 0 <= index < max(job.request.get("n", 1), 1):
        raise invalid("index", f"'index' must be in [0, {job.request.get('n', 1) - 1}]")
    return index
