"""machgen.client: call served machgen pipelines from Python."""

from machgen.client.client import PROTOCOLS, GenerationError, MachgenClient

__all__ = ["PROTOCOLS", "GenerationError", "MachgenClient"]
