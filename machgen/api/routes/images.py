"""OpenAI's Images API: POST /v1/images/generations and /v1/images/edits, answered when done (OpenAI's
ImagesResponse), at once with the job (``async``), or streamed (OpenAI's image events)."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from machgen.api.explore import AGENT_FIELDS, prompt_variants
from machgen.api.incoming import caller, read_fields
from machgen.api.media import sse
from machgen.api.pipeline import JobRequest, drawn_seed, failure_error, prompt_of, served_model, variant_count
from machgen.api.routes.content import stored_result
from machgen.api.schemas import (
    bounded,
    decode_picture,
    invalid,
    job_object,
    openai_choice,
    parse_size,
    typed,
)
from machgen.api.state import ApiState, state_of
from machgen.api.store import Job
from machgen.api.triton import ServedModel

router = APIRouter()


@router.post("/v1/images/generations")
async def images_generations(request: Request):
    return await image_job(request, edit=False)


@router.post("/v1/images/edits")
async def images_edits(request: Request):
    return await image_job(request, edit=True)


async def image_job(request: Request, edit: bool):
    state = state_of(request)
    caller(state, request)
    fields, files = await read_fields(state, request, form=edit, json_body=not edit)
    model = await served_model(state, fields.get("model"), "image")
    prompt = prompt_of(fields)
    n = variant_count(fields)
    options = image_options(fields, edit)
    stream = options["stream"]
    run_async = typed("async", fields.get("async", False), bool)
    if run_async and stream:
        raise invalid("stream", "a request answered at once ('async': true) is not streamed")
    seed = drawn_seed(fields)
    inputs: dict[str, Any] = {"prompt": prompt}
    if edit:
        pictures = files.get("image") or files.get("image[]")
        if not pictures:
            raise invalid("image", "'image' is required: the picture to edit (a file)")
        if len(pictures) > 1:
            raise invalid("image", "one picture is edited at a time")
        if files.get("mask"):
            raise invalid("mask", "masks are not supported: the whole picture is redrawn by 'strength'",
                          code="unsupported_value")
        inputs["image"] = decode_picture("image", pictures[0])
        if fields.get("size") not in (None, "auto"):
            inputs["width"], inputs["height"] = parse_size(fields["size"], model.defaults)
        else:
            inputs["height"], inputs["width"] = inputs["image"].shape[:2]
    else:
        inputs["width"], inputs["height"] = parse_size(fields.get("size"), model.defaults)
    job_request = JobRequest(state, request, "image", model, fields, {
        "model", "prompt", "n", "async", "size", "seed", "callback_url", "image", "mask", *options, *AGENT_FIELDS})
    await job_request.refine(inputs)
    await job_request.complete(inputs, seed, partial_images=options["partial_images"])
    prompts = prompt_variants(fields.get("prompts"), prompt, n)
    explore = await job_request.explore(n)
    if explore is None and fields.get("prompts") is not None and n < 2:
        raise invalid("prompts", "prompt variants need 'n' of 2 or more")
    job = await job_request.submit(inputs, n, prompts, explore, waits_in_queue=run_async, edit=edit,
                                   usage=image_usage(model, inputs, n), **options)
    if run_async:
        return job_object(job)
    if stream:
        return StreamingResponse(image_stream(state, job, str(request.base_url)), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                          "X-Machgen-Job-Id": job.id})
    job = await state.jobs.wait(job.id)
    if job.status != "completed":
        raise failure_error(job)
    return image_answer(state, job, str(request.base_url))


def image_options(fields: dict[str, Any], edit: bool) -> dict[str, Any]:
    """OpenAI's image fields besides model, prompt, n, size, image and mask, each honoured or refused by
    name (a value outside OpenAI's set: invalid_value; one OpenAI defines that is not honoured here:
    unsupported_value). As OpenAI's: generations take ``moderation`` and ``style``, edits ``input_fidelity``;
    the others' are unknown parameters."""
    if fields.get("background") is True:
        raise invalid("background", "'background' is OpenAI's transparency choice (opaque or auto); to be "
                                    "answered at once with the job, send 'async': true")
    choices = ("response_format", "output_format", "background", "quality",
               *(("input_fidelity",) if edit else ("moderation", "style")))
    options = {name: openai_choice(name, fields.get(name), None) for name in choices}
    options["response_format"] = options["response_format"] or "b64_json"
    options["output_format"] = options["output_format"] or "png"
    compression = fields.get("output_compression")
    if compression is not None:
        compression = bounded("output_compression", compression, 0, 100)
        if options["output_format"] == "png" and compression != 100:
            raise invalid("output_compression", "'output_compression' applies to jpeg and webp output, not png")
    options["output_compression"] = compression
    options["stream"] = typed("stream", fields["stream"], bool) if fields.get("stream") is not None else False
    partial = fields.get("partial_images")
    options["partial_images"] = 0 if partial is None else bounded("partial_images", partial, 0, 3)
    if options["partial_images"] and not options["stream"]:
        raise invalid("partial_images", "partial images are streamed: send 'stream': true with them")
    options["user"] = typed("user", fields["user"], str) if fields.get("user") is not None else None
    return options


def image_usage(model: ServedModel, inputs: dict[str, Any], n: int) -> dict[str, Any]:
    """OpenAI's image usage, counted as the model sees its request: text tokens, the text sequence its
    prompt is padded to (max_sequence_length); image tokens, the picture's cells of size_multiple pixels
    square (an edit's input image; each output image)."""
    multiple = int(model.card["size_multiple"])
    text = int(model.defaults.get("max_sequence_length") or 0)
    picture = inputs.get("image")
    image_in = (picture.shape[0] // multiple) * (picture.shape[1] // multiple) if picture is not None else 0
    output = n * (int(inputs["width"]) // multiple) * (int(inputs["height"]) // multiple)
    return {"input_tokens": text + image_in, "output_tokens": output, "total_tokens": text + image_in + output,
            "input_tokens_details": {"text_tokens": text, "image_tokens": image_in},
            "output_tokens_details": {"text_tokens": 0, "image_tokens": output}}


def image_usage_of_one(usage: dict[str, Any], n: int) -> dict[str, Any]:
    """The usage of one of a request's ``n`` images (a streamed image's completed event)."""
    output = usage["output_tokens"] // n
    return {**usage, "output_tokens": output, "total_tokens": usage["input_tokens"] + output,
            "output_tokens_details": {"text_tokens": 0, "image_tokens": output}}


def result_url(state: ApiState, job: Job, index: int, base_url: str) -> str:
    """A URL of one image that a plain GET downloads, keys or not, until it expires (an hour, or the
    results' own expiry when sooner)."""
    expires = int(min(time.time() + state.settings.url_ttl_s, job.expires_at or float("inf")))
    return base_url.rstrip("/") + state.signer.sign(f"/v1/jobs/{job.id}/content", {"index": str(index)}, expires)


def image_answer(state: ApiState, job: Job, base_url: str) -> dict[str, Any]:
    """OpenAI's ImagesResponse (and machgen's ``machgen``: job id, seeds, stats)."""
    data = []
    for index, name in enumerate(job.outputs):
        if job.request.get("response_format") == "url":
            data.append({"url": result_url(state, job, index, base_url)})
        else:
            data.append({"b64_json": base64.b64encode(stored_result(state, job, name)).decode()})
    return {"created": job.created_at, "data": data, "background": "opaque",
            "output_format": job.request.get("output_format", "png"),
            "size": f"{job.request['width']}x{job.request['height']}", "usage": job.request.get("usage"),
            "machgen": {"job_id": job.id, "seeds": job.request["seeds"], "stats": job.stats}}


async def image_stream(state: ApiState, job: Job, base_url: str) -> AsyncIterator[bytes]:
    """OpenAI's image stream: ``partial_images`` partial images of each image (numbered from 0 per image),
    then each image's completed event; an error event if the job fails. Edits' events are image_edit.*.
    machgen's progress events are the job's own (/v1/jobs/{id}/events, the X-Machgen-Job-Id header)."""
    request = job.request
    prefix = "image_edit" if request["edit"] else "image_generation"
    described = {"size": f"{request['width']}x{request['height']}", "quality": "auto", "background": "opaque",
                 "output_format": request.get("output_format", "png")}
    wanted = request.get("partial_images") or 0
    sent: dict[int, int] = {}
    events = state.jobs.events(job.id)
    if events is not None and wanted:
        async for event, data in events.follow():
            if event in ("completed", "failed", "cancelled"):
                break
            index = data.get("index", 0)
            if event != "preview" or sent.get(index, 0) >= wanted:
                continue
            partial = await asyncio.to_thread(_partial_image, data["image"], request)
            yield sse(f"{prefix}.partial_image", {
                "type": f"{prefix}.partial_image", "b64_json": partial, "created_at": int(time.time()),
                **described, "partial_image_index": sent.get(index, 0),
                "machgen": {"job_id": job.id, "index": index, "step": data["step"]}})
            sent[index] = sent.get(index, 0) + 1
    job = await state.jobs.wait(job.id)
    if job.status != "completed":
        yield sse("error", {"type": "error", **failure_error(job).body()})
        return
    answer = image_answer(state, job, base_url)
    for index, name in enumerate(job.outputs):
        encoded = base64.b64encode(stored_result(state, job, name)).decode()
        yield sse(f"{prefix}.completed", {
            "type": f"{prefix}.completed", "b64_json": encoded, "created_at": job.completed_at or job.created_at,
            **described, "usage": image_usage_of_one(request["usage"], request["n"]),
            **({"url": answer["data"][index]["url"]} if request.get("response_format") == "url" else {}),
            "machgen": {"job_id": job.id, "index": index, "seed": request["seeds"][index],
                        "stats": job.stats[index] if index < len(job.stats) else None}})


def _partial_image(preview_url: str, request: dict[str, Any]) -> str:
    """A preview (a PNG data URL at the latents' size) as a partial image: base64 of the request's size and
    output format."""
    import io

    import numpy as np
    from PIL import Image

    from machgen.api.media import picture_bytes

    with Image.open(io.BytesIO(base64.b64decode(preview_url.split(",", 1)[1]))) as preview:
        picture = preview.convert("RGB").resize((int(request["width"]), int(request["height"])),
                                                Image.Resampling.NEAREST)
    encoded = picture_bytes(np.asarray(picture), request.get("output_format", "png"),
                            request.get("output_compression"))
    return base64.b64encode(encoded).decode()
