"""How ``machgen api`` runs: its settings, one for each of its CLI options."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
    # Realtime sessions (WebSocket /v1/realtime/video) one key may have open at once in this process, forks
    # included; more are refused naming the cap. Without keys every caller is one owner, so it caps them all.
    max_sessions_per_key: int = 4
    # Browser origins (scheme://host[:port]) that may open realtime sessions besides the API's own ("*": any). A
    # client that sends no Origin (not a browser's page) is not checked; keys still are.
    allowed_origins: tuple[str, ...] = ()
