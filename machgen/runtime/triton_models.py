"""The Python-backend models; the only module that imports triton_python_backend_utils.

The generated ``model.py`` shims in a model repository import one of these
classes as ``TritonPythonModel``:

- ``PublicModel``: the public model NAME, one instance per request in flight.
  It holds no model code (numpy only): it relays each request to the
  sampler and answers with its result, passing on a client's cancellation
  (which it looks for every ``CANCEL_POLL_S``: it asks for no progress).
- ``StreamModel``: NAME_stream, the public model's decoupled twin: the same
  relay, on one instance's threads, passing on the sampler's progress
  responses (and previews) before the result.
- ``SamplerModel``: NAME_sampler, one decoupled instance running every
  in-flight request's denoising loop on its own thread (BLS calls to the
  components release the GIL, so the loops overlap), so the libraries the
  loop needs (torch, diffusers, tokenizers) are loaded once, not once per
  request in flight. It answers a request with its result, after a
  progress response per step where the relay asks (NAME_stream does).
- ``OnnxComponentModel``, ``TorchComponentModel``: one pipeline component.
  (tensorrt-target components are served by Triton's TensorRT backend.)

Why two models and not one: a decoupled model cannot answer plain infer
(HTTP, gRPC unary, perf_analyzer), and a plain Python model handles one
request per instance process at a time. Errors travel from the sampler to
the public model as an ``error`` output (BLS in Triton 2.51 drops the
error responses of a decoupled model).
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import gc
import json
import os
import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from machgen.contract.adapters import ADAPTER_NAMES_INPUT
from machgen.contract.api import (
    AUDIO_OUTPUT,
    ELAPSED_OUTPUT,
    PREVIEW_INTERVAL_INPUT,
    PREVIEW_OUTPUT,
    PROGRESS_OUTPUT,
    STREAM_ERROR_STATUSES,
    TRAJECTORY_OUTPUT,
    InvalidArgument,
    integer_input,
    stream_error_message,
)
from machgen.contract.manifest import (
    ACCEPTED_OUTPUT,
    CANCEL_INPUT,
    ERROR_OUTPUT,
    INTERACTIVE_STEPS_PARAMETER,
    LONE_CALL_PARAMETER,
    LONE_STEP_SESSIONS_PARAMETER,
    LONE_THREADS_PARAMETER,
    NICE_PARAMETER,
    PROGRESS_INPUT,
    REQUEST_KEY_INPUT,
    SAMPLER,
    STEP_LOG_ENV,
    STOP_FILE_ENV,
    PipelineManifest,
    drained_file,
    model_name,
)
from machgen.contract.specs import is_denoiser
from machgen.runtime.processes import STACKS_SIGNAL, instances_of, sibling_stubs
from machgen.runtime.sampler import GenerationCancelled
from machgen.runtime.scheduling import BATCH, INTERACTIVE, GateClosed, SchedulingPolicy, StepGate
from machgen.runtime.spread import RowSpread
from machgen.runtime.tensors import is_torch

# Asked by a start that hangs (machgen/server.py): where this stub's threads wait, in the server log.
faulthandler.register(STACKS_SIGNAL, all_threads=True)

# A relay that hears nothing from its sampler for this long checks that the sampler still runs.
SAMPLER_CHECK_S = 1.0
# How often a relay asks whether its client withdrew the request, between the sampler's responses: the
# sampler stops at its next step once told, so a cancellation costs at most this and a step.
CANCEL_POLL_S = 0.05
# A sampler takes a request within milliseconds; one not taken for this long was sent to an instance that
# had died (during its reload Triton may still route to it) and will never be.
ACCEPT_WAIT_S = 10.0
# NAME_stream sends its client a progress response at least this often (the last step again while a
# step, the text encoders or the decoder take long): a client that hears nothing for several of these
# knows the stream is lost (a stub that dies never ends its streams). api.STREAM_SILENCE_S is the client's limit.
HEARTBEAT_S = 5.0
# What a component call answers while the component's stub is dead or it is being loaded again (Triton 2.51).
_COMPONENT_GONE = ("is not healthy", "is not ready", "unknown model", "has no available versions")
# How long the sampler waits for such a component to come back (machgen serve brings it back in seconds).
COMPONENT_WAIT_S = 30.0


def server_stopping() -> bool:
    """Whether machgen serve is stopping the server and asks running requests to stop (STOP_FILE_ENV)."""
    stop_file = os.environ.get(STOP_FILE_ENV)
    return bool(stop_file) and os.path.exists(stop_file)


def mark_drained(model: str) -> None:
    """Tell machgen serve that ``model`` has answered every request it took: Triton finalizes an instance
    only then, and finalizes the others a second apart (drained_file in contract/manifest.py)."""
    stop_file = os.environ.get(STOP_FILE_ENV)
    if stop_file:
        Path(drained_file(stop_file, model)).touch()


def _model_dir(args: dict) -> Path:
    return Path(args["model_repository"]) / args["model_version"]


def _parameter(config: dict, key: str, default: str) -> str:
    return config.get("parameters", {}).get(key, {}).get("string_value", default)


def _adapters_of(args: dict, config: dict) -> tuple[Path | None, int]:
    """(folder, how many to keep) of the per-request adapters a component's config names (its "adapters")."""
    folder = _parameter(config, "adapters", "")
    if not folder:
        return None, 0
    return Path(args["model_repository"]).parent / folder, int(_parameter(config, "max_loras", "8"))


def _marked_lone(request) -> bool:
    """Whether the sampler sent ``request`` as the call of the only request it runs."""
    parameters = request.parameters()
    return bool(parameters) and bool(json.loads(parameters).get(LONE_CALL_PARAMETER))


def _error_response(message: str, code) -> "pb_utils.InferenceResponse":
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def _text(value: str) -> np.ndarray:
    return np.array([value.encode("utf-8")], dtype=np.object_)


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
            return [_error_response(*self._failure(err)) for _ in requests]
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
    depends on whether it ran alone."""

    def initialize(self, args: dict) -> None:
        from machgen.runtime.onnx_runner import CheckedWideRunner, cpu_threads

        config = json.loads(args["model_config"])
        self.source = _model_dir(args) / "model.onnx"
        self.logger = pb_utils.Logger
        nice = int(_parameter(config, NICE_PARAMETER, "0"))
        if nice:
            _nice_every_thread(nice, self.logger)
        threads = int(_parameter(config, "intra_op_threads", "0"))
        self.runner = self._open(args, config, threads)
        lone_threads = _parameter(config, LONE_THREADS_PARAMETER, "")
        self.lone_runner = None
        if lone_threads and cpu_threads(int(lone_threads)) > cpu_threads(threads):
            self.lone_runner = CheckedWideRunner(self.runner, self._open(args, config, int(lone_threads)),
                                                 self.logger.log_info)
        self.max_rows = int(config["max_batch_size"]) or None

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
        from machgen.runtime.adapters import with_adapters
        from machgen.runtime.torch_runner import open_program

        config = json.loads(args["model_config"])
        device = None
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        self.source = _model_dir(args)
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


class ComponentError(RuntimeError):
    """A BLS call to a component model failed."""


class ComponentUnavailable(ComponentError):
    """A component model stayed unreachable (its stub dead, not loaded again in time)."""


class PublicModel:
    """The public model NAME: relays each request to NAME_sampler and answers
    with its result (see the module docstring)."""

    def initialize(self, args: dict) -> None:
        faulthandler.enable(all_threads=True)  # a crash leaves the Python stacks in the server log
        config = json.loads(args["model_config"])
        self.input_names = [entry["name"] for entry in config["input"]]
        self.output_names = [entry["name"] for entry in config["output"]]
        self.name = config["name"]
        self.sampler = model_name(config["name"], SAMPLER)
        # The sampler's response streams, kept here until the stub has let go
        # of them. The stub (Python backend 2.51 and still upstream in
        # 2026-07) keeps each BLS response stream, and every response read
        # from it, in a map that a background thread clears a moment after the
        # final response, without the GIL. Were this model's reference gone by
        # then, the responses' numpy arrays would be freed on that thread and
        # corrupt the interpreter: measured here as a segfault in about one run
        # in three of 8 requests of 250 steps. That thread also carries
        # request.is_cancelled()'s round trip, in order: once one returns, the
        # streams that ended before it are safe to free here.
        self._streams: list = []

    def execute(self, requests):
        return [self._relay(request) for request in requests]

    def finalize(self) -> None:
        mark_drained(self.name)

    def _relay(self, request) -> "pb_utils.InferenceResponse":
        withdrawn = request.is_cancelled()  # a round trip: a request's first call is never cached
        self._streams.clear()
        if withdrawn:  # withdrawn while it waited in the queue
            return _error_response("cancelled before it started", pb_utils.TritonError.CANCELLED)
        answer = self._answer(request)
        if not request.is_cancelled():  # a round trip too: only True is cached
            self._streams.clear()
        return answer

    def _answer(self, request) -> "pb_utils.InferenceResponse":
        inputs = [tensor for tensor in (pb_utils.get_input_tensor_by_name(request, name) for name in self.input_names)
                  if tensor is not None]
        relay = [pb_utils.Tensor(PREVIEW_INTERVAL_INPUT, np.zeros(1, np.int32)),
                 pb_utils.Tensor(PROGRESS_INPUT, np.zeros(1, np.int32))]
        return _run_on_sampler(self.sampler, request, [*inputs, *relay], self.output_names,
                               is_cancelled=request.is_cancelled, keep_stream=self._streams.append)


def _run_on_sampler(sampler: str, request, inputs: list, output_names: list[str], is_cancelled, keep_stream,
                    on_progress=None, on_silence=None) -> "pb_utils.InferenceResponse":
    """``request`` (its ``inputs``) run by the sampler model: its final
    answer, outputs ``output_names`` or an error. Every progress response
    goes to ``on_progress(outputs by name)``, and ``on_silence()`` is called
    after each ``CANCEL_POLL_S`` without one; once ``is_cancelled()`` says so
    (asked at each response and each silence) the sampler is told to stop
    (at its next step, answering CANCELLED). Every stream read goes to
    ``keep_stream`` (see PublicModel.initialize)."""
    key = uuid.uuid4().hex
    call = pb_utils.InferenceRequest(
        model_name=sampler, inputs=[*inputs, pb_utils.Tensor(REQUEST_KEY_INPUT, _text(key))],
        requested_output_names=[*output_names, PROGRESS_OUTPUT, ELAPSED_OUTPUT, PREVIEW_OUTPUT, ERROR_OUTPUT,
                                ACCEPTED_OUTPUT],
        request_id=request.request_id())
    answer = None
    cancel_sent = False
    last_step = None  # known to a relay that asked for progress

    def stop_if_withdrawn() -> None:
        nonlocal cancel_sent
        if cancel_sent or not is_cancelled():
            return
        # Stops the loop at its next step; its answer (CANCELLED) is still read.
        pb_utils.Logger.log_info(f"request {request.request_id() or '-'}: withdrawn by its client; stopping it")
        cancel_sent = True
        stop = pb_utils.InferenceRequest(model_name=sampler, requested_output_names=[],
                                         inputs=[pb_utils.Tensor(CANCEL_INPUT, _text(key))])
        stop_stream = stop.exec(decoupled=True)
        keep_stream(stop_stream)
        for _ in stop_stream:  # its one (empty) final response
            pass

    sent_at = time.time()
    stream = call.exec(decoupled=True)
    keep_stream(stream)
    for response in _responses_while_alive(stream, sampler, sent_at):
        if response is _SILENCE:
            stop_if_withdrawn()
            if on_silence is not None:
                on_silence()
            continue
        if response is None:  # the sampler's stub died under the request
            where = "" if last_step is None else f" after step {last_step}"
            pb_utils.Logger.log_warn(f"request {request.request_id() or '-'}: {sampler} died{where}")
            answer = _error_response(f"{sampler} stopped while it ran the request{where}; it is being loaded "
                                     "again: send the request again", pb_utils.TritonError.UNAVAILABLE)
            break
        if response.has_error():  # the sampler model itself failed (not loaded, stopping)
            answer = _error_response(f"{sampler}: {response.error().message()}", pb_utils.TritonError.UNAVAILABLE)
            continue
        outputs = {tensor.name(): tensor for tensor in response.output_tensors()}
        if ERROR_OUTPUT in outputs:
            error = json.loads(outputs[ERROR_OUTPUT].as_numpy()[0])
            answer = _error_response(error["message"], getattr(pb_utils.TritonError, error["status"]))
        elif "images" in outputs:
            answer = pb_utils.InferenceResponse([outputs[name] for name in output_names if name in outputs])
        else:
            stop_if_withdrawn()
            if cancel_sent:
                continue
            last_step = int(outputs[PROGRESS_OUTPUT].as_numpy()[0])
            if on_progress is not None:
                on_progress(outputs)
    if answer is None:
        answer = _error_response(f"{sampler} ended the request without an answer", pb_utils.TritonError.INTERNAL)
    return answer


_SILENCE = object()


def _send_heartbeat(sender, progress: np.ndarray, elapsed: float) -> None:
    """A progress response that repeats ``progress`` ([step, steps]): the stream lives (HEARTBEAT_S)."""
    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(PROGRESS_OUTPUT, progress),
                                            pb_utils.Tensor(ELAPSED_OUTPUT, np.array([elapsed], np.float32))]))


def _responses_while_alive(stream, sampler: str, sent_at: float):
    """The responses of ``stream`` to its last (the sampler's stream must be
    read to its end), ``_SILENCE`` after each ``CANCEL_POLL_S`` without one,
    or None once the request is found lost: a dead decoupled stub never ends
    its streams (Triton 2.51), so a thread reads them, and after each
    ``SAMPLER_CHECK_S`` of silence the relay checks that the sampler process
    that took the request (ACCEPTED_OUTPUT, the first response, not passed
    on) still runs; before one took it, that a sampler older than the
    request runs and ``ACCEPT_WAIT_S`` have not passed."""
    responses: queue.Queue = queue.Queue()

    def read() -> None:
        try:
            for response in stream:
                responses.put(response)
        finally:
            responses.put(StopIteration)

    threading.Thread(target=read, name="sampler-stream", daemon=True).start()
    accepted_by = None
    heard_at = time.monotonic()
    while True:
        try:
            response = responses.get(timeout=CANCEL_POLL_S)
        except queue.Empty:
            if time.monotonic() - heard_at >= SAMPLER_CHECK_S:
                heard_at = time.monotonic()
                if accepted_by is not None:
                    alive = _running(accepted_by)
                else:
                    alive = time.time() - sent_at < ACCEPT_WAIT_S and any(
                        stub.started <= sent_at + 0.05 for stub in instances_of(sampler, sibling_stubs()))
                if not alive:
                    yield None
                    return
            yield _SILENCE
            continue
        heard_at = time.monotonic()
        if response is StopIteration:
            return
        taken = None if response.has_error() else pb_utils.get_output_tensor_by_name(response, ACCEPTED_OUTPUT)
        if taken is not None:
            accepted_by = int(taken.as_numpy()[0])
            continue
        yield response


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a killed stub stays a zombie until the server reaps it)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class StreamModel:
    """NAME_stream: the public model's decoupled twin. Each request runs on
    its own thread, relayed to the sampler as the public model relays it,
    and every progress response (step, steps, elapsed seconds, the preview
    when one is due) is passed on before the result. A client that cancels
    the stream stops the request at the next step. Up to ``in_flight`` +
    ``max_queue_size`` requests are relayed at once; they wait for their
    turns at the sampler's step gate (by priority and owner, not first come,
    first served); more are refused with UNAVAILABLE, as the public model's
    queue refuses them."""

    def initialize(self, args: dict) -> None:
        faulthandler.enable(all_threads=True)
        config = json.loads(args["model_config"])
        self.input_names = [entry["name"] for entry in config["input"]]
        self.output_names = [entry["name"] for entry in config["output"]
                             if entry["name"] not in (PROGRESS_OUTPUT, ELAPSED_OUTPUT, PREVIEW_OUTPUT)]
        self.name = config["name"]
        self.sampler = _parameter(config, "sampler", "")
        # Requests relayed to the sampler at once: those running and those queued. They queue at the sampler's
        # step gate, which decides by priority and owner whose steps run (not first come, first served).
        self.max_admitted = int(_parameter(config, "in_flight", "8")) + int(_parameter(config, "max_queue_size", "64"))
        self._lock = threading.Lock()
        self._admitted = 0
        self._threads: set[threading.Thread] = set()
        self._closing = threading.Event()
        # Streams read to their end, with the count of streams ended before
        # each, freed once an is_cancelled() round trip began after they ended
        # (PublicModel.initialize says why).
        self._ended: list[tuple[int, object]] = []
        self._ended_count = 0
        self._status_names = {getattr(pb_utils.TritonError, name): name for name in STREAM_ERROR_STATUSES
                              if hasattr(pb_utils.TritonError, name)}
        self.logger = pb_utils.Logger

    def execute(self, requests):
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request,), name=f"stream-{request.request_id()}",
                                      daemon=True)
            with self._lock:
                self._threads.add(thread)
            thread.start()
        return None

    def _is_cancelled(self, request) -> bool:
        with self._lock:
            ended_before = self._ended_count
        cancelled = request.is_cancelled()
        if not cancelled:  # a round trip (only True is cached): what ended before it can go
            with self._lock:
                self._ended = [entry for entry in self._ended if entry[0] >= ended_before]
        return cancelled

    def _release(self, streams: list) -> None:
        with self._lock:
            for stream in streams:
                self._ended.append((self._ended_count, stream))
                self._ended_count += 1

    def _serve(self, request) -> None:
        sender = request.get_response_sender()
        streams: list = []
        try:
            answer = self._run(request, sender, streams)
        except Exception as err:  # noqa: BLE001 - every request gets an answer
            self.logger.log_error(f"stream: {traceback.format_exc()}")
            answer = _error_response(f"request failed: {err}", pb_utils.TritonError.INTERNAL)
        finally:
            self._release(streams)
            with self._lock:
                self._threads.discard(threading.current_thread())
        if answer.has_error():
            answer = _error_response(stream_error_message(self._status_names.get(answer.error().code(), "UNKNOWN"),
                                                          answer.error().message()), answer.error().code())
        sender.send(answer, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _run(self, request, sender, streams: list) -> "pb_utils.InferenceResponse":
        with self._lock:
            full = self._admitted >= self.max_admitted
            if not full:
                self._admitted += 1
        if full:
            return _error_response("Exceeds maximum queue size", pb_utils.TritonError.UNAVAILABLE)
        try:
            if self._is_cancelled(request):
                return _error_response("cancelled before it started", pb_utils.TritonError.CANCELLED)
            inputs = [tensor for tensor in (pb_utils.get_input_tensor_by_name(request, name)
                                            for name in self.input_names) if tensor is not None]

            started = time.monotonic()
            last = {"sent": started, "step": np.zeros(2, np.int32)}

            def on_progress(outputs: dict) -> None:
                sender.send(pb_utils.InferenceResponse(list(outputs.values())))
                last.update(sent=time.monotonic(), step=outputs[PROGRESS_OUTPUT].as_numpy().copy())

            def on_silence() -> None:  # the last step again, so that the client knows the stream lives
                if time.monotonic() - last["sent"] >= HEARTBEAT_S:
                    _send_heartbeat(sender, last["step"], time.monotonic() - started)
                    last["sent"] = time.monotonic()

            return _run_on_sampler(self.sampler, request, inputs, self.output_names,
                                   is_cancelled=lambda: self._closing.is_set() or self._is_cancelled(request),
                                   keep_stream=streams.append, on_progress=on_progress, on_silence=on_silence)
        finally:
            with self._lock:
                self._admitted -= 1

    def finalize(self) -> None:
        # Triton unloads the model once every request has its final response;
        # a forced unload stops what still runs at its next step.
        self._closing.set()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=30)
        mark_drained(self.name)


@dataclass
class _RunningRequest:
    """A request the sampler runs: set ``stop`` and it stops at its next step."""

    request_id: str
    thread: threading.Thread
    stop: threading.Event = field(default_factory=threading.Event)
    steps_done: int = 0
    priority: str | None = None  # once its inputs are read


class SamplerModel:
    """NAME_sampler: every in-flight request start to finish (text encoders,
    denoising loop, decoders) by BLS calls to the components, each on its
    own thread.

    Validation errors answer INVALID_ARG naming the field; a request whose
    public model passed on a cancellation stops at the next step boundary
    and answers CANCELLED; anything else answers INTERNAL for that request
    only, and the model keeps serving.
    """

    def initialize(self, args: dict) -> None:
        import torch

        from machgen.contract.engines import check_repository_engines, serving_host
        from machgen.contract.adapters import served_adapters
        from machgen.runtime.components import InSamplerComponents, LoneStepSessions
        from machgen.runtime.preview import LatentPreview
        from machgen.runtime.sampler import load_sampler

        # The loop only steps the scheduler; the components own the cores.
        torch.set_num_threads(1)
        model_dir = _model_dir(args)
        self.manifest = PipelineManifest.read(model_dir)
        if self.manifest.target == "tensorrt":
            # Refuse engines built for another TensorRT or GPU with a message that says so (Triton's own
            # load error for them is TensorRT's).
            check_repository_engines(Path(args["model_repository"]).parent, self.manifest.served_models,
                                     serving_host())
        self.in_sampler = InSamplerComponents(self.manifest.components, model_dir,
                                              *served_adapters(self.manifest.adapters, model_dir))
        self.sampler = load_sampler(self.manifest, str(model_dir), self._run_component, chains=True)
        self.preview = LatentPreview.load(model_dir)  # None: the build fitted none (--no-preview)
        self.logger = pb_utils.Logger
        # Every denoiser call passes the step gate: whose steps run when more requests are runnable than it
        # lets run at once (runtime/scheduling.py).
        config = json.loads(args["model_config"])
        self.gate = StepGate(SchedulingPolicy(slots=int(_parameter(config, "step_slots", "8")),
                                              batch_min_share=float(_parameter(config, "batch_min_share", "0.1"))))
        self._turn = threading.local()  # the request this thread runs: who it is for, its priority
        self.spread = RowSpread(int(_parameter(config, "spread_instances", "1")))
        self.lone_steps = LoneStepSessions(self.manifest.components, Path(args["model_repository"]).parent,
                                           sessions=int(_parameter(config, LONE_STEP_SESSIONS_PARAMETER, "0")),
                                           intra_op_threads=int(_parameter(config, "intra_op_threads", "1")))
        # The one interactive request among batch ones computes its steps on those sessions too, outside the
        # gate's slots, while the denoiser's instances (the batch calls) run niced (ServingOptions.denoiser_nice).
        self.interactive_steps_here = _parameter(config, INTERACTIVE_STEPS_PARAMETER, "0") == "1"
        # Requests running, by the key their relay gave them.
        self._running: dict[str, _RunningRequest] = {}
        self._lock = threading.Lock()

    def _run_component(self, name: str, inputs: dict):
        if not is_denoiser(name):
            # A stage (text encoders, VAE) of the only request running may take the cores that concurrent
            # requests would otherwise use (its component's wider session, OnnxComponentModel).
            return self._component_call(name, inputs, lone=len(self._running) == 1)
        turn = getattr(self._turn, "request", None)
        if (turn is not None and (name in self.lone_steps or name in self.in_sampler)
                and self._only_interactive(turn)):
            # Beside batch requests only: its rows on every core whatever else runs (the batch calls' instances
            # are niced), charged to its owner but holding no slot the batch requests' calls could use.
            owner, priority, _, waited, order = turn
            self.gate.leave(order)  # a slot it held for an earlier call (before the others came)
            with self.gate.unslotted(owner, priority, waited):
                if name in self.in_sampler:
                    return self._component_call(name, inputs)
                return self._steps_here(name, inputs, whole_cores=True)
        with contextlib.nullcontext() if turn is None else self.gate.turn(*turn):
            if name in self.in_sampler:
                return self._component_call(name, inputs)
            if name in self.lone_steps and len(self._running) == 1:
                return self._steps_here(name, inputs)
            return self.spread.call(functools.partial(self._component_call, name), inputs)

    def _only_interactive(self, turn: tuple) -> bool:
        """Whether this thread's request is interactive and every other one running is batch (one whose inputs
        are not read yet may be interactive)."""
        if not self.interactive_steps_here or turn[1] != INTERACTIVE:
            return False
        with self._lock:
            priorities = [running.priority for running in self._running.values()]
        return len(priorities) > 1 and sum(priority != BATCH for priority in priorities) == 1

    def _steps_here(self, name: str, inputs: dict, whole_cores: bool = False):
        """A denoiser call on the sampler's own sessions, its rows cut as they would be over the instances (as
        many parts as idle instances; ``whole_cores``: as many as there are instances): the bits an instance
        gives for such a part. A request that arrives meanwhile finds them counted busy and sends its calls
        whole."""
        rows = len(inputs["hidden_states"])
        self._turn.passes_in_sampler = getattr(self._turn, "passes_in_sampler", 0) + rows
        return self.spread.call(functools.partial(self.lone_steps.run, name), inputs, whole_cores=whole_cores)

    def _component_call(self, name: str, inputs: dict, lone: bool = False):
        if name in self.in_sampler:
            return self.in_sampler.run(name, inputs)
        model = self.manifest.components[name].model
        call = functools.partial(self._call, model, name, inputs, lone)
        response = call()
        if response.has_error() and any(sign in response.error().message() for sign in _COMPONENT_GONE):
            response = self._call_when_back(model, call, response.error().message())
        if response.has_error():
            raise ComponentError(f"{model}: {response.error().message()}")
        return {tensor.name(): _received(tensor) for tensor in response.output_tensors()}

    def _call(self, model: str, name: str, inputs: dict, lone: bool):
        return pb_utils.InferenceRequest(
            model_name=model,
            inputs=[_bls_tensor(key, value) for key, value in inputs.items()],
            requested_output_names=list(self.manifest.components[name].outputs),
            **({"parameters": {LONE_CALL_PARAMETER: True}} if lone else {}),
        ).exec()

    def _call_when_back(self, model: str, call, message: str):
        """The call again once ``model`` answers: a component call is a pure
        function of its inputs, so a step whose component died under it is
        run again once the component is loaded again (by machgen serve), and
        the request goes on unharmed. A call to a dead stub fails at once;
        it is sent every half second until ``COMPONENT_WAIT_S``."""
        self.logger.log_warn(f"{model}: {message}; waiting for it to come back")
        started = time.monotonic()
        while time.monotonic() - started < COMPONENT_WAIT_S and not server_stopping():
            time.sleep(0.5)
            response = call()
            if not response.has_error():
                self.logger.log_info(f"{model}: back after {time.monotonic() - started:.1f} s; call run again")
                return response
            message = response.error().message()
            if not any(sign in message for sign in _COMPONENT_GONE):
                return response
        raise ComponentUnavailable(f"{model} did not come back within {COMPONENT_WAIT_S:.0f} s ({message}); "
                                   "send the request again")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._accept(request, sender)
            except Exception as err:  # noqa: BLE001 - answer this request, keep the others
                self.logger.log_error(f"sampler: {traceback.format_exc()}")
                self._send_final(sender, self._error("INTERNAL", f"request not started: {err}"))
        return None

    def _accept(self, request, sender) -> None:
        """Start a request on its own thread, or pass on a cancellation."""
        cancel = pb_utils.get_input_tensor_by_name(request, CANCEL_INPUT)
        if cancel is not None:
            with self._lock:
                running = self._running.get(cancel.as_numpy()[0].decode())
            if running is not None:
                steps_done = running.steps_done
                running.stop.set()  # then the log (a message to the server): the loop checks it between steps
                self.logger.log_info(f"request {running.request_id}: asked to stop after step {steps_done}")
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        key = pb_utils.get_input_tensor_by_name(request, REQUEST_KEY_INPUT)
        key = uuid.uuid4().hex if key is None else key.as_numpy()[0].decode()
        thread = threading.Thread(target=self._serve, args=(request, sender, key), name=f"request-{key}",
                                  daemon=True)
        with self._lock:
            duplicate = key in self._running  # a cancellation must reach the one request it names
            if not duplicate:
                self._running[key] = _RunningRequest(request.request_id() or "-", thread)
        if duplicate:
            self._send_final(sender, self._error("INVALID_ARG", f"{REQUEST_KEY_INPUT}: {key!r} is already running"))
            return
        sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(ACCEPTED_OUTPUT, np.array([os.getpid()], np.int64))]))
        thread.start()

    def _serve(self, request, sender, key: str) -> None:
        try:
            outputs = self._generate(request, sender, self._running[key])
        except InvalidArgument as err:
            outputs = self._error("INVALID_ARG", str(err))
        except GenerationCancelled as err:
            self.logger.log_info(f"request {request.request_id() or '-'}: {err}")
            if self._running[key].stop.is_set():
                outputs = self._error("CANCELLED", str(err))
            else:  # by the server's stop, not by its client: it can run elsewhere
                outputs = self._error("UNAVAILABLE", f"the server is stopping: {err}; send the request again")
        except ComponentUnavailable as err:
            outputs = self._error("UNAVAILABLE", str(err))
        except Exception as err:  # noqa: BLE001 - one bad request must not take the model down
            self.logger.log_error(f"sampler: {traceback.format_exc()}")
            outputs = self._error("INTERNAL", f"generation failed: {err}")
        finally:
            with self._lock:  # the key is free by the time its answer is out
                self._running.pop(key, None)
        self._send_final(sender, outputs)

    def _send_final(self, sender, outputs: list) -> None:
        """The last response of a request; if that one cannot be sent (an
        output Triton refuses), an error in its place, so the stream ends."""
        try:
            sender.send(pb_utils.InferenceResponse(outputs), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as err:  # noqa: BLE001
            self.logger.log_error(f"sampler: answer not sent: {traceback.format_exc()}")
            sender.send(pb_utils.InferenceResponse(self._error("INTERNAL", f"answer not sent: {err}")),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    @staticmethod
    def _error(status: str, message: str) -> list:
        return [pb_utils.Tensor(ERROR_OUTPUT, _text(json.dumps({"status": status, "message": message})))]

    def _generate(self, request, sender, running: "_RunningRequest") -> list:
        def get_input(name: str):
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            return None if tensor is None else tensor.as_numpy()

        started = time.monotonic()
        parsed = self.sampler.parse_request(get_input, self.manifest.defaults)
        running.priority = parsed.priority
        interval = get_input(PREVIEW_INTERVAL_INPUT)
        interval = (self.manifest.preview_interval if interval is None
                    else integer_input(PREVIEW_INTERVAL_INPUT, interval, 0, parsed.num_inference_steps))
        request_id = request.request_id() or "-"
        progress = get_input(PROGRESS_INPUT)
        progress = True if progress is None else bool(progress.reshape(-1)[0])
        log_steps = os.environ.get(STEP_LOG_ENV) == "1"
        previews: list[np.ndarray] = []

        def on_preview(step: int, latents) -> None:
            previews.append(self.preview.render(latents))

        def on_step(step: int, total: int) -> None:
            running.steps_done = step
            if log_steps:
                self.logger.log_verbose(f"request {request_id}: step {step}/{total}")
            if not progress:
                return
            outputs = [pb_utils.Tensor(PROGRESS_OUTPUT, np.array([step, total], np.int32)),
                       pb_utils.Tensor(ELAPSED_OUTPUT, np.array([time.monotonic() - started], np.float32))]
            if previews:
                outputs.append(pb_utils.Tensor(PREVIEW_OUTPUT, previews.pop()))
            sender.send(pb_utils.InferenceResponse(outputs))

        def is_cancelled() -> bool:
            return running.stop.is_set() or server_stopping()

        turns: list[tuple[float, float]] = []  # each denoiser call's seconds at the gate and running
        order = self.gate.request_order()
        self._turn.request = (parsed.owner, parsed.priority, is_cancelled, turns, order)
        self._turn.passes_in_sampler = 0
        try:
            result = self.sampler.generate(parsed, on_step=on_step, is_cancelled=is_cancelled,
                                           on_preview=on_preview if self.preview is not None and progress else None,
                                           preview_interval=interval)
        except GateClosed:
            raise GenerationCancelled(running.steps_done, parsed.denoising_steps) from None
        finally:
            self._turn.request = None
            self.gate.leave(order)
        result.stats.priority = parsed.priority
        result.stats.waited_seconds = round(sum(waited for waited, _ in turns), 4)
        result.stats.denoiser_seconds = round(sum(ran for _, ran in turns), 4)
        result.stats.passes_in_sampler = self._turn.passes_in_sampler
        if is_cancelled():  # after the last step, before the decode
            raise GenerationCancelled(result.stats.steps, result.stats.steps)
        images = self.sampler.decode(result.latents)
        audio = self.sampler.decode_audio(result.latents)
        outputs = [pb_utils.Tensor("images", np.ascontiguousarray(images)),
                   pb_utils.Tensor("stats", _text(result.stats.to_json()))]
        if audio is not None:
            outputs.append(pb_utils.Tensor(AUDIO_OUTPUT, audio))
        if result.trajectory is not None:
            outputs.append(pb_utils.Tensor(TRAJECTORY_OUTPUT, result.trajectory))
        return outputs

    def finalize(self) -> None:
        # Triton unloads the model once its requests have their final
        # responses; what still runs (an unload forced by a timeout) stops at
        # its next step, and answers CANCELLED rather than vanishing.
        with self._lock:
            running = list(self._running.values())
        for request in running:
            request.stop.set()
        for request in running:
            request.thread.join(timeout=30)
        self.spread.close()
        # Tearing down an interpreter with torch and diffusers loaded spends
        # about a second in garbage collection; frozen objects are skipped
        # (exit of such a process measured 1.37 s, 0.39 s frozen).
        gc.freeze()


__all__ = ["OnnxComponentModel", "PublicModel", "SamplerModel", "StreamModel", "TorchComponentModel"]
