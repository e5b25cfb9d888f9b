"""The Python-backend models; the only module that imports triton_python_backend_utils.

The generated ``model.py`` shims in a model repository import one of these
classes as ``TritonPythonModel``. Each model reads what it needs from its
own folder (written by ``machgen-build``): ``model.onnx`` or ``model.pt2``
for a component, ``pipeline.json`` plus tokenizers and scheduler config for
the sampler. (tensorrt-target components are served by Triton's TensorRT
backend, not by a class here.)
"""

from __future__ import annotations

import gc
import json
import traceback
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from machgen.ensembles.api import AUDIO_OUTPUT, InvalidArgument
from machgen.ensembles.sampler import GenerationCancelled
from machgen.ensembles.tensors import is_torch


def _model_dir(args: dict) -> Path:
    return Path(args["model_repository"]) / args["model_version"]


def _parameter(config: dict, key: str, default: str) -> str:
    return config.get("parameters", {}).get(key, {}).get("string_value", default)


def _error_response(message: str, code) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


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

    def execute(self, requests):
        batches = [{name: self._read(pb_utils.get_input_tensor_by_name(request, name))
                    for name in self.runner.input_names} for request in requests]
        try:
            outputs = self.runner.run_batches(batches, max_rows=self.max_rows)
        except Exception as err:  # noqa: BLE001 - every request must get an answer
            self.logger.log_error(f"{self.source}: {traceback.format_exc()}")
            return [_error_response(f"component failed: {err}", pb_utils.TritonError.INTERNAL)
                    for _ in requests]
        return [pb_utils.InferenceResponse([self._write(name, value) for name, value in result.items()])
                for result in outputs]


class OnnxComponentModel(_ComponentModel):
    """One pipeline component under ONNX Runtime on the CPU."""

    def initialize(self, args: dict) -> None:
        from machgen.ensembles.onnx_runner import OnnxSession

        config = json.loads(args["model_config"])
        self.source = _model_dir(args) / "model.onnx"
        self.runner = OnnxSession(self.source, intra_op_threads=int(_parameter(config, "intra_op_threads", "0")))
        self.max_rows = int(config["max_batch_size"]) or None
        self.logger = pb_utils.Logger

    def _read(self, tensor: "pb_utils.Tensor"):
        return tensor.as_numpy()

    def _write(self, name: str, value) -> "pb_utils.Tensor":
        return pb_utils.Tensor(name, np.ascontiguousarray(value))


def _bls_tensor(name: str, value) -> "pb_utils.Tensor":
    """A torch tensor goes by DLPack (a GPU tensor stays on its GPU), a numpy array as is."""
    if is_torch(value):
        return pb_utils.Tensor.from_dlpack(name, value.contiguous())
    return pb_utils.Tensor(name, np.ascontiguousarray(value))


def _received(tensor: "pb_utils.Tensor"):
    """A GPU output as a torch tensor on that GPU (DLPack, no host copy); a CPU one as numpy."""
    if tensor.is_cpu():
        return tensor.as_numpy()
    import torch

    return torch.from_dlpack(tensor.to_dlpack())


class TorchComponentModel(_ComponentModel):
    """One pipeline component as a torch.export program (the ``torch``
    target), on the GPU Triton gives this instance or on the CPU.

    Tensors come and go by DLPack: a GPU input is used where it lies, an
    output stays on the GPU for the caller.
    """

    def initialize(self, args: dict) -> None:
        from machgen.ensembles.torch_runner import TorchProgram

        config = json.loads(args["model_config"])
        device = None
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        self.source = _model_dir(args)
        self.runner = TorchProgram.load(self.source, device=device)
        self.max_rows = int(config["max_batch_size"]) or None
        self.logger = pb_utils.Logger
        self.logger.log_info(f"{config['name']}: {self.runner.memory_report()}")

    def _read(self, tensor: "pb_utils.Tensor"):
        import torch

        return torch.from_dlpack(tensor.to_dlpack())

    def _write(self, name: str, value) -> "pb_utils.Tensor":
        return pb_utils.Tensor.from_dlpack(name, value.contiguous())


class ComponentError(RuntimeError):
    """A BLS call to a component model failed."""


class SamplerModel:
    """The public model: one request at a time per instance, start to finish
    (text encoders, denoising loop, decoder) by BLS calls to the components.

    Validation errors answer INVALID_ARGUMENT naming the field; a request
    its client cancelled (or whose gRPC deadline passed) stops at the next
    step boundary and answers CANCELLED; anything else answers INTERNAL for
    that request only, and the model keeps serving.
    """

    def initialize(self, args: dict) -> None:
        import torch

        from machgen.ensembles.components import InSamplerComponents
        from machgen.ensembles.sampler import load_sampler

        # The sampler only steps the scheduler; the components own the cores.
        torch.set_num_threads(1)
        model_dir = _model_dir(args)
        self.pipeline = json.loads((model_dir / "pipeline.json").read_text())
        self.components = self.pipeline["components"]
        if self.pipeline.get("target") == "tensorrt":
            # Refuse engines built for another TensorRT or GPU with a message that says so (Triton's own
            # load error for them is TensorRT's).
            from machgen.builder.tensorrt_engine import check_repository_engines, serving_host

            check_repository_engines(Path(args["model_repository"]).parent, self.components, serving_host())
        self.in_sampler = InSamplerComponents(self.components, model_dir)
        self.sampler = load_sampler(self.pipeline, str(model_dir), self._run_component)
        self.logger = pb_utils.Logger

    def _run_component(self, name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if name in self.in_sampler:
            return self.in_sampler.run(name, inputs)
        component = self.components[name]
        request = pb_utils.InferenceRequest(
            model_name=component["model"],
            inputs=[_bls_tensor(key, value) for key, value in inputs.items()],
            requested_output_names=component["outputs"],
        )
        response = request.exec()
        if response.has_error():
            raise ComponentError(f"{component['model']}: {response.error().message()}")
        return {tensor.name(): _received(tensor) for tensor in response.output_tensors()}

    def _generate(self, request) -> "pb_utils.InferenceResponse":
        def get_input(name: str):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        parsed = self.sampler.parse_request(get_input, self.pipeline["defaults"])
        request_id = request.request_id() or "-"

        def on_step(step: int, total: int) -> None:
            self.logger.log_verbose(f"request {request_id}: step {step}/{total}")

        result = self.sampler.generate(parsed, on_step=on_step, is_cancelled=request.is_cancelled)
        if request.is_cancelled():
            raise GenerationCancelled(parsed.num_inference_steps, parsed.num_inference_steps)
        images = self.sampler.decode(result.latents)
        audio = self.sampler.decode_audio(result.latents)
        outputs = [pb_utils.Tensor("images", np.ascontiguousarray(images)),
                   pb_utils.Tensor("stats", np.array([result.stats.to_json().encode()], dtype=np.object_))]
        if audio is not None:
            outputs.append(pb_utils.Tensor(AUDIO_OUTPUT, audio))
        return pb_utils.InferenceResponse(outputs)

    def finalize(self) -> None:
        # Triton stops the instances one after another, and tearing down an
        # interpreter with torch and diffusers loaded spends about a second
        # in garbage collection; frozen objects are skipped (exit of such a
        # process measured 1.37 s, 0.39 s frozen).
        gc.freeze()

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._generate(request))
            except InvalidArgument as err:
                responses.append(_error_response(str(err), pb_utils.TritonError.INVALID_ARG))
            except GenerationCancelled as err:
                self.logger.log_info(f"request {request.request_id() or '-'}: {err}")
                responses.append(_error_response(str(err), pb_utils.TritonError.CANCELLED))
            except Exception as err:  # noqa: BLE001 - one bad request must not take the model down
                self.logger.log_error(f"sampler: {traceback.format_exc()}")
                responses.append(_error_response(f"generation failed: {err}", pb_utils.TritonError.INTERNAL))
        return responses


__all__ = ["OnnxComponentModel", "SamplerModel", "TorchComponentModel"]
