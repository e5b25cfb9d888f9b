"""What the client raises when the server refuses or fails a request."""

from __future__ import annotations


class GenerationError(RuntimeError):
    """The server refused or failed a request; ``status`` is its status code."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status
