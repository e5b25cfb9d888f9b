"""The ``torch`` target: a component as a program exported with torch.export
(``model.pt2``), run by PyTorch on a GPU (or the CPU) inside the Python
backend, with our kernels (the SparseAttention op dispatches to the Triton
kernel on CUDA tensors).

Used by the Triton component model, by the builder's parity check and by the
in-process runner, so all three run a program the same way. Each component
folder holds ``model.pt2`` and ``component.json`` (``TorchComponentInfo``).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from machgen.runtime.onnx_runner import run_grouped
from machgen.runtime.tensors import as_torch

PROGRAM_FILE = "model.pt2"
INFO_FILE = "component.json"
DTYPES = ("bfloat16", "float16", "float32")

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TorchComponentInfo:
    """What a torch-target component folder says about its program."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    # The program's floating-point dtype. Its inputs and outputs keep the
    # component's float32 interface: floats are cast on the way in and out,
    # so the sampler and the scheduler stay in float32 as in diffusers.
    dtype: str
    device: str  # "cuda" or "cpu": where the program was exported and checked
    weight_bytes: int
    # One CUDA graph per input-shape bucket (CUDA only): a step's launches
    # replayed at once instead of one Python dispatch per kernel.
    cuda_graphs: bool = True
    max_cuda_graphs: int = 8  # shape buckets captured; further shapes run eagerly
    compile: bool = False  # torch.compile the program at load (minutes for a large model)
    # A parallel build's ShardPlan (machgen/parallel/layout.py) as JSON: the program runs on its layout's
    # ranks. None: on one device.
    parallel: dict | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def read(cls, folder: str | os.PathLike) -> "TorchComponentInfo":
        data = json.loads((Path(folder) / INFO_FILE).read_text())
        return cls(**{**data, "inputs": tuple(data["inputs"]), "outputs": tuple(data["outputs"])})


def _as_tuple(outputs) -> tuple:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


class CudaGraphs:
    """Replays ``module`` as one CUDA graph per input-shape bucket.

    A bucket is captured at its first call (after two eager warm-up calls on
    a side stream, which also run any autotuning); later calls copy their
    inputs into the captured buffers and replay. At most ``max_graphs``
    buckets are captured (all share one memory pool); other shapes, and a
    bucket whose capture fails (an op that syncs with the host), run eagerly.
    """

    def __init__(self, module: Callable[..., Any], max_graphs: int = 8):
        self.module = module
        self.max_graphs = max_graphs
        self._graphs: dict[tuple, Any] = {}
        self._pool = None

    def __call__(self, **inputs) -> tuple:
        key = tuple((name, tuple(value.shape), value.dtype) for name, value in inputs.items())
        if key not in self._graphs:
            self._graphs[key] = self._capture(inputs) if len(self._graphs) < self.max_graphs else None
        captured = self._graphs[key]
        if captured is None:
            return _as_tuple(self.module(**inputs))
        static_inputs, static_outputs, graph = captured
        for name, value in inputs.items():
            static_inputs[name].copy_(value)
        graph.replay()
        # The captured buffers are overwritten by the next replay.
        return tuple(output.clone() for output in static_outputs)

    def _capture(self, inputs: Mapping[str, Any]):
        import torch

        static_inputs = {name: value.clone() for name, value in inputs.items()}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.module(**static_inputs)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                static_outputs = _as_tuple(self.module(**static_inputs))
        except Exception as err:  # noqa: BLE001 - eager still gives the right answer
            _log.warning("CUDA graph capture failed for shapes %s (%s): running eagerly",
                         [tuple(v.shape) for v in inputs.values()], err)
            return None
        self._pool = graph.pool()
        return static_inputs, static_outputs, graph


class TorchProgram:
    """A component's exported program on a device, run like an OnnxSession."""

    def __init__(self, program, info: TorchComponentInfo, device: str | None = None, folder: Path | None = None,
                 rewrite: Callable[[Any], Any] | None = None):
        """``program``: an ExportedProgram (loaded, or fresh from torch.export); ``rewrite``: called with its
        graph module before it runs or is compiled, to rewrite the graph in place (what it returns is kept as
        ``rewritten``)."""
        import torch
        from torch.export.passes import move_to_device_pass

        self.folder = folder
        self.info = info
        self.input_names = list(info.inputs)
        self.output_names = list(info.outputs)
        self.dtype = getattr(torch, info.dtype)
        self.device = torch.device(device or info.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{folder or 'program'}: built for CUDA, and this process sees no CUDA device")
        # Device constants the trace recorded (tensors created inside forward) move with the weights.
        program = move_to_device_pass(program, self.device)
        module: Callable[..., Any] = program.module()
        self.rewritten = rewrite(module) if rewrite is not None else None
        if info.compile:
            module = torch.compile(module)
        if info.cuda_graphs and self.device.type == "cuda":
            module = CudaGraphs(module, info.max_cuda_graphs)
        self._module = module

    @classmethod
    def load(cls, folder: str | os.PathLike, device: str | None = None,
             rewrite: Callable[[Any], Any] | None = None) -> "TorchProgram":
        """The program a build wrote to ``folder`` (model.pt2, component.json); ``rewrite``: as for the
        constructor."""
        # The program may call machgen::sparse_attention, machgen::sequence_attention or machgen::halo_rows:
        # they must be registered before loading.
        import machgen.parallel.op  # noqa: F401
        import machgen.parallel.rows  # noqa: F401
        import machgen.plugins.ops  # noqa: F401
        from machgen.runtime.program_load import load_program

        folder = Path(folder)
        return cls(load_program(folder / PROGRAM_FILE), TorchComponentInfo.read(folder), device, folder, rewrite)

    def memory_report(self) -> str:
        """Where the program runs and what it holds, for the model's log."""
        import torch

        if self.device.type != "cuda":
            return f"{self.device}, {self.info.dtype}, weights {self.info.weight_bytes / 2**20:.1f} MiB"
        properties = torch.cuda.get_device_properties(self.device)
        return (f"{self.device} ({properties.name}), {self.info.dtype}, weights "
                f"{self.info.weight_bytes / 2**20:.1f} MiB, allocated "
                f"{torch.cuda.memory_allocated(self.device) / 2**20:.1f} of {properties.total_memory / 2**20:.0f} MiB")

    def prepare(self, value):
        """``value`` as the program takes it: a contiguous tensor on its device, floats in its dtype (the
        program was traced with contiguous inputs; another part's sliced output is a view)."""
        tensor = as_torch(value, self.device)
        return (tensor.to(self.dtype) if tensor.is_floating_point() else tensor).contiguous()

    def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Outputs by name as torch tensors on the program's device (floats in
        float32); inputs are numpy arrays or torch tensors on any device."""
        import torch

        with torch.inference_mode():
            outputs = _as_tuple(self._module(**{name: self.prepare(inputs[name]) for name in self.input_names}))
            return {name: (value.float() if value.is_floating_point() else value)
                    for name, value in zip(self.output_names, outputs)}

    def run_batches(self, batches: Sequence[Mapping[str, Any]], max_rows: int | None = None) -> list[dict[str, Any]]:
        return run_grouped(self.run, self.input_names, batches, max_rows)


def open_program(folder: str | os.PathLike, device: str | None = None, layout: Any = None) -> Any:
    """The program of a torch-target component folder: a ``TorchProgram``, or
    on its ranks a ``ParallelProgram`` when its build has a parallel layout
    (``layout``: run it under another layout the build allows; a
    ParallelLayout of one rank runs it as a plain program)."""
    info = TorchComponentInfo.read(folder)
    if info.parallel is None:
        return TorchProgram.load(folder, device)
    from machgen.parallel.layout import ShardPlan
    from machgen.parallel.program import ParallelProgram

    plan = ShardPlan.from_json(info.parallel)
    chosen = layout or plan.layout
    if chosen.is_single:
        if plan.marker is None:
            return TorchProgram.load(folder, device)
        from machgen.parallel.program import WholeSequence

        return WholeSequence(TorchProgram.load(folder, device), plan.marker)
    return ParallelProgram(folder, info.inputs, info.outputs, plan, TorchProgram.load, chosen,
                           device="cuda" if (device or info.device).startswith("cuda") else None)
