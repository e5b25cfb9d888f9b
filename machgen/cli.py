"""machgen: serve a model repository, and generate images from a served model."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Optional

import typer

from machgen.contract.tasks import TASKS, short_task_name
from machgen.session_cli import session as session_command

if TYPE_CHECKING:  # pragma: no cover
    from machgen.contract.api import FamilyInput

WEBHOOK_SECRET_ENV = "MACHGEN_WEBHOOK_SECRET"
WEBHOOK_SECRET_HELP = ("Standard Webhooks secret (whsec_...) that signs callbacks and scorer requests; without it jobs "
                       "cannot ask for them")
DATABASE_URL_ENV = "MACHGEN_DATABASE_URL"
DATABASE_URL_HELP = ("PostgreSQL (postgresql://USER@HOST/DB) instead of SQLite: jobs, results, webhooks and keys in it, "
                     "shared by every API process given the same URL")

app = typer.Typer(help="Serve diffusion pipelines on Triton and call them.", no_args_is_help=True,
                  add_completion=False)


def _interrupt(signum, frame) -> None:
    # SIGTERM takes the same clean shutdown path as Ctrl-C.
    raise KeyboardInterrupt


@app.command()
def serve(
    repository: Path = typer.Argument(..., exists=True, file_okay=False, help="model repository"),
    http_port: int = typer.Option(8000, "--http-port"),
    grpc_port: int = typer.Option(8001, "--grpc-port"),
    metrics_port: int = typer.Option(8002, "--metrics-port"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0 for all)"),
    verbose: bool = typer.Option(False, "--verbose", help="verbose server log (per-step progress)"),
    api_port: Optional[int] = typer.Option(None, "--api-port", help="also run the HTTP API (machgen api) on this "
                                                                    "port, talking to this server"),
    api_data_dir: Path = typer.Option(Path("machgen-api"), "--api-data-dir", help="the API's jobs and results"),
    api_keys_file: Optional[Path] = typer.Option(None, "--api-keys-file", help="the API's keys (machgen api-key)"),
    api_webhook_secret: Optional[str] = typer.Option(None, "--api-webhook-secret", envvar=WEBHOOK_SECRET_ENV,
                                                     help=f"the API's {WEBHOOK_SECRET_HELP}"),
    api_database_url: Optional[str] = typer.Option(None, "--api-database-url", envvar=DATABASE_URL_ENV,
                                                   help=f"the API's {DATABASE_URL_HELP}"),
    api_max_sessions_per_key: int = typer.Option(4, "--api-max-sessions-per-key", min=1,
                                                 help="the API's realtime sessions open at once per key"),
    api_allowed_origins: Optional[list[str]] = typer.Option(None, "--api-allowed-origin",
                                                            help="a browser origin that may open the API's realtime "
                                                                 "sessions besides its own; repeatable; '*': any"),
    supervisor_metrics_port: int = typer.Option(8003, "--supervisor-metrics-port", min=0,
                                                help="the supervisor's Prometheus metrics (model recoveries, "
                                                     "server restarts) at /metrics; with --replicas also each "
                                                     "replica's state there (machgen_replica_up) and at /status "
                                                     "(JSON); 0: none"),
    drain_timeout: float = typer.Option(60.0, "--drain-timeout", min=0.0,
                                        help="on a stop: seconds requests in flight get to finish before they are "
                                             "stopped at their next step (answering UNAVAILABLE)"),
    load_timeout: float = typer.Option(180.0, "--load-timeout", min=1.0,
                                       help="seconds a model whose stub died may take to load again; a load "
                                            "that takes longer is wedged and the server is started again"),
    shm_reclaim_mb: float = typer.Option(16.0, "--shm-reclaim-mb", min=0.0,
                                         help="a Python-backend model whose stubs' shared memory (/dev/shm) grew by "
                                              "more than this many MB is loaded again, fresh, once its pipeline "
                                              "has been idle for the build's --idle-release-s (no request held, no "
                                              "realtime session open); 0: never"),
    max_restarts: int = typer.Option(3, "--max-restarts", min=0,
                                     help="times a server that died is started again within a minute; one more "
                                          "and machgen serve exits with code 1"),
    replicas: int = typer.Option(1, "--replicas", min=1,
                                 help="tritonservers on loopback behind HAProxy, which takes --http-port, "
                                      "--grpc-port and --metrics-port (its own metrics); SIGHUP restarts them one "
                                      "after another without losing a request (one that fails to start is "
                                      "tried again, with backoff, before the next is taken out)"),
    prometheus_port: int = typer.Option(0, "--prometheus-port", min=0,
                                        help="with --replicas: a Prometheus on this port scraping the balancer, "
                                             "every replica and the supervisors (deploy/prometheus/rules.yaml)"),
    tritonserver: Optional[Path] = typer.Option(None, "--tritonserver", exists=True, dir_okay=False,
                                                envvar="MACHGEN_TRITONSERVER",
                                                help="an installed Triton's bin/tritonserver (NVIDIA's container: "
                                                     "/opt/tritonserver/bin/tritonserver) instead of the bundled one"),
) -> None:
    """Start tritonserver on REPOSITORY (and with --api-port the HTTP API) and
    keep it serving: a model whose stub process died is loaded again (the
    others untouched), a server that died is started again. Ctrl-C or SIGTERM
    drains it: no new request is taken, those in flight finish, then it stops."""
    from machgen.server import START_ATTEMPTS, Ports, ServerError, TritonServer
    from machgen.supervisor import Supervisor, SupervisorSettings

    _database_url(api_database_url, "--api-database-url")  # before the server starts

    def say(line: str) -> None:
        typer.echo(line, err="supervisor:" in line)

    supervision = SupervisorSettings(max_restarts=max_restarts, drain_timeout_s=drain_timeout,
                                     load_timeout_s=load_timeout, shm_reclaim_mb=shm_reclaim_mb)
    if replicas > 1:
        _serve_replicas(repository, Ports(http_port, grpc_port, metrics_port), host, replicas, supervision,
                        verbose, tritonserver, prometheus_port, supervisor_metrics_port, say)
        return
    if prometheus_port:
        raise typer.BadParameter("needs --replicas 2 or more", param_hint="--prometheus-port")
    # Triton must not give up on requests in flight before the drain does.
    server = TritonServer(repository, Ports(http_port, grpc_port, metrics_port), host=host, verbose=verbose,
                          exit_timeout_s=int(drain_timeout) + 60, tritonserver=tritonserver)
    supervisor = Supervisor(server, supervision, log=say)
    metrics = None
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        typer.echo(f"starting tritonserver on {repository} ...")
        server.start(attempts=START_ATTEMPTS)  # a start that wedges or aborts is made again (the supervisor later)
        supervisor.start()
        if supervisor_metrics_port:
            try:
                metrics = supervisor.serve_metrics(host, supervisor_metrics_port)
            except OSError as err:
                raise ServerError(f"--supervisor-metrics-port {supervisor_metrics_port}: {err}") from None
        typer.echo(f"ready: HTTP {host}:{http_port}  gRPC {host}:{grpc_port}  metrics {host}:{metrics_port}"
                   + (f"  supervisor metrics {host}:{supervisor_metrics_port}" if metrics else ""))
        typer.echo(f"server log: {server.log_file}")
        if api_port is not None:
            from machgen.api.settings import ApiSettings

            typer.echo(f"API: http://{host}:{api_port}")

            def stop_api_if_given_up() -> None:  # the API must not outlive a server that cannot be kept up
                if supervisor.wait():
                    os.kill(os.getpid(), signal.SIGTERM)

            threading.Thread(target=stop_api_if_given_up, daemon=True).start()
            _run_api(ApiSettings(triton_url=f"127.0.0.1:{grpc_port}", data_dir=api_data_dir,
                                 keys_file=api_keys_file, webhook_secret=api_webhook_secret,
                                 database_url=api_database_url, max_sessions_per_key=api_max_sessions_per_key,
                                 allowed_origins=tuple(api_allowed_origins or ())),
                     host, api_port)
            if supervisor.exit_code:
                raise typer.Exit(supervisor.exit_code)
            return
        code = supervisor.wait()
        typer.secho(f"tritonserver could not be kept serving:\n{server.log_tail()}", fg=typer.colors.RED, err=True)
        raise typer.Exit(code or 1)
    except KeyboardInterrupt:
        pass
    except ServerError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    finally:
        # A second Ctrl-C or SIGTERM must not cut the drain short and leave the server running.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        typer.echo(f"stopping tritonserver: requests in flight get {drain_timeout:.0f} s to finish ...")
        supervisor.drain()
        if metrics is not None:
            metrics.shutdown()
        typer.echo("stopped")


def _serve_replicas(repository: Path, ports, host: str, count: int, supervision, verbose: bool,
                    tritonserver: Optional[Path], prometheus_port: int, supervisor_metrics_port: int, say) -> None:
    """machgen serve --replicas: ``count`` supervised servers behind HAProxy (machgen/replicas.py)."""
    from machgen.replicas import ReplicaSet, ReplicaSettings
    from machgen.server import ServerError

    replica_set = ReplicaSet(repository, ports, ReplicaSettings(count=count, host=host, verbose=verbose,
                                                                tritonserver=tritonserver),
                             supervision, log=say)
    metrics = None
    signal.signal(signal.SIGTERM, _interrupt)
    restarting = threading.Lock()

    def rolling_restart() -> None:
        if not restarting.acquire(blocking=False):
            say("a rolling restart is already under way")
            return
        try:
            replica_set.rolling_restart()
            say("rolling restart done")
        except ServerError as err:
            say(f"rolling restart failed: {err}")
        finally:
            restarting.release()

    signal.signal(signal.SIGHUP, lambda signum, frame: threading.Thread(target=rolling_restart, daemon=True).start())
    try:
        typer.echo(f"starting {count} tritonservers on {repository} behind HAProxy ...")
        replica_set.start(prometheus_port=prometheus_port or None,
                          supervisor_metrics_port=supervisor_metrics_port or None)
        if supervisor_metrics_port:
            try:
                metrics = replica_set.serve_metrics(host, supervisor_metrics_port)
            except OSError as err:
                raise ServerError(f"--supervisor-metrics-port {supervisor_metrics_port}: {err}") from None
        typer.echo(f"ready: HTTP {host}:{ports.http}  gRPC {host}:{ports.grpc}  balancer metrics "
                   f"{host}:{ports.metrics}  ({count} replicas; SIGHUP: rolling restart)"
                   + (f"  supervisor metrics {host}:{supervisor_metrics_port} (/metrics, /status)" if metrics else "")
                   + (f"  Prometheus http://{host}:{prometheus_port}" if prometheus_port else ""))
        typer.echo(f"logs: {replica_set.work_dir}")
        replica_set.wait()
        typer.secho("a replica could not be kept serving", fg=typer.colors.RED, err=True)
        raise typer.Exit(1)
    except KeyboardInterrupt:
        pass
    except ServerError as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        typer.echo(f"stopping {count} tritonservers: requests in flight get {supervision.drain_timeout_s:.0f} s "
                   "to finish ...")
        replica_set.drain()
        if metrics is not None:
            metrics.shutdown()
        typer.echo("stopped")


def _run_api(settings, host: str, port: int) -> None:
    """The API under uvicorn until Ctrl-C or SIGTERM (uvicorn's own handlers)."""
    import uvicorn

    from machgen.api.app import create_app

    uvicorn.Server(uvicorn.Config(create_app(settings), host=host, port=port, log_level="info",
                                  timeout_graceful_shutdown=10)).run()


def _database_url(url: str | None, flag: str) -> str | None:
    if url is not None and not url.startswith(("postgresql://", "postgres://")):
        raise typer.BadParameter("a PostgreSQL URL: postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE", param_hint=flag)
    return url


@app.command()
def api(
    triton: str = typer.Option("127.0.0.1:8001", "--triton", help="host:port of Triton's gRPC endpoint"),
    host: str = typer.Option("127.0.0.1", "--host", help="address to listen on (0.0.0.0 for all)"),
    port: int = typer.Option(8080, "--port"),
    data_dir: Path = typer.Option(Path("machgen-api"), "--data-dir", help="job records and results"),
    database: Optional[Path] = typer.Option(None, "--database", help="the SQLite file (default: in --data-dir)"),
    database_url: Optional[str] = typer.Option(None, "--database-url", envvar=DATABASE_URL_ENV,
                                               help=DATABASE_URL_HELP),
    job_lease: float = typer.Option(30.0, "--job-lease-seconds", min=1.0,
                                    help="with --database-url: how long after a process stops renewing its jobs "
                                         "(killed) another one runs them"),
    keys_file: Optional[Path] = typer.Option(None, "--keys-file", exists=True, dir_okay=False,
                                             help="API keys (machgen api-key); without it no key is needed (with "
                                                  "--database-url: the database's keys, once it has one)"),
    max_jobs_per_key: int = typer.Option(16, "--max-jobs-per-key", min=1, help="jobs in flight per key; more: 429"),
    max_running_per_key: Optional[int] = typer.Option(
        None, "--max-running-per-key", min=1,
        help="jobs of one key running at once (every API process of the database); its others wait queued"),
    max_upload_mb: float = typer.Option(25.0, "--max-upload-mb", min=0.001, help="largest request body"),
    result_ttl_hours: float = typer.Option(24.0, "--result-ttl-hours", min=0.0, help="how long results are kept"),
    max_latents_mb: float = typer.Option(64.0, "--max-latents-mb", min=0.0,
                                         help="the most latents a job keeps for refines (keep_latents); past it, "
                                              "evenly spaced steps; they expire with its results"),
    webhook_secret: Optional[str] = typer.Option(None, "--webhook-secret", envvar=WEBHOOK_SECRET_ENV,
                                                 help=WEBHOOK_SECRET_HELP),
    allow_private_callbacks: bool = typer.Option(False, "--allow-private-callbacks",
                                                 help="send webhooks to loopback, private and link-local "
                                                      "addresses too (refused otherwise: request forgery)"),
    webhook_attempts: int = typer.Option(6, "--webhook-attempts", min=1),
    webhook_retry_delay: float = typer.Option(1.0, "--webhook-retry-delay", min=0.0,
                                              help="seconds before the first retry, doubling after"),
    preview_interval: Optional[int] = typer.Option(None, "--preview-interval", min=0,
                                                   help="steps between previews (default: each model's)"),
    tenant_header: Optional[str] = typer.Option(None, "--tenant-header",
                                                help="a header a trusted gateway sets to the tenant a request is "
                                                     "for: denoiser time is shared fairly per key and tenant"),
    max_sessions_per_key: int = typer.Option(4, "--max-sessions-per-key", min=1,
                                             help="realtime sessions (/v1/realtime/video) open at once per key"),
    allowed_origins: Optional[list[str]] = typer.Option(None, "--allowed-origin", help="a browser origin "
                                                        "(https://host[:port]) that may open realtime sessions "
                                                        "besides the API's own; repeatable; '*': any"),
) -> None:
    """The HTTP API over a Triton server's models: OpenAI's /v1/images and
    /v1/videos, jobs with live progress (/v1/jobs/ID/events), webhooks,
    metrics (/metrics) and a playground page (/)."""
    from machgen.api.settings import ApiSettings

    _run_api(ApiSettings(triton_url=triton, data_dir=data_dir, database=database,
                         database_url=_database_url(database_url, "--database-url"),
                         job_lease_s=job_lease, keys_file=keys_file,
                         max_jobs_per_key=max_jobs_per_key, max_running_per_key=max_running_per_key,
                         max_upload_bytes=int(max_upload_mb * 1024 * 1024),
                         result_ttl_s=result_ttl_hours * 3600, max_latents_bytes=int(max_latents_mb * (1 << 20)),
                         webhook_secret=webhook_secret,
                         allow_private_callbacks=allow_private_callbacks,
                         webhook_attempts=webhook_attempts, webhook_first_delay_s=webhook_retry_delay,
                         preview_interval=preview_interval, tenant_header=tenant_header,
                         max_sessions_per_key=max_sessions_per_key, allowed_origins=tuple(allowed_origins or ())),
             host, port)


@app.command("api-key")
def api_key(
    keys: str = typer.Argument(..., metavar="KEYS_FILE|DATABASE_URL",
                               help="the keys file (created if absent), or the API's PostgreSQL URL"),
    name: str = typer.Argument(..., help="who the key is for (one word)"),
    max_jobs: Optional[int] = typer.Option(None, "--max-jobs", min=1, help="this key's limit of jobs in flight"),
) -> None:
    """Make an API key: its hash goes into KEYS_FILE (or the API's database), the key is printed once."""
    from machgen.api.database import is_database_url
    from machgen.api.keys import add_key, add_stored_key

    try:
        if is_database_url(keys):
            from machgen.api.store import JobStore

            store = JobStore(Path("machgen-api"), keys)
            try:
                typer.echo(add_stored_key(store, name, max_jobs))
            finally:
                store.close()
        else:
            if Path(keys).is_dir():
                raise ValueError(f"{keys} is a folder: give the keys file")
            typer.echo(add_key(Path(keys), name, max_jobs))
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None


class _ProgressDisplay:
    """``machgen generate``'s progress bar (on stderr) and preview files."""

    def __init__(self, preview_dir: Path | None):
        self.preview_dir = preview_dir
        self._bar = None
        self._task = None
        self.previews = 0

    def __enter__(self) -> "_ProgressDisplay":
        return self

    def update(self, progress) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        if self._bar is None:
            self._bar = Progress(TextColumn("denoising"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
                                 TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("steps", total=progress.total)
        self._bar.update(self._task, completed=progress.step)
        if progress.preview is not None and self.preview_dir is not None:
            from PIL import Image

            import numpy as np

            self.preview_dir.mkdir(parents=True, exist_ok=True)
            picture = np.concatenate(list(progress.preview), axis=1)  # a video's frames side by side
            Image.fromarray(picture).save(self.preview_dir / f"step-{progress.step:04d}.png")
            self.previews += 1

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
        if self.previews:
            typer.echo(f"wrote {self.previews} previews to {self.preview_dir}", err=True)


# An image model's frames written as MP4 (it reports no frame rate of its own).
DEFAULT_FPS = 16


# --help is written without a server, so it cannot list a model's own inputs: the model publishes them.
_MODEL_INPUTS_HELP = ("A model's own inputs (LTX-2's guidance, Wan 2.2's second expert's scale, ...) are taken as the "
                      "flags the served model publishes (machgen inputs --model NAME lists them), or as --input "
                      "NAME=VALUE; a flag the model does not publish is refused.")


def _family_options(extra: list[str], pairs: list[str], published: Mapping[str, FamilyInput],
                    model: str) -> dict[str, object]:
    """The model's own inputs given as the flags it publishes (``extra``:
    what typer did not parse) or as ``--input NAME=VALUE``, typed as it
    publishes them (``published``: MachgenClient.published_inputs)."""
    by_flag = {declared.flag: declared for declared in published.values()}
    values: dict[str, list[str]] = {}
    words = list(extra)
    while words:
        flag = words.pop(0)
        name, _, value = flag.partition("=")
        if name not in by_flag:
            offered = ", ".join(sorted(by_flag)) or "none"
            raise typer.BadParameter(f"no such option: {name} ({model} publishes these of its own: {offered})",
                                     param_hint="OPTIONS")
        if not value:
            if not words:
                raise typer.BadParameter(f"{name} needs a value", param_hint=name)
            value = words.pop(0)
        values.setdefault(by_flag[name].name, []).append(value)
    for pair in pairs:
        name, separator, value = pair.partition("=")
        if not separator:
            raise typer.BadParameter(f"{pair!r} is not NAME=VALUE", param_hint="--input")
        values.setdefault(name, []).extend(value.split(","))

    def typed(text: str, triton_dtype: str):
        from machgen.contract.api import python_type

        kind = python_type(triton_dtype)
        try:
            if kind is bool:
                return {"true": True, "1": True, "false": False, "0": False}[text.lower()]
            return kind(text)
        except (KeyError, ValueError):
            raise typer.BadParameter(f"{text!r} is not a {triton_dtype} value") from None

    options: dict[str, object] = {}
    for name, texts in values.items():
        if name not in published:  # every model's input, or one the model does not take: the client says
            options[name] = texts if len(texts) > 1 else texts[0]
            continue
        tensor = published[name].tensor
        items = [typed(text, tensor.triton_dtype) for text in texts]
        options[name] = items if published[name].repeatable else items[-1]
    return options


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             epilog=_MODEL_INPUTS_HELP)
def generate(
    ctx: typer.Context,
    prompt: str = typer.Option(..., "--prompt"),
    out: Path = typer.Option(..., "--out", help="file to write: .mp4 for video (all frames, with its sound), "
                                                ".wav for the sound alone, else an image (PNG; an index is "
                                                "appended when there are several frames)"),
    model: str = typer.Option(..., "--model", help="served model name"),
    url: str = typer.Option("127.0.0.1:8001", "--url", help="host:port of the chosen protocol"),
    protocol: str = typer.Option("grpc", "--protocol", help="grpc or http"),
    task: Optional[str] = typer.Option(None, "--task", help="t2i, i2i, t2v, i2v or r2v: checks that the inputs "
                                                            "it needs are given (default: as the inputs imply)"),
    negative_prompt: Optional[str] = typer.Option(None, "--negative-prompt"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    steps: Optional[int] = typer.Option(None, "--steps"),
    guidance_scale: Optional[float] = typer.Option(None, "--guidance-scale"),
    true_cfg_scale: Optional[float] = typer.Option(None, "--true-cfg-scale"),
    height: Optional[int] = typer.Option(None, "--height"),
    width: Optional[int] = typer.Option(None, "--width"),
    cache_policy: Optional[str] = typer.Option(None, "--cache-policy", help="none, fbcache or magcache"),
    cache_threshold: Optional[float] = typer.Option(None, "--cache-threshold"),
    image: Optional[Path] = typer.Option(None, "--image", exists=True, dir_okay=False,
                                         help="image-to-image or image-to-video: the starting picture "
                                              "(PNG, JPEG, ...)"),
    strength: Optional[float] = typer.Option(None, "--strength",
                                             help="image-to-image: how much is redrawn, 0-1 (default 0.6)"),
    num_frames: Optional[int] = typer.Option(None, "--num-frames", help="video: frames to generate"),
    fps: Optional[int] = typer.Option(None, "--fps", help="video: frames per second (default: the model's)"),
    reference_images: Optional[list[Path]] = typer.Option(None, "--reference-image", exists=True, dir_okay=False,
                                                          help="reference-to-video: a picture (repeatable)"),
    lora: Optional[list[str]] = typer.Option(None, "--lora", help="a LoRA adapter the model serves, by the name "
                                                                   "machgen-build lora add gave it (repeatable, "
                                                                   "up to 4)"),
    lora_scale: Optional[list[float]] = typer.Option(None, "--lora-scale", help="the weight of each --lora, in "
                                                                                "order (default 1.0 each)"),
    inputs: Optional[list[str]] = typer.Option(None, "--input", help="NAME=VALUE: any input of the model, a "
                                                                     "vector as comma-separated values "
                                                                     "(repeatable)"),
    progress: bool = typer.Option(True, "--progress/--no-progress",
                                  help="a progress bar (steps, ETA) where the model has a streaming twin (gRPC)"),
    preview_dir: Optional[Path] = typer.Option(None, "--preview-dir", file_okay=False,
                                               help="write the previews the model sends there "
                                                    "(step-NNNN.png; needs the streaming twin)"),
    preview_interval: Optional[int] = typer.Option(None, "--preview-interval", min=0,
                                                   help="steps between previews (default: the model's)"),
    retries: int = typer.Option(4, "--retries", min=0,
                                help="times a request that failed for want of a server (UNAVAILABLE, no "
                                     "connection, a stub that died) is sent again, with growing waits; without "
                                     "--seed a random seed is sent, so every try makes the same image"),
) -> None:
    """Generate an image or a video through a served pipeline and save it (PNG, MP4; WAV: the sound alone)."""
    import time

    import numpy as np
    from PIL import Image

    from machgen.client import GenerationError, MachgenClient, RetryPolicy

    if task is not None:
        if short_task_name(task) is None:
            raise typer.BadParameter(f"{task!r} is not one of {', '.join(TASKS)}", param_hint="--task")
        chosen = TASKS[short_task_name(task)]
        if chosen.needs_image != (image is not None):
            raise typer.BadParameter(f"{task} {'needs' if chosen.needs_image else 'takes no'} --image",
                                     param_hint="--task")
        if chosen.needs_references != bool(reference_images):
            raise typer.BadParameter(f"{task} {'needs' if chosen.needs_references else 'takes no'} --reference-image",
                                     param_hint="--task")
        if chosen.video != (out.suffix.lower() in (".mp4", ".wav")):
            raise typer.BadParameter(f"{task} writes {'an .mp4' if chosen.video else 'an image'} file",
                                     param_hint="--out")
    picture = None if image is None else np.asarray(Image.open(image).convert("RGB"))
    references = (np.stack([np.asarray(Image.open(path).convert("RGB")) for path in reference_images])
                  if reference_images else None)

    try:
        def retrying(attempt: int, error: GenerationError, delay: float) -> None:
            typer.secho(f"{error.status}: {error}; sending it again in {delay:.1f} s (retry {attempt} of {retries})",
                        fg=typer.colors.YELLOW, err=True)

        with MachgenClient(url, protocol=protocol, retry=RetryPolicy(attempts=retries + 1),
                           on_retry=retrying) as client, _ProgressDisplay(preview_dir) as display:
            published = client.published_inputs(model) if ctx.args or inputs else {}
            family_options = _family_options(ctx.args, inputs or [], published, model)
            streamed = (progress or preview_dir is not None) and protocol == "grpc" and client.has_stream(model)
            if preview_dir is not None and not streamed:
                typer.secho(f"note: no previews: {model} has no streaming twin reachable over {protocol}",
                            fg=typer.colors.YELLOW, err=True)
            if streamed and preview_interval is not None:
                family_options["preview_interval"] = preview_interval
            start = time.perf_counter()
            generated = client.generate_all(
                model, prompt, on_progress=display.update if streamed else None,
                negative_prompt=negative_prompt, seed=seed, num_inference_steps=steps,
                guidance_scale=guidance_scale, true_cfg_scale=true_cfg_scale, height=height, width=width,
                cache_policy=cache_policy, cache_threshold=cache_threshold, image=picture, strength=strength,
                num_frames=num_frames, fps=fps, reference_images=references, lora=lora or None,
                lora_scale=lora_scale or None, **family_options)
            seconds = time.perf_counter() - start
    except GenerationError as err:
        typer.secho(f"error ({err.status}): {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    except TypeError as err:  # an input the model does not declare
        raise typer.BadParameter(str(err), param_hint="--input") from None
    images, audio, stats = generated.images, generated.audio, generated.stats
    out.parent.mkdir(parents=True, exist_ok=True)
    sound = f", sound {audio.shape[1] / stats['sample_rate']:.2f} s" if audio is not None else ""
    if out.suffix.lower() == ".wav":
        from machgen.client.video import write_wav

        if audio is None:
            typer.secho(f"error: {model} makes no sound to write to {out}", fg=typer.colors.RED, err=True)
            raise typer.Exit(2)
        write_wav(audio, out, stats["sample_rate"])
        paths = [out]
        written = f"{audio.shape[0]} channels at {stats['sample_rate']} Hz{sound}"
    elif out.suffix.lower() == ".mp4":
        from machgen.client.video import write_mp4

        rate = fps or stats.get("fps") or DEFAULT_FPS
        write_mp4(images, out, fps=rate, audio=audio, sample_rate=stats.get("sample_rate"))
        paths = [out]
        written = f"{len(images)} frames at {rate} fps{sound}"
    else:
        paths = [out] if len(images) == 1 else [out.with_name(f"{out.stem}-{i}{out.suffix}")
                                                for i in range(len(images))]
        for path, frame in zip(paths, images):
            Image.fromarray(frame).save(path)
        written = f"{len(images)} image{'s' if len(images) > 1 else ''}"
    typer.echo(f"wrote {', '.join(map(str, paths))} ({written}, {images.shape[2]}x{images.shape[1]}, "
               f"{seconds:.2f} s, {stats['denoiser_tail_calls']}/{stats['steps']} steps ran the full denoiser, "
               f"cache {stats['cache_policy']})")



@app.command("inputs")
def list_inputs(
    model: str = typer.Option(..., "--model", help="served model name"),
    url: str = typer.Option("127.0.0.1:8001", "--url", help="host:port of the chosen protocol"),
    protocol: str = typer.Option("grpc", "--protocol", help="grpc or http"),
) -> None:
    """List a served model's own inputs as it publishes them: machgen generate's flags for them."""
    import json

    from machgen.client import GenerationError, MachgenClient

    try:
        with MachgenClient(url, protocol=protocol) as client:
            published = client.published_inputs(model)
    except GenerationError as err:
        typer.secho(f"error ({err.status}): {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    if not published:
        typer.echo(f"{model} takes no inputs of its own (machgen generate --help lists every model's)")
    for declared in published.values():
        shape = "[" + ", ".join("K" if d < 0 else str(d) for d in declared.tensor.dims) + "]"
        default = (declared.default_doc or "none") if declared.default is None else json.dumps(declared.default)
        typer.echo(f"{declared.flag} VALUE{' (repeatable)' if declared.repeatable else ''}: {declared.name}, "
                   f"{declared.tensor.triton_dtype} {shape}, default {default}. {declared.tensor.doc}")


app.command("session")(session_command)

if __name__ == "__main__":  # pragma: no cover
    app()

