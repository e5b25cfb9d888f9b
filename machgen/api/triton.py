"""The API's side of Triton: which models are served, and one request run
on a model's streaming twin with its progress (tritonclient's asyncio gRPC)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping

import numpy as np

from machgen.client.client import GENERIC_INPUTS
from machgen.contract.api import (
    STREAM_SILENCE_S,
    AUDIO_OUTPUT,
    ELAPSED_OUTPUT,
    PREVIEW_OUTPUT,
    PROGRESS_OUTPUT,
    TRAJECTORY_OUTPUT,
    FamilyInput,
    input_array,
    model_card_of,
    published_inputs,
    stream_error_status,
)
from machgen.contract.manifest import STREAM, model_name

QUEUE_FULL = "Exceeds maximum queue size"


class TritonFailure(Exception):
    """Triton refused or failed a request: ``status`` is its code's name
    (INVALID_ARG, UNAVAILABLE, CANCELLED, INTERNAL, ...), ``field`` the input
    an INVALID_ARG names."""

    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status
        self.field = None
        if status == "INVALID_ARG" and "invalid input '" in message:
            self.field = message.split("invalid input '", 1)[1].split("'", 1)[0]

    @property
    def queue_full(self) -> bool:
        return self.status == "UNAVAILABLE" and QUEUE_FULL in str(self)

    @property
    def retryable(self) -> bool:
        """The server could not run the request (it or a stub of its was down or stopping); the request
        itself was fine and, being seeded, makes the same result when sent again."""
        from machgen.client import GenerationError, retryable

        return retryable(GenerationError(f"StatusCode.{self.status}", str(self)))


@dataclass(frozen=True)
class StepReport:
    step: int
    total: int
    elapsed: float
    preview: np.ndarray | None  # uint8 [frames, h, w, 3]


@dataclass(frozen=True)
class ServedModel:
    """A model the API can run: its name, its card (builder/repository.py
    model_card) and its own inputs as it publishes them (by name)."""

    name: str
    card: dict[str, Any]
    inputs: Mapping[str, FamilyInput] = field(default_factory=dict)
    # Every input its config lists (a repository built before an input existed lacks it).
    accepts: frozenset[str] = frozenset()

    @property
    def kind(self) -> str:
        return self.card["kind"]

    @property
    def defaults(self) -> dict[str, Any]:
        return self.card["defaults"]


class TritonModels:
    """The served models (asked again at most every ``refresh_s``) and requests to them."""

    def __init__(self, url: str, refresh_s: float = 5.0):
        import tritonclient.grpc.aio as grpcaio

        self.url = url
        self._client = grpcaio.InferenceServerClient(url)
        self._models: dict[str, ServedModel] = {}
        self._asked = 0.0
        self.refresh_s = refresh_s

    async def close(self) -> None:
        await self._client.close()

    async def ready(self) -> bool:
        try:
            return bool(await self._client.is_server_ready())
        except Exception:  # noqa: BLE001 - a server that is down is not ready
            return False

    async def models(self) -> dict[str, ServedModel]:
        """Every ready model that has a streaming twin with a model card."""
        if time.monotonic() - self._asked < self.refresh_s and self._models:
            return self._models
        # The loaded models, from the statistics API: the repository index is one of the control APIs
        # only machgen serve may call (machgen/server.py).
        statistics = await self._client.get_inference_statistics(as_json=True)
        loaded = {entry["name"] for entry in statistics.get("model_stats", [])}
        found = {}
        for name in sorted(loaded):
            public = name.removesuffix(f"_{STREAM}")
            if not name.endswith(f"_{STREAM}") or public not in loaded:
                continue
            if not (await self._client.is_model_ready(name) and await self._client.is_model_ready(public)):
                continue
            config = (await self._client.get_model_config(name, as_json=True))["config"]
            card = model_card_of(config)
            if card:
                found[public] = ServedModel(public, card, published_inputs(
                    card["inputs"] if "inputs" in card else _own_inputs(config)),
                    frozenset(entry["name"] for entry in config.get("input", [])))
        self._models, self._asked = found, time.monotonic()
        return found

    @staticmethod
    def tensor(model: ServedModel, name: str, value: Any):
        import tritonclient.grpc as grpcclient

        declared = GENERIC_INPUTS[name] if name in GENERIC_INPUTS else model.inputs[name].tensor
        array = input_array(declared, value)
        tensor = grpcclient.InferInput(name, list(array.shape), declared.triton_dtype)
        tensor.set_data_from_numpy(array)
        return tensor

    async def run(self, model: ServedModel, inputs: dict[str, Any], request_id: str,
                  on_step: Callable[[StepReport], Awaitable[None]]) -> dict[str, Any]:
        """One request on ``model``'s streaming twin: its outputs (images,
        stats, audio where the model makes it, trajectory where asked) once done, ``on_step`` awaited
        after every step. Cancelling the calling task cancels the request
        (Triton stops it at its next step). Raises TritonFailure."""
        tensors = [self.tensor(model, name, value) for name, value in inputs.items() if value is not None]
        finished = asyncio.Event()

        async def one_request():
            yield {"model_name": model_name(model.name, STREAM), "inputs": tensors, "request_id": request_id}
            await finished.wait()  # the stream stays open until the final response is in

        responses = self._client.stream_infer(one_request())
        received = responses.__aiter__()
        last_step = 0
        try:
            while True:
                try:
                    result, error = await _next_within(received, STREAM_SILENCE_S)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:  # a stub that died never ends its streams
                    responses.cancel()
                    raise TritonFailure("UNAVAILABLE", f"the server sent nothing for {STREAM_SILENCE_S:.0f} s: "
                                                       "the stream is lost") from None
                if error is not None:
                    status, message = stream_error_status(error.message())
                    raise TritonFailure(status or "UNKNOWN", message)
                names = {output.name for output in result.get_response().outputs}
                if "images" in names:
                    outputs = {"images": result.as_numpy("images"),
                               "stats": json.loads(result.as_numpy("stats")[0])}
                    for optional in (AUDIO_OUTPUT, TRAJECTORY_OUTPUT):
                        if optional in names:
                            outputs[optional] = result.as_numpy(optional)
                    return outputs
                step, total = (int(v) for v in result.as_numpy(PROGRESS_OUTPUT))
                if total == 0 or step == last_step:  # a heartbeat: the stream lives, no step was done
                    continue
                last_step = step
                preview = result.as_numpy(PREVIEW_OUTPUT) if PREVIEW_OUTPUT in names else None
                await on_step(StepReport(step, total, float(result.as_numpy(ELAPSED_OUTPUT)[0]), preview))
            raise TritonFailure("UNAVAILABLE", "the server ended the stream without an answer")
        except asyncio.CancelledError:
            responses.cancel()
            raise
        finally:
            finished.set()


def _own_inputs(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The inputs beyond every model's that a config lists (name, datatype, shape), for a card that does
    not describe them (a repository built before cards did)."""
    return [{"name": entry["name"], "datatype": entry["data_type"].removeprefix("TYPE_").replace("STRING", "BYTES"),
             "shape": entry["dims"]} for entry in config.get("input", []) if entry["name"] not in GENERIC_INPUTS]


async def _next_within(iterator, timeout: float):
    """The next item of the async ``iterator``, or TimeoutError after ``timeout``
    seconds. Not asyncio.wait_for: on Python before 3.12 it swallows a
    cancellation that arrives as the item does, and a job deleted while its
    responses stream in then ran to its end (seen: one delete in ten)."""
    read = asyncio.ensure_future(iterator.__anext__())
    try:
        done, _ = await asyncio.wait({read}, timeout=timeout)
    except asyncio.CancelledError:
        read.cancel()
        raise
    if not done:
        read.cancel()
        raise asyncio.TimeoutError
    return read.result()
