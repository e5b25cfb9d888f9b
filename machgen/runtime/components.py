"""Opening an exported component file with the runner of its target, and
the components a pipeline runs in the sampler's own process."""

from __future__ import annotations

import os
import queue
import threading
from pathlib import Path
from typing import Any, Mapping

from machgen.contract.manifest import COMPONENT_FILES, ComponentEntry


def open_component(path: str | os.PathLike, intra_op_threads: int = 0, device: str | None = None,
                   adapters: str | os.PathLike | None = None, max_loaded: int = 8, layout: Any = None) -> Any:
    """A runner (``run(inputs) -> outputs``, ``run_batches``) for an exported
    file: ``model.onnx`` under ONNX Runtime, ``model.pt2`` under torch (on
    ``device``, or where it was built). A component that takes per-request
    adapters reads them from ``adapters`` (contract.adapters.adapters_root),
    keeping ``max_loaded`` in memory (runtime/adapters.py). A program built
    for a parallel layout runs on its ranks (``layout``: another layout the
    build allows)."""
    from machgen.runtime.adapters import with_adapters

    path = Path(path)
    if path.suffix == ".plan":
        raise ValueError(f"{path}: a TensorRT engine runs in Triton's TensorRT backend, not in-process")
    if path.suffix == ".pt2":
        from machgen.runtime.torch_runner import open_program

        program = open_program(path.parent, device=device, layout=layout)
        return with_adapters(program, path.parent, adapters, max_loaded, convert=program.prepare)
    from machgen.runtime.onnx_runner import OnnxSession

    return with_adapters(OnnxSession(path, intra_op_threads=intra_op_threads), path.parent, adapters, max_loaded)


class InSamplerComponents:
    """The components a pipeline runs in the sampler's own process (their
    manifest entry names a ``file`` under the sampler's folder
    instead of a Triton model). One single-threaded session each on the
    CPU: they are tiny, and the sampler shares the cores with the served
    components. Request threads take turns on each (a runner is not made
    to be called from two threads at once)."""

    def __init__(self, components: Mapping[str, ComponentEntry], sampler_dir: str | os.PathLike,
                 adapters: str | os.PathLike | None = None, max_loaded: int = 8):
        self._runners = {name: open_component(Path(sampler_dir) / entry.file, intra_op_threads=1,
                                              adapters=adapters, max_loaded=max_loaded)
                         for name, entry in components.items() if entry.file is not None}
        self._locks = {name: threading.Lock() for name in self._runners}

    def __contains__(self, component: str) -> bool:
        return component in self._runners

    def run(self, component: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
        with self._locks[component]:
            return self._runners[component].run(inputs)

    def release_memory(self) -> None:
        """The memory their runs grew given back (onnx_runner.release_memory), while runs may go on."""
        from machgen.runtime.onnx_runner import release_memory

        release_memory(*self._runners.values())

    def release_after_s(self, idle_s: float) -> float:
        """Seconds after the last session's close before a release: ``idle_s``, or longer where reopening
        them is slow (onnx_runner.release_delay)."""
        from machgen.runtime.onnx_runner import release_delay

        return release_delay(idle_s, *self._runners.values())


class LoneStepSessions:
    """The sampler's own sessions of each denoiser chain that is one ONNX
    file (the onnxruntime target's joined head and tail, builder/chain.py),
    for the steps of a request that runs alone: its calls then skip two
    BLS round trips, a third of such a step on the trained video default
    (perf/RESULTS.md). ``sessions`` per chain, each opened as the chain's
    Triton instances open theirs (``intra_op_threads``), so that a part of
    a call cut as RowSpread cuts it gives the bits an instance would give.
    A part takes whichever session is free."""

    def __init__(self, components: Mapping[str, ComponentEntry], repository_dir: str | os.PathLike, sessions: int,
                 intra_op_threads: int):
        self._free: dict[str, queue.SimpleQueue] = {}
        for name, entry in components.items():
            path = Path(repository_dir) / str(entry.model) / "1" / COMPONENT_FILES["onnxruntime"]
            if sessions < 1 or not entry.steps or not path.is_file():
                continue  # an ensemble (another target, per-request adapters) has no file of its own
            free = self._free[name] = queue.SimpleQueue()
            for _ in range(sessions):
                free.put(open_component(path, intra_op_threads=intra_op_threads))

    def __contains__(self, component: str) -> bool:
        return component in self._free

    def run(self, component: str, inputs: Mapping[str, Any]) -> dict[str, Any]:
        session = self._free[component].get()
        try:
            return session.run(inputs)
        finally:
            self._free[component].put(session)
