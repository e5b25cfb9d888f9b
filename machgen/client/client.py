"""A small client for served machgen pipelines, over tritonclient gRPC or HTTP."""

from __future__ import annotations

import json
import queue
import random
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from machgen.contract.api import (
    API_INPUTS,
    AUDIO_OUTPUT,
    ELAPSED_OUTPUT,
    PREVIEW_OUTPUT,
    PROGRESS_OUTPUT,
    STREAM_INPUTS,
    STREAM_SILENCE_S,
    TRAJECTORY_OUTPUT,
    ApiTensor,
    FamilyInput,
    Generated,
    input_array,
    model_card_of,
    published_inputs,
    stream_error_status,
)
from machgen.contract.manifest import STREAM, model_name
from machgen.client.errors import GenerationError
from machgen.contract.sessions import SESSION_INPUTS

PROTOCOLS = ("grpc", "http")
# Every model's inputs (the streaming twin's too, and a realtime model's); a model's own come from the model
# (published_inputs).
GENERIC_INPUTS = {tensor.name: tensor for tensor in API_INPUTS + STREAM_INPUTS + SESSION_INPUTS}


@dataclass(frozen=True)
class Progress:
    """One step of a streamed request: ``step`` of ``total`` done after
    ``elapsed`` seconds, and every few steps a ``preview`` of the result
    (uint8 [frames, height, width, 3] at the latents' size; else None)."""

    step: int
    total: int
    elapsed: float
    preview: np.ndarray | None = None


ProgressCallback = Callable[[Progress], None]
# A stream error's status as a unary gRPC call's error reports it.
_GRPC_STATUS = {"INVALID_ARG": "StatusCode.INVALID_ARGUMENT", "UNAVAILABLE": "StatusCode.UNAVAILABLE",
                "CANCELLED": "StatusCode.CANCELLED", "INTERNAL": "StatusCode.INTERNAL",
                "NOT_FOUND": "StatusCode.NOT_FOUND", "UNSUPPORTED": "StatusCode.UNIMPLEMENTED",
                "ALREADY_EXISTS": "StatusCode.ALREADY_EXISTS", "UNKNOWN": "StatusCode.UNKNOWN"}


# Failures after which the same request may be sent again: the server (or a stub of its) was down or
# stopping, not the request wrong. gRPC and HTTP statuses; a Python stub that died answers INTERNAL with
# this message (Triton 2.51 gives it no other status). A stream that a balancer in front of several servers
# reset because the server behind it died (HAProxy: RST_STREAM, CANCEL) fails UNKNOWN "Stream removed".
# A model the server knows but holds no loaded version of ("has no available versions", NOT_FOUND) is being
# drained or loaded: a request a balancer sent to a replica just before taking it out arrives after the
# drain unloaded its models; sent again, it reaches a replica that serves. A model the server does not know
# at all ("is not found") is the request's fault.
_RETRYABLE_STATUSES = {"StatusCode.UNAVAILABLE", "503", "502", "504"}
_RETRYABLE_MESSAGES = ("is not healthy", "Stream removed", "has no available versions")


@dataclass(frozen=True)
class RetryPolicy:
    """How MachgenClient sends a request again after a failure that a later
    try can cure (UNAVAILABLE, a connection that failed, a server stub that
    died). Waits grow exponentially with jitter: before retry k (from 0), a
    random time in [d/2, d] where d = min(max_delay_s, first_delay_s * 2**k).
    A request is only sent again when it is deterministic: the client gives
    one without a seed a random seed first, so every try makes the same image."""

    attempts: int = 5
    """Tries in all (1: no retry)."""
    first_delay_s: float = 0.5
    max_delay_s: float = 8.0

    def delay(self, retry: int, rng: random.Random) -> float:
        ceiling = min(self.max_delay_s, self.first_delay_s * 2 ** retry)
        return rng.uniform(ceiling / 2, ceiling)


NO_RETRY = RetryPolicy(attempts=1)


def retryable(error: "GenerationError") -> bool:
    """Whether ``error`` says the server could not run the request (not that the request was wrong)."""
    return error.status in _RETRYABLE_STATUSES or any(sign in str(error) for sign in _RETRYABLE_MESSAGES)


def _stats(array: np.ndarray) -> dict[str, Any]:
    return json.loads(bytes(array.reshape(-1)[0]).decode("utf-8"))


class MachgenClient:
    """Calls a served pipeline; ``generate`` returns uint8 images or frames [N, H, W, 3].

    ``url`` is host:port of the chosen protocol's endpoint (8001 for gRPC,
    8000 for HTTP by default). ``retry`` says how a request that failed for
    want of a server is sent again (``NO_RETRY``: never); ``on_retry(try,
    error, delay_s)`` hears of each retry before its wait. A progress stream
    that stays silent for ``stream_silence_s`` (the server sends a heartbeat
    every 5 s) is taken as lost: UNAVAILABLE.
    """

    def __init__(self, url: str, protocol: str = "grpc", timeout_s: float | None = None,
                 retry: RetryPolicy = RetryPolicy(),
                 on_retry: Callable[[int, "GenerationError", float], None] | None = None,
                 stream_silence_s: float = STREAM_SILENCE_S):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {PROTOCOLS}, not {protocol!r}")
        self.protocol = protocol
        self.url = url
        self.timeout_s = timeout_s
        self.retry = retry
        self.on_retry = on_retry
        self.stream_silence_s = stream_silence_s
        self._rng = random.Random()
        if protocol == "grpc":
            import tritonclient.grpc as module
            self._client = module.InferenceServerClient(url)
        else:
            import tritonclient.http as module
            self._client = module.InferenceServerClient(url, network_timeout=timeout_s or 600.0,
                                                        connection_timeout=timeout_s or 600.0)
        self._module = module
        self._metadata: dict[str, dict[str, Any]] = {}
        self._published: dict[str, dict[str, FamilyInput]] = {}

    def close(self) -> None:
        self._client.close()

    def new_grpc_client(self):
        """Another tritonclient gRPC client of the same server (one carries one stream at a time)."""
        if self.protocol != "grpc":
            raise ValueError("realtime sessions stream over gRPC: use protocol='grpc'")
        return self._module.InferenceServerClient(self.url)

    def open_session(self, model: str, prompt: str | None = None, action: str | None = None,
                     seed: int | None = None, height: int | None = None, width: int | None = None,
                     session_id: str | None = None, chunks: int | None = None):
        """A realtime session of ``model`` (built with a streaming mode), started from ``prompt`` (or one of
        its ``action``s) and played: iterate it for its chunks (client/sessions.py). ``chunks``: the stream
        ends after that many (the session stays open: ``play`` it again); ``session_id``: random when absent."""
        from machgen.client.sessions import RealtimeSession

        return RealtimeSession(self, model, session_id or secrets.token_hex(8), {
            "session_op": "start", "prompt": prompt, "action": action, "seed": seed, "height": height,
            "width": width, "chunks": chunks})

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
        """One request input, typed as the API declares it (one of ``model``'s
        own as the model publishes it); ``dtype`` overrides it (to send a
        wrong one on purpose)."""
        declared = GENERIC_INPUTS.get(name) or (None if model is None else self.input_tensor(model, name))
        if declared is None:
            raise TypeError(f"unknown generation option {name!r}" + (
                f"; {model} takes {sorted(self.model_inputs(model))}" if model is not None else ""))
        triton_dtype = dtype or declared.triton_dtype
        array = input_array(replace(declared, triton_dtype=triton_dtype), value)
        tensor = self._module.InferInput(name, list(array.shape), triton_dtype)
        tensor.set_data_from_numpy(array)
        return tensor

    def infer(self, model: str, inputs: list, outputs: tuple[str, ...] = ("images",),
              on_progress: ProgressCallback | None = None) -> dict[str, np.ndarray]:
        """``outputs`` of one request to ``model``; with ``on_progress``, the
        request goes to the model's streaming twin (gRPC only), which calls it
        after every step. Sent again as ``retry`` says after a failure that a
        later try can cure (the caller makes sure the request is deterministic)."""
        for attempt in range(self.retry.attempts):
            try:
                if on_progress is not None:
                    return self._stream(model, inputs, outputs, on_progress)
                return self._infer_once(model, inputs, outputs)
            except GenerationError as err:
                if attempt + 1 >= self.retry.attempts or not retryable(err):
                    raise
                delay = self.retry.delay(attempt, self._rng)
                if self.on_retry is not None:
                    self.on_retry(attempt + 1, err, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _infer_once(self, model: str, inputs: list, outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        requested = [self._module.InferRequestedOutput(name) for name in outputs]
        kwargs = {"client_timeout": self.timeout_s} if self.protocol == "grpc" and self.timeout_s else {}
        from tritonclient.utils import InferenceServerException

        try:
            result = self._client.infer(model, inputs, outputs=requested, **kwargs)
        except InferenceServerException as err:
            raise GenerationError(str(err.status()), err.message()) from err
        except OSError as err:  # HTTP: no connection (gRPC reports it as UNAVAILABLE)
            raise GenerationError("StatusCode.UNAVAILABLE", f"no connection to the server: {err}") from err
        return {name: result.as_numpy(name) for name in outputs}

    def has_stream(self, model: str) -> bool:
        """Whether ``model`` has a ready streaming twin (progress and previews)."""
        return self.is_ready(model_name(model, STREAM))

    def _stream(self, model: str, inputs: list, outputs: tuple[str, ...],
                on_progress: ProgressCallback) -> dict[str, np.ndarray]:
        if self.protocol != "grpc":
            raise ValueError("progress needs the streaming model, which only gRPC reaches: use protocol='grpc'")
        responses: queue.Queue = queue.Queue()
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)),
                                  stream_timeout=self.timeout_s)
        try:
            self._send_on_stream(model_name(model, STREAM), inputs, responses)
            last_step = 0
            while True:
                try:
                    result, error = responses.get(timeout=self.stream_silence_s)
                except queue.Empty:
                    raise GenerationError("StatusCode.UNAVAILABLE", f"the server sent nothing for "
                                          f"{self.stream_silence_s:g} s: the stream is lost") from None
                if error is not None:
                    status, message = stream_error_status(error.message())
                    raise GenerationError(_GRPC_STATUS.get(status, str(error.status())), message)
                names = {output.name for output in result.get_response().outputs}
                if "images" in names:
                    return {name: result.as_numpy(name) for name in outputs}
                step, total = (int(v) for v in result.as_numpy(PROGRESS_OUTPUT))
                if total == 0 or step == last_step:  # a heartbeat: the stream lives, no step was done
                    continue
                last_step = step
                preview = result.as_numpy(PREVIEW_OUTPUT) if PREVIEW_OUTPUT in names else None
                on_progress(Progress(step, total, float(result.as_numpy(ELAPSED_OUTPUT)[0]), preview))
        except BaseException:
            # Ctrl-C, a callback that raised, an error: the server stops the request at its next step.
            self._client.stop_stream(cancel_requests=True)
            raise
        finally:
            self._client.stop_stream()

    def _send_on_stream(self, model: str, inputs: list, responses: queue.Queue) -> None:
        # A stream that failed before its request went out (its server died, a balancer refused it) says why
        # only through the callback. No server saw the request, so sending it again is always safe.
        from tritonclient.utils import InferenceServerException

        try:
            self._client.async_stream_infer(model, inputs)
        except InferenceServerException as err:
            try:
                _, error = responses.get(timeout=1.0)
            except queue.Empty:
                error = None
            why = error.message() if error is not None else err.message()
            raise GenerationError("StatusCode.UNAVAILABLE", f"the stream failed before the request was sent: "
                                  f"{why}") from err

    def generate(self, model: str, prompt: str, on_progress: ProgressCallback | None = None,
                 **options: Any) -> np.ndarray:
        """Generate images for ``prompt``; options are the API's optional inputs
        (negative_prompt, seed, num_inference_steps, guidance_scale, true_cfg_scale,
        height, width, cache_policy, cache_threshold, image, strength, num_frames,
        fps, reference_images, lora, lora_scale, preview_interval) and the model's own, as the model publishes them
        (``published_inputs``; ``machgen inputs`` lists them).
        Absent ones take the served model's defaults; without a seed, with
        retries on (the default), the client picks a random one, so that a try
        sent again makes the same image.
        A video model returns all its frames [F, H, W, 3]; ``client.video.write_mp4``
        writes them as MP4.

        ``on_progress(Progress)`` is called after every step (the request
        goes to the model's streaming twin, over gRPC; one such request at a
        time per client, as tritonclient has one stream per client);
        ``preview_interval`` sets how often it carries a preview (0: never).
        An exception it raises, or Ctrl-C, cancels the request."""
        return self.infer(model, self._inputs(model, prompt, options), on_progress=on_progress)["images"]

    def generate_with_stats(self, model: str, prompt: str, on_progress: ProgressCallback | None = None,
                            **options: Any) -> tuple[np.ndarray, dict[str, Any]]:
        """``generate`` plus the ``stats`` output (steps, tail calls, cache hits, ...)."""
        result = self.infer(model, self._inputs(model, prompt, options), outputs=("images", "stats"),
                            on_progress=on_progress)
        return result["images"], _stats(result["stats"])

    def generate_all(self, model: str, prompt: str, on_progress: ProgressCallback | None = None,
                     **options: Any) -> Generated:
        """Everything a request gives back: frames, stats, the sound track
        of a model that makes one (asked for only where the model declares it)
        and, with ``trajectory_steps``, the latents after those steps (a row is
        a later request's ``start_latents``: a refine)."""
        outputs = ("images", "stats") + ((AUDIO_OUTPUT,) if self.makes_audio(model) else ()) + (
            (TRAJECTORY_OUTPUT,) if options.get("trajectory_steps") else ())
        result = self.infer(model, self._inputs(model, prompt, options), outputs=outputs, on_progress=on_progress)
        return Generated(result["images"], result.get(AUDIO_OUTPUT), _stats(result["stats"]),
                         result.get(TRAJECTORY_OUTPUT))

    def _ask(self, call: str, model: str) -> dict[str, Any]:
        """A plain (unrestricted) question about ``model``: its metadata or config, as JSON."""
        from tritonclient.utils import InferenceServerException

        try:
            if self.protocol == "grpc":
                return getattr(self._client, call)(model, as_json=True)
            return getattr(self._client, call)(model)
        except InferenceServerException as err:
            raise GenerationError(str(err.status()), err.message()) from err
        except OSError as err:
            raise GenerationError("StatusCode.UNAVAILABLE", f"no connection to the server: {err}") from err

    def model_metadata(self, model: str) -> dict[str, Any]:
        """The served model's metadata (its inputs and outputs), asked once per model."""
        if model not in self._metadata:
            self._metadata[model] = self._ask("get_model_metadata", model)
        return self._metadata[model]

    def model_card(self, model: str) -> dict[str, Any] | None:
        """What the served model publishes of itself in its config (builder/repository.py
        model_card): family, tasks, defaults, its own inputs; None where it publishes none."""
        config = self._ask("get_model_config", model)
        return model_card_of(config["config"] if self.protocol == "grpc" else config)

    def published_inputs(self, model: str) -> dict[str, FamilyInput]:
        """The model's own inputs (those beyond every model's), by name, as
        the model publishes them: name, type, shape, help, default and CLI
        flag from its card; from a model whose card does not describe them
        (a repository built before cards did), its metadata's name, type and
        shape. Asked once per model; this client's machgen need not know the
        model's family."""
        if model not in self._published:
            card = self.model_card(model)
            if card is not None and "inputs" in card:
                entries = card["inputs"]
            else:
                entries = [entry for entry in self.model_metadata(model).get("inputs", [])
                           if entry["name"] not in GENERIC_INPUTS]
            self._published[model] = published_inputs(entries)
        return self._published[model]

    def input_tensor(self, model: str, name: str) -> ApiTensor | None:
        """How ``model`` takes the input ``name`` (type, shape); None: it takes no such input."""
        if name in GENERIC_INPUTS:
            return GENERIC_INPUTS[name]
        published = self.published_inputs(model).get(name)
        return published.tensor if published is not None else self.model_inputs(model).get(name)

    def model_inputs(self, model: str) -> dict[str, ApiTensor]:
        """The inputs the served model declares, by name."""
        return {entry["name"]: ApiTensor(entry["name"], entry["datatype"], tuple(int(d) for d in entry["shape"]), "")
                for entry in self.model_metadata(model).get("inputs", [])}

    def makes_audio(self, model: str) -> bool:
        """Whether the served model declares the ``audio`` output."""
        return any(output["name"] == AUDIO_OUTPUT for output in self.model_metadata(model).get("outputs", []))

    def _inputs(self, model: str, prompt: str, options: dict[str, Any]) -> list:
        if self.retry.attempts > 1 and options.get("seed") is None:
            options = {**options, "seed": secrets.randbelow(2**63)}
        inputs = [self.make_input("prompt", prompt)]
        return inputs + [self.make_input(name, value, model=model) for name, value in options.items()
                         if value is not None]
