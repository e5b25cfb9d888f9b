"""The API's database: a SQLite file (the embedded default, one API
process) or PostgreSQL (``postgresql://...``: several API processes share
it), behind one small interface, and the schema's migrations.

SQL is written once with ``?`` placeholders; the few words the two
dialects spell differently are filled in from ``Dialect``. A migration runs
once per database, in order, inside a transaction (on PostgreSQL under an
advisory lock, so API processes starting together do not race); a database
newer than this machgen is refused.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

Rows = list[tuple]
Run = Callable[..., Rows]


@dataclass(frozen=True)
class Dialect:
    name: str
    blob: str  # binary column type
    serial: str  # auto-numbered integer key
    order: str  # the column that orders jobs by insertion
    jobs_order_column: str  # its definition in the jobs table ("" where implicit)
    skip_locked: str  # row locking of a claim ("" where a write transaction locks the whole file)


SQLITE = Dialect("sqlite", "BLOB", "INTEGER PRIMARY KEY AUTOINCREMENT", "rowid", "", "")
POSTGRESQL = Dialect("postgresql", "BYTEA", "BIGSERIAL PRIMARY KEY", "seq", "seq BIGSERIAL UNIQUE,",
                     "FOR UPDATE SKIP LOCKED")

# (version, what it adds, statements). Never edit one that has shipped: add the next.
MIGRATIONS: list[tuple[int, str, str]] = [
    (1, "jobs", """
CREATE TABLE IF NOT EXISTS jobs (
    {jobs_order_column}
    id TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL,
    owner TEXT NOT NULL,
    idempotency_key TEXT,
    created_at BIGINT NOT NULL,
    completed_at BIGINT,
    expires_at BIGINT,
    request TEXT NOT NULL,
    outputs TEXT NOT NULL,
    stats TEXT NOT NULL,
    error TEXT
);
CREATE UNIQUE INDEX IF NOT EXISTS jobs_idempotency ON jobs (owner, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
"""),
    (2, "leases and inputs of jobs; events, results, webhooks, keys and settings shared by API processes", """
ALTER TABLE jobs ADD COLUMN runner TEXT;
ALTER TABLE jobs ADD COLUMN lease_until DOUBLE PRECISION;
ALTER TABLE jobs ADD COLUMN inputs {blob};
ALTER TABLE jobs ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0;
CREATE INDEX jobs_active ON jobs (status, lease_until);
CREATE TABLE job_events (
    seq {serial},
    job_id TEXT NOT NULL,
    event TEXT NOT NULL,
    variant INTEGER,
    data TEXT NOT NULL
);
CREATE INDEX job_events_job ON job_events (job_id, seq);
CREATE TABLE results (
    job_id TEXT NOT NULL,
    name TEXT NOT NULL,
    data {blob} NOT NULL,
    PRIMARY KEY (job_id, name)
);
CREATE TABLE webhooks (
    id {serial},
    message_id TEXT NOT NULL,
    url TEXT NOT NULL,
    body TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at DOUBLE PRECISION NOT NULL,
    lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
    delivered_at DOUBLE PRECISION,
    gave_up INTEGER NOT NULL DEFAULT 0,
    problem TEXT
);
CREATE INDEX webhooks_due ON webhooks (delivered_at, gave_up, next_attempt_at);
CREATE TABLE api_keys (
    name TEXT PRIMARY KEY,
    digest TEXT NOT NULL,
    max_jobs INTEGER
);
CREATE TABLE settings (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
"""),
    (3, "which active jobs have their turn to run (an owner's running cap)", """
ALTER TABLE jobs ADD COLUMN admitted INTEGER NOT NULL DEFAULT 0;
CREATE INDEX jobs_owner_active ON jobs (owner, status, admitted);
"""),
]
SCHEMA_VERSION = MIGRATIONS[-1][0]
_MIGRATION_LOCK = 0x6D616368  # "mach": the advisory lock PostgreSQL migrations hold


def is_database_url(text: str | None) -> bool:
    return bool(text) and str(text).startswith(("postgresql://", "postgres://"))


class Database:
    """One connection, used under a lock: the API calls it from its event
    loop and from worker threads."""

    def __init__(self, target: str | Path):
        self._lock = threading.RLock()
        self._target = target
        if is_database_url(str(target)):
            self.dialect = POSTGRESQL
        else:
            self.dialect = SQLITE
        self._connection = self._connect()
        self.migrate()

    def _connect(self):
        if self.dialect is POSTGRESQL:
            import psycopg

            return psycopg.connect(str(self._target), autocommit=True)
        import sqlite3

        connection = sqlite3.connect(self._target, check_same_thread=False, isolation_level=None, timeout=30)
        connection.execute("PRAGMA journal_mode=WAL")
        return connection

    @property
    def shared(self) -> bool:
        """Whether other API processes may use this database too."""
        return self.dialect is POSTGRESQL

    def close(self) -> None:
        with self._lock:
            self._connection.close()

    def _sql(self, sql: str) -> str:
        return sql.replace("?", "%s") if self.dialect is POSTGRESQL else sql

    def _run(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        cursor = self._connection.execute(self._sql(sql), tuple(params))
        return cursor.fetchall() if cursor.description is not None else []

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        """One statement on its own; its rows (a SELECT's, or RETURNING's)."""
        with self._lock:
            try:
                return self._run(sql, params)
            except Exception as err:
                if not self._reconnected(err):
                    raise
            return self._run(sql, params)

    def columns(self, table: str) -> list[str]:
        with self._lock:
            cursor = self._connection.execute(f"SELECT * FROM {table} LIMIT 0")
            return [d[0] for d in cursor.description]

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Run]:
        """Statements that take effect together or not at all: ``run(sql, params)`` gives each one's rows."""
        with self._lock:
            if self.dialect is POSTGRESQL:
                if self._connection.closed or self._connection.broken:
                    self._connection = self._connect()
                with self._connection.transaction():
                    yield self._run
                return
            self._connection.execute("BEGIN IMMEDIATE")
            try:
                yield self._run
            except BaseException:
                self._connection.execute("ROLLBACK")
                raise
            self._connection.execute("COMMIT")

    def _reconnected(self, err: Exception) -> bool:
        """A PostgreSQL connection lost (the server restarted): connected again, the statement to be run
        again. Anything else is the caller's."""
        if self.dialect is not POSTGRESQL:
            return False
        import psycopg

        if not isinstance(err, psycopg.OperationalError) or not (self._connection.closed or self._connection.broken):
            return False
        self._connection = self._connect()
        return True

    def migrate(self) -> int:
        """Every migration this database lacks, in order; its schema version."""
        words = {field: getattr(self.dialect, field) for field in ("blob", "serial", "jobs_order_column")}
        with self.transaction() as run:
            if self.dialect is POSTGRESQL:
                run("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            run("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            rows = run("SELECT version FROM schema_version")
            if not rows:
                run("INSERT INTO schema_version (version) VALUES (0)")
            current = rows[0][0] if rows else 0
            if current > SCHEMA_VERSION:
                raise RuntimeError(f"the database's schema is version {current}, newer than this machgen's "
                                   f"({SCHEMA_VERSION}): run the machgen that wrote it, or a newer one")
            for version, _, statements in MIGRATIONS:
                if version <= current:
                    continue
                for statement in statements.format(**words).split(";"):
                    if statement.strip():
                        run(statement)
                run("UPDATE schema_version SET version = ?", (version,))
        return max(current, SCHEMA_VERSION)
