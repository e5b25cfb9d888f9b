"""API keys: a text file of key hashes, never the keys themselves.

One key a line: ``NAME sha256:HEX [MAX_JOBS]`` (``#`` starts a comment);
MAX_JOBS is the key's limit of jobs in flight (the API's default when
absent). ``machgen api-key add FILE NAME`` makes a key, appends its line and
prints the key once.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from pathlib import Path

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
    if not name or any(c.isspace() or c == "#" for c in name):
        raise ValueError(f"a key's name is one word, not {name!r}")
    path = Path(path)
    if path.exists() and any(key.name == name for key in read_keys(path)):
        raise ValueError(f"{path} already has a key named {name!r}")
    key = KEY_PREFIX + secrets.token_urlsafe(24)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as out:
        out.write(f"{name} sha256:{digest(key)}" + (f" {max_jobs}" if max_jobs is not None else "") + "\n")
    return key


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
