"""What a sampler with realtime sessions tells `machgen serve`, through files beside the stop file (no Triton
import: the supervisor's side is machgen/supervisor.py)."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Callable

from machgen.contract.manifest import SAMPLER, STOP_FILE_ENV, model_name, replacing_file, sessions_file
from machgen.runtime.streaming.engine import SessionRefused


class SessionsOpen:
    """Whether this sampler has realtime sessions open (or one opening), published to machgen serve as a file
    that exists while it has any (sessions_file in contract/manifest.py): its supervisor loads no model of the
    pipeline again then. A session opens only after the file is there and no replacing_file names this
    process: the supervisor writes that before it looks at the sessions files a last time, so either it sees
    the opening session and loads nothing, or the opening sees the replacement and is refused, never lost."""

    def __init__(self, pipeline: str):
        stop_file = os.environ.get(STOP_FILE_ENV)
        self._path = Path(sessions_file(stop_file, pipeline, os.getpid())) if stop_file else None
        self._replacing = Path(replacing_file(stop_file, model_name(pipeline, SAMPLER))) if stop_file else None
        self._published = False
        self._opening = 0
        self._lock = threading.Lock()

    def update(self, count: Callable[[], int]) -> None:
        """``count``: the sessions open now, read under the lock (else an older reading could be written last)."""
        with self._lock:
            self._publish(count() > 0 or self._opening > 0)

    def _publish(self, is_open: bool) -> None:
        if self._path is None or is_open == self._published:
            return
        if is_open:
            self._path.touch()
        else:
            self._path.unlink(missing_ok=True)
        self._published = is_open

    @contextlib.contextmanager
    def opening(self, count: Callable[[], int]):
        """Around a session's opening: published first; refused (SessionRefused) where this process is being
        replaced."""
        with self._lock:
            self._opening += 1
            self._publish(True)
        try:
            if self._replaced():
                raise SessionRefused("session", "this model is being loaded again (machgen serve gives back the "
                                                "shared memory it grew while idle): open the session again in a "
                                                "few seconds")
            yield
        finally:
            with self._lock:
                self._opening -= 1
            self.update(count)

    def _replaced(self) -> bool:
        try:
            return str(os.getpid()) in self._replacing.read_text().split()
        except (OSError, AttributeError):  # no replacement under way; no machgen serve
            return False

    def close(self) -> None:
        with self._lock:
            if self._path is not None:
                self._path.unlink(missing_ok=True)
            self._published = False
