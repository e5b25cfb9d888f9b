"""The relays: the public model NAME (``PublicModel``) and its decoupled
twin NAME_stream (``StreamModel``) pass each request on to the sampler
model, and its progress, result or error back, and a client's cancellation
on to the sampler; they find a sampler that died under a request."""

from __future__ import annotations

import faulthandler
import json
import queue
import threading
import time
import traceback
import uuid

import numpy as np

from machgen.contract.api import (
    ELAPSED_OUTPUT,
    PREVIEW_INTERVAL_INPUT,
    PREVIEW_OUTPUT,
    PROGRESS_OUTPUT,
    STREAM_ERROR_STATUSES,
    stream_error_message,
)
from machgen.contract.manifest import (
    ACCEPTED_OUTPUT,
    CANCEL_INPUT,
    ERROR_OUTPUT,
    PROGRESS_INPUT,
    REQUEST_KEY_INPUT,
    SAMPLER,
    model_name,
)
from machgen.contract.sessions import (CHUNKS_INPUT, MAX_CHUNKS, PLAYING_OPS, SEGMENT_CHUNKS, SESSION_INFO_OUTPUT,
                                       SESSION_INPUT, SESSION_OP_INPUT, VIDEO_CHUNK_OUTPUT)
from machgen.runtime.processes import instances_of, process_running, sibling_stubs
from machgen.runtime.triton_models.backend import (RequestsHeld, error_response, mark_drained, parameter, pb_utils,
                                                   text_array)


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


class PublicModel:
    """The public model NAME: relays each request to NAME_sampler and answers
    with its result (see the package's docstring)."""

    def initialize(self, args: dict) -> None:
        faulthandler.enable(all_threads=True)  # a crash leaves the Python stacks in the server log
        config = json.loads(args["model_config"])
        self.input_names = [entry["name"] for entry in config["input"]]
        self.output_names = [entry["name"] for entry in config["output"]]
        self.name = config["name"]
        self.sampler = model_name(config["name"], SAMPLER)
        self.held = RequestsHeld(self.name)
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
        with self.held.held():  # until Triton sends the answers (a drain gives it a moment more)
            return [self._relay(request) for request in requests]

    def finalize(self) -> None:
        mark_drained(self.name)

    def _relay(self, request) -> "pb_utils.InferenceResponse":
        withdrawn = request.is_cancelled()  # a round trip: a request's first call is never cached
        self._streams.clear()
        if withdrawn:  # withdrawn while it waited in the queue
            return error_response("cancelled before it started", pb_utils.TritonError.CANCELLED)
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
        model_name=sampler, inputs=[*inputs, pb_utils.Tensor(REQUEST_KEY_INPUT, text_array(key))],
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
        # On a thread of its own: a sampler killed under the request never ends the stop's stream either, and a
        # relay blocked on it would never answer its client (nor let a drain unload the model).
        threading.Thread(target=_send_stop, args=(sampler, key, keep_stream), name="sampler-stop",
                         daemon=True).start()

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
            # A session's state (its cache) lived in that process: sent again, the session would not be found.
            again = ("the session went with it: open it again" if any(tensor.name() == SESSION_OP_INPUT
                                                                     for tensor in inputs)
                     else "send the request again")
            answer = error_response(f"{sampler} stopped while it ran the request{where}; it is being loaded "
                                     f"again: {again}", pb_utils.TritonError.UNAVAILABLE)
            break
        if response.has_error():  # the sampler model itself failed (not loaded, stopping)
            answer = error_response(f"{sampler}: {response.error().message()}", pb_utils.TritonError.UNAVAILABLE)
            continue
        outputs = {tensor.name(): tensor for tensor in response.output_tensors()}
        if ERROR_OUTPUT in outputs:
            error = json.loads(outputs[ERROR_OUTPUT].as_numpy()[0])
            answer = error_response(error["message"], getattr(pb_utils.TritonError, error["status"]))
        elif "images" in outputs or SESSION_INFO_OUTPUT in outputs:
            answer = pb_utils.InferenceResponse([outputs[name] for name in output_names if name in outputs])
        else:  # a step's progress, or a realtime session's chunk
            stop_if_withdrawn()
            if cancel_sent:
                continue
            if PROGRESS_OUTPUT in outputs:
                last_step = int(outputs[PROGRESS_OUTPUT].as_numpy()[0])
            if on_progress is not None:
                on_progress(outputs)
    if answer is None:
        answer = error_response(f"{sampler} ended the request without an answer", pb_utils.TritonError.INTERNAL)
    return answer


def _send_stop(sampler: str, key: str, keep_stream) -> None:
    """Ask the sampler to stop the request it runs under ``key`` (at its next step)."""
    stop = pb_utils.InferenceRequest(model_name=sampler, requested_output_names=[],
                                     inputs=[pb_utils.Tensor(CANCEL_INPUT, text_array(key))])
    stop_stream = stop.exec(decoupled=True)
    keep_stream(stop_stream)
    for _ in stop_stream:  # its one (empty) final response
        pass


def _segmented_play(inputs: list) -> tuple[bool, int | None]:
    """Whether a request's play of a session is relayed in segments, and the chunks it asks for (None: until
    the session stops); not for any other request, nor for a chunk count the sampler refuses or one segment
    holds."""
    by_name = {tensor.name(): tensor for tensor in inputs}
    op = by_name.get(SESSION_OP_INPUT)
    if op is None or SESSION_INPUT not in by_name:
        return False, None
    value = op.as_numpy().reshape(-1)
    name = value[0].decode(errors="replace") if value.size and isinstance(value[0], bytes) else None
    if name not in PLAYING_OPS:
        return False, None
    if CHUNKS_INPUT not in by_name:
        return True, None
    chunks = by_name[CHUNKS_INPUT].as_numpy().reshape(-1)
    if chunks.size != 1 or chunks.dtype.kind not in "iu" or not SEGMENT_CHUNKS < int(chunks[0]) <= MAX_CHUNKS:
        return False, None  # one call holds it, or the sampler refuses it
    return True, int(chunks[0])


def _with_chunks(inputs: list, chunks: int) -> list:
    return [*(tensor for tensor in inputs if tensor.name() != CHUNKS_INPUT),
            pb_utils.Tensor(CHUNKS_INPUT, np.array([chunks], np.int32))]


def _session_info(answer) -> dict | None:
    """The session_info of a session request's final answer (None: an error, or none)."""
    if answer.has_error():
        return None
    tensor = pb_utils.get_output_tensor_by_name(answer, SESSION_INFO_OUTPUT)
    return None if tensor is None else json.loads(tensor.as_numpy().reshape(-1)[0])


def _with_chunks_sent(answer, info: dict, sent: int) -> "pb_utils.InferenceResponse":
    """``answer`` with its session_info counting the chunks of every segment."""
    info = {**info, "chunks_sent": sent}
    return pb_utils.InferenceResponse([
        pb_utils.Tensor(SESSION_INFO_OUTPUT, text_array(json.dumps(info))) if tensor.name() == SESSION_INFO_OUTPUT
        else tensor for tensor in answer.output_tensors()])


_SILENCE = object()
PROGRESS_NAMES = (PROGRESS_OUTPUT, ELAPSED_OUTPUT, PREVIEW_OUTPUT)


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
                    alive = process_running(accepted_by)
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
        self.sampler = parameter(config, "sampler", "")
        self.held = RequestsHeld(self.name)
        # Requests relayed to the sampler at once: those running and those queued. They queue at the sampler's
        # step gate, which decides by priority and owner whose steps run (not first come, first served).
        self.max_admitted = int(parameter(config, "in_flight", "8")) + int(parameter(config, "max_queue_size", "64"))
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
            self.held.begin()
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
        try:
            self._answer_stream(request)
        finally:
            self.held.end()

    def _answer_stream(self, request) -> None:
        sender = request.get_response_sender()
        streams: list = []
        try:
            answer = self._run(request, sender, streams)
        except Exception as err:  # noqa: BLE001 - every request gets an answer
            self.logger.log_error(f"stream: {traceback.format_exc()}")
            answer = error_response(f"request failed: {err}", pb_utils.TritonError.INTERNAL)
        finally:
            self._release(streams)
            with self._lock:
                self._threads.discard(threading.current_thread())
        if answer.has_error():
            answer = error_response(stream_error_message(self._status_names.get(answer.error().code(), "UNKNOWN"),
                                                          answer.error().message()), answer.error().code())
        sender.send(answer, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def _run(self, request, sender, streams: list) -> "pb_utils.InferenceResponse":
        with self._lock:
            full = self._admitted >= self.max_admitted
            if not full:
                self._admitted += 1
        if full:
            return error_response("Exceeds maximum queue size", pb_utils.TritonError.UNAVAILABLE)
        try:
            if self._is_cancelled(request):
                return error_response("cancelled before it started", pb_utils.TritonError.CANCELLED)
            inputs = [tensor for tensor in (pb_utils.get_input_tensor_by_name(request, name)
                                            for name in self.input_names) if tensor is not None]

            started = time.monotonic()
            last = {"sent": started, "step": np.zeros(2, np.int32)}

            def on_progress(outputs: dict) -> None:
                sender.send(pb_utils.InferenceResponse([outputs[name] for name in outputs
                                                        if name in self.output_names or name in PROGRESS_NAMES]))
                last["sent"] = time.monotonic()
                if PROGRESS_OUTPUT in outputs:
                    last["step"] = outputs[PROGRESS_OUTPUT].as_numpy().copy()

            def on_silence() -> None:  # the last step again, so that the client knows the stream lives
                if time.monotonic() - last["sent"] >= HEARTBEAT_S:
                    _send_heartbeat(sender, last["step"], time.monotonic() - started)
                    last["sent"] = time.monotonic()

            def relay(call_inputs: list, progress=on_progress) -> "pb_utils.InferenceResponse":
                return _run_on_sampler(self.sampler, request, call_inputs, self.output_names,
                                       is_cancelled=lambda: self._closing.is_set() or self._is_cancelled(request),
                                       keep_stream=streams.append, on_progress=progress, on_silence=on_silence)

            segmented, chunks = _segmented_play(inputs)
            if not segmented:
                return relay(inputs)
            return self._play_in_segments(inputs, chunks, relay, on_progress, streams)
        finally:
            with self._lock:
                self._admitted -= 1

    def _play_in_segments(self, inputs: list, chunks: int | None, relay, on_progress,
                          streams: list) -> "pb_utils.InferenceResponse":
        """A session's play relayed as calls of SEGMENT_CHUNKS chunks each (the first as the client sent it,
        the others a "play" of the session), one stream to the client, until ``chunks`` (None: until the
        session stops) were sent or a call sends fewer than it asked; each call's ``streams`` are let go when
        it ends (freed once safe, PublicModel.initialize). Why: the Python backend's response stream keeps
        every response read from it until the stream is freed (ResponseIterator's responses_, Triton 2.51),
        so one call for a whole session held each of its chunks in this process: the 10-minute realtime
        soak's relay grew 43 -> 503 MB (43 -> 76 in calls of SEGMENT_CHUNKS)."""
        sent = 0
        call_inputs = inputs
        counted = {"chunks": 0}

        def count(outputs: dict) -> None:
            if VIDEO_CHUNK_OUTPUT in outputs:
                counted["chunks"] += 1
            on_progress(outputs)

        while True:
            asked = SEGMENT_CHUNKS if chunks is None else min(SEGMENT_CHUNKS, chunks - sent)
            counted["chunks"] = 0
            answer = relay(_with_chunks(call_inputs, asked), count)
            while streams:  # one by one: a stop's stream may be added meanwhile (its own thread)
                self._release([streams.pop(0)])
            sent += counted["chunks"]
            info = _session_info(answer)
            if info is None or info.get("state") != "open" or counted["chunks"] < asked or sent == chunks \
                    or self._closing.is_set():
                return answer if info is None else _with_chunks_sent(answer, info, sent)
            session = next(tensor for tensor in inputs if tensor.name() == SESSION_INPUT)
            call_inputs = [session, pb_utils.Tensor(SESSION_OP_INPUT, text_array("play"))]

    def finalize(self) -> None:
        # Triton unloads the model once every request has its final response;
        # a forced unload stops what still runs at its next step.
        self._closing.set()
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(timeout=30)
        mark_drained(self.name)


__all__ = ["PublicModel", "StreamModel"]
