"""Jobs run: each variant of a job (one of ``n`` images, or the video) is a
request to the model's streaming twin; their progress and previews become
the job's events (replayed to a late listener), their results files in the
job's results folder, and the job's end a webhook when it asked for one."""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import numpy as np

from machgen.api.explore import EARLY_FILE, LATENTS_FILE, ExploreSettings, latents_file, ranking, score
from machgen.api.media import data_url, mp4_bytes, picture_bytes, png_bytes, preview_picture
from machgen.api.schemas import job_object, public_object
from machgen.api.store import Job, JobStore, pack_inputs, unpack_inputs
from machgen.api.triton import ServedModel, StepReport, TritonFailure, TritonModels
from machgen.api.webhooks import WebhookSender
from machgen.client import RetryPolicy

log = logging.getLogger("machgen.api.jobs")
TERMINAL_EVENTS = ("completed", "failed", "cancelled")


def new_job_id(kind: str) -> str:
    return f"{'video' if kind == 'video' else 'img'}_{uuid.uuid4().hex}"


def result_stem(name: str, index: int) -> str:
    """The file name (without extension) of a video job's ``index``-th video or thumbnail: ``name`` for the
    first (OpenAI's one video), ``name-INDEX`` for an explore's others."""
    return name if index == 0 else f"{name}-{index}"


class JobEvents:
    """One job's events: kept for a late listener (only the latest preview of
    each variant), and every one of them handed to each listener from the
    moment it listens (a listener slower than the job misses no preview)."""

    def __init__(self):
        self.history: list[tuple[int, str, dict[str, Any]]] = []  # (sequence number, event, data)
        self.closed = False
        self._count = 0
        self._listeners: set[asyncio.Queue] = set()

    async def emit(self, event: str, data: dict[str, Any]) -> None:
        if event == "preview":
            self.history = [entry for entry in self.history
                            if not (entry[1] == "preview" and entry[2]["index"] == data["index"])]
        self._count += 1
        entry = (self._count, event, data)
        self.history.append(entry)
        self.closed = self.closed or event in TERMINAL_EVENTS
        for listener in self._listeners:
            listener.put_nowait(entry)

    async def follow(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """What the history holds now, then every event as it comes, until the job's last."""
        listener: asyncio.Queue = asyncio.Queue()
        # No await between the copy and the registration: no event falls between the two.
        kept = list(self.history)
        self._listeners.add(listener)
        try:
            for _, event, data in kept:
                yield event, data
            while not (self.closed and listener.empty()):
                _, event, data = await listener.get()
                yield event, data
        finally:
            self._listeners.discard(listener)


@dataclass
class Running:
    job: Job
    task: asyncio.Task | None = None
    events: JobEvents = field(default_factory=JobEvents)
    steps: dict[int, tuple[int, int]] = field(default_factory=dict)  # variant: (step, total)
    started: float | None = None
    lost: bool = False  # its lease was taken over by another API process


class JobMetrics:
    """What /metrics reports of jobs besides their count by state."""

    def __init__(self, registry):
        from prometheus_client import Counter, Histogram

        self.queue_seconds = Histogram("machgen_api_job_queue_seconds", "Seconds from a job's submission to its "
                                       "first denoising step", registry=registry,
                                       buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
        self.steps = Counter("machgen_api_denoising_steps", "Denoising steps run by the API's jobs (rate: "
                             "steps per second)", registry=registry)
        self.previews = Counter("machgen_api_previews_sent", "Preview pictures sent as job events",
                                registry=registry)
        self.finished = Counter("machgen_api_jobs_finished", "Jobs finished, by final state", ["state"],
                                registry=registry)
        by_owner = ["owner", "priority"]
        self.owner_queue_seconds = Histogram(
            "machgen_api_owner_queue_seconds", "Seconds from a job's submission to its first denoising step, by "
            "owner and priority", by_owner, registry=registry, buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800))
        self.owner_run_seconds = Histogram(
            "machgen_api_owner_run_seconds", "Seconds from a job's first denoising step to its end, by owner and "
            "priority", by_owner, registry=registry, buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800))
        self.owner_denoiser_seconds = Counter(
            "machgen_api_owner_denoiser_seconds", "Denoiser seconds the jobs' requests ran (their stats), by owner "
            "and priority: each owner's share of the model", by_owner, registry=registry)

    def observe_end(self, job: Job, started: float | None) -> None:
        labels = (job.request.get("owner") or job.owner, job.request.get("priority") or "interactive")
        if started is not None:
            self.owner_run_seconds.labels(*labels).observe(max(time.monotonic() - started, 0.0))
        denoised = sum(float(stats.get("denoiser_seconds") or 0.0) for stats in job.stats)
        if denoised:
            self.owner_denoiser_seconds.labels(*labels).inc(denoised)


class JobManager:
    """Starts, follows and cancels the jobs of one API process; holds their
    leases (store.py) and, on a shared database, takes over the jobs of a
    process whose leases ran out."""

    def __init__(self, store: JobStore, triton: TritonModels, webhooks: WebhookSender, metrics: JobMetrics,
                 result_ttl_s: float, queue_retry_s: float = 1.0, lease_s: float = 30.0,
                 max_latents_bytes: int = 64 << 20, max_running_per_owner: int | None = None):
        self.store = store
        self.max_running_per_owner = max_running_per_owner
        self.max_latents_bytes = max_latents_bytes
        self.triton = triton
        self.webhooks = webhooks
        self.metrics = metrics
        self.result_ttl_s = result_ttl_s
        self.queue_retry_s = queue_retry_s
        self.lease_s = lease_s
        self.retry = RetryPolicy()  # as MachgenClient's
        self._rng = random.Random()
        self.running: dict[str, Running] = {}
        # Finished jobs' events, kept a while for a listener that comes late.
        self._finished_events: dict[str, JobEvents] = {}
        self._handing_over = False
        self._job_ended = asyncio.Event()  # set, and replaced, when a job of this process ends

    def in_flight(self, owner: str) -> int:
        """The owner's jobs queued or running, in every API process of the database."""
        return self.store.active_count(owner)

    def submit(self, job: Job, model: ServedModel, variants: list[dict[str, Any]],
               wait_when_queue_full: bool) -> Job:
        """Store ``job`` with its variants' inputs, held by this process, and run it; an Idempotency-Key its
        owner used before gives that job back instead."""
        stored = self.store.insert(job, pack_inputs(variants), self.lease_s)
        if stored.id == job.id:  # else the same key, sent twice at once
            self.start(stored, model, variants, wait_when_queue_full)
        return stored

    def start(self, job: Job, model: ServedModel, variants: list[dict[str, Any]],
              wait_when_queue_full: bool) -> Running:
        """Run ``job``: a request per variant (their inputs), POSTing its end to
        the job's ``callback_url`` when it names one."""
        running = Running(job)
        self.running[job.id] = running
        running.task = asyncio.get_running_loop().create_task(
            self._run(running, model, variants, wait_when_queue_full), name=f"job-{job.id}")
        return running

    def forget(self, job_id: str) -> None:
        """A deleted job's kept events dropped."""
        self._finished_events.pop(job_id, None)

    def events(self, job_id: str) -> "JobEvents | StoredEvents | None":
        """The job's events: followed here where this process runs (or ran) it; from the database where
        another process of a shared one runs it."""
        running = self.running.get(job_id)
        if running is not None:
            return running.events
        if job_id in self._finished_events:
            return self._finished_events[job_id]
        return StoredEvents(self.store, job_id) if self.store.shared else None

    async def cancel(self, job_id: str) -> None:
        running = self.running.get(job_id)
        if running is not None and running.task is not None:
            running.task.cancel()
            await asyncio.wait([running.task])
        elif self.store.shared:  # another process runs it: it cancels at its next lease renewal
            self.store.request_cancel(job_id)
            await self.wait(job_id, timeout_s=3 * self.lease_s)

    async def wait(self, job_id: str, timeout_s: float | None = None) -> Job:
        running = self.running.get(job_id)
        if running is not None and running.task is not None:
            await asyncio.wait([running.task])
        job = self.store.get(job_id)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while job is not None and not job.finished and (deadline is None or time.monotonic() < deadline):
            await asyncio.sleep(0.25)  # run by another process, or handed over: its record says when it ends
            job = self.store.get(job_id)
        assert job is not None
        return job

    async def hold_leases(self) -> None:
        """Renew this process's leases every third of a lease; a job whose lease another process took is
        stopped here without a word (that process runs it), one a caller cancelled elsewhere is cancelled."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            progress = {job_id: (running.job.status, running.job.progress)
                        for job_id, running in list(self.running.items())}
            if not progress:
                continue
            try:
                held, cancel = await asyncio.to_thread(self.store.renew, progress, self.lease_s)
            except Exception:  # noqa: BLE001 - the database away for a moment; the leases last a while yet
                log.exception("could not renew the jobs' leases")
                continue
            for job_id in progress:
                running = self.running.get(job_id)
                if running is None or running.task is None:
                    continue
                if job_id not in held:
                    log.warning("job %s: its lease was taken over by another API process; stopped here", job_id)
                    running.lost = True
                    running.task.cancel()
                elif job_id in cancel:
                    running.task.cancel()

    async def take_over(self) -> None:
        """On a shared database: run the jobs whose process stopped renewing their leases (killed), each
        again from its stored inputs."""
        while True:
            await asyncio.sleep(self.lease_s / 3 * (0.5 + self._rng.random()))
            try:
                found = await asyncio.to_thread(self.store.take_over, self.lease_s)
                while found is not None:
                    job, inputs = found
                    log.warning("job %s: its API process stopped renewing it; running it here", job.id)
                    model = (await self.triton.models()).get(job.model)
                    if model is None:
                        self.store.finish(self._failed(job, "model_not_found",
                                                       f"the model '{job.model}' is not served any more"), None)
                    else:
                        self.start(job, model, unpack_inputs(inputs), wait_when_queue_full=True)
                    found = await asyncio.to_thread(self.store.take_over, self.lease_s)
            except Exception:  # noqa: BLE001 - Triton or the database away for a moment: look again later
                log.exception("could not take over jobs")

    @staticmethod
    def _failed(job: Job, code: str, message: str) -> Job:
        job.status, job.error, job.completed_at = "failed", {"code": code, "message": message}, int(time.time())
        return job

    async def stop(self) -> None:
        """At shutdown: every running job stopped. One process of a shared database hands its jobs over
        (their leases end now: another process runs them); alone, it records them cancelled."""
        tasks = [running.task for running in self.running.values() if running.task is not None]
        self._handing_over = self.store.shared
        held = list(self.running)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        if self._handing_over and held:
            self.store.renew({job_id: ("queued", 0) for job_id in held}, -1.0)

    async def _emit(self, running: Running, event: str, data: dict[str, Any], variant: int | None = None) -> None:
        await running.events.emit(event, data)
        if self.store.shared:  # a listener may follow the job through another process
            await asyncio.to_thread(self.store.add_event, running.job.id, event, data, variant)

    async def _run(self, running: Running, model: ServedModel, variants: list[dict[str, Any]],
                   wait_when_queue_full: bool) -> None:
        job = running.job
        try:
            await self._turn(job)
            if job.request.get("explore"):
                results = await self._explore(running, model, variants, wait_when_queue_full)
            else:
                results = await self._variants(running, model, dict(enumerate(variants)), wait_when_queue_full)
            job.outputs = await asyncio.to_thread(self._write_results, job, results)
            job.stats = [result["stats"] for result in results]
            job.status, job.progress = "completed", 100
            job.expires_at = int(time.time() + self.result_ttl_s)
        except asyncio.CancelledError:
            if running.lost or self._handing_over:  # another process runs it (again): nothing to record here
                self.running.pop(job.id, None)
                return
            job.status = "cancelled"
            job.error = {"code": "cancelled", "message": "cancelled by the caller"}
        except TritonFailure as failure:
            job.status = "failed"
            job.error = {"code": failure.status.lower(), "message": str(failure), "param": failure.field}
        except Exception as err:  # noqa: BLE001 - a job's failure must be recorded, never lost
            log.exception("job %s failed", job.id)
            job.status = "failed"
            job.error = {"code": "internal", "message": f"{type(err).__name__}: {err}"}
        job.completed_at = int(time.time())
        webhook = None
        if job.request.get("callback_url") and self.webhooks.policy is not None:
            public = public_object(job)  # a video's status is one of OpenAI's: cancelled is failed
            webhook = (job.request["callback_url"], f"{job.kind}.{public['status']}", public)
        try:
            recorded = await asyncio.to_thread(self.store.finish, job, webhook)
        finally:
            self.running.pop(job.id, None)
            ended, self._job_ended = self._job_ended, asyncio.Event()
            ended.set()  # recorded ended: the owner's next job may have its turn
        if not recorded:
            log.warning("job %s: taken over by another API process before it ended here; its result is theirs",
                        job.id)
            return
        self.webhooks.queued()
        self.metrics.finished.labels(job.status).inc()
        self.metrics.observe_end(job, running.started)
        self._finished_events[job.id] = running.events
        while len(self._finished_events) > 256:
            self._finished_events.pop(next(iter(self._finished_events)))
        await self._emit(running, job.status, job_object(job))

    async def _turn(self, job: Job) -> None:
        """Until the job may run: at most ``max_running_per_owner`` of an owner's jobs run at once, in every
        API process of the database; the others wait, queued, and start in the order they came."""
        while True:
            ended = self._job_ended
            if await asyncio.to_thread(self.store.admit, job.id, job.owner, self.max_running_per_owner):
                return
            try:  # a job ending here wakes it at once; one ending in another process, within a poll
                await asyncio.wait_for(ended.wait(), timeout=self.queue_retry_s)
            except asyncio.TimeoutError:
                pass

    async def _variants(self, running: Running, model: ServedModel, variants: dict[int, dict[str, Any]],
                        wait_when_queue_full: bool) -> list[dict[str, Any]]:
        """Each variant (by its index in the job) run at once; their results in the order given."""
        tasks = [asyncio.ensure_future(self._variant(running, model, index, inputs, wait_when_queue_full))
                 for index, inputs in variants.items()]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:  # one failed: the others stop too
                task.cancel()
            await asyncio.wait(tasks)

    async def _explore(self, running: Running, model: ServedModel, variants: list[dict[str, Any]],
                       wait_when_queue_full: bool) -> list[dict[str, Any]]:
        """Every variant to the plan's step (its early image and latents there), scored; the best continue from
        those latents. The continued variants' results, best first; the job's request records every variant's
        rank, score and cost (``explored``)."""
        job = running.job
        plan = ExploreSettings(**job.request["explore"])
        at = plan.at_step
        kept_steps = {index: sorted(inputs.get("trajectory_steps") or ()) for index, inputs in enumerate(variants)}
        # A variant's kept latents (keep_latents) come from both parts of its run: those up to the step from the first.
        early = await self._variants(running, model, {
            index: {**inputs, "stop_step": at, "trajectory_steps": sorted({*(s for s in kept_steps[index] if s <= at),
                                                                           at})}
            for index, inputs in enumerate(variants)}, wait_when_queue_full)
        # A video's early clip is scored whole: the detector reads motion, an agent's scorer gets the MP4.
        media = [result["images"] if job.kind == "video" else result["images"][0] for result in early]
        files = await asyncio.gather(*(asyncio.to_thread(self._media_file, job, result) for result in early))
        secret = self.webhooks.policy.secret if self.webhooks.policy is not None else None
        scores, problem = await score(plan, job.id, media, files, [v["prompt"] for v in variants],
                                      [v["seed"] for v in variants], self.webhooks.destinations, secret)
        order, continued = ranking(scores, plan.keep, len(variants))
        extension = "mp4" if job.kind == "video" else "png"
        await asyncio.to_thread(self.store.write_results, job.id, {
            EARLY_FILE.format(index=index, extension=extension): file for index, file in enumerate(files)})
        await self._emit(running, "scored", {"job_id": job.id, "step": at, "scores": scores, "problem": problem,
                                             "continued": sorted(continued)})
        later = await self._variants(running, model, {
            index: continuation(variants[index], at, early[index]["trajectory"][-1],
                                [s for s in kept_steps[index] if s > at])
            for index in order if index in continued}, wait_when_queue_full)
        results, explored = [], []
        finished = dict(zip([index for index in order if index in continued], later))
        for rank, index in enumerate(order):
            cost = [early[index]["stats"]] + ([finished[index]["stats"]] if index in finished else [])
            explored.append({"index": index, "rank": rank, "seed": variants[index]["seed"],
                             "prompt": variants[index]["prompt"], "score": None if scores is None else scores[index],
                             "status": "continued" if index in finished else "pruned",
                             "steps": sum(int(stats.get("steps") or 0) for stats in cost),
                             "denoiser_seconds": round(sum(float(stats.get("denoiser_seconds") or 0) for stats in cost),
                                                       4)})
            if index in finished:
                kept = {step: row for part in (early[index], finished[index]) if part.get("trajectory") is not None
                        for step, row in zip(part["trajectory_steps"], part["trajectory"])}
                wanted = kept_steps[index]
                results.append({**finished[index], "variant": index, "trajectory_steps": wanted,
                                "trajectory": np.stack([kept[step] for step in wanted]) if wanted else None})
        job.request["explored"] = {"step": at, "scorer": plan.scorer, "problem": problem, "variants": explored}
        job.request["n"] = len(results)  # the images it gives: every variant where nothing was pruned
        return results

    async def _variant(self, running: Running, model: ServedModel, index: int, inputs: dict[str, Any],
                       wait_when_queue_full: bool) -> dict[str, Any]:
        job = running.job
        running.steps[index] = (0, 1)

        async def on_step(report: StepReport) -> None:
            if running.started is None:
                running.started = time.monotonic()
                queued = max(time.time() - job.created_at, 0.0)
                self.metrics.queue_seconds.observe(queued)
                self.metrics.owner_queue_seconds.labels(job.request.get("owner") or job.owner,
                                                        job.request.get("priority") or "interactive").observe(queued)
                job.status = "in_progress"
            running.steps[index] = (report.step, report.total)
            done = sum(step / total for step, total in running.steps.values()) / len(running.steps)
            job.progress = min(99, int(100 * done))
            self.metrics.steps.inc()
            await self._emit(running, "progress", {"job_id": job.id, "index": index, "step": report.step,
                                                   "total": report.total, "progress": job.progress,
                                                   "elapsed": round(report.elapsed, 3)}, index)
            if report.preview is not None:
                png = await asyncio.to_thread(png_bytes, preview_picture(report.preview))
                self.metrics.previews.inc()
                await self._emit(running, "preview", {"job_id": job.id, "index": index, "step": report.step,
                                                      "image": data_url(png)}, index)

        delay = self.queue_retry_s
        retries = 0
        while True:
            try:
                result = await self.triton.run(model, inputs, f"{job.id}-{index}", on_step)
                return {**result, "trajectory_steps": list(inputs.get("trajectory_steps") or ())}
            except TritonFailure as failure:
                if failure.queue_full:
                    if not wait_when_queue_full:
                        raise  # a request that waits for its answer: 503 with Retry-After
                    await asyncio.sleep(delay)  # the server's queue is full: the job stays queued
                    delay = min(delay * 2, 30.0)
                    continue
                # A stub that died, a server stopping: the variant is seeded, so a second try makes the same.
                if not failure.retryable or retries + 1 >= self.retry.attempts:
                    raise
                log.warning("job %s: %s; sending variant %d again", job.id, failure, index)
                await asyncio.sleep(self.retry.delay(retries, self._rng))
                retries += 1
                running.steps[index] = (0, 1)

    @staticmethod
    def _media_file(job: Job, result: dict[str, Any]) -> bytes:
        """A video job's result as an MP4 (with its sound, if it has one), an image job's first image as a PNG."""
        if job.kind != "video":
            return png_bytes(result["images"][0])
        fps = int(result["stats"].get("fps") or job.request.get("fps") or 16)
        return mp4_bytes(result["images"], fps, audio=result.get("audio"),
                         sample_rate=result["stats"].get("sample_rate"))

    def _write_results(self, job: Job, results: list[dict[str, Any]]) -> list[str]:
        files = {}
        if job.kind == "video":  # an explore's continued videos, best first: video.mp4, video-1.mp4, ...
            for index, result in enumerate(results):
                files[f"{result_stem('video', index)}.mp4"] = self._media_file(job, result)
                # OpenAI's thumbnail is WebP; lossless, so it is the first frame exactly.
                files[f"{result_stem('thumbnail', index)}.webp"] = picture_bytes(result["images"][0], "webp")
        else:
            output_format = job.request.get("output_format", "png")
            for index, result in enumerate(results):
                files[f"image-{index}.{output_format}"] = picture_bytes(
                    result["images"][0], output_format, job.request.get("output_compression"))
        self.store.write_results(job.id, {**files, **self._latents_files(job, results)})
        return list(files)

    def _latents_files(self, job: Job, results: list[dict[str, Any]]) -> dict[str, bytes]:
        """The kept latents (keep_latents) of each result, within the job's share of --max-latents-mb; what
        was kept is listed in the job's ``latents``."""
        files, listed = {}, []
        for index, result in enumerate(results):
            if result.get("trajectory") is None:
                continue
            data, steps = latents_file(result["trajectory"], result["trajectory_steps"],
                                       self.max_latents_bytes // len(results))
            files[LATENTS_FILE.format(index=index)] = data
            listed.append({"index": index, "variant": result.get("variant", index), "steps": steps,
                           "bytes": len(data)})
        if listed:
            job.request["latents"] = listed
        return files


def continuation(inputs: dict[str, Any], step: int, latents: np.ndarray, kept_steps: list[int]) -> dict[str, Any]:
    """A variant's inputs going on from its latents after ``step``: with its own prompt and settings, its
    full run's result (docs/model-api.md's start_step)."""
    inputs = {name: value for name, value in inputs.items() if name not in ("trajectory_steps", "stop_step")}
    return {**inputs, "start_step": step, "start_latents": latents,
            **({"trajectory_steps": kept_steps} if kept_steps else {})}


class StoredEvents:
    """A job's events as another API process of a shared database records them (store.add_event), followed
    as JobEvents are: what is kept now, then each new one, until the job's last."""

    def __init__(self, store: JobStore, job_id: str, poll_s: float = 0.2):
        self.store, self.job_id, self.poll_s = store, job_id, poll_s

    async def follow(self) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        seen = 0
        while True:
            for seen, event, data in await asyncio.to_thread(self.store.events_after, self.job_id, seen):
                yield event, data
                if event in TERMINAL_EVENTS:
                    return
            job = await asyncio.to_thread(self.store.get, self.job_id)
            if job is None:
                return
            if job.finished and not await asyncio.to_thread(self.store.events_after, self.job_id, seen):
                yield job.status, job_object(job)  # its events expired with its results
                return
            await asyncio.sleep(self.poll_s)
