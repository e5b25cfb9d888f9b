"""A small client for served machgen pipelines, over tritonclient gRPC or HTTP."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import numpy as np

from machgen.ensembles.api import API_INPUTS, AUDIO_OUTPUT, Generated, input_array

PROTOCOLS = ("grpc", "http")
_API = {tensor.name: tensor for tensor in API_INPUTS}


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
        self._makes_audio: dict[str, bool] = {}

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

    def make_input(self, name: str, value: Any, dtype: str | None = None):
        """One request input; ``dtype`` overrides the API's (to send a wrong one on purpose)."""
        triton_dtype = dtype or _API[name].triton_dtype
        array = input_array(replace(_API[name], triton_dtype=triton_dtype), value)
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
        fps, reference_images, and a family's own guidance inputs: api.FAMILY_INPUTS).
        Absent ones take the served model's defaults.
        A video model returns all its frames [F, H, W, 3]; ``client.video.write_mp4``
        writes them as MP4."""
        return self.infer(model, self._inputs(prompt, options))["images"]

    def generate_with_stats(self, model: str, prompt: str, **options: Any) -> tuple[np.ndarray, dict[str, Any]]:
        """``generate`` plus the ``stats`` output (steps, tail calls, cache hits, ...)."""
        result = self.infer(model, self._inputs(prompt, options), outputs=("images", "stats"))
        return result["images"], _stats(result["stats"])

    def generate_all(self, model: str, prompt: str, **options: Any) -> Generated:
        """Everything a request gives back: frames, stats, and the sound track
        of a model that makes one (asked for only where the model declares it)."""
        outputs = ("images", "stats") + ((AUDIO_OUTPUT,) if self.makes_audio(model) else ())
        result = self.infer(model, self._inputs(prompt, options), outputs=outputs)
        return Generated(result["images"], result.get(AUDIO_OUTPUT), _stats(result["stats"]))

    def makes_audio(self, model: str) -> bool:
        """Whether the served model declares the ``audio`` output (asked once per model)."""
        if model not in self._makes_audio:
            if self.protocol == "grpc":
                outputs = self._client.get_model_metadata(model, as_json=True).get("outputs", [])
            else:
                outputs = self._client.get_model_metadata(model).get("outputs", [])
            self._makes_audio[model] = any(output["name"] == AUDIO_OUTPUT for output in outputs)
        return self._makes_audio[model]

    def _inputs(self, prompt: str, options: dict[str, Any]) -> list:
        unknown = set(options) - set(_API)
        if unknown:
            raise TypeError(f"unknown generation options: {sorted(unknown)}")
        inputs = [self.make_input("prompt", prompt)]
        return inputs + [self.make_input(name, value) for name, value in options.items() if value is not None]
