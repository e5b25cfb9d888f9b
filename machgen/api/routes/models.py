"""GET /v1/models and /v1/models/{name}: the served models (those with a streaming twin and a card), each with
its kind, tasks, defaults and its own inputs as it publishes them (what ``machgen inputs`` lists)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from machgen.api.incoming import caller
from machgen.api.realtime import Realtime
from machgen.api.schemas import ApiError
from machgen.api.state import state_of
from machgen.api.triton import ServedModel

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request):
    state = state_of(request)
    caller(state, request)
    return {"object": "list", "data": [model_entry(m) for m in (await state.triton.models()).values()]}


@router.get("/v1/models/{name}")
async def get_model(name: str, request: Request):
    state = state_of(request)
    caller(state, request)
    models = await state.triton.models()
    if name not in models:
        raise ApiError(404, f"the model '{name}' does not exist", param="model", code="model_not_found")
    return model_entry(models[name])


def model_entry(model: ServedModel) -> dict[str, Any]:
    """OpenAI's model object and machgen's fields: ``inputs`` lists the model's own inputs (beyond every
    model's, docs/model-api.md) as its card publishes them: name, datatype, shape, doc (the help text),
    default, default_doc, flag (machgen generate's) and repeatable. ``realtime``: how its sessions play (frame
    rate, video frames a chunk, actions) where it was built with a streaming mode, else null."""
    defaults = model.defaults
    realtime = Realtime.of(model)
    return {"id": model.name, "object": "model", "created": 0, "owned_by": "machgen", "kind": model.kind,
            "family": model.card["family"], "tasks": model.card["tasks"], "audio": model.card["audio"],
            "size_multiple": model.card["size_multiple"], "frame_multiple": model.card["frame_multiple"],
            "defaults": {name: defaults.get(name) for name in
                         ("width", "height", "num_inference_steps", "guidance_scale", "num_frames", "fps",
                          "max_width", "max_height", "max_frames", "max_inference_steps")},
            "inputs": [declared.published(declared.default) for declared in model.inputs.values()],
            "realtime": None if realtime is None else {
                "fps": realtime.fps, "chunk_frames": realtime.chunk_frames(False),
                "first_chunk_frames": realtime.chunk_frames(True), "actions": list(realtime.actions)}}
