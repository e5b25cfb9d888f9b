"""Realtime sessions through Triton: the inputs and outputs a model built
with a streaming mode adds to its public model and its streaming twin, and
the parsing of a session request. Only numpy is imported.

A session is opened and played on the streaming twin NAME_stream
(``session_op`` "start": one response per chunk, ``video_chunk`` and
``chunk_info``, until ``chunks`` were sent or the session stops); it is
steered, forked and stopped by short requests to either model ("interact",
"fork", "stop", answered with ``session_info``); a fork is played with
"play". docs/realtime.md documents each field for users.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from machgen.contract.api import ApiTensor
from machgen.contract.validation import InvalidArgument, integer_input, text_input

SESSION_INPUT = "session"
SESSION_OP_INPUT = "session_op"
ACTION_INPUT = "action"
PARENT_SESSION_INPUT = "parent_session"
CHUNKS_INPUT = "chunks"
VIDEO_CHUNK_OUTPUT = "video_chunk"
CHUNK_INFO_OUTPUT = "chunk_info"
SESSION_INFO_OUTPUT = "session_info"
# The sampler config's parameters of ServingOptions' realtime fields.
MAX_SESSIONS_PARAMETER = "max_sessions"
SESSION_IDLE_PARAMETER = "session_idle_s"
SESSION_MEMORY_PARAMETER = "session_memory_mb"
SESSION_ROWS_PARAMETER = "session_rows"
SESSION_LEAD_PARAMETER = "session_lead_s"

# start: open a session and play it; play: play an open one (a fork); interact: a new prompt, action or seed
# from the next chunk; fork: open a session as a child of parent_session at its next chunk; stop: close one.
PLAYING_OPS = ("start", "play")
SESSION_OPS = PLAYING_OPS + ("interact", "fork", "stop")
SESSION_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_SESSION_PROMPT_CHARACTERS = 32000
MAX_CHUNKS = 1_000_000
# NAME_stream plays a session to the sampler this many chunks a call (runtime/triton_models/relays.py
# StreamModel._play_in_segments says why); its client reads one stream.
SEGMENT_CHUNKS = 8

SESSION_INPUTS: tuple[ApiTensor, ...] = (
    ApiTensor(SESSION_INPUT, "BYTES", (1,), "realtime: the session's id (1-128 letters, digits, '.', '_', ':', "
                                            "'-'), chosen by the client; with session_op"),
    ApiTensor(SESSION_OP_INPUT, "BYTES", (1,), "realtime: start (open and play, on NAME_stream), play (play an "
                                               "open session, a fork, on NAME_stream), interact, fork or stop"),
    ApiTensor(ACTION_INPUT, "BYTES", (1,), "realtime interact or fork: one of the actions the model card "
                                           "declares (each switches to its prompt); or send a prompt"),
    ApiTensor(PARENT_SESSION_INPUT, "BYTES", (1,), "realtime fork: the session to fork at its next chunk"),
    ApiTensor(CHUNKS_INPUT, "INT32", (1,), "realtime start or play: chunks to stream before the response ends "
                                           "(the session stays open); until the session stops when absent"),
)
SESSION_OUTPUTS: tuple[ApiTensor, ...] = (
    ApiTensor(VIDEO_CHUNK_OUTPUT, "UINT8", (-1, -1, -1, 3), "realtime: one chunk's frames, [frames, height, "
                                                             "width, RGB], as soon as they are decoded"),
    ApiTensor(CHUNK_INFO_OUTPUT, "BYTES", (1,), "realtime: JSON of the chunk: session, chunk, first_frame, "
                                                "frames, fps, and its stats (wait_ms: from its request to its "
                                                "frames, denoise_ms, decode_ms, decoded_together, rows: the most "
                                                "sessions in its calls, deadline_missed, late_ms, cache_bytes: "
                                                "the session's)"),
    ApiTensor(SESSION_INFO_OUTPUT, "BYTES", (1,), "realtime: JSON answer of a session op: session, state "
                                                  "(open, closed), chunks (generated), cache_bytes"),
)


@dataclass(frozen=True)
class SessionRequest:
    op: str
    session: str
    prompt: str | None = None
    action: str | None = None
    seed: int | None = None
    height: int | None = None
    width: int | None = None
    parent: str | None = None
    chunks: int | None = None


def _session_id(field: str, value) -> str:
    text = text_input(field, value)
    if not SESSION_ID.match(text):
        raise InvalidArgument(field, f"{text[:40]!r} is not 1-128 letters, digits, '.', '_', ':' or '-'")
    return text


def parse_session_request(get_input: Callable[[str], Any]) -> SessionRequest:
    """The session request among a request's inputs (``get_input(name)``: its array, None when absent),
    checked field by field."""
    op = get_input(SESSION_OP_INPUT)
    if op is None:
        raise InvalidArgument(SESSION_OP_INPUT, "missing")
    op = text_input(SESSION_OP_INPUT, op)
    if op not in SESSION_OPS:
        raise InvalidArgument(SESSION_OP_INPUT, f"{op[:40]!r} is not one of {', '.join(SESSION_OPS)}")
    session = get_input(SESSION_INPUT)
    if session is None:
        raise InvalidArgument(SESSION_INPUT, f"missing: session_op {op} names its session")
    fields: dict[str, Any] = {"op": op, "session": _session_id(SESSION_INPUT, session)}
    prompt = get_input("prompt")
    if prompt is not None:
        fields["prompt"] = text_input("prompt", prompt)
        if len(fields["prompt"]) > MAX_SESSION_PROMPT_CHARACTERS:
            raise InvalidArgument("prompt", f"{len(fields['prompt'])} characters long; at most "
                                            f"{MAX_SESSION_PROMPT_CHARACTERS}")
    action = get_input(ACTION_INPUT)
    if action is not None:
        fields["action"] = text_input(ACTION_INPUT, action)
    seed = get_input("seed")
    if seed is not None:
        fields["seed"] = integer_input("seed", seed, 0, 2**63 - 1)
    for name in ("height", "width"):
        value = get_input(name)
        if value is not None:
            fields[name] = integer_input(name, value, 1, 1 << 16)
    parent = get_input(PARENT_SESSION_INPUT)
    if parent is not None:
        fields["parent"] = _session_id(PARENT_SESSION_INPUT, parent)
    chunks = get_input(CHUNKS_INPUT)
    if chunks is not None:
        fields["chunks"] = integer_input(CHUNKS_INPUT, chunks, 1, MAX_CHUNKS)
    request = SessionRequest(**fields)
    if op == "start" and request.prompt is None and request.action is None:
        raise InvalidArgument("prompt", "missing: a session starts from a prompt (or an action)")
    if op == "fork" and request.parent is None:
        raise InvalidArgument(PARENT_SESSION_INPUT, "missing: a fork names the session it forks")
    if op == "interact" and request.prompt is None and request.action is None and request.seed is None:
        raise InvalidArgument(ACTION_INPUT, "missing: an interaction brings a prompt, an action or a seed")
    if op not in PLAYING_OPS and request.chunks is not None:
        raise InvalidArgument(CHUNKS_INPUT, f"only start and play stream chunks, not {op}")
    return request


def session_array(value: str) -> np.ndarray:
    return np.array([value.encode("utf-8")], dtype=np.object_)
