"""API keys: a text file of key hashes, never the keys themselves.

One key a line: ``NAME sha256:HEX [MAX_JOBS]`` (``#`` starts a comment);
MAX_JOBS is the key's limit of jobs in flight (the API's default when
absent). ``machgen api-key add FILE NAME`` makes a key, appends its line and
prints the key once.

Result URLs stand in for a key: ``UrlSigner`` signs them, with their expiry.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlencode

KEY_PREFIX = "mg-"


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: str  # sha256 hex of the key
    max_jobs: int | None = None


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def read_keys(path: Path) -> list[ApiKey]:
    keys = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) not in (2, 3) or not words[1].startswith("sha256:"):
            raise ValueError(f"{path}:{number}: expected 'NAME sha256:HEX [MAX_JOBS]'")
        keys.append(ApiKey(words[0], words[1].removeprefix("sha256:"), int(words[2]) if len(words) == 3 else None))
    return keys


def add_key(path: Path, name: str, max_jobs: int | None = None) -> str:
    """A new key for ``name``, its hash appended to ``path``; the key is returned, not kept."""
    _check_name(name)
    path = Path(path)
    if path.exists() and any(key.name == name for key in read_keys(path)):
        raise ValueError(f"{path} already has a key named {name!r}")
    key = KEY_PREFIX + secrets.token_urlsafe(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        out.write(f"{name} sha256:{digest(key)}" + (f" {max_jobs}" if max_jobs is not None else "") + "\n")
    return key


def _check_name(name: str) -> None:
    if not name or any(c.isspace() or c == "#" for c in name):
        raise ValueError(f"a key's name is one word, not {name!r}")


class KeyRing:
    """Who a request's bearer key is; no file: nobody needs a key."""

    def __init__(self, keys: list[ApiKey] | None):
        self.keys = keys

    @property
    def required(self) -> bool:
        return self.keys is not None

    def find(self, key: str | None) -> ApiKey | None:
        if key is None or self.keys is None:
            return None
        wanted = digest(key)
        found = None
        for candidate in self.keys:  # every one compared: the time taken says nothing of which matched
            if hmac.compare_digest(candidate.digest, wanted):
                found = candidate
        return found


class StoredKeyRing(KeyRing):
    """The keys a shared database keeps (``machgen api-key postgresql://... NAME``), read again every few
    seconds, so that a key added or removed reaches every API process; a key is needed once there is one."""

    def __init__(self, store, refresh_s: float = 5.0):
        super().__init__(None)
        self.store, self.refresh_s = store, refresh_s
        self._read_at = -float("inf")

    def _fresh(self) -> None:
        if time.monotonic() - self._read_at >= self.refresh_s:
            self.keys = [ApiKey(name, digest, max_jobs) for name, digest, max_jobs in self.store.api_keys()] or None
            self._read_at = time.monotonic()

    @property
    def required(self) -> bool:
        self._fresh()
        return self.keys is not None

    def find(self, key: str | None) -> ApiKey | None:
        self._fresh()
        return super().find(key)


def add_stored_key(store, name: str, max_jobs: int | None = None) -> str:
    """A new key for ``name`` kept in the API's database; the key is returned, not kept."""
    _check_name(name)
    key = KEY_PREFIX + secrets.token_urlsafe(24)
    if not store.add_api_key(name, digest(key), max_jobs):
        raise ValueError(f"the database already has a key named {name!r}")
    return key


SIGNING_KEY_FILE = "url-signing.key"


class UrlSigner:
    """Result URLs a plain GET downloads without the API key: the path and
    query signed (HMAC-SHA256 under a key kept in the data folder, so URLs
    outlive a restart) with their expiry, ``expires`` and ``signature`` added
    to the query."""

    def __init__(self, key: bytes):
        self._key = key

    @classmethod
    def in_folder(cls, folder: Path) -> "UrlSigner":
        path = Path(folder) / SIGNING_KEY_FILE
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(descriptor, "w") as out:
                out.write(secrets.token_hex(32))
        return cls(bytes.fromhex(path.read_text().strip()))

    def _signature(self, path: str, query: dict[str, str]) -> str:
        canonical = path + "?" + urlencode(sorted(query.items()))
        return hmac.new(self._key, canonical.encode(), hashlib.sha256).hexdigest()

    def sign(self, path: str, query: dict[str, str], expires: int) -> str:
        """``path`` with its query, ``expires`` (Unix seconds) and the signature of all of it."""
        signed = {**query, "expires": str(expires)}
        return path + "?" + urlencode({**signed, "signature": self._signature(path, signed)})

    def check(self, path: str, query: dict[str, str], now: float) -> str | None:
        """Why the signed ``query`` (its ``signature`` included) does not open ``path`` now; None: it does."""
        query = dict(query)
        signature = query.pop("signature", "")
        if not hmac.compare_digest(self._signature(path, query), signature):
            return "the URL's signature is not valid"
        expires = query.get("expires", "")
        if not expires.isdigit() or int(expires) <= now:
            return "the URL has expired"
        return None
