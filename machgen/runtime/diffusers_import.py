"""diffusers in a process that never hands its modules to torch.compile."""

from __future__ import annotations

import sys


def import_diffusers_without_dynamo() -> bool:
    """Import diffusers' utilities with ``torch._dynamo`` hidden, where nothing has imported either yet;
    True where it did.

    diffusers' first import pulls in ``torch._dynamo`` only for ``allow_in_graph``, a torch.compile hint
    put on its transformer blocks as they are defined: in a sampler, which only steps diffusers' schedulers
    and draws its noise, that is about 1.1 s of CPU of its 3.4 s start and 140 MB of its memory (measured
    on these CPUs with torch 2.9, diffusers 0.42). Hidden, diffusers takes the identity for the hint, as it
    does where dynamo is missing. torch.compile still works later in the process (it imports dynamo
    itself); only diffusers blocks defined after lack the hint, which changes where torch.compile splits
    graphs around them, never what they compute."""
    if "diffusers.utils.torch_utils" in sys.modules or "torch._dynamo" in sys.modules:
        return False
    import torch  # noqa: F401 - imported whole first: torch's own start-up may need dynamo

    sys.modules["torch._dynamo"] = None  # type: ignore[assignment] - an import of it raises ImportError
    try:
        import diffusers.utils.torch_utils  # noqa: F401
    finally:
        del sys.modules["torch._dynamo"]
    return True
