"""The HTTP API (FastAPI): OpenAI's images and videos routes, machgen's
jobs, events, the playground page and metrics. ``create_app(ApiSettings)``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response, StreamingResponse

from machgen.api.explore import (
    AGENT_FIELDS,
    EARLY_FILE,
    LATENTS_FILE,
    ExploreSettings,
    check_scorer,
    explore_settings,
    kept_latents,
    no_parent,
    prompt_variants,
    read_latents,
    refine_step,
)
from machgen.api.jobs import JobManager, JobMetrics, new_job_id, result_stem
from machgen.api.destinations import DestinationPolicy
from machgen.api.keys import KeyRing, StoredKeyRing, UrlSigner, read_keys
from machgen.api.schemas import (
    ADAPTER_FIELDS,
    MAX_VARIANTS,
    MEDIA_TYPES,
    MODEL_FIELDS,
    SEED_LIMIT,
    ApiError,
    bounded,
    decode_picture,
    invalid,
    job_object,
    openai_choice,
    parse_size,
    public_object,
    typed,
    typed_list,
    video_object,
)
from machgen.api.store import Job, JobStore
from machgen.api.triton import ServedModel, TritonModels
from machgen.api.webhooks import WebhookPolicy, WebhookSender, secret_key

log = logging.getLogger("machgen.api")
PLAYGROUND = Path(__file__).parent / "static" / "playground.html"
ANONYMOUS = "anonymous"
# Where a remix (POST /v1/videos/{id}/remix, OpenAI's) starts when its body says neither step nor strength: the
# parent's latents after half its steps (its composition kept, the rest redrawn under the new prompt).
REMIX_STRENGTH = 0.5


@dataclass(frozen=True)
class ApiSettings:
    """How ``machgen api`` runs (its CLI options, one for one)."""

    triton_url: str = "127.0.0.1:8001"
    # Job records (jobs.sqlite3 unless ``database`` says) and results/ live here.
    data_dir: Path = Path("machgen-api")
    database: Path | None = None
    # PostgreSQL (postgresql://...) instead of SQLite: jobs, events, results, webhooks and keys in it, shared by
    # every API process given the same URL.
    database_url: str | None = None
    # How long a job stays this process's without it renewing (it renews every third): on PostgreSQL, another
    # process runs the jobs of a process killed that long ago.
    job_lease_s: float = 30.0
    # API keys (keys.py); None: no key needed (with database_url: the database's keys, when it has any).
    keys_file: Path | None = None
    # Jobs in flight (queued or running) per key (a key's own limit in the file wins); more answer 429.
    max_jobs_per_key: int = 16
    # Jobs of one owner (key) that run at once, in every API process of the database; its others wait, queued,
    # and start in the order they came (None: no limit below max_jobs_per_key). So an agent's burst holds at
    # most this many of Triton's request slots, and queues at most max_jobs_per_key minus this many.
    max_running_per_key: int | None = None
    # Largest request body (uploaded images included), bytes.
    max_upload_bytes: int = 25 * 1024 * 1024
    # How long results stay downloadable, seconds.
    result_ttl_s: float = 24 * 3600.0
    # Standard Webhooks secret ("whsec_..."); None: jobs cannot ask for webhooks.
    webhook_secret: str | None = None
    # Webhooks to loopback, private and link-local addresses too (else refused: request forgery).
    allow_private_callbacks: bool = False
    webhook_attempts: int = 6
    webhook_first_delay_s: float = 1.0
    # An asynchronous job finding Triton's queue full waits this long first, doubling, then asks again.
    queue_retry_s: float = 1.0
    # A header a trusted gateway in front sets to the tenant a request is for: its owner for fair shares of
    # denoiser time is then KEY/TENANT (None: the key's name alone).
    tenant_header: str | None = None
    # Steps between previews of a job that does not say (None: the model's default).
    preview_interval: int | None = None
    # How long a result URL (response_format "url") downloads without the key, seconds (OpenAI's: an hour).
    url_ttl_s: float = 3600.0
    # The most bytes of latents a job keeps (keep_latents) for refines; past it, evenly spaced steps. They go
    # with the job's results (result_ttl_s).
    max_latents_bytes: int = 64 << 20


@dataclass
class _State:
    settings: ApiSettings
    store: JobStore
    triton: TritonModels
    keys: KeyRing
    webhooks: WebhookSender
    jobs: JobManager
    signer: UrlSigner
    tasks: list = field(default_factory=list)


# --------------------------------------------------------------------------- requests


def _bearer(request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _owner(state: _State, request) -> str:
    """Whose request it is, for fair shares: the tenant a trusted gateway names (--tenant-header), else the key's
    name."""
    owner, _ = _caller(state, request)
    header = state.settings.tenant_header
    tenant = request.headers.get(header, "").strip() if header else ""
    return f"{owner}/{tenant}" if tenant else owner


def _scheduling(state: _State, request, model: ServedModel, inputs: dict[str, Any]) -> None:
    """The request's owner, and its priority where given, sent as the model takes them (a model built before
    priorities takes neither: its requests are served first come, first served)."""
    if "owner" in model.accepts:
        inputs["owner"] = _owner(state, request)
    elif inputs.get("priority") not in (None, "interactive"):
        raise invalid("priority", f"the model '{model.name}' was built before request priorities; rebuild it "
                                  "with this machgen to give it batch requests", code="unsupported_value")
    else:
        inputs.pop("priority", None)


def _caller(state: _State, request) -> tuple[str, int]:
    """(the key's name, its limit of jobs in flight); 401 without a valid key where keys are needed."""
    if not state.keys.required:
        return ANONYMOUS, state.settings.max_jobs_per_key
    key = state.keys.find(_bearer(request))
    if key is None:
        problem = "no API key given" if _bearer(request) is None else "the API key is not valid"
        raise ApiError(401, f"{problem}: send 'Authorization: Bearer KEY'", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return key.name, key.max_jobs or state.settings.max_jobs_per_key


async def _read_fields(state: _State, request, form: bool, json_body: bool) -> tuple[dict[str, Any],
                                                                                     dict[str, list[bytes]]]:
    """The request's fields and uploaded files, from JSON or a multipart/urlencoded form."""
    limit = state.settings.max_upload_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {int(length)} bytes; this API takes at most {limit}",
                       code="request_too_large")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if json_body and content_type in ("application/json", ""):
        body = await request.body()
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
        try:
            fields = json.loads(body or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the body is not valid JSON: {err}", code="invalid_json") from None
        if not isinstance(fields, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        return fields, {}
    if form and content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            parsed = await request.form(max_files=16, max_fields=64, max_part_size=limit)
        except Exception as err:  # noqa: BLE001 - starlette's parse errors, a part over the limit
            raise ApiError(400, f"the form could not be read: {err}", code="invalid_form") from None
        fields: dict[str, Any] = {}
        files: dict[str, list[bytes]] = {}
        total = 0
        for name, value in parsed.multi_items():
            name = name.removesuffix("[]")
            if hasattr(value, "read"):
                data = await value.read()
                total += len(data)
                if total > limit:
                    raise ApiError(413, f"the uploaded files are over {limit} bytes", code="request_too_large")
                files.setdefault(name, []).append(data)
            else:
                fields[name] = value
        return fields, files
    accepted = " or ".join(kind for kind, ok in (("application/json", json_body), ("multipart/form-data", form))
                           if ok)
    raise ApiError(415, f"content type {content_type or '(none)'} is not accepted here; send {accepted}",
                   code="unsupported_media_type")


async def _model(state: _State, name: Any, kind: str) -> ServedModel:
    models = await state.triton.models()
    if name is None:
        of_kind = [m for m in models.values() if m.kind == kind]
        if len(of_kind) == 1:
            return of_kind[0]
        raise invalid("model", f"'model' is required: one of {', '.join(sorted(models)) or '(none served)'}")
    if not isinstance(name, str):
        raise invalid("model", "'model' must be a string")
    if name not in models:
        raise ApiError(404, f"the model '{name}' does not exist; served: {', '.join(sorted(models)) or '(none)'}",
                       param="model", code="model_not_found")
    model = models[name]
    if model.kind != kind:
        raise invalid("model", f"'{name}' makes {model.kind}s, not {kind}s")
    return model


def _model_inputs(fields: dict[str, Any], model: ServedModel, used: set[str]) -> dict[str, Any]:
    """The request's fields that are the model's inputs, typed (the model's
    own as it publishes them); any other unknown field is refused."""
    inputs = {}
    for name, value in fields.items():
        if name in used or value is None:
            continue
        if name in MODEL_FIELDS:
            inputs[name] = typed(name, value, MODEL_FIELDS[name])
        elif name in ADAPTER_FIELDS:
            inputs[name] = typed_list(name, value, ADAPTER_FIELDS[name])
        elif name in model.inputs:
            inputs[name] = _published_field(name, value, model.inputs[name].tensor)
        else:
            raise invalid(name, f"unknown parameter '{name}'", code="unknown_parameter")
    return inputs


def _published_field(name: str, value: Any, tensor) -> Any:
    """A field of one of the model's own inputs, typed as the model publishes it (its shape is checked with
    the request)."""
    from machgen.contract.api import python_type

    kind = python_type(tensor.triton_dtype)
    if tensor.dims == (1,):
        return typed(name, value, kind)
    return typed_list(name, value, kind) if len(tensor.dims) == 1 else value


class _AnyAdapter:
    """The adapters a model has change while it runs (machgen-build lora add): the server checks the names."""

    def __contains__(self, name: object) -> bool:
        return True

    def __iter__(self):
        return iter(())


def _check_request(model: ServedModel, inputs: dict[str, Any]) -> None:
    """The request checked as the sampler will check it, but for the values
    of the model's own inputs (their type and shape only, as the model
    publishes them): a bad field answers 400 naming it before any job exists
    (the server checks again, and its INVALID_ARGUMENT names the field too)."""
    from machgen.contract.api import API_INPUTS, InvalidArgument, input_array, parse_request
    from machgen.contract.specs import CACHE_POLICY_NAMES, Capabilities, ServedDefaults

    if "guidance_is_cfg" not in model.card:
        return  # a card from before cards described the model's own inputs: the server alone checks
    declared = {t.name: t for t in API_INPUTS} | {name: d.tensor for name, d in model.inputs.items()}
    arrays = {}
    for name, value in inputs.items():
        if name in declared:
            try:
                arrays[name] = input_array(declared[name], value)
            except (TypeError, ValueError, OverflowError) as err:
                raise invalid(name, f"'{name}': {err}") from None
    try:
        parse_request(arrays.get, ServedDefaults.from_json(model.card["defaults"]),
                      size_multiple=model.card["size_multiple"],
                      capabilities=Capabilities(tuple(model.card["tasks"]), model.card["guidance_is_cfg"],
                                                model.card["audio"]),
                      cache_policies=CACHE_POLICY_NAMES, frame_multiple=model.card["frame_multiple"],
                      family_inputs=tuple(model.inputs.values()), settings=model.card.get("family_settings", {}),
                      adapters=_AnyAdapter)
    except InvalidArgument as err:
        raise invalid(err.field, str(err)) from None
    interval = inputs.get("preview_interval")
    if interval is not None and interval < 0:
        raise invalid("preview_interval", f"invalid input 'preview_interval': {interval} is negative")


def _seed(fields: dict[str, Any]) -> int:
    seed = fields.get("seed")
    if seed is None:
        return secrets.randbelow(SEED_LIMIT - MAX_VARIANTS)
    return typed("seed", seed, int)


async def _callback(state: _State, fields: dict[str, Any]) -> str | None:
    from machgen.api.destinations import RefusedDestination

    url = fields.get("callback_url")
    if url is None:
        return None
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise invalid("callback_url", "'callback_url' must be an http:// or https:// URL")
    if state.webhooks.policy is None:
        raise invalid("callback_url", "this API sends no webhooks: it was started without a webhook secret",
                      code="webhooks_disabled")
    try:
        await asyncio.to_thread(state.webhooks.destinations.check, url)
    except RefusedDestination as err:
        raise invalid("callback_url", f"'callback_url' is refused: {err}", code="callback_refused") from None
    return url


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


def partial_image_interval(model: ServedModel, inputs: dict[str, Any], wanted: int) -> int:
    """Steps between previews that make ``wanted`` partial images of each image, spread over its denoising
    (an edit denoises the last ``strength`` of its steps; no preview follows the last step)."""
    from machgen.contract.api import DEFAULT_STRENGTH

    steps = int(inputs.get("num_inference_steps") or model.defaults["num_inference_steps"])
    if inputs.get("image") is not None:
        steps = max(int(steps * (inputs.get("strength") or DEFAULT_STRENGTH)), 1)
    return max(steps // (wanted + 1), 1)


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


def _partial_image(preview_url: str, request: dict[str, Any]) -> str:
    """A preview (a PNG data URL at the latents' size) as a partial image: base64 of the request's size and
    output format."""
    import io

    import numpy as np
    from PIL import Image

    from machgen.api.jobs import picture_bytes

    with Image.open(io.BytesIO(base64.b64decode(preview_url.split(",", 1)[1]))) as preview:
        picture = preview.convert("RGB").resize((int(request["width"]), int(request["height"])),
                                                Image.Resampling.NEAREST)
    encoded = picture_bytes(np.asarray(picture), request.get("output_format", "png"),
                            request.get("output_compression"))
    return base64.b64encode(encoded).decode()


def _query(request, allowed: dict[str, type]) -> dict[str, Any]:
    """The query's parameters, typed; one the route does not take is refused by name (as a body's are)."""
    for name in request.query_params:
        if name not in allowed:
            raise invalid(name, f"unknown query parameter '{name}'; this route takes "
                                f"{', '.join(allowed) or 'none'}", code="unknown_parameter")
    return {name: typed(name, request.query_params[name], kind) for name, kind in allowed.items()
            if name in request.query_params}


def _page(request, extra: dict[str, type] | None = None) -> tuple[int, str | None, bool, dict[str, Any]]:
    """OpenAI's list parameters: (``limit`` 0-100, default 20; ``after``; ascending, from ``order`` asc or
    desc, default desc; the query, ``extra`` included)."""
    query = _query(request, {"limit": int, "after": str, "order": str, **(extra or {})})
    limit = bounded("limit", query.get("limit", 20), 0, 100)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", f"'order' must be asc or desc, not {order!r}")
    return limit, query.get("after"), order == "asc", query


def _failure_error(job: Job) -> ApiError:
    """A failed or cancelled job as the synchronous request's error answer."""
    error = job.error or {"code": "internal", "message": "the job failed"}
    code = error.get("code")
    if code == "invalid_arg":
        return ApiError(400, error["message"], param=error.get("param"), code="invalid_value")
    if code == "unavailable":
        return ApiError(503, error["message"], code="server_busy", headers={"Retry-After": "1"})
    if code == "cancelled":
        return ApiError(409, f"job {job.id} was cancelled", code="cancelled")
    return ApiError(500, error["message"], code=code)


# --------------------------------------------------------------------------- the app


def create_app(settings: ApiSettings) -> FastAPI:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import GaugeMetricFamily
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    registry = CollectorRegistry()
    if settings.webhook_secret is not None:
        secret_key(settings.webhook_secret)  # refused at start, not at the first job

    @contextlib.asynccontextmanager
    async def lifespan(app):
        store = JobStore(settings.data_dir, settings.database_url or settings.database)
        triton = TritonModels(settings.triton_url)
        webhooks = WebhookSender(WebhookPolicy(settings.webhook_secret, settings.webhook_attempts,
                                               settings.webhook_first_delay_s)
                                 if settings.webhook_secret else None, store,
                                 DestinationPolicy(allow_private=settings.allow_private_callbacks))
        if not store.shared:  # alone on its database: what it was running when it stopped is lost
            interrupted = [store.get(job_id) for job_id in store.fail_interrupted()]
            if interrupted:
                log.warning("%d jobs were running when the API last stopped: marked failed", len(interrupted))
            for job in interrupted:  # their callers still learn of it
                if job is not None and job.request.get("callback_url"):
                    webhooks.send(job.request["callback_url"], f"{job.kind}.failed", public_object(job))
        if settings.keys_file is not None:
            keys = KeyRing(read_keys(settings.keys_file))
        else:
            keys = StoredKeyRing(store) if store.shared else KeyRing(None)
        signer = UrlSigner(bytes.fromhex(store.setting("url_signing_key", lambda: secrets.token_hex(32)))) \
            if store.shared else UrlSigner.in_folder(settings.data_dir)
        jobs = JobManager(store, triton, webhooks, JobMetrics(registry), settings.result_ttl_s,
                          settings.queue_retry_s, settings.job_lease_s, settings.max_latents_bytes,
                          settings.max_running_per_key)
        state = _State(settings, store, triton, keys, webhooks, jobs, signer)
        app.state.machgen = state
        loop = asyncio.get_running_loop()
        state.tasks += [loop.create_task(_expire_results(store)), loop.create_task(webhooks.run()),
                        loop.create_task(jobs.hold_leases())]
        if store.shared:
            state.tasks.append(loop.create_task(jobs.take_over()))
        try:
            yield
        finally:
            for task in state.tasks:
                task.cancel()
            await state.jobs.stop()
            await webhooks.drain()
            await triton.close()
            store.close()

    app = FastAPI(title="machgen", lifespan=lifespan, docs_url="/docs", redoc_url=None)

    class JobStates:
        def collect(self):
            gauge = GaugeMetricFamily("machgen_api_jobs", "Jobs by state", labels=["state"])
            state = getattr(app.state, "machgen", None)
            counts = state.store.counts() if state is not None else {}
            for name in ("queued", "in_progress", "completed", "failed", "cancelled"):
                gauge.add_metric([name], counts.get(name, 0))
            yield gauge

    registry.register(JobStates())

    def state_of(request: Request) -> _State:
        return request.app.state.machgen

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
        message = f"no route {request.method} {request.url.path}" if error.status_code in (404, 405) \
            else str(error.detail)
        return JSONResponse(ApiError(error.status_code, message, code=code).body(), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        """FastAPI's own checks (a parameter of the wrong type) answered in OpenAI's shape, not its 422."""
        problems = error.errors()
        where = problems[0].get("loc", ()) if problems else ()
        param = str(where[-1]) if where else None
        message = "; ".join(f"'{'.'.join(str(part) for part in problem.get('loc', ()))}': {problem.get('msg')}"
                            for problem in problems) or "the request is not valid"
        return JSONResponse(ApiError(400, message, param=param).body(), status_code=400)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, error: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(ApiError(500, f"internal error: {type(error).__name__}: {error}").body(),
                            status_code=500)

    # ---- pages, health, metrics
    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(PLAYGROUND, media_type="text/html") if PLAYGROUND.exists() else HTMLResponse("machgen")

    @app.get("/health")
    async def health(request: Request):
        ready = await state_of(request).triton.ready()
        return JSONResponse({"status": "ok" if ready else "triton_unavailable", "triton": ready},
                            status_code=200 if ready else 503)

    @app.get("/metrics", include_in_schema=False)
    async def metrics(request: Request):
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4")

    # ---- models
    def model_entry(model: ServedModel) -> dict[str, Any]:
        defaults = model.defaults
        return {"id": model.name, "object": "model", "created": 0, "owned_by": "machgen", "kind": model.kind,
                "family": model.card["family"], "tasks": model.card["tasks"], "audio": model.card["audio"],
                "size_multiple": model.card["size_multiple"], "frame_multiple": model.card["frame_multiple"],
                "defaults": {name: defaults.get(name) for name in
                             ("width", "height", "num_inference_steps", "guidance_scale", "num_frames", "fps",
                              "max_width", "max_height", "max_frames", "max_inference_steps")}}

    @app.get("/v1/models")
    async def list_models(request: Request):
        state = state_of(request)
        _caller(state, request)
        return {"object": "list", "data": [model_entry(m) for m in (await state.triton.models()).values()]}

    @app.get("/v1/models/{name}")
    async def get_model(name: str, request: Request):
        state = state_of(request)
        _caller(state, request)
        models = await state.triton.models()
        if name not in models:
            raise ApiError(404, f"the model '{name}' does not exist", param="model", code="model_not_found")
        return model_entry(models[name])

    # ---- jobs in common
    async def submit(request: Request, state: _State, kind: str, model: ServedModel, variants: list[dict[str, Any]],
                     recorded: dict[str, Any], waits_in_queue: bool) -> Job:
        """The job started; an Idempotency-Key its owner used before gives that job back instead."""
        owner, limit = _caller(state, request)
        idempotency = request.headers.get("idempotency-key")
        if idempotency:
            existing = state.store.find_idempotent(owner, idempotency)
            if existing is not None:
                return existing
        if state.jobs.in_flight(owner) >= limit:
            raise ApiError(429, f"{limit} jobs of this key are in flight already; wait for one to finish",
                           code="too_many_jobs", headers={"Retry-After": "2"})
        new = Job(new_job_id(kind), kind, model.name, owner, recorded, idempotency_key=idempotency or None)
        return state.jobs.submit(new, model, variants, waits_in_queue)

    def job_for(state: _State, request: Request, job_id: str, kind: str | None = None) -> Job:
        owner, _ = _caller(state, request)
        job = state.store.get(job_id)
        if job is None or (state.keys.required and job.owner != owner) or (kind is not None and job.kind != kind):
            raise ApiError(404, f"no {kind or 'job'} with id '{job_id}'", param="id", code="not_found")
        running = state.jobs.running.get(job_id)
        return running.job if running is not None else job

    def with_preview_default(inputs: dict[str, Any]) -> None:
        if "preview_interval" not in inputs and settings.preview_interval is not None:
            inputs["preview_interval"] = settings.preview_interval

    async def refine_of(state: _State, request: Request, fields: dict[str, Any], model: ServedModel,
                        inputs: dict[str, Any], kind: str = "image") -> dict[str, Any]:
        """A refine's inputs from its parent job (one of the caller's, finished with kept latents): the
        parent's size, steps and settings unless the request gives others, and its latents at the step; what
        the job records of its parent (with the seed it continues). The pictures the parent was conditioned
        on at every step (its ``pictured`` inputs) must be in ``inputs`` again."""
        parent_id = fields["parent"]
        if not isinstance(parent_id, str):
            raise invalid("parent", "'parent' must be a job id")
        owner, _ = _caller(state, request)
        parent = state.store.get(parent_id)
        if parent is None or parent.owner != owner or parent.kind != kind:
            raise no_parent(parent_id)
        if parent.model != model.name:
            raise invalid("parent", f"the parent job ran on '{parent.model}', not '{model.name}'")
        missing = [name for name in parent.request.get("pictured", []) if name not in inputs]
        if missing:
            field = {"image": "input_reference"}.get(missing[0], missing[0])
            raise invalid(field, f"the parent was conditioned on '{field}' at every step: a refine takes it again "
                                 f"(the same picture continues the parent's trajectory)")
        if parent.status != "completed" or not parent.request.get("latents"):
            raise invalid("parent", f"job {parent_id} is {parent.status} and kept no latents: a parent is a "
                                    f"completed job sent with 'keep_latents'", code="parent_without_latents")
        if fields.get("n") not in (None, 1) or fields.get("prompts") is not None:
            raise invalid("n", "a refine continues one trajectory: 'n' is 1")
        index = typed("parent_index", fields.get("parent_index", 0), int)
        listed = {entry["index"]: entry for entry in parent.request["latents"]}
        if index not in listed:
            raise invalid("parent_index", f"job {parent_id} kept the latents of its images {sorted(listed)}")
        if fields.get("size") is not None and parse_size(fields["size"], model.defaults) != (
                parent.request["width"], parent.request["height"]):
            raise invalid("size", f"a refine keeps its parent's size, {parent.request['width']}x"
                                  f"{parent.request['height']}")
        steps = int(parent.request.get("steps") or model.defaults["num_inference_steps"])
        if fields.get("num_inference_steps") not in (None, steps):
            raise invalid("num_inference_steps", f"a refine keeps its parent's schedule of {steps} steps")
        step = refine_step(fields, steps)
        if step not in listed[index]["steps"]:
            raise invalid("step", f"job {parent_id} kept its latents after steps {listed[index]['steps']}, not "
                                  f"after step {step}")
        data = await asyncio.to_thread(state.store.read_result, parent_id, LATENTS_FILE.format(index=index))
        if data is None:
            raise invalid("parent", f"the results of job {parent_id} have expired", code="expired")
        kept_steps, rows = read_latents(data)
        for name, value in parent.request.items():  # the parent's settings, unless this request gives its own
            if name in MODEL_FIELDS or name in ADAPTER_FIELDS or name in model.inputs:
                if name not in ("priority", "preview_interval", "trajectory_steps", "start_step"):
                    inputs.setdefault(name, value)
        inputs["width"], inputs["height"] = parent.request["width"], parent.request["height"]
        inputs.update(num_inference_steps=steps, start_step=step, start_latents=rows[kept_steps.index(step)])
        seed = parent.request["seeds"][listed[index].get("variant", index)] if parent.request.get("seeds") else 0
        return {"parent": parent_id, "parent_index": index, "step": step, "seed": seed}

    async def explore_of(state: _State, fields: dict[str, Any], n: int, steps: int,
                         refined: dict[str, Any] | None) -> ExploreSettings | None:
        """The request's explore plan (a scorer URL checked: allowed, and answering), or None; 400 naming the
        field."""
        if fields.get("explore") is None:
            return None
        if refined is not None:
            raise invalid("explore", "a refine continues one trajectory: it does not explore")
        explore = explore_settings(fields["explore"], n, steps)
        if explore.by_callback:
            await check_scorer(explore.scorer, state.webhooks.destinations,
                               state.webhooks.policy.secret if state.webhooks.policy else None, explore.timeout_s)
        return explore

    def early_file(state: _State, job: Job, index: int) -> Response:
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

    # ---- images
    async def image_job(request: Request, edit: bool):
        state = state_of(request)
        _caller(state, request)
        fields, files = await _read_fields(state, request, form=edit, json_body=not edit)
        model = await _model(state, fields.get("model"), "image")
        prompt = fields.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise invalid("prompt", "'prompt' is required: a non-empty string")
        n = bounded("n", fields["n"], 1, MAX_VARIANTS) if fields.get("n") is not None else 1
        options = image_options(fields, edit)
        stream = options["stream"]
        run_async = typed("async", fields.get("async", False), bool)
        if run_async and stream:
            raise invalid("stream", "a request answered at once ('async': true) is not streamed")
        seed = _seed(fields)
        inputs = {"prompt": prompt}
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
        used = {"model", "prompt", "n", "async", "size", "seed", "callback_url", "image", "mask", *options,
                *AGENT_FIELDS}
        refined = await refine_of(state, request, fields, model, inputs) if fields.get("parent") is not None else None
        if refined is not None:
            seed = refined.pop("seed")
            used.add("strength")
        inputs.update(_model_inputs(fields, model, used))
        _scheduling(state, request, model, inputs)
        if options["partial_images"] and "preview_interval" not in inputs:
            inputs["preview_interval"] = partial_image_interval(model, inputs, options["partial_images"])
        with_preview_default(inputs)
        callback_url = await _callback(state, fields)
        steps = int(inputs.get("num_inference_steps") or model.defaults["num_inference_steps"])
        kept = kept_latents(fields.get("keep_latents"), inputs.get("start_step", 0), steps)
        if kept:
            inputs["trajectory_steps"] = kept
        _check_request(model, {**inputs, "seed": seed})
        prompts = prompt_variants(fields.get("prompts"), prompt, n)
        explore = await explore_of(state, fields, n, steps, refined)
        if explore is None and fields.get("prompts") is not None and n < 2:
            raise invalid("prompts", "prompt variants need 'n' of 2 or more")
        variants = [{**inputs, "prompt": prompts[index], "seed": seed + index} for index in range(n)]
        recorded = {name: value for name, value in inputs.items() if name not in ("image", "start_latents")}
        recorded.update(n=explore.keep if explore else n, seeds=[seed + index for index in range(n)], edit=edit,
                        callback_url=callback_url, usage=image_usage(model, inputs, n), steps=steps, **options,
                        **(refined or {}), **({"explore": explore.to_json(), "prompts": prompts} if explore else {}))
        job = await submit(request, state, "image", model, variants, recorded, waits_in_queue=run_async)
        if run_async:
            return job_object(job)
        if stream:
            return StreamingResponse(_image_stream(state, job, str(request.base_url)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                              "X-Machgen-Job-Id": job.id})
        job = await state.jobs.wait(job.id)
        if job.status != "completed":
            raise _failure_error(job)
        return image_answer(state, job, str(request.base_url))

    def result_url(state: _State, job: Job, index: int, base_url: str) -> str:
        """A URL of one image that a plain GET downloads, keys or not, until it expires (an hour, or the
        results' own expiry when sooner)."""
        expires = int(min(time.time() + settings.url_ttl_s, job.expires_at or float("inf")))
        return base_url.rstrip("/") + state.signer.sign(f"/v1/jobs/{job.id}/content", {"index": str(index)},
                                                        expires)

    def image_answer(state: _State, job: Job, base_url: str) -> dict[str, Any]:
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

    async def _image_stream(state: _State, job: Job, base_url: str) -> AsyncIterator[bytes]:
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
                yield _sse(f"{prefix}.partial_image", {
                    "type": f"{prefix}.partial_image", "b64_json": partial, "created_at": int(time.time()),
                    **described, "partial_image_index": sent.get(index, 0),
                    "machgen": {"job_id": job.id, "index": index, "step": data["step"]}})
                sent[index] = sent.get(index, 0) + 1
        job = await state.jobs.wait(job.id)
        if job.status != "completed":
            yield _sse("error", {"type": "error", **_failure_error(job).body()})
            return
        answer = image_answer(state, job, base_url)
        for index, name in enumerate(job.outputs):
            encoded = base64.b64encode(stored_result(state, job, name)).decode()
            yield _sse(f"{prefix}.completed", {
                "type": f"{prefix}.completed", "b64_json": encoded, "created_at": job.completed_at or job.created_at,
                **described, "usage": image_usage_of_one(request["usage"], request["n"]),
                **({"url": answer["data"][index]["url"]} if request.get("response_format") == "url" else {}),
                "machgen": {"job_id": job.id, "index": index, "seed": request["seeds"][index],
                            "stats": job.stats[index] if index < len(job.stats) else None}})

    @app.post("/v1/images/generations")
    async def images_generations(request: Request):
        return await image_job(request, edit=False)

    @app.post("/v1/images/edits")
    async def images_edits(request: Request):
        return await image_job(request, edit=True)

    # ---- videos
    @app.post("/v1/videos")
    async def create_video(request: Request):
        state = state_of(request)
        _caller(state, request)
        fields, files = await _read_fields(state, request, form=True, json_body=True)
        return await video_job(request, state, fields, files)

    @app.post("/v1/videos/{video_id}/remix")
    async def remix_video(video_id: str, request: Request):
        """OpenAI's remix: the video again under a new prompt, a refine of it (the video must have kept its
        latents, keep_latents). From half its steps unless the body says ``step`` or ``strength``."""
        state = state_of(request)
        parent = job_for(state, request, video_id, "video")
        fields, files = await _read_fields(state, request, form=False, json_body=True)
        if fields.get("parent") is not None:
            raise invalid("parent", "a remix's parent is the video of its path", code="unknown_parameter")
        if fields.get("step") is None and fields.get("strength") is None:
            fields["strength"] = REMIX_STRENGTH
        return await video_job(request, state, {"model": parent.model, **fields, "parent": video_id}, files)

    async def video_job(request: Request, state: _State, fields: dict[str, Any], files: dict[str, list[bytes]]):
        model = await _model(state, fields.get("model"), "video")
        prompt = fields.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise invalid("prompt", "'prompt' is required: a non-empty string")
        defaults = model.defaults
        inputs: dict[str, Any] = {"prompt": prompt}
        reference = files.get("input_reference") or ([] if fields.get("input_reference") is None else None)
        if reference is None:
            reference = [_data_url_bytes("input_reference", fields["input_reference"])]
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
        refined = await refine_of(state, request, fields, model, inputs, "video") if fields.get("parent") is not None \
            else None
        if refined is None:
            inputs["width"], inputs["height"] = parse_size(fields.get("size"), defaults)
        # A refine's length is its parent's (a refine keeps the latents' shape); given again, it must be the same.
        fps = typed("fps", fields["fps"], int) if fields.get("fps") is not None else int(
            inputs.get("fps") or defaults.get("fps") or 16)
        if fields.get("seconds") is not None and fields.get("num_frames") is not None:
            raise invalid("seconds", "give 'seconds' or 'num_frames', not both")
        if fields.get("seconds") is not None:
            seconds = typed("seconds", fields["seconds"], float)
            if seconds <= 0:
                raise invalid("seconds", f"'seconds' must be positive, not {seconds:g}")
            multiple = model.card["frame_multiple"]
            frames = max(round(seconds * fps / multiple), 1) * multiple + 1
        elif fields.get("num_frames") is not None:
            frames = typed("num_frames", fields["num_frames"], int)
        else:
            frames = int(inputs.get("num_frames") or defaults["num_frames"])
        if refined is not None and (frames, fps) != (inputs["num_frames"], inputs["fps"]):
            field = "fps" if fps != inputs["fps"] else ("seconds" if fields.get("seconds") is not None else "num_frames")
            raise invalid(field, f"a refine keeps its parent's {inputs['num_frames']} frames at {inputs['fps']} fps")
        inputs["num_frames"], inputs["fps"] = frames, fps
        seed = _seed(fields)
        n = bounded("n", fields["n"], 1, MAX_VARIANTS) if fields.get("n") is not None else 1
        used = {"model", "prompt", "size", "seconds", "num_frames", "fps", "input_reference", "reference_images",
                "seed", "callback_url", "n", *AGENT_FIELDS}
        if refined is not None:
            seed = refined.pop("seed")
            used.add("strength")
        inputs.update(_model_inputs(fields, model, used))
        _scheduling(state, request, model, inputs)
        with_preview_default(inputs)
        callback_url = await _callback(state, fields)
        steps = int(inputs.get("num_inference_steps") or defaults["num_inference_steps"])
        kept = kept_latents(fields.get("keep_latents"), inputs.get("start_step", 0), steps)
        if kept:
            inputs["trajectory_steps"] = kept
        _check_request(model, {**inputs, "seed": seed})
        # A video job makes one video, unless it explores: n variants, the best explore.keep continued.
        explore = await explore_of(state, fields, n, steps, refined)
        if explore is None and n > 1:
            raise invalid("n", "a video job makes one video: 'n' variants are an explore's (give 'explore')")
        if explore is None and fields.get("prompts") is not None:
            raise invalid("prompts", "prompt variants are an explore's: give 'explore' and 'n'")
        prompts = prompt_variants(fields.get("prompts"), prompt, n)
        recorded = {name: value for name, value in inputs.items() if name not in ("image", "reference_images",
                                                                                  "start_latents")}
        recorded.update(n=explore.keep if explore else 1, seeds=[seed + index for index in range(n)],
                        image_to_video="image" in inputs, callback_url=callback_url, steps=steps,
                        pictured=pictured, **(refined or {}),
                        **({"explore": explore.to_json(), "prompts": prompts} if explore else {}))
        variants = [{**inputs, "prompt": prompts[index], "seed": seed + index} for index in range(n)]
        job = await submit(request, state, "video", model, variants, recorded, waits_in_queue=True)
        return video_object(job)

    @app.get("/v1/videos")
    async def list_videos(request: Request):
        state = state_of(request)
        owner, _ = _caller(state, request)
        limit, after, ascending, _ = _page(request)
        jobs = state.store.list("video", owner if state.keys.required else None, limit + 1, after, ascending)
        data = [video_object(state.jobs.running[j.id].job if j.id in state.jobs.running else j)
                for j in jobs[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(jobs) > limit}

    @app.get("/v1/videos/{video_id}")
    async def get_video(video_id: str, request: Request):
        return video_object(job_for(state_of(request), request, video_id, "video"))

    @app.delete("/v1/videos/{video_id}")
    async def delete_video(video_id: str, request: Request):
        """OpenAI's delete: the video is gone (stopped first if it runs), its id answers 404 after."""
        state = state_of(request)
        job = job_for(state, request, video_id, "video")
        await state.jobs.cancel(job.id)
        state.jobs.forget(job.id)
        state.store.delete(job.id)
        return {"id": job.id, "object": "video.deleted", "deleted": True}

    @app.get("/v1/videos/{video_id}/content")
    async def video_content(video_id: str, request: Request):
        state = state_of(request)
        query = _query(request, {"variant": str, "index": int, "early": int})
        variant = openai_video_variant(query.get("variant", "video"))
        job = job_for(state, request, video_id, "video")
        if "early" in query:
            return early_file(state, job, query["early"])
        return result_file(state, job, result_stem(variant, result_index(job, query.get("index", 0))))

    def openai_video_variant(variant: str) -> str:
        if variant not in ("video", "thumbnail", "spritesheet"):
            raise invalid("variant", f"'variant' must be video, thumbnail or spritesheet, not {variant!r}")
        if variant == "spritesheet":
            raise invalid("variant", "'variant' spritesheet is not made here: video or thumbnail",
                          code="unsupported_value")
        return variant

    def result_file(state: _State, job: Job, stem: str):
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

    def stored_result(state: _State, job: Job, name: str) -> bytes:
        data = state.store.read_result(job.id, name)
        if data is None:
            raise ApiError(404, f"the results of job {job.id} have expired", code="expired")
        return data

    # ---- jobs
    @app.get("/v1/jobs")
    async def list_jobs(request: Request):
        state = state_of(request)
        owner, _ = _caller(state, request)
        limit, after, ascending, query = _page(request, {"kind": str})
        if query.get("kind") not in (None, "image", "video"):
            raise invalid("kind", f"'kind' must be image or video, not {query['kind']!r}")
        jobs = state.store.list(query.get("kind"), owner if state.keys.required else None, limit + 1, after,
                                ascending)
        data = [job_object(state.jobs.running[j.id].job if j.id in state.jobs.running else j) for j in jobs[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(jobs) > limit}

    @app.get("/v1/jobs/{job_id}")
    async def get_job(job_id: str, request: Request):
        return job_object(job_for(state_of(request), request, job_id))

    @app.delete("/v1/jobs/{job_id}")
    async def cancel_job(job_id: str, request: Request):
        state = state_of(request)
        job = job_for(state, request, job_id)
        await state.jobs.cancel(job.id)
        return job_object(state.store.get(job.id) or job)

    @app.get("/v1/jobs/{job_id}/content")
    async def job_content(job_id: str, request: Request):
        """A job's file: with the API key, or by a signed URL (result_url) that needs none until it expires."""
        state = state_of(request)
        signed = "signature" in request.query_params
        query = _query(request, {"index": int, "early": int,
                                 **({"expires": str, "signature": str} if signed else {})})
        index = query.get("index", 0)
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
        if "early" in query:  # an explored variant's early image or clip, at the step it was scored
            return early_file(state, job, query["early"])
        index = result_index(job, index)
        return result_file(state, job, result_stem("video", index) if job.kind == "video" else f"image-{index}")

    @app.get("/v1/jobs/{job_id}/events")
    async def job_events(job_id: str, request: Request):
        state = state_of(request)
        job = job_for(state, request, job_id)

        async def events() -> AsyncIterator[bytes]:
            followed = state.jobs.events(job.id)
            if followed is None:  # finished before this process kept its events: its end alone
                yield _sse(job.status if job.finished else "failed", job_object(job))
                return
            async for event, data in followed.follow():
                yield _sse(event, data)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


def _data_url_bytes(name: str, value: Any) -> bytes:
    """An image given in JSON: a data URL or {"image_url": data URL} (no fetching of remote URLs)."""
    if isinstance(value, dict):
        value = value.get("image_url")
    if not isinstance(value, str) or not value.startswith("data:") or ";base64," not in value:
        raise invalid(name, f"'{name}' in JSON must be a base64 data URL (or upload it as a file with "
                            f"multipart/form-data)")
    try:
        return base64.b64decode(value.split(";base64,", 1)[1], validate=True)
    except ValueError:
        raise invalid(name, f"'{name}' is not valid base64") from None


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


async def _expire_results(store: JobStore, every_s: float = 60.0) -> None:
    while True:
        expired = await asyncio.to_thread(store.expire, time.time())
        if expired:
            log.info("results of %d jobs expired", len(expired))
        await asyncio.sleep(every_s)
