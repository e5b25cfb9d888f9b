"""machgen.client: call served machgen pipelines from Python."""

from machgen.client.client import NO_RETRY, PROTOCOLS, GenerationError, MachgenClient, RetryPolicy, retryable

__all__ = ["NO_RETRY", "PROTOCOLS", "GenerationError", "MachgenClient", "RetryPolicy", "retryable"]
