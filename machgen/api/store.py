"""Jobs and their results, kept across restarts: a SQLite file (the job
records) and a results folder (one folder of files per job), both under the
API's data folder. Results expire: past ``expires_at`` the files go and the
record stays, saying so.

A job that was queued or running when the API stopped cannot be resumed
(its Triton request ended with the API's connection): at start-up it is
marked failed, code ``interrupted``, so a caller polling it learns to
submit it again.
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ACTIVE = ("queued", "in_progress")
FINISHED = ("completed", "failed", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL,
    owner TEXT NOT NULL,
    idempotency_key TEXT,
    created_at INTEGER NOT NULL,
    completed_at INTEGER,
    expires_at INTEGER,
    request TEXT NOT NULL,
    outputs TEXT NOT NULL,
    stats TEXT NOT NULL,
    error TEXT
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (owner, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
"""


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


class JobStore:
    """The job records (SQLite) and result files of one API process."""

    def __init__(self, data_dir: Path, database: Path | None = None):
        self.data_dir = Path(data_dir)
        self.results_dir = self.data_dir / "results"
        self.results_dir.mkdir(parents=True, exist_ok=True)
        self.database = Path(database) if database is not None else self.data_dir / "jobs.sqlite3"
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.database, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def fail_interrupted(self) -> list[str]:
        """Jobs left active by a previous process: failed, code ``interrupted``."""
        error = json.dumps({"code": "interrupted", "message": "the API stopped while this job was queued or "
                                                              "running; submit it again"})
        with self._lock:
            ids = [row[0] for row in self._db.execute(
                f"SELECT id FROM jobs WHERE status IN {ACTIVE}")]
            self._db.execute(f"UPDATE jobs SET status = 'failed', error = ?, completed_at = ? "
                             f"WHERE status IN {ACTIVE}", (error, int(time.time())))
        return ids

    def insert(self, job: Job) -> Job:
        """Store a new job; with an idempotency key already used by its owner, the existing job instead."""
        row = self._row(job)
        with self._lock:
            try:
                self._db.execute(f"INSERT INTO jobs ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                                 tuple(row.values()))
                return job
            except sqlite3.IntegrityError:
                if job.idempotency_key is None:
                    raise
        existing = self.find_idempotent(job.owner, job.idempotency_key)
        assert existing is not None
        return existing

    def update(self, job: Job) -> None:
        row = self._row(job)
        with self._lock:
            self._db.execute(f"UPDATE jobs SET {', '.join(f'{k} = ?' for k in row)} WHERE id = ?",
                             (*row.values(), job.id))

    def get(self, job_id: str) -> Job | None:
        with self._lock:
            found = self._db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
            names = [d[0] for d in self._db.execute("SELECT * FROM jobs LIMIT 0").description]
        return None if found is None else self._job(dict(zip(names, found)))

    def find_idempotent(self, owner: str, key: str) -> Job | None:
        with self._lock:
            found = self._db.execute("SELECT id FROM jobs WHERE owner = ? AND idempotency_key = ?",
                                     (owner, key)).fetchone()
        return None if found is None else self.get(found[0])

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
            clauses.append(f"rowid {'>' if ascending else '<'} (SELECT rowid FROM jobs WHERE id = ?)")
            values.append(after)
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        with self._lock:
            ids = [row[0] for row in self._db.execute(
                f"SELECT id FROM jobs {where} ORDER BY rowid {'ASC' if ascending else 'DESC'} LIMIT ?",
                (*values, limit))]
        return [job for job in (self.get(i) for i in ids) if job is not None]

    def delete(self, job_id: str) -> None:
        """The job's record and its files gone (OpenAI's DELETE of a video)."""
        shutil.rmtree(self.result_dir(job_id), ignore_errors=True)
        with self._lock:
            self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def counts(self) -> dict[str, int]:
        """Jobs by status."""
        with self._lock:
            return dict(self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall())

    def result_dir(self, job_id: str) -> Path:
        return self.results_dir / job_id

    def expire(self, now: float | None = None) -> list[str]:
        """Delete the files of jobs past their expiry; their records say ``expired``."""
        now = int(now if now is not None else time.time())
        with self._lock:
            ids = [row[0] for row in self._db.execute(
                "SELECT id FROM jobs WHERE expires_at IS NOT NULL AND expires_at <= ? AND outputs != '[]'", (now,))]
        for job_id in ids:
            shutil.rmtree(self.result_dir(job_id), ignore_errors=True)
            with self._lock:
                self._db.execute("UPDATE jobs SET outputs = '[]' WHERE id = ?", (job_id,))
        return ids

    @staticmethod
    def _row(job: Job) -> dict[str, Any]:
        row = asdict(job)
        for name in ("request", "outputs", "stats"):
            row[name] = json.dumps(row[name])
        row["error"] = None if job.error is None else json.dumps(job.error)
        return row

    @staticmethod
    def _job(row: dict[str, Any]) -> Job:
        for name in ("request", "outputs", "stats"):
            row[name] = json.loads(row[name])
        row["error"] = None if row["error"] is None else json.loads(row["error"])
        return Job(**row)
