"""OpenAI's Videos API: POST /v1/videos (asynchronous: the video object at once), its remix, and the
videos listed, read, downloaded and deleted."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from machgen.api.explore import AGENT_FIELDS, prompt_variants
from machgen.api.incoming import caller, data_url_bytes, page, query, read_fields
from machgen.api.jobs import result_stem
from machgen.api.pipeline import JobRequest, drawn_seed, job_for, prompt_of, served_model, variant_count
from machgen.api.routes.content import early_file, result_file, result_index
from machgen.api.routes.jobs import jobs_page
from machgen.api.schemas import (
    TextValue,
    decode_picture,
    invalid,
    parse_size,
    typed,
    video_object,
)
from machgen.api.state import ApiState, state_of

router = APIRouter()
# Where a remix (POST /v1/videos/{id}/remix, OpenAI's) starts when its body says neither step nor strength: the
# parent's latents after half its steps (its composition kept, the rest redrawn under the new prompt).
REMIX_STRENGTH = 0.5


@router.post("/v1/videos")
async def create_video(request: Request):
    state = state_of(request)
    caller(state, request)
    fields, files = await read_fields(state, request, form=True, json_body=True)
    return await video_job(request, state, fields, files)


@router.post("/v1/videos/{video_id}/remix")
async def remix_video(video_id: str, request: Request):
    """OpenAI's remix: the video again under a new prompt, a refine of it (the video must have kept its
    latents, keep_latents). From half its steps unless the body says ``step`` or ``strength``."""
    state = state_of(request)
    parent = job_for(state, request, video_id, "video")
    fields, files = await read_fields(state, request, form=False, json_body=True)
    if fields.get("parent") is not None:
        raise invalid("parent", "a remix's parent is the video of its path", code="unknown_parameter")
    if fields.get("step") is None and fields.get("strength") is None:
        fields["strength"] = REMIX_STRENGTH
    return await video_job(request, state, {"model": parent.model, **fields, "parent": video_id}, files)


async def video_job(request: Request, state: ApiState, fields: dict[str, Any], files: dict[str, list[bytes]]):
    model = await served_model(state, fields.get("model"), "video")
    prompt = prompt_of(fields)
    defaults = model.defaults
    inputs: dict[str, Any] = {"prompt": prompt}
    reference = files.get("input_reference") or ([] if fields.get("input_reference") is None else None)
    if reference is None:
        reference = [data_url_bytes("input_reference", fields["input_reference"])]
    if len(reference) > 1:
        raise invalid("input_reference", "one picture starts a video")
    if reference:
        inputs["image"] = decode_picture("input_reference", reference[0])
    if files.get("reference_images"):
        import numpy as np

        pictures = [decode_picture("reference_images", data) for data in files["reference_images"]]
        if len({p.shape for p in pictures}) != 1:
            raise invalid("reference_images", "every reference picture must have one size")
        inputs["reference_images"] = np.stack(pictures)
    pictured = [name for name in ("image", "reference_images") if name in inputs]
    job_request = JobRequest(state, request, "video", model, fields, {
        "model", "prompt", "size", "seconds", "num_frames", "fps", "input_reference", "reference_images", "seed",
        "callback_url", "n", *AGENT_FIELDS})
    await job_request.refine(inputs)
    refined = job_request.refined is not None
    if not refined:
        inputs["width"], inputs["height"] = parse_size(fields.get("size"), defaults)
    # A refine's length is its parent's (a refine keeps the latents' shape); given again, it must be the same.
    fps = typed("fps", fields["fps"], int) if fields.get("fps") is not None else int(
        inputs.get("fps") or defaults.get("fps") or 16)
    frames = _frames(fields, model.card["frame_multiple"], fps, inputs.get("num_frames") or defaults["num_frames"])
    if refined and (frames, fps) != (inputs["num_frames"], inputs["fps"]):
        field = "fps" if fps != inputs["fps"] else ("seconds" if fields.get("seconds") is not None else "num_frames")
        raise invalid(field, f"a refine keeps its parent's {inputs['num_frames']} frames at {inputs['fps']} fps")
    inputs["num_frames"], inputs["fps"] = frames, fps
    seed = drawn_seed(fields)
    n = variant_count(fields)
    await job_request.complete(inputs, seed)
    # A video job makes one video, unless it explores: n variants, the best explore.keep continued.
    explore = await job_request.explore(n)
    if explore is None and n > 1:
        raise invalid("n", "a video job makes one video: 'n' variants are an explore's (give 'explore')")
    if explore is None and fields.get("prompts") is not None:
        raise invalid("prompts", "prompt variants are an explore's: give 'explore' and 'n'")
    prompts = prompt_variants(fields.get("prompts"), prompt, n)
    job = await job_request.submit(inputs, n, prompts, explore, waits_in_queue=True,
                                   image_to_video="image" in inputs, pictured=pictured)
    return video_object(job)


def _frames(fields: dict[str, Any], frame_multiple: int, fps: int, default: int) -> int:
    """The video's frames: OpenAI's ``seconds`` at ``fps`` to the model's frame rule (frame_multiple k + 1),
    or ``num_frames``, or ``default``."""
    if fields.get("seconds") is not None and fields.get("num_frames") is not None:
        raise invalid("seconds", "give 'seconds' or 'num_frames', not both")
    if fields.get("seconds") is not None:
        given = fields["seconds"]  # OpenAI's seconds is a string ("4"), a number here too
        seconds = typed("seconds", TextValue(given) if isinstance(given, str) else given, float)
        if seconds <= 0:
            raise invalid("seconds", f"'seconds' must be positive, not {seconds:g}")
        return max(round(seconds * fps / frame_multiple), 1) * frame_multiple + 1
    if fields.get("num_frames") is not None:
        return typed("num_frames", fields["num_frames"], int)
    return int(default)


@router.get("/v1/videos")
async def list_videos(request: Request):
    state = state_of(request)
    owner, _ = caller(state, request)
    limit, after, ascending, _ = page(request)
    return jobs_page(state, owner, "video", limit, after, ascending, video_object)


@router.get("/v1/videos/{video_id}")
async def get_video(video_id: str, request: Request):
    return video_object(job_for(state_of(request), request, video_id, "video"))


@router.delete("/v1/videos/{video_id}")
async def delete_video(video_id: str, request: Request):
    """OpenAI's delete: the video is gone (stopped first if it runs), its id answers 404 after."""
    state = state_of(request)
    job = job_for(state, request, video_id, "video")
    await state.jobs.cancel(job.id)
    state.jobs.forget(job.id)
    state.store.delete(job.id)
    return {"id": job.id, "object": "video.deleted", "deleted": True}


@router.get("/v1/videos/{video_id}/content")
async def video_content(video_id: str, request: Request):
    state = state_of(request)
    found = query(request, {"variant": str, "index": int, "early": int})
    variant = _openai_video_variant(found.get("variant", "video"))
    job = job_for(state, request, video_id, "video")
    if "early" in found:
        return early_file(state, job, found["early"])
    return result_file(state, job, result_stem(variant, result_index(job, found.get("index", 0))))


def _openai_video_variant(variant: str) -> str:
    if variant not in ("video", "thumbnail", "spritesheet"):
        raise invalid("variant", f"'variant' must be video, thumbnail or spritesheet, not {variant!r}")
    if variant == "spritesheet":
        raise invalid("variant", "'variant' spritesheet is not made here: video or thumbnail",
                      code="unsupported_value")
    return variant
