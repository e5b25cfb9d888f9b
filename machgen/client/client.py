"""A small client for served machgen pipelines, over tritonclient gRPC or HTTP."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np

from machgen.contract.api import API_INPUTS, AUDIO_OUTPUT, ApiTensor, Generated, input_array

PROTOCOLS = ("grpc", "http")
_API = {tensor.name: tensor for tensor in API_INPUTS}


def _known_inputs() -> dict[str, ApiTensor]:
    """Every model's inputs and every family's own, by name (the families' declarations)."""
    from machgen.families.registry import family_inputs

    return {**_API, **{name: declared.tensor for name, (declared, _) in family_inputs().items()}}


def _stats(array: np.ndarray) -> dict[str, Any]:
    return json.loads(bytes(array.reshape(-1)[0]).decode("utf-8"))


class GenerationError(RuntimeError):
    """The server refused or failed a request; ``status`` is its status code."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


class MachgenClient:
    """Calls a served pipeline; ``generate`` returns uint8 images or frames [N, H, W, 3].

    ``url`` is host:port of the chosen protocol's endpoint (8001 for gRPC,
    8000 for HTTP by default).
    """

    def __init__(self, url: str, protocol: str = "grpc", timeout_s: float | None = None):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
        self.protocol = protocol
        self.timeout_s = timeout_s
        if protocol == "grpc":
            import tritonclient.grpc as module
            self._client = module.InferenceServerClient(url)
        else:
            import tritonclient.http as module
            self._client = module.InferenceServerClient(url, network_timeout=timeout_s or 600.0,
                                                        connection_timeout=timeout_s or 600.0)
        self._module = module
        self._metadata: dict[str, dict[str, Any]] = {}
        self._known = _known_inputs()

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> "MachgenClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def is_ready(self, model: str) -> bool:
        try:
            return bool(self._client.is_server_ready() and self._client.is_model_ready(model))
        except Exception:  # noqa: BLE001 - a server that is down is simply not ready
            return False

    def rows_and_forwards(self, model: str) -> tuple[int, int]:
        """Rows (batch items) a model has run and in how many forwards, from
        Triton's statistics: more rows than forwards means requests were batched."""
        if self.protocol == "grpc":
            (stats,) = self._client.get_inference_statistics(model, as_json=True)["model_stats"]
        else:
            (stats,) = self._client.get_inference_statistics(model)["model_stats"]
        return int(stats.get("inference_count", 0)), int(stats.get("execution_count", 0))

    def make_input(self, name: str, value: Any, dtype: str | None = None, model: str | None = None):
        """One request input, typed as the API declares it (a family's own
        input as its family does; one this client does not know as ``model``'s
        metadata says); ``dtype`` overrides it (to send a wrong one on purpose)."""
        declared = self._known.get(name)
        if declared is None and model is not None:
            declared = self.model_inputs(model).get(name)
        if declared is None:
            raise TypeError(f"unknown generation option {name!r}" + (
                f"; {model} takes {sorted(self.model_inputs(model))}" if model is not None else ""))
        triton_dtype = dtype or declared.triton_dtype
        array = input_array(replace(declared, triton_dtype=triton_dtype), value)
        tensor = self._module.InferInput(name, list(array.shape), triton_dtype)
        tensor.set_data_from_numpy(array)
        return tensor

    def infer(self, model: str, inputs: list, outputs: tuple[str, ...] = ("images",)) -> dict[str, np.ndarray]:
        requested = [self._module.InferRequestedOutput(name) for name in outputs]
        kwargs = {"client_timeout": self.timeout_s} if self.protocol == "grpc" and self.timeout_s else {}
        from tritonclient.utils import InferenceServerException

        try:
            result = self._client.infer(model, inputs, outputs=requested, **kwargs)
        except InferenceServerException as err:
            raise GenerationError(str(err.status()), err.message()) from err
        return {name: result.as_numpy(name) for name in outputs}

    def generate(self, model: str, prompt: str, **options: Any) -> np.ndarray:
        """Generate images for ``prompt``; options are the API's optional inputs
        (negative_prompt, seed, num_inference_steps, guidance_scale, true_cfg_scale,
        height, width, cache_policy, cache_threshold, image, strength, num_frames,
        fps, reference_images) and the model's family's own (``machgen-build
        families`` lists them; another family's are refused by the server).
        Absent ones take the served model's defaults.
        A video model returns all its frames [F, H, W, 3]; ``client.video.write_mp4``
        writes them as MP4."""
        return self.infer(model, self._inputs(model, prompt, options))["images"]

    def generate_with_stats(self, model: str, prompt: str, **options: Any) -> tuple[np.ndarray, dict[str, Any]]:
        """``generate`` plus the ``stats`` output (steps, tail calls, cache hits, ...)."""
        result = self.infer(model, self._inputs(model, prompt, options), outputs=("images", "stats"))
        return result["images"], _stats(result["stats"])

    def generate_all(self, model: str, prompt: str, **options: Any) -> Generated:
        """Everything a request gives back: frames, stats, and the sound track
        of a model that makes one (asked for only where the model declares it)."""
        outputs = ("images", "stats") + ((AUDIO_OUTPUT,) if self.makes_audio(model) else ())
        result = self.infer(model, self._inputs(model, prompt, options), outputs=outputs)
        return Generated(result["images"], result.get(AUDIO_OUTPUT), _stats(result["stats"]))

    def model_metadata(self, model: str) -> dict[str, Any]:
        """The served model's metadata (its inputs and outputs), asked once per model."""
        if model not in self._metadata:
            if self.protocol == "grpc":
                self._metadata[model] = self._client.get_model_metadata(model, as_json=True)
            else:
                self._metadata[model] = self._client.get_model_metadata(model)
        return self._metadata[model]

    def model_inputs(self, model: str) -> dict[str, ApiTensor]:
        """The inputs the served model declares, by name."""
        return {entry["name"]: ApiTensor(entry["name"], entry["datatype"], tuple(int(d) for d in entry["shape"]), "")
                for entry in self.model_metadata(model).get("inputs", [])}

    def makes_audio(self, model: str) -> bool:
        """Whether the served model declares the ``audio`` output."""
        return any(output["name"] == AUDIO_OUTPUT for output in self.model_metadata(model).get("outputs", []))

    def _inputs(self, model: str, prompt: str, options: dict[str, Any]) -> list:
        inputs = [self.make_input("prompt", prompt)]
        return inputs + [self.make_input(name, value, model=model) for name, value in options.items()
                         if value is not None]
