"""The only module that imports triton_python_backend_utils (``pb_utils``,
which the Python backend's stub provides), and what every model shares:
its config's parameters, error answers, the stop machgen serve asks for."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from machgen.contract.manifest import STOP_FILE_ENV, busy_file, drained_file


def server_stopping() -> bool:
    """Whether machgen serve is stopping the server and asks running requests to stop (STOP_FILE_ENV)."""
    stop_file = os.environ.get(STOP_FILE_ENV)
    return bool(stop_file) and os.path.exists(stop_file)


def mark_drained(model: str) -> None:
    """Tell machgen serve that ``model`` has answered every request it took: Triton finalizes an instance
    only then, and finalizes the others a second apart (drained_file in contract/manifest.py)."""
    stop_file = os.environ.get(STOP_FILE_ENV)
    if stop_file:
        Path(drained_file(stop_file, model)).touch()


class RequestsHeld:
    """The requests this instance of a public model holds, published to machgen serve's drain as a file
    that exists while it holds any (busy_file in contract/manifest.py)."""

    def __init__(self, model: str):
        stop_file = os.environ.get(STOP_FILE_ENV)
        self._path = Path(busy_file(stop_file, model, os.getpid())) if stop_file else None
        self._count = 0
        self._lock = threading.Lock()

    def begin(self) -> None:
        """A request taken (from execute, before any thread of its own starts)."""
        with self._lock:
            self._count += 1
            if self._count == 1 and self._path is not None:
                self._path.touch()

    def end(self) -> None:
        """A request's final response sent."""
        with self._lock:
            self._count -= 1
            if self._count == 0 and self._path is not None:
                self._path.unlink(missing_ok=True)

    @contextlib.contextmanager
    def held(self):
        self.begin()
        try:
            yield
        finally:
            self.end()


def model_dir(args: dict) -> Path:
    """The version folder of the model Triton initializes with ``args``."""
    return Path(args["model_repository"]) / args["model_version"]


def parameter(config: dict, key: str, default: str) -> str:
    """A string parameter of a model's config (its JSON form), or ``default``."""
    return config.get("parameters", {}).get(key, {}).get("string_value", default)


def error_response(message: str, code) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def text_array(value: str) -> np.ndarray:
    """One UTF-8 text as a BYTES tensor's array."""
    return np.array([value.encode("utf-8")], dtype=np.object_)

