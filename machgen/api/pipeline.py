"""One request pipeline for image and video jobs: the served model the request names, its fields typed as
the model's inputs (OpenAI's, machgen's and the model's own as it publishes them), a refine's parent, an
explore's plan, checked as the sampler will check them, then the job submitted. Each route reads its own
fields (images.py: OpenAI's image options; videos.py: frames and pictures) and hands the rest to a JobRequest."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

from machgen.api.explore import (
    LATENTS_FILE,
    ExploreSettings,
    check_scorer,
    explore_settings,
    kept_latents,
    no_parent,
    read_latents,
    refine_step,
)
from machgen.api.incoming import caller, owner_of
from machgen.api.jobs import new_job_id
from machgen.api.schemas import (
    ADAPTER_FIELDS,
    MAX_PROMPT_CHARACTERS,
    MAX_VARIANTS,
    MODEL_FIELDS,
    SEED_LIMIT,
    ApiError,
    bounded,
    invalid,
    parse_size,
    typed,
    typed_list,
)
from machgen.api.state import ApiState
from machgen.api.store import Job
from machgen.api.triton import ServedModel


async def served_model(state: ApiState, name: Any, kind: str) -> ServedModel:
    """The model the request names (of ``kind``, image or video); the one served of that kind where it names
    none."""
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


def prompt_of(fields: dict[str, Any]) -> str:
    """The request's prompt: a non-empty string within OpenAI's longest; 400 naming ``prompt``."""
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise invalid("prompt", "'prompt' is required: a non-empty string")
    if len(prompt) > MAX_PROMPT_CHARACTERS:
        raise invalid("prompt", f"'prompt' is {len(prompt)} characters long; at most {MAX_PROMPT_CHARACTERS} "
                                f"(OpenAI's limit)", code="string_above_max_length")
    return str(prompt)


def variant_count(fields: dict[str, Any]) -> int:
    """The request's ``n``: variants, 1 to MAX_VARIANTS (1 where not given)."""
    return bounded("n", fields["n"], 1, MAX_VARIANTS) if fields.get("n") is not None else 1


def drawn_seed(fields: dict[str, Any]) -> int:
    """The request's seed, or one drawn at random (room left for its variants' seeds after it)."""
    seed = fields.get("seed")
    if seed is None:
        return secrets.randbelow(SEED_LIMIT - MAX_VARIANTS)
    return typed("seed", seed, int)


def model_inputs(fields: dict[str, Any], model: ServedModel, used: set[str]) -> dict[str, Any]:
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


def check_request(model: ServedModel, inputs: dict[str, Any]) -> None:
    """The request checked as the sampler will check it, but for the values
    of the model's own inputs (their type and shape only, as the model
    publishes them): a bad field answers 400 naming it before any job exists
    (the server checks again, and its INVALID_ARGUMENT names the field too)."""
    from machgen.contract.api import API_INPUTS, input_array
    from machgen.contract.request import parse_request
    from machgen.contract.specs import CACHE_POLICY_NAMES, Capabilities, ServedDefaults
    from machgen.contract.validation import InvalidArgument

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


def partial_image_interval(model: ServedModel, inputs: dict[str, Any], wanted: int) -> int:
    """Steps between previews that make ``wanted`` partial images of each image, spread over its denoising
    (an edit denoises the last ``strength`` of its steps; no preview follows the last step)."""
    from machgen.contract.api import DEFAULT_STRENGTH

    steps = int(inputs.get("num_inference_steps") or model.defaults["num_inference_steps"])
    if inputs.get("image") is not None:
        steps = max(int(steps * (inputs.get("strength") or DEFAULT_STRENGTH)), 1)
    return max(steps // (wanted + 1), 1)


def job_for(state: ApiState, request, job_id: str, kind: str | None = None) -> Job:
    """The caller's job ``job_id`` (of ``kind`` where given), as this process runs it; 404 otherwise."""
    owner, _ = caller(state, request)
    job = state.store.get(job_id)
    if job is None or (state.keys.required and job.owner != owner) or (kind is not None and job.kind != kind):
        raise ApiError(404, f"no {kind or 'job'} with id '{job_id}'", param="id", code="not_found")
    running = state.jobs.running.get(job_id)
    return running.job if running is not None else job


def failure_error(job: Job) -> ApiError:
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


class JobRequest:
    """An image or video job's request on its way to a job, in the order both kinds take it: ``refine`` (a
    request naming a parent), ``complete`` (the model's inputs, the request's owner, previews, webhook, kept
    latents, all checked), ``explore`` (the plan of n variants), then ``submit``. ``used``: the fields the
    route read itself (any other is one of the model's inputs, or refused)."""

    def __init__(self, state: ApiState, request, kind: str, model: ServedModel, fields: dict[str, Any],
                 used: set[str]):
        self.state, self.request, self.kind, self.model, self.fields = state, request, kind, model, fields
        self.used = used
        self.refined: dict[str, Any] | None = None  # what the job records of its parent
        self.seed = 0
        self.steps = 0
        self.callback_url: str | None = None

    async def refine(self, inputs: dict[str, Any]) -> None:
        """Where the request names a ``parent``: its inputs from the parent job (refine_of)."""
        if self.fields.get("parent") is not None:
            self.refined = await refine_of(self.state, self.request, self.fields, self.model, inputs, self.kind)

    async def complete(self, inputs: dict[str, Any], seed: int, partial_images: int = 0) -> None:
        """``inputs`` completed from the request's other fields and checked as the sampler will check them; the
        seed (a refine's is its parent's), the steps and the webhook URL kept."""
        if self.refined is not None:
            seed = self.refined.pop("seed")
            self.used.add("strength")
        inputs.update(model_inputs(self.fields, self.model, self.used))
        self._scheduling(inputs)
        if partial_images and "preview_interval" not in inputs:
            inputs["preview_interval"] = partial_image_interval(self.model, inputs, partial_images)
        if "preview_interval" not in inputs and self.state.settings.preview_interval is not None:
            inputs["preview_interval"] = self.state.settings.preview_interval
        self.callback_url = await self._callback()
        self.steps = int(inputs.get("num_inference_steps") or self.model.defaults["num_inference_steps"])
        kept = kept_latents(self.fields.get("keep_latents"), inputs.get("start_step", 0), self.steps)
        if kept:
            inputs["trajectory_steps"] = kept
        check_request(self.model, {**inputs, "seed": seed})
        self.seed = seed

    async def explore(self, n: int) -> ExploreSettings | None:
        """The request's explore plan (a scorer URL checked: allowed, and answering), or None; 400 naming the
        field."""
        if self.fields.get("explore") is None:
            return None
        if self.refined is not None:
            raise invalid("explore", "a refine continues one trajectory: it does not explore")
        explore = explore_settings(self.fields["explore"], n, self.steps)
        if explore.by_callback:
            webhooks = self.state.webhooks
            await check_scorer(explore.scorer, webhooks.destinations,
                               webhooks.policy.secret if webhooks.policy else None, explore.timeout_s)
        return explore

    async def submit(self, inputs: dict[str, Any], n: int, prompts: list[str], explore: ExploreSettings | None,
                     waits_in_queue: bool, **recorded: Any) -> Job:
        """The job of ``n`` variants (seeds seed, seed + 1, ...; prompts in turn) started, its request recorded
        (``recorded``: the route's own fields of it); an Idempotency-Key its owner used before gives that job
        back instead."""
        seed = self.seed
        variants = [{**inputs, "prompt": prompts[index], "seed": seed + index} for index in range(n)]
        record = {name: value for name, value in inputs.items()
                  if name not in ("image", "reference_images", "start_latents")}
        record.update(n=explore.keep if explore else n, seeds=[seed + index for index in range(n)],
                      callback_url=self.callback_url, steps=self.steps, **recorded, **(self.refined or {}),
                      **({"explore": explore.to_json(), "prompts": prompts} if explore else {}))
        state, request = self.state, self.request
        owner, limit = caller(state, request)
        idempotency = request.headers.get("idempotency-key")
        if idempotency:
            existing = state.store.find_idempotent(owner, idempotency)
            if existing is not None:
                return existing
        if state.jobs.in_flight(owner) >= limit:
            raise ApiError(429, f"{limit} jobs of this key are in flight already; wait for one to finish",
                           code="too_many_jobs", headers={"Retry-After": "2"})
        new = Job(new_job_id(self.kind), self.kind, self.model.name, owner, record,
                  idempotency_key=idempotency or None)
        return state.jobs.submit(new, self.model, variants, waits_in_queue)

    def _scheduling(self, inputs: dict[str, Any]) -> None:
        """The request's owner, and its priority where given, sent as the model takes them (a model built before
        priorities takes neither: its requests are served first come, first served)."""
        if "owner" in self.model.accepts:
            inputs["owner"] = owner_of(self.state, self.request)
        elif inputs.get("priority") not in (None, "interactive"):
            raise invalid("priority", f"the model '{self.model.name}' was built before request priorities; "
                                      "rebuild it with this machgen to give it batch requests",
                          code="unsupported_value")
        else:
            inputs.pop("priority", None)

    async def _callback(self) -> str | None:
        from machgen.api.destinations import RefusedDestination

        url = self.fields.get("callback_url")
        if url is None:
            return None
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise invalid("callback_url", "'callback_url' must be an http:// or https:// URL")
        webhooks = self.state.webhooks
        if webhooks.policy is None:
            raise invalid("callback_url", "this API sends no webhooks: it was started without a webhook secret",
                          code="webhooks_disabled")
        try:
            await asyncio.to_thread(webhooks.destinations.check, url)
        except RefusedDestination as err:
            raise invalid("callback_url", f"'callback_url' is refused: {err}", code="callback_refused") from None
        return str(url)


async def refine_of(state: ApiState, request, fields: dict[str, Any], model: ServedModel,
                    inputs: dict[str, Any], kind: str) -> dict[str, Any]:
    """A refine's inputs from its parent job (one of the caller's, finished with kept latents): the
    parent's size, steps and settings unless the request gives others, and its latents at the step; what
    the job records of its parent (with the seed it continues). The pictures the parent was conditioned
    on at every step (its ``pictured`` inputs) must be in ``inputs`` again."""
    parent_id = fields["parent"]
    if not isinstance(parent_id, str):
        raise invalid("parent", "'parent' must be a job id")
    owner, _ = caller(state, request)
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
