"""The world model's steering and key latency through a served Triton (``world_eval --url``): the same held-out
sessions and walk as in process, played as a user's client plays them, over gRPC, paced to real time.

Each session is a client stream; before each chunk is made, the walk picks the next action from where the
detector last saw the shape and steers with ``interact``. The server answers the chunk a key applies from (the
next one not yet begun: a session runs up to the build's --session-lead-s plus a chunk's making ahead of its
frames), and each chunk is scored against the action it was made under. A key's latency is from the ``interact`` call to the arrival of the
chunk that shows it; keys pressed at random times (``key_latency``) show what a player meets: a key waits for
the next chunk boundary, then the chunk's steps and decode.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from machgen.builder.world_scores import SessionRecord, last_centre, score
from machgen.datasets import world_shapes


def _moved(centre, action: str, frames: int, size: float):
    """Where ``frames`` steps of ``action`` take a shape ``size`` px across from ``centre`` (held at walls)."""
    low, high = world_shapes.bounds(size)
    step = np.array(world_shapes.MOVES[action], dtype=np.float64) * world_shapes.SPEED * frames
    return np.clip(np.asarray(centre, dtype=np.float64) + step, low, high)


def _next_action(walk, centre, current: str, frames: int, size: float) -> str:
    """An action that keeps the shape inside the walls whether it starts with the next chunk or (the server
    already making that one) with the chunk after, the current action running on until then."""
    if centre is None:
        return world_shapes.ACTIONS[walk.integers(len(world_shapes.ACTIONS))]
    now = set(world_shapes.allowed_actions(centre, size, frames))
    later = set(world_shapes.allowed_actions(_moved(centre, current, frames, size), size, frames))
    # The detector's centre may sit a pixel past where the walk's margin allows: then only stop is left.
    allowed = [a for a in world_shapes.ACTIONS if a in now and a in later] or ["stop"]
    return allowed[walk.integers(len(allowed))]


def play_session(url: str, model: str, subject, seed: int, chunks: int, walk_size: float,
                 timeout_s: float = 60.0):
    """One held-out session through the server; its record (the action each chunk was made under) and its
    keys' latencies in seconds."""
    from machgen.client import MachgenClient

    record = SessionRecord(subject, seed)
    walk = np.random.default_rng([seed, 1])
    chunk_frames = world_shapes.chunk_lengths(2)[1]
    first = world_shapes.ACTIONS[walk.integers(len(world_shapes.ACTIONS))]
    # (the chunk it applies from, action): a session of the bare subject stays still until its first key.
    schedule = [(0, "stop")]
    pressed: dict[int, float] = {}  # the chunk a key applies from: when it was pressed
    latencies, last, current = [], None, first
    with MachgenClient(url, stream_silence_s=timeout_s) as client:
        session = client.open_session(model, prompt=subject.phrase, seed=seed, chunks=chunks,
                                      session_id=f"world-eval-{seed}-{secrets.token_hex(3)}")
        try:
            schedule.append((int(session.interact(action=first)["applies_from"]), first))
            for chunk in session:
                arrived = time.perf_counter()
                if chunk.chunk in pressed:
                    latencies.append(arrived - pressed.pop(chunk.chunk))
                frames = np.asarray(chunk.frames)
                before = last[-1] if last is not None else None
                record.readings.append(world_shapes.detect_chunk(frames, before))
                record.actions.append([action for start, action in schedule if start <= chunk.chunk][-1])
                last = frames
                if chunk.chunk + 1 >= chunks:
                    continue
                found = last_centre(frames)
                action = _next_action(walk, found, current, chunk_frames, walk_size)
                if action != current:
                    started = time.perf_counter()
                    applies_from = int(session.interact(action=action)["applies_from"])
                    schedule.append((applies_from, action))
                    pressed[applies_from] = started
                    current = action
        finally:
            session.stop()
    return record, latencies


def run_served(url: str, model: str, sessions, chunks: int, rows: int, walk_size: float, log=print):
    """The sessions, ``rows`` played at once (their chunks batched in the server's calls); records and every
    key's latency (seconds)."""
    records, latencies = [], []
    for first in range(0, len(sessions), rows):
        group = sessions[first:first + rows]
        started = time.monotonic()
        with ThreadPoolExecutor(len(group)) as pool:
            for record, keys in pool.map(lambda s: play_session(url, model, s[0], s[1], chunks, walk_size),
                                         group):
                records.append(record)
                latencies.extend(keys)
        log(f"served sessions {first + 1}-{first + len(group)}: {chunks} chunks in "
            f"{time.monotonic() - started:.1f} s")
    return records, latencies


def key_latency(url: str, model: str, keys: int, seed: int = 7) -> dict:
    """One session alone, keys pressed at random times while it plays (uniform over a chunk's time): seconds
    from each key to the arrival of the chunk that shows it, and to when a player that starts with the
    first chunk's arrival shows that chunk's first frame."""
    from machgen.client import MachgenClient

    rng = np.random.default_rng(seed)
    cycle = ["right", "stop", "left", "stop", "down", "stop", "up", "stop"]
    arrivals: dict[int, tuple[float, int]] = {}
    arrived = threading.Condition()
    with MachgenClient(url) as client:
        session = client.open_session(model, prompt=world_shapes.Subject("red", "circle").phrase, seed=seed,
                                      chunks=keys * 2 + 4, session_id=f"world-latency-{secrets.token_hex(3)}")

        def read():
            for chunk in session:
                with arrived:
                    arrivals[chunk.chunk] = (time.perf_counter(), chunk.first_frame, chunk.fps)
                    arrived.notify_all()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        with arrived:
            arrived.wait_for(lambda: 0 in arrivals, timeout=60)
        period = None
        to_arrival, to_display = [], []
        try:
            for index in range(keys):
                with arrived:
                    latest = max(arrivals)
                    fps = arrivals[latest][2]
                    period = period or world_shapes.chunk_lengths(2)[1] / fps
                time.sleep(float(rng.uniform(0, period)))
                pressed = time.perf_counter()
                applies_from = int(session.interact(action=cycle[index % len(cycle)])["applies_from"])
                with arrived:
                    if not arrived.wait_for(lambda: applies_from in arrivals, timeout=60):
                        raise TimeoutError(f"chunk {applies_from} did not arrive")
                    when, first_frame, fps = arrivals[applies_from]
                    played = max(when, arrivals[0][0] + first_frame / fps)
                to_arrival.append(when - pressed)
                to_display.append(played - pressed)
        finally:
            session.stop()
            reader.join(timeout=30)

    def summary(seconds):
        ms = np.array(seconds) * 1000
        return {"median_ms": round(float(np.median(ms)), 1), "p90_ms": round(float(np.percentile(ms, 90)), 1),
                "max_ms": round(float(ms.max()), 1)}

    return {"keys": keys, "to_arrival": summary(to_arrival), "to_display": summary(to_display)}


def served_figures(url: str, model: str, sessions, chunks: int, rows: int, walk_size: float, latency_keys: int,
                   log=print) -> dict:
    records, latencies = run_served(url, model, sessions, chunks, rows, walk_size, log)
    figures = score(records)
    ms = np.array(latencies) * 1000
    if len(ms):
        figures["key_to_chunk_after_a_chunk"] = {
            "keys": len(ms), "median_ms": round(float(np.median(ms)), 1),
            "p90_ms": round(float(np.percentile(ms, 90)), 1), "max_ms": round(float(ms.max()), 1)}
    if latency_keys:
        figures["key_to_frames_at_random_times"] = key_latency(url, model, latency_keys)
    return figures
