"""The Python-backend stub processes of a tritonserver, as psutil sees them
(``machgen serve`` watches them; a relay checks that its sampler still runs)."""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from pathlib import Path

# A stub's command line: triton_python_backend_stub .../MODEL/VERSION/model.py SHM_REGION SHM_DEFAULT_BYTES ...
# instance-name kind.
_MODEL_FILE_ARG = 1
_SHM_REGION_ARG = 2
_SHM_START_BYTES_ARG = 3
_INSTANCE_ARG = 8


# The signal on which a stub running machgen's models writes every thread's Python stack into the server log
# (runtime/triton_models/__init__.py registers it; machgen/server.py sends it to the stubs of a start that hangs).
STACKS_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class Stub:
    """One Python-backend stub process: model ``model``'s instance ``instance``."""

    pid: int
    model: str
    instance: str
    started: float  # seconds since the epoch
    # Its shared-memory region in /dev/shm, and the bytes that region was made with (it grows, never shrinks).
    region: Path | None = None
    region_start_bytes: int = 0

    def region_bytes(self) -> int:
        """Its region's bytes now (0 once it is gone)."""
        try:
            return self.region.stat().st_size if self.region is not None else 0
        except OSError:
            return 0


def stub_of(process) -> Stub | None:
    """``process`` (a psutil.Process) as a Python-backend stub; None if it is none, or gone."""
    import psutil

    try:
        command = process.cmdline()
        if len(command) <= _INSTANCE_ARG or not command[0].endswith("triton_python_backend_stub"):
            return None
        return Stub(process.pid, Path(command[_MODEL_FILE_ARG]).parent.parent.name, command[_INSTANCE_ARG],
                    process.create_time(), Path("/dev/shm") / command[_SHM_REGION_ARG],
                    int(command[_SHM_START_BYTES_ARG]))
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied, ValueError):
        return None


def instances_of(model: str, stubs) -> list[Stub]:
    """Those of ``stubs`` that are instances of ``model`` (named MODEL_GROUP_INDEX)."""
    pattern = re.compile(rf"{re.escape(model)}_\d+_\d+")
    return [stub for stub in stubs if pattern.fullmatch(stub.instance)]


def process_running(pid: int) -> bool:
    """Whether process ``pid`` runs: a killed stub stays a zombie until the server reaps it (under Triton 2.51
    one whose version never unloads, for the server's life), and its pid still exists."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def sibling_stubs() -> list[Stub]:
    """The live stubs of the server that started this process (a stub)."""
    import os

    import psutil

    try:
        children = psutil.Process(os.getppid()).children()
    except psutil.NoSuchProcess:
        return []
    return [stub for stub in map(stub_of, children) if stub is not None]
