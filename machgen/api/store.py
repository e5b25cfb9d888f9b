"""Jobs, their inputs and results, kept across restarts in the API's
database (machgen/api/database.py): a SQLite file under the API's data
folder, results in a folder beside it; or PostgreSQL, results in the
database, shared by several API processes. Results expire: past
``expires_at`` they go and the record stays, saying so.

Each active job is held by one API process (its ``runner``) under a lease
that process renews while it runs the job. On SQLite (one process), a job
that was queued or running when the API stopped is marked failed at
start-up, code ``interrupted``, so a caller polling it learns to submit it
again. On PostgreSQL, another process takes over a job whose lease ran out
(its holder was killed) and runs it again from its stored inputs: a job's
variants are seeded, so the second run makes the same pictures.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from machgen.api.database import Database, is_database_url

ACTIVE = ("queued", "in_progress")
_ACTIVE_SQL = f"status IN {ACTIVE}"  # SQL: a job queued or running
FINISHED = ("completed", "failed", "cancelled")


@dataclass
class Job:
    """One generation job: ``n`` images, or one video."""

    id: str
    kind: str  # "image" or "video"
    model: str
    owner: str  # the API key's name ("anonymous" without keys)
    request: dict[str, Any]  # what was asked, as the API read it (prompt, size, seed, ...)
    status: str = "queued"
    progress: int = 0  # 0-100
    idempotency_key: str | None = None
    created_at: int = field(default_factory=lambda: int(time.time()))
    completed_at: int | None = None
    expires_at: int | None = None
    outputs: list[str] = field(default_factory=list)  # file names in the job's results folder
    stats: list[dict[str, Any]] = field(default_factory=list)  # per image or video, as Triton reported it
    error: dict[str, Any] | None = None  # {"message", "code"}

    @property
    def finished(self) -> bool:
        return self.status in FINISHED


def pack_inputs(variants: list[dict[str, Any]]) -> bytes:
    """A job's variants (each a request's inputs: numbers, text, lists, pictures as arrays) as bytes kept with
    the job, for the process that takes it over."""
    import numpy as np

    arrays, values = {}, []
    for index, inputs in enumerate(variants):
        values.append({name: value for name, value in inputs.items() if not isinstance(value, np.ndarray)})
        arrays.update({f"{index}/{name}": value for name, value in inputs.items() if isinstance(value, np.ndarray)})
    buffer = io.BytesIO()
    np.savez(buffer, __values__=np.frombuffer(json.dumps(values).encode(), dtype=np.uint8), **arrays)
    return buffer.getvalue()


def unpack_inputs(data: bytes) -> list[dict[str, Any]]:
    import numpy as np

    with np.load(io.BytesIO(data), allow_pickle=False) as stored:
        variants = json.loads(stored["__values__"].tobytes())
        for key in stored.files:
            if key != "__values__":
                index, name = key.split("/", 1)
                variants[int(index)][name] = stored[key]
    return variants


_JOB_FIELDS = ("id", "kind", "model", "status", "progress", "owner", "idempotency_key", "created_at",
               "completed_at", "expires_at", "request", "outputs", "stats", "error")


def runner_id() -> str:
    """This API process, among those sharing a database."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _owner_lock(owner: str) -> int:
    """The PostgreSQL advisory lock of an owner's turns: a signed 64-bit number from its name."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"machgen-turns/{owner}".encode()).digest()[:8], "big", signed=True)


@dataclass(frozen=True)
class Webhook:
    """A delivery of the outbox: its body is signed and sent until a 2xx answer or the attempts run out."""

    id: int
    message_id: str
    url: str
    body: bytes
    attempts: int


class JobStore:
    """The job records, their inputs, events, results and webhook deliveries."""

    def __init__(self, data_dir: Path, database: Path | str | None = None):
        self.data_dir = Path(data_dir)
        self.results_dir = self.data_dir / "results"
        if database is None or not is_database_url(str(database)):
            self.results_dir.mkdir(parents=True, exist_ok=True)
        self.db = Database(database if database is not None else self.data_dir / "jobs.sqlite3")
        self.runner = runner_id()
        self._order = self.db.dialect.order

    @property
    def shared(self) -> bool:
        """Other API processes use this store too (PostgreSQL): jobs are taken over, events and results are
        read from the database."""
        return self.db.shared

    def close(self) -> None:
        self.db.close()

    # ---- jobs
    def fail_interrupted(self) -> list[str]:
        """Jobs left active by a previous process: failed, code ``interrupted`` (one API process: SQLite)."""
        error = json.dumps({"code": "interrupted", "message": "the API stopped while this job was queued or "
                                                              "running; submit it again"})
        with self.db.transaction() as run:
            ids = [row[0] for row in run(f"SELECT id FROM jobs WHERE {_ACTIVE_SQL}")]
            run("UPDATE jobs SET status = 'failed', error = ?, completed_at = ?, runner = NULL "
                f"WHERE {_ACTIVE_SQL}", (error, int(time.time())))
        return ids

    def insert(self, job: Job, inputs: bytes | None = None, lease_s: float = 60.0) -> Job:
        """Store a new job held by this process, with its variants' ``inputs`` (pack_inputs) for a takeover;
        with an idempotency key already used by its owner, the existing job instead."""
        row = {**self._row(job), "runner": self.runner, "lease_until": time.time() + lease_s, "inputs": inputs}
        columns = ", ".join(row)
        found = self.db.execute(
            f"INSERT INTO jobs ({columns}) VALUES ({', '.join('?' * len(row))}) "
            f"ON CONFLICT DO NOTHING RETURNING id", tuple(row.values()))
        if found:
            return job
        if job.idempotency_key is None:
            raise ValueError(f"job {job.id} exists already")
        existing = self.find_idempotent(job.owner, job.idempotency_key)
        assert existing is not None
        return existing

    def update(self, job: Job) -> bool:
        """The job's record as ``job`` says, unless another process holds it now (False)."""
        row = self._row(job)
        updated = self.db.execute(
            f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in row)} WHERE id = ? AND (runner IS NULL OR runner = ?) "
            f"RETURNING id", (*row.values(), job.id, self.runner))
        return bool(updated)

    def finish(self, job: Job, webhook: tuple[str, str, dict[str, Any]] | None) -> bool:
        """The job's final record and its webhook (url, event type, data) queued, together; nothing when
        another process holds the job now (False)."""
        row = {**self._row(job), "runner": None, "lease_until": None, "inputs": None}
        with self.db.transaction() as run:
            updated = run(f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in row)} WHERE id = ? AND runner = ? "
                          f"RETURNING id", (*row.values(), job.id, self.runner))
            if updated and webhook is not None:
                self._queue_webhook(run, *webhook)
        return bool(updated)

    def renew(self, progress: dict[str, tuple[str, int]], lease_s: float) -> tuple[set[str], set[str]]:
        """The leases of the jobs this process runs (job id: its status and progress, recorded too)
        extended; (those it still holds, those of them a caller asked to cancel)."""
        held, cancel = set(), set()
        until = time.time() + lease_s
        with self.db.transaction() as run:
            for job_id, (status, percent) in progress.items():
                rows = run("UPDATE jobs SET lease_until = ?, status = ?, progress = ? WHERE id = ? AND runner = ? "
                           "RETURNING cancel_requested", (until, status, percent, job_id, self.runner))
                if rows:
                    held.add(job_id)
                    if rows[0][0]:
                        cancel.add(job_id)
        return held, cancel

    def take_over(self, lease_s: float) -> tuple[Job, bytes] | None:
        """An active job whose holder's lease ran out, now held by this process, with its inputs; or None."""
        now = time.time()
        with self.db.transaction() as run:
            rows = run(f"SELECT id FROM jobs WHERE {_ACTIVE_SQL} AND lease_until < ? "
                       f"AND inputs IS NOT NULL ORDER BY {self._order} LIMIT 1 {self.db.dialect.skip_locked}",
                       (now,))
            if not rows:
                return None
            run("UPDATE jobs SET runner = ?, lease_until = ?, status = 'queued', progress = 0, admitted = 0 "
                "WHERE id = ?", (self.runner, now + lease_s, rows[0][0]))
            found = run(f"SELECT {', '.join(_JOB_FIELDS)}, inputs FROM jobs WHERE id = ?", (rows[0][0],))
        *fields, inputs = found[0]
        self.db.execute("DELETE FROM job_events WHERE job_id = ?", (rows[0][0],))  # a rerun's events start again
        return self._job(dict(zip(_JOB_FIELDS, fields))), bytes(inputs)

    def admit(self, job_id: str, owner: str, cap: int | None) -> bool:
        """Whether the job's turn to run has come, in every API process of the database: it is the oldest of
        its owner's active jobs still waiting, and fewer than ``cap`` (None: no limit) of the owner's jobs
        have theirs. Marked as having it if so."""
        with self.db.transaction() as run:
            if self.db.shared:  # the count and the mark as one step for every process of the database
                run("SELECT pg_advisory_xact_lock(?)", (_owner_lock(owner),))
            if cap is not None:
                running = run(f"SELECT COUNT(*) FROM jobs WHERE owner = ? AND admitted = 1 AND {_ACTIVE_SQL}",
                              (owner,))[0][0]
                first = run(f"SELECT id FROM jobs WHERE owner = ? AND admitted = 0 AND {_ACTIVE_SQL} "
                            f"ORDER BY {self._order} LIMIT 1", (owner,))
                if running >= cap or not first or first[0][0] != job_id:
                    return False
            run("UPDATE jobs SET admitted = 1 WHERE id = ?", (job_id,))
            return True

    def request_cancel(self, job_id: str) -> None:
        """Ask the process that runs the job to cancel it (it learns at its next lease renewal)."""
        self.db.execute("UPDATE jobs SET cancel_requested = 1 WHERE id = ?", (job_id,))

    def get(self, job_id: str) -> Job | None:
        found = self.db.execute(f"SELECT {', '.join(_JOB_FIELDS)} FROM jobs WHERE id = ?", (job_id,))
        return None if not found else self._job(dict(zip(_JOB_FIELDS, found[0])))

    def find_idempotent(self, owner: str, key: str) -> Job | None:
        found = self.db.execute("SELECT id FROM jobs WHERE owner = ? AND idempotency_key = ?", (owner, key))
        return None if not found else self.get(found[0][0])

    def active_count(self, owner: str) -> int:
        """The owner's jobs queued or running, in every API process."""
        return self.db.execute(f"SELECT COUNT(*) FROM jobs WHERE owner = ? AND {_ACTIVE_SQL}",
                               (owner,))[0][0]

    def list(self, kind: str | None = None, owner: str | None = None, limit: int = 50,
             after: str | None = None, ascending: bool = False) -> list[Job]:
        """Newest first (oldest first when ``ascending``); ``after``: the jobs past that one in that order
        (pagination)."""
        clauses, values = [], []
        if kind is not None:
            clauses.append("kind = ?")
            values.append(kind)
        if owner is not None:
            clauses.append("owner = ?")
            values.append(owner)
        if after is not None:
            clauses.append(f"{self._order} {'>' if ascending else '<'} (SELECT {self._order} FROM jobs WHERE id = ?)")
            values.append(after)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        rows = self.db.execute(f"SELECT {', '.join(_JOB_FIELDS)} FROM jobs {where} "
                               f"ORDER BY {self._order} {'ASC' if ascending else 'DESC'} LIMIT ?", (*values, limit))
        return [self._job(dict(zip(_JOB_FIELDS, row))) for row in rows]

    def delete(self, job_id: str) -> None:
        """The job's record, events and results gone (OpenAI's DELETE of a video)."""
        shutil.rmtree(self.result_dir(job_id), ignore_errors=True)
        with self.db.transaction() as run:
            for table, column in (("results", "job_id"), ("job_events", "job_id"), ("jobs", "id")):
                run(f"DELETE FROM {table} WHERE {column} = ?", (job_id,))

    def counts(self) -> dict[str, int]:
        """Jobs by status."""
        return dict(self.db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status"))

    # ---- results: files under the data folder (SQLite), rows of the database (PostgreSQL)
    def result_dir(self, job_id: str) -> Path:
        return self.results_dir / job_id

    def write_results(self, job_id: str, files: dict[str, bytes]) -> None:
        if self.shared:
            for name, data in files.items():
                self.db.execute("INSERT INTO results (job_id, name, data) VALUES (?, ?, ?) ON CONFLICT (job_id, name) "
                                "DO UPDATE SET data = excluded.data", (job_id, name, data))
            return
        folder = self.result_dir(job_id)
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            (folder / name).write_bytes(data)

    def result_path(self, job_id: str, name: str) -> Path | None:
        """Where a result file lies on this machine (SQLite), to be sent from disk; None otherwise."""
        path = self.result_dir(job_id) / name
        return path if not self.shared and path.is_file() else None

    def read_result(self, job_id: str, name: str) -> bytes | None:
        if not self.shared:
            path = self.result_path(job_id, name)
            return None if path is None else path.read_bytes()
        found = self.db.execute("SELECT data FROM results WHERE job_id = ? AND name = ?", (job_id, name))
        return bytes(found[0][0]) if found else None

    def expire(self, now: float | None = None) -> list[str]:
        """Delete the results of jobs past their expiry; their records say ``expired``, their events go."""
        now = int(now if now is not None else time.time())
        ids = [row[0] for row in self.db.execute(
            "SELECT id FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ? AND outputs != '[]'", (now,))]
        for job_id in ids:
            shutil.rmtree(self.result_dir(job_id), ignore_errors=True)
            with self.db.transaction() as run:
                run("DELETE FROM results WHERE job_id = ?", (job_id,))
                run("DELETE FROM job_events WHERE job_id = ?", (job_id,))
                run("UPDATE jobs SET outputs = '[]' WHERE id = ?", (job_id,))
        return ids

    # ---- events of jobs, for listeners in other API processes (PostgreSQL)
    def add_event(self, job_id: str, event: str, data: dict[str, Any], variant: int | None = None) -> None:
        """A job's event; a preview replaces the variant's earlier one (a late listener needs the latest)."""
        with self.db.transaction() as run:
            if event == "preview":
                run("DELETE FROM job_events WHERE job_id = ? AND event = 'preview' AND variant = ?", (job_id, variant))
            run("INSERT INTO job_events (job_id, event, variant, data) VALUES (?, ?, ?, ?)",
                (job_id, event, variant, json.dumps(data)))

    def events_after(self, job_id: str, seq: int) -> list[tuple[int, str, dict[str, Any]]]:
        rows = self.db.execute("SELECT seq, event, data FROM job_events WHERE job_id = ? AND seq > ? ORDER BY seq",
                               (job_id, seq))
        return [(number, event, json.loads(data)) for number, event, data in rows]

    # ---- the webhook outbox
    def queue_webhook(self, url: str, event_type: str, data: dict[str, Any]) -> None:
        with self.db.transaction() as run:
            self._queue_webhook(run, url, event_type, data)

    @staticmethod
    def _queue_webhook(run, url: str, event_type: str, data: dict[str, Any]) -> None:
        body = json.dumps({"type": event_type, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "data": data})
        run("INSERT INTO webhooks (message_id, url, body, next_attempt_at) VALUES (?, ?, ?, ?)",
            (f"msg_{uuid.uuid4().hex}", url, body, time.time()))

    def claim_webhook(self, lease_s: float) -> Webhook | None:
        """A delivery that is due, held by this process for ``lease_s`` (no other process sends it meanwhile)."""
        now = time.time()
        with self.db.transaction() as run:
            rows = run(f"SELECT id, message_id, url, body, attempts FROM webhooks WHERE delivered_at IS NULL "
                       f"AND gave_up = 0 AND next_attempt_at <= ? AND lease_until < ? ORDER BY id LIMIT 1 "
                       f"{self.db.dialect.skip_locked}", (now, now))
            if not rows:
                return None
            run("UPDATE webhooks SET lease_until = ? WHERE id = ?", (now + lease_s, rows[0][0]))
        number, message_id, url, body, attempts = rows[0]
        return Webhook(number, message_id, url, body.encode(), attempts)

    def webhook_attempted(self, webhook: Webhook, delivered: bool, problem: str | None,
                          retry_at: float | None) -> None:
        """One attempt's outcome: delivered, to be retried at ``retry_at``, or (None) given up."""
        now = time.time()
        if delivered:
            self.db.execute("UPDATE webhooks SET delivered_at = ?, attempts = attempts + 1, problem = NULL "
                            "WHERE id = ?", (now, webhook.id))
        else:
            self.db.execute("UPDATE webhooks SET attempts = attempts + 1, problem = ?, next_attempt_at = ?, "
                            "lease_until = 0, gave_up = ? WHERE id = ?",
                            (problem, retry_at if retry_at is not None else now, int(retry_at is None), webhook.id))

    def next_webhook_at(self) -> float | None:
        found = self.db.execute("SELECT MIN(next_attempt_at) FROM webhooks WHERE delivered_at IS NULL AND gave_up = 0")
        return found[0][0] if found and found[0][0] is not None else None

    # ---- keys and settings kept in the database
    def api_keys(self) -> list[tuple[str, str, int | None]]:
        return [tuple(row) for row in self.db.execute("SELECT name, digest, max_jobs FROM api_keys ORDER BY name")]

    def add_api_key(self, name: str, digest: str, max_jobs: int | None) -> bool:
        """False: the name has a key already."""
        return bool(self.db.execute("INSERT INTO api_keys (name, digest, max_jobs) VALUES (?, ?, ?) "
                                    "ON CONFLICT DO NOTHING RETURNING name", (name, digest, max_jobs)))

    def setting(self, name: str, make) -> str:
        """A value every API process of the database shares: the stored one, or ``make()`` stored first."""
        self.db.execute("INSERT INTO settings (name, value) VALUES (?, ?) ON CONFLICT DO NOTHING", (name, make()))
        return self.db.execute("SELECT value FROM settings WHERE name = ?", (name,))[0][0]

    @staticmethod
    def _row(job: Job) -> dict[str, Any]:
        row = asdict(job)
        for name in ("request", "outputs", "stats"):
            row[name] = json.dumps(row[name])
        row["error"] = None if job.error is None else json.dumps(job.error)
        return row

    @staticmethod
    def _job(row: dict[str, Any]) -> Job:
        row = dict(row)
        for name in ("request", "outputs", "stats"):
            row[name] = json.loads(row[name])
        row["error"] = None if row["error"] is None else json.loads(row["error"])
        return Job(**row)
