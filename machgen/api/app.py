"""The HTTP API (FastAPI): OpenAI's images and videos routes, machgen's jobs, events, the playground page and
metrics. ``create_app(ApiSettings)`` assembles it: the process's parts (state.py) made at start and closed at
the end, errors answered in OpenAI's shape, and the routers of routes/, one per resource."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from machgen.api.destinations import DestinationPolicy
from machgen.api.jobs import JobManager, JobMetrics
from machgen.api.keys import KeyRing, StoredKeyRing, UrlSigner, read_keys
from machgen.api.routes import health, images, jobs, models, playground, realtime, videos
from machgen.api.schemas import ApiError, public_object
from machgen.api.settings import ApiSettings
from machgen.api.state import ApiState
from machgen.api.store import JobStore
from machgen.api.triton import TritonModels
from machgen.api.webhooks import WebhookPolicy, WebhookSender, secret_key

log = logging.getLogger("machgen.api")
ROUTERS = (playground.router, health.router, models.router, images.router, videos.router, jobs.router,
           realtime.router)


def create_app(settings: ApiSettings) -> FastAPI:
    from prometheus_client import CollectorRegistry

    if settings.webhook_secret is not None:
        secret_key(settings.webhook_secret)  # refused at start, not at the first job

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state = _start(settings, app.state.registry)
        app.state.machgen = state
        try:
            yield
        finally:
            for task in state.tasks:
                task.cancel()
            await state.jobs.stop()
            await state.webhooks.drain()
            await state.triton.close()
            state.store.close()

    app = FastAPI(title="machgen", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    app.state.registry = CollectorRegistry()
    app.state.registry.register(_JobStates(app))
    _answer_errors_as_openai(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


def _start(settings: ApiSettings, registry) -> ApiState:
    """The process's parts: the job store (jobs the last run left running marked failed, where this process is
    alone on its database), Triton, webhooks, keys, the URL signer and the jobs, with their background tasks."""
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
    state = ApiState(settings, store, triton, keys, webhooks, jobs, signer)
    loop = asyncio.get_running_loop()
    state.tasks += [loop.create_task(_expire_results(store)), loop.create_task(webhooks.run()),
                    loop.create_task(jobs.hold_leases())]
    if store.shared:
        state.tasks.append(loop.create_task(jobs.take_over()))
    return state


class _JobStates:
    """/metrics' jobs by state, counted in the store when scraped."""

    def __init__(self, app: FastAPI):
        self.app = app

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        gauge = GaugeMetricFamily("machgen_api_jobs", "Jobs by state", labels=["state"])
        state = getattr(self.app.state, "machgen", None)
        counts = state.store.counts() if state is not None else {}
        for name in ("queued", "in_progress", "completed", "failed", "cancelled"):
            gauge.add_metric([name], counts.get(name, 0))
        yield gauge


def _answer_errors_as_openai(app: FastAPI) -> None:
    """Every error in OpenAI's shape, the framework's own too: an unknown route, a wrong method, a parameter of
    the wrong type, an unexpected failure."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

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


async def _expire_results(store: JobStore, every_s: float = 60.0) -> None:
    while True:
        expired = await asyncio.to_thread(store.expire, time.time())
        if expired:
            log.info("results of %d jobs expired", len(expired))
        await asyncio.sleep(every_s)
