"""The component models: one pipeline component each, under ONNX Runtime
(``OnnxComponentModel``) or as a torch.export program (``TorchComponentModel``).
(tensorrt-target components are served by Triton's TensorRT backend.)"""

from __future__ import annotations

import json
import os
import threading
import traceback
from pathlib import Path

import numpy as np

from machgen.contract.adapters import ADAPTER_NAMES_INPUT
from machgen.contract.manifest import (IDLE_RELEASE_PARAMETER, LONE_CALL_PARAMETER, LONE_THREADS_PARAMETER,
                                      NICE_PARAMETER)
from machgen.runtime.tensors import is_torch
from machgen.runtime.triton_models.backend import error_response, model_dir, parameter, pb_utils


def _adapters_of(args: dict, config: dict) -> tuple[Path | None, int]:
    """(folder, how many to keep) of the per-request adapters a component's config names (its "adapters")."""
    folder = parameter(config, "adapters", "")
    if not folder:
        return None, 0
    return Path(args["model_repository"]).parent / folder, int(parameter(config, "max_loras", "8"))


def _marked_lone(request) -> bool:
    """Whether the sampler sent ``request`` as the call of the only request it runs."""
    parameters = request.parameters()
    return bool(parameters) and bool(json.loads(parameters).get(LONE_CALL_PARAMETER))


class _ComponentModel:
    """What both component models do with a batch of requests: Triton's
    dynamic batcher hands several at once; those with equal per-item shapes
    run as one forward, and a failure answers every request of the batch.
    Subclasses set ``runner`` (``run_batches``, ``input_names``),
    ``max_rows`` and ``logger``, and say how tensors are read and written."""

    def _read(self, tensor: "pb_utils.Tensor"):
        raise NotImplementedError

    def _write(self, name: str, value) -> "pb_utils.Tensor":
        raise NotImplementedError

    def _runner_for(self, requests):
        """The runner of this batch of requests."""
        return self.runner

    def execute(self, requests):
        batches = [{name: self._read(pb_utils.get_input_tensor_by_name(request, name))
                    for name in self.runner.input_names} for request in requests]
        try:
            outputs = self._runner_for(requests).run_batches(batches, max_rows=self.max_rows)
        except Exception as err:  # noqa: BLE001 - every request must get an answer
            self.logger.log_error(f"{self.source}: {traceback.format_exc()}")
            return [error_response(*self._failure(err)) for _ in requests]
        return [pb_utils.InferenceResponse([self._write(name, value) for name, value in result.items()])
                for result in outputs]

    def _failure(self, err: Exception) -> tuple:
        """The message and code a failed batch is answered with."""
        return f"component failed: {err}", pb_utils.TritonError.INTERNAL


class OnnxComponentModel(_ComponentModel):
    """One pipeline component under ONNX Runtime on the CPU.

    A once-per-request stage (text encoder, VAE) built with lone-call
    threads keeps a second, wider session: a call the sampler marks as its
    only request's (LONE_CALL_PARAMETER) runs there when it comes alone,
    on the cores the other instances would otherwise use, but only for
    input shapes on which the wide session has given this one's outputs bit
    for bit (onnx_runner.CheckedWideRunner): a request's output never
    depends on whether it ran alone.

    After IDLE_RELEASE_PARAMETER seconds without a request (longer for sessions slow to open:
    onnx_runner.release_delay), its sessions give back the memory their runs grew (ONNX Runtime's arena keeps
    its peak otherwise: onnx_runner.OnnxSession.release_memory)."""

    def initialize(self, args: dict) -> None:
        from machgen.runtime.onnx_runner import (CheckedWideRunner, IdleRelease, cpu_threads, release_delay,
                                                 release_memory)

        config = json.loads(args["model_config"])
        self.source = model_dir(args) / "model.onnx"
        self.logger = pb_utils.Logger
        nice = int(parameter(config, NICE_PARAMETER, "0"))
        if nice:
            _nice_every_thread(nice, self.logger)
        threads = int(parameter(config, "intra_op_threads", "0"))
        self.runner = self._open(args, config, threads)
        lone_threads = parameter(config, LONE_THREADS_PARAMETER, "")
        self.lone_runner = None
        if lone_threads and cpu_threads(int(lone_threads)) > cpu_threads(threads):
            self.lone_runner = CheckedWideRunner(self.runner, self._open(args, config, int(lone_threads)),
                                                 self.logger.log_info)
        self.max_rows = int(config["max_batch_size"]) or None
        released = self.lone_runner or self.runner
        self.idle = IdleRelease(lambda: release_memory(released, idle=True),
                                release_delay(float(parameter(config, IDLE_RELEASE_PARAMETER, "0")), released),
                                log=self.logger.log_warn).start()

    def execute(self, requests):
        with self.idle.running():
            return super().execute(requests)

    def finalize(self) -> None:
        self.idle.stop()

    def _open(self, args: dict, config: dict, threads: int):
        from machgen.runtime.adapters import with_adapters
        from machgen.runtime.onnx_runner import OnnxSession

        return with_adapters(OnnxSession(self.source, intra_op_threads=threads), self.source.parent,
                             *_adapters_of(args, config))

    def _runner_for(self, requests):
        # Two requests in one batch are two requests' work: never the wide session then.
        if self.lone_runner is not None and len(requests) == 1 and _marked_lone(requests[0]):
            return self.lone_runner
        return self.runner

    def _read(self, tensor: "pb_utils.Tensor"):
        return tensor.as_numpy()

    def _write(self, name: str, value) -> "pb_utils.Tensor":
        return pb_utils.Tensor(name, np.ascontiguousarray(value))


def _nice_every_thread(nice: int, logger) -> None:
    """Every thread of this process at OS nice value ``nice`` (Linux's nice is a thread's; the threads ONNX
    Runtime starts later inherit it from the thread that starts them)."""
    try:
        for thread in os.listdir("/proc/self/task"):
            os.setpriority(os.PRIO_PROCESS, int(thread), nice)
    except OSError as err:
        logger.log_warn(f"nice {nice} not set: {err}")


class TorchComponentModel(_ComponentModel):
    """One pipeline component as a torch.export program (the ``torch``
    target), on the GPU Triton gives this instance or on the CPU.

    Tensors come and go by DLPack: a GPU input is used where it lies, an
    output stays on the GPU for the caller.
    """

    def initialize(self, args: dict) -> None:
        from machgen.runtime.adapters import with_adapters
        from machgen.runtime.torch_runner import open_program

        config = json.loads(args["model_config"])
        device = None
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        self.source = model_dir(args)
        # A parallel component (KIND_MODEL on GPUs) starts its ranks here, one per GPU of its layout.
        program = open_program(self.source, device=device)
        self.runner = with_adapters(program, self.source, *_adapters_of(args, config), convert=program.prepare)
        self.max_rows = int(config["max_batch_size"]) or None
        self.logger = pb_utils.Logger
        self.logger.log_info(f"{config['name']}: {self.runner.memory_report()}")

    def _read(self, tensor: "pb_utils.Tensor"):
        import torch

        if tensor.name() == ADAPTER_NAMES_INPUT:  # text has no DLPack form
            return tensor.as_numpy()
        return torch.from_dlpack(tensor.to_dlpack())

    def _write(self, name: str, value) -> "pb_utils.Tensor":
        if not is_torch(value):  # a parallel component's leader answers in numpy
            return pb_utils.Tensor(name, np.ascontiguousarray(value))
        return pb_utils.Tensor.from_dlpack(name, value.contiguous())

    def _failure(self, err: Exception) -> tuple:
        if getattr(self.runner, "alive", lambda: True)():
            return super()._failure(err)
        # A parallel component whose rank died (its ranks are stopped): this process goes too, so that Triton
        # calls the model not healthy and machgen serve loads it again with new ranks, as a dead stub; the
        # sampler runs the call again once it is back (the message says "is not healthy").
        self.logger.log_error(f"{self.source}: a rank died; the model is not healthy and this process exits")
        threading.Timer(0.5, os._exit, (1,)).start()
        return (f"{self.source.parent.name} is not healthy (a rank died: {err}); it is being loaded again",
                pb_utils.TritonError.UNAVAILABLE)

    def finalize(self) -> None:
        getattr(self.runner, "close", lambda: None)()  # a parallel component's ranks


__all__ = ["OnnxComponentModel", "TorchComponentModel"]
