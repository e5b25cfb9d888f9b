"""Realtime sessions in process (runtime/streaming/, families/wan/streaming.py): a tiny random Wan built with a
streaming mode, its sessions' chunks against the uncached references of tests/streaming_reference.py
(diffusers' SkyReels-V2 block-causal forward where it applies), batching, forks, prompt switches and the
sessions' lifecycle."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import build_tiny_repository, write_tiny_streaming
from streaming_reference import allowed_mask, dense_forward, diffusers_block_causal, reference_chunk

from machgen.contract.streaming import StreamingSettings, StreamingSettingsError
from machgen.families.wan.tiny import TINY_STREAMING
from machgen.runtime.streaming.engine import SessionRefused, StreamingEngine
from machgen.runtime.streaming.kv_cache import bytes_of

pytestmark = pytest.mark.export

# Chunks of 2 latent frames in 3 steps; the first chunk stays (the sink), and the 4 frames before a chunk.
STREAMING = TINY_STREAMING
HEIGHT, WIDTH = 48, 32
LATENTS = 1e-5  # streamed against uncached latents
PROMPT = "a red circle"


@pytest.fixture(scope="module")
def streaming_model(tmp_path_factory) -> Path:
    return write_tiny_streaming(tmp_path_factory)


@pytest.fixture(scope="module")
def pipeline(streaming_model, tmp_path_factory):
    from machgen.runtime.local import LocalPipeline

    repository = build_tiny_repository(tmp_path_factory, streaming_model, "tiny-stream")
    with LocalPipeline(repository, "tiny-stream") as local:
        yield local


@pytest.fixture(scope="module")
def sky(streaming_model):
    """diffusers' SkyReels-V2 transformer on the same weights, blocks of ``chunk_frames`` latent frames."""
    import diffusers

    return diffusers.SkyReelsV2Transformer3DModel.from_pretrained(
        streaming_model / "transformer", num_frame_per_block=STREAMING["chunk_frames"]).eval()


def engine_of(pipeline, **changes) -> StreamingEngine:
    """The built model's engine, its sink and window as ``changes`` say (they rule only what stays cached)."""
    engine = pipeline.streaming()
    engine.settings = dataclasses.replace(engine.settings, **changes)
    return engine


def stream(engine, session_id: str, chunks: int, seed: int = 7, prompt: str = PROMPT):
    engine.open(session_id, prompt, seed, HEIGHT, WIDTH)
    return [engine.next_chunk(session_id) for _ in range(chunks)]


def chunk_shape(engine) -> tuple[int, ...]:
    return (1, 16, engine.settings.chunk_frames, HEIGHT // 8, WIDTH // 8)


def test_streamed_chunks_equal_diffusers_block_causal_forward_without_a_cache(pipeline, sky):
    """Every earlier chunk kept (Self-Forcing's default): each chunk's clean latents equal the same steps
    computed by diffusers' SkyReels-V2 forward over the whole sequence with its block-causal mask, and the
    frames streamed chunk by chunk equal the whole clip decoded at once."""
    engine = engine_of(pipeline, sink_frames=0, window_frames=None)
    chunks = stream(engine, "whole", 4)
    text = engine.runtime.encode_prompts([PROMPT])["encoder_hidden_states"]
    for index, chunk in enumerate(chunks):
        context = [c.latents for c in chunks[:index]]
        expected = reference_chunk(lambda whole, timesteps, positions: diffusers_block_causal(sky, whole,
                                                                                             timesteps, text),
                                   engine.settings, context, [c.first_latent for c in chunks[:index]], 7, index,
                                   chunk_shape(engine))
        assert float((chunk.latents - expected).abs().max()) <= LATENTS, index
    whole = pipeline.sampler.decode(torch.cat([c.latents for c in chunks], dim=2))
    streamed = np.concatenate([c.frames for c in chunks])
    assert streamed.shape == whole.shape == (1 + 7 * 4, HEIGHT, WIDTH, 3)
    assert np.abs(streamed.astype(int) - whole.astype(int)).max() <= 1
    assert [c.first_frame for c in chunks] == [0, 5, 13, 21]


def test_the_dense_reference_is_diffusers_where_both_apply(pipeline, sky):
    """tests/streaming_reference.dense_forward (any mask, explicit positions) equals diffusers' own
    block-causal forward on the same sequence: the window and prompt-switch references stand on it."""
    settings = StreamingSettings(chunk_frames=2, sink_frames=0, window_frames=None)
    generator = torch.Generator().manual_seed(3)
    latents = torch.randn(1, 16, 6, HEIGHT // 8, WIDTH // 8, generator=generator)
    text = torch.randn(1, 16, 32, generator=generator)
    timesteps = torch.tensor([0.0, 0.0, 0.0, 0.0, 640.0, 640.0])
    with torch.no_grad():
        ours = dense_forward(sky, latents, timesteps, text, torch.arange(6),
                             allowed_mask([0, 2, 4], 2, settings, (HEIGHT // 16) * (WIDTH // 16)))
        theirs = diffusers_block_causal(sky, latents, timesteps, text)
    assert float((ours - theirs).abs().max()) < 1e-5


def window_forward(sky, text, settings, first_frames):
    patch_tokens = (HEIGHT // 16) * (WIDTH // 16)
    return lambda whole, timesteps, positions: dense_forward(
        sky, whole, timesteps, text, positions, allowed_mask(first_frames, settings.chunk_frames, settings,
                                                             patch_tokens))


def test_a_sink_and_a_window_equal_the_dense_mask_that_keeps_them(pipeline, sky):
    """LongLive's bounds (the card's sink of 2 frames, window of 4): six chunks, the cache evicting from the
    fourth on, equal one dense forward per step whose mask lets each chunk see the sink and its window."""
    engine = pipeline.streaming()
    chunks = stream(engine, "windowed", 6, seed=11)
    assert [e.first_frame for e in engine.session("windowed").cache.entries] == [0, 8, 10]
    text = engine.runtime.encode_prompts([PROMPT])["encoder_hidden_states"]
    firsts = [c.first_latent for c in chunks]
    for index in (3, 4, 5):
        expected = reference_chunk(window_forward(sky, text, engine.settings, firsts[:index + 1]),
                                   engine.settings, [c.latents for c in chunks[:index]], firsts[:index], 11, index,
                                   chunk_shape(engine))
        assert float((chunks[index].latents - expected).abs().max()) <= LATENTS, index


def test_one_frame_chunks_equal_the_frame_causal_reference_and_start_playing_after_the_lone_first_frame(
        pipeline, sky, streaming_model):
    """Chunks of one latent frame (models/shapes-world-fast's): each equals one dense forward per step in which
    every frame sees itself and the frames before it (diffusers' own forward applies no mask to one-frame
    blocks: every frame would see the future). The first chunk is the causal VAE's lone first frame: the video
    starts playing with the next chunk, so that one is still due by the startup's deadline, not 1 / fps later.
    The build exported its streaming denoiser for its card's two-frame chunks: here the module it exports runs
    in torch (its export's parity is the build's check), the engine, the cache and the decoder as served."""
    import diffusers

    from machgen.families.wan.streaming import StreamingChunkDenoiser

    now = [0.0]
    engine = engine_of(pipeline, chunk_frames=1, sink_frames=0, window_frames=None)
    engine.clock = lambda: now[0]
    transformer = diffusers.WanTransformer3DModel.from_pretrained(streaming_model / "transformer").eval()
    module = StreamingChunkDenoiser(transformer, engine.settings.max_frames).eval()
    served = engine.run_component

    def run_component(name, inputs):
        if name != "streaming_denoiser":
            return served(name, inputs)
        with torch.no_grad():
            outputs = module(**{key: torch.as_tensor(value) for key, value in inputs.items()})
        return dict(zip(("noise_pred", "chunk_keys", "chunk_values"), outputs))

    engine.run_component = run_component
    engine.open("one", PROMPT, 5, HEIGHT, WIDTH)
    session = engine.session("one")
    engine.want("one", 4)
    chunks = []
    while len(chunks) < 4:
        now[0] += 0.01
        made = engine.step()
        chunks += made
        if len(chunks) == 1 and made:
            assert len(made[0].frames) == 1 and session.playing_since is None
            assert engine.deadline(session) == pytest.approx(session.opened_at + engine.startup_s)
        if len(chunks) == 2 and made:
            assert len(made[0].frames) == 4 and session.playing_since == now[0]
            assert engine.deadline(session) == pytest.approx(now[0] + 5 / engine.fps)
    assert not any(chunk.stats["deadline_missed"] for chunk in chunks)
    text = engine.runtime.encode_prompts([PROMPT])["encoder_hidden_states"]
    firsts = [c.first_latent for c in chunks]
    assert firsts == [0, 1, 2, 3]
    for index in range(1, 4):
        expected = reference_chunk(window_forward(sky, text, engine.settings, firsts[:index + 1]),
                                   engine.settings, [c.latents for c in chunks[:index]], firsts[:index], 5, index,
                                   chunk_shape(engine))
        assert float((chunks[index].latents - expected).abs().max()) <= LATENTS, index


def test_sessions_batched_together_equal_each_run_alone(pipeline):
    """Three sessions of different prompts and seeds, one opened two chunks later (rows at different steps
    and cache lengths in one call), equal each session run alone."""
    together = pipeline.streaming(max_rows=4)
    together.open("a", PROMPT, 1, HEIGHT, WIDTH)
    together.open("b", "a blue square", 2, HEIGHT, WIDTH)
    together.want("a", 5)
    together.want("b", 5)
    got: dict[str, list] = {"a": [], "b": [], "c": []}
    rows = []
    while len(got["c"]) < 3:
        if len(got["a"]) == 2 and "c" not in together.sessions:
            together.open("c", "a green triangle", 3, HEIGHT, WIDTH)
            together.want("c", 3)
        for result in together.step():
            got[result.session_id].append(together.session(result.session_id).outbox.pop(0))
            rows.append(result.stats["rows"])
    assert max(rows) == 3
    for session_id, prompt, seed in (("a", PROMPT, 1), ("b", "a blue square", 2), ("c", "a green triangle", 3)):
        alone = stream(pipeline.streaming(), session_id, 3, seed=seed, prompt=prompt)
        for mine, theirs in zip(got[session_id][:3], alone):
            assert float((mine.latents - theirs.latents).abs().max()) <= LATENTS
            assert np.abs(mine.frames.astype(int) - theirs.frames.astype(int)).max() <= 1


def test_a_fork_shares_the_cache_and_its_children_equal_fresh_sessions_replaying_the_history(pipeline):
    engine = pipeline.streaming()
    parent = stream(engine, "parent", 2, seed=5)
    before = engine.cache_bytes()
    engine.fork("parent", "left", action="left")
    engine.fork("parent", "other-seed", seed=99)
    assert engine.cache_bytes() == before  # copy on write: nothing copied yet
    children = {child: [engine.next_chunk(child) for _ in range(2)] for child in ("left", "other-seed")}
    parent += [engine.next_chunk("parent") for _ in range(2)]
    assert engine.cache_bytes() > before

    def replay(changes: dict) -> list:
        fresh = pipeline.streaming()
        chunks = stream(fresh, "replay", 2, seed=5)
        fresh.change("replay", **changes)
        return chunks + [fresh.next_chunk("replay") for _ in range(2)]

    for child, changes in (("left", {"action": "left"}), ("other-seed", {"seed": 99}), ("parent", {})):
        replayed = replay(changes)
        mine = (parent[:2] + children[child]) if child != "parent" else parent
        for index, (a, b) in enumerate(zip(mine, replayed)):
            assert float((a.latents - b.latents).abs().max()) <= LATENTS, (child, index)
            assert np.abs(a.frames.astype(int) - b.frames.astype(int)).max() <= 1, (child, index)


def test_a_prompt_switch_recaches_the_kept_chunks_and_equals_its_uncached_reference(pipeline, sky):
    """LongLive's re-cache: after the switch the kept chunks (sink and window) are run again under the new
    prompt, so the next chunk equals a dense forward over the kept chunks and itself under the new prompt,
    each at its own absolute position."""
    engine = pipeline.streaming()
    chunks = stream(engine, "switch", 5, seed=21)
    engine.change("switch", prompt="a blue square")
    after = engine.next_chunk("switch")
    kept = [c for c in chunks if engine.settings.kept(c.first_latent, after.first_latent)]
    assert [c.first_latent for c in kept] == [0, 6, 8]
    text = engine.runtime.encode_prompts(["a blue square"])["encoder_hidden_states"]
    firsts = [c.first_latent for c in kept] + [after.first_latent]
    expected = reference_chunk(window_forward(sky, text, engine.settings, firsts), engine.settings,
                               [c.latents for c in kept], firsts[:-1], 21, 5, chunk_shape(engine))
    assert float((after.latents - expected).abs().max()) <= LATENTS


def test_sessions_are_evicted_when_idle_refused_over_the_budget_and_give_their_memory_back(pipeline):
    now = [0.0]
    engine = pipeline.streaming(max_sessions=2, idle_timeout_s=5.0, clock=lambda: now[0])
    stream(engine, "a", 2)
    stream(engine, "b", 1, seed=8)
    with pytest.raises(SessionRefused, match="at most 2 sessions") as refused:
        engine.open("c", PROMPT, 1, HEIGHT, WIDTH)
    assert refused.value.field == "session"
    assert engine.cache_bytes() > 0
    now[0] = 4.0
    engine.next_chunk("b")
    now[0] = 7.0
    assert engine.evict_idle() == ["a"]
    with pytest.raises(SessionRefused, match="no open session 'a'"):
        engine.next_chunk("a")
    engine.close("b")
    assert engine.cache_bytes() == 0 and not engine.sessions
    engine.open("c", PROMPT, 1, HEIGHT, WIDTH)


def test_the_load_admission_reads_is_the_share_of_time_in_calls_and_fades_when_idle(pipeline):
    """The sampler refuses a new session while the denoiser calls keep the model busy (runtime/triton_models/
    sessions.py FULL_BUSY_SHARE): the share of wall time in calls, here on a clock the calls themselves move
    (each call takes 1 s, 0.25 s pass between calls), fading to nothing over 2 s without a call."""
    now = [0.0]
    engine = pipeline.streaming(clock=lambda: now[0])
    run = engine.run_component

    def slow_call(name, inputs):
        now[0] += 1.0
        return run(name, inputs)

    engine.run_component = slow_call
    engine.open("a", PROMPT, 1, HEIGHT, WIDTH)
    engine.want("a", 20)
    for _ in range(60):
        engine.step()
        now[0] += 0.25
    assert engine.load() == pytest.approx(0.8 * (1 - 0.25 / 2), abs=0.05)
    now[0] += 2.0
    assert engine.load() == 0.0


def test_a_late_chunk_moves_the_session_s_clock_as_its_reader_s_player_waited(pipeline):
    """A chunk done after its frames were due: the reader's player waited for it (a rebuffer), so the next
    chunk is due a chunk's play time after it, not on the clock it missed; one on time leaves the clock."""
    now = [0.0]
    engine = pipeline.streaming(clock=lambda: now[0])
    run = engine.run_component
    call_s = [0.01]

    def timed_call(name, inputs):
        now[0] += call_s[0]
        return run(name, inputs)

    engine.run_component = timed_call
    engine.open("a", PROMPT, 1, HEIGHT, WIDTH)
    engine.want("a", 3)
    session = engine.session("a")
    while not session.outbox:
        engine.step()
    first = session.outbox.pop()
    assert session.playing_since == now[0]
    assert engine.deadline(session) == pytest.approx(now[0] + len(first.frames) / engine.fps)
    call_s[0] = 1.0  # each call longer than a chunk plays: the second chunk is late
    while not session.outbox:
        engine.step()
    late = session.outbox.pop()
    assert late.stats["deadline_missed"] and late.stats["late_ms"] > 0
    # Its frames play from when it came, the next chunk due after them, not on the clock it missed.
    assert engine.deadline(session) == pytest.approx(now[0] + len(late.frames) / engine.fps)
    call_s[0] = 0.0
    while not session.outbox:
        engine.step()
    on_time = session.outbox.pop()
    assert not on_time.stats["deadline_missed"] and first.chunk + 2 == on_time.chunk


def test_a_session_over_the_memory_budget_is_refused_until_one_closes(pipeline):
    engine = pipeline.streaming(memory_budget_bytes=1)
    stream(engine, "a", 1)
    with pytest.raises(SessionRefused, match="memory budget") as refused:
        engine.open("b", PROMPT, 1, HEIGHT, WIDTH)
    assert refused.value.field == "session"
    engine.close("a")
    engine.open("b", PROMPT, 1, HEIGHT, WIDTH)


def test_bad_session_requests_name_their_field(pipeline):
    engine = pipeline.streaming()
    engine.open("a", PROMPT, 1, HEIGHT, WIDTH)
    for call, field, words in (
            (lambda: engine.open("a", PROMPT, 1, HEIGHT, WIDTH), "session", "already open"),
            (lambda: engine.change("nope", prompt="x"), "session", "no open session"),
            (lambda: engine.fork("nope", "child"), "session", "no open session"),
            (lambda: engine.change("a", action="jump"), "action", "unknown action 'jump'; this model's "
                                                                  "actions: left, right"),
            (lambda: engine.change("a", prompt="x", action="left"), "action", "not both"),
    ):
        with pytest.raises(SessionRefused, match=words) as refused:
            call()
        assert refused.value.field == field


def test_an_action_template_is_filled_with_the_session_s_own_prompt(pipeline):
    engine = engine_of(pipeline, actions={"left": "{prompt} moves to the left", "spin": "a spinning top"})
    engine.open("a", "a blue square", 1, HEIGHT, WIDTH)
    engine.change("a", action="left")
    assert engine.session("a").prompt == "a blue square moves to the left"
    engine.change("a", prompt="a green circle")
    engine.change("a", action="left")
    assert engine.session("a").prompt == "a green circle moves to the left"
    engine.fork("a", "b", action="spin")
    assert engine.session("b").prompt == "a spinning top" and engine.session("b").subject == "a green circle"
    with pytest.raises(SessionRefused, match="made from the session's prompt") as refused:
        engine.action_prompt("left", None)
    assert refused.value.field == "prompt"


def test_every_graph_of_the_build_passes_onnx_s_full_check(pipeline):
    from test_chain import check_every_graph

    check_every_graph(pipeline.repository, joined=True)
    assert list(pipeline.repository.rglob("streaming_denoiser/model.onnx"))


def test_the_build_s_session_options_reach_the_sampler_s_config(pipeline):
    """--session-lead-s and the other realtime options are the sampler's parameters, read by its SessionHost
    (the pacing lead: how long before it is due a chunk may be made, beyond its making)."""
    from machgen.builder.repository import ServingOptions, render_sampler_config
    from machgen.families.registry import get_family

    built = (pipeline.repository / "tiny-stream_sampler" / "config.pbtxt").read_text()
    assert 'key: "session_lead_s"\n  value: { string_value: "0.5" }' in built
    rendered = render_sampler_config("tiny-stream", get_family("wan"), ServingOptions(session_lead_s=0.1,
                                                                                      session_rows=3),
                                     streaming=True)
    assert 'key: "session_lead_s"\n  value: { string_value: "0.1" }' in rendered
    assert 'key: "session_rows"\n  value: { string_value: "3" }' in rendered
    assert "session_lead_s" not in render_sampler_config("tiny-stream", get_family("wan"), ServingOptions())


def test_the_card_s_streaming_section_is_checked_field_by_field():
    for section, words in (({"chunk_frames": 0}, "streaming.chunk_frames"),
                           ({"timesteps": [500, 750]}, "streaming.timesteps: must decrease"),
                           ({"window_frames": 5}, "streaming.window_frames: must be a non-negative multiple"),
                           ({"chunk": 3}, "unknown field")):
        with pytest.raises(StreamingSettingsError, match=words):
            StreamingSettings.from_json(section)
    assert StreamingSettings(shift=5.0).sigmas()[:2] == [1.0, pytest.approx(0.9375)]


def test_a_fork_leaves_memory_counted_once(pipeline):
    engine = pipeline.streaming()
    stream(engine, "p", 2)
    children = [engine.fork("p", f"c{i}") for i in range(3)]
    caches = [engine.session("p").cache] + [child.cache for child in children]
    assert bytes_of(caches) == engine.session("p").cache.bytes() == engine.cache_bytes()


# Through Triton: the sampler holds the sessions; the client plays them over gRPC.

@pytest.fixture(scope="module")
def served(pipeline):
    """``machgen serve`` (it brings a killed stub back, as a user's server does). A short drain: what these
    tests check ends with each test, and a drain that waits on a request is reported (conftest.SlowStop)."""
    from conftest import machgen_serve

    with machgen_serve(pipeline.repository, "--drain-timeout", "10") as server:
        yield server


@pytest.fixture
def client(served):
    from machgen.client import MachgenClient

    with MachgenClient(served.grpc_url) as machgen:
        yield machgen


def realtime_metric(served, name: str) -> float:
    """A realtime metric of the model on Triton's /metrics (labelled with the model)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{served.metrics}/metrics", timeout=5) as response:
        lines = response.read().decode().splitlines()
    values = [float(line.split()[-1]) for line in lines
              if line.startswith(name + "{") and 'model="tiny-stream"' in line]
    assert values, f"{name} of tiny-stream is not on /metrics"
    return sum(values)


def frames_of(chunks) -> np.ndarray:
    return np.concatenate([chunk.frames for chunk in chunks])


def test_a_served_session_equals_the_same_session_in_process_steered_forked_and_stopped(pipeline, client, served):
    """Chunks streamed through Triton equal the in-process engine's for the same seed and steering: the
    start, an action mid-session, a fork with its own seed; stopping frees the session's memory."""
    counted = {name: realtime_metric(served, name) for name in (
        "machgen_realtime_chunks_total", "machgen_realtime_deadline_misses_total",
        "machgen_realtime_chunk_latency_seconds_count")}
    session = client.open_session("tiny-stream", prompt=PROMPT, seed=31, height=HEIGHT, width=WIDTH, chunks=2)
    first = list(session)
    assert [c.chunk for c in first] == [0, 1] and [c.first_frame for c in first] == [0, 5]
    assert session.info["state"] == "open" and session.info["chunks_sent"] == 2
    assert first[0].fps == 16 and first[0].stats["rows"] >= 1 and "denoise_ms" in first[0].stats
    assert session.interact(action="right")["applies_from"] == 2  # between chunks: from the next one
    child = session.fork("served-child", seed=5, chunks=1)
    more = list(session.play(chunks=2))
    child_chunks = list(child)
    local = pipeline.streaming()
    here = stream(local, "here", 2, seed=31)
    local.change("here", action="right")
    local.fork("here", "local-child", seed=5)
    local_more = [local.next_chunk("here") for _ in range(2)]
    local_child = [local.next_chunk("local-child")]
    for mine, theirs in ((first, here), (more, local_more), (child_chunks, local_child)):
        assert np.array_equal(frames_of(mine), frames_of(theirs))
    info = session.stop()
    assert info["state"] == "closed"
    assert realtime_metric(served, "machgen_realtime_sessions") == 1
    closed = child.stop()
    assert closed["cache_bytes"] == 0 and closed["sessions"] == 0
    assert realtime_metric(served, "machgen_realtime_sessions") == 0
    assert realtime_metric(served, "machgen_realtime_cache_bytes") == 0
    received = first + more + child_chunks
    assert realtime_metric(served, "machgen_realtime_chunks_total") - counted["machgen_realtime_chunks_total"] == 5
    assert realtime_metric(served, "machgen_realtime_chunk_latency_seconds_count") - \
        counted["machgen_realtime_chunk_latency_seconds_count"] == 5
    assert realtime_metric(served, "machgen_realtime_deadline_misses_total") - \
        counted["machgen_realtime_deadline_misses_total"] == sum(c.stats["deadline_missed"] for c in received)


def test_sessions_started_together_each_play_steered_and_the_server_stays_up(pipeline, served):
    """Six clients at once, each starting a session and steering it before its first chunk arrives: every
    session plays its chunks (as the same session in process, within batching's rounding), the steer lands where the server
    says, and Triton never restarts (the sessions' metric calls from several threads at once once crashed
    it, SIGSEGV)."""
    from concurrent.futures import ThreadPoolExecutor

    from machgen.client import MachgenClient

    def play(seed: int):
        with MachgenClient(served.grpc_url) as machgen:
            session = machgen.open_session("tiny-stream", prompt=PROMPT, seed=seed, height=HEIGHT, width=WIDTH,
                                           chunks=3)
            applies_from = session.interact(action="left")["applies_from"]
            chunks = list(session)
            session.stop()
            return applies_from, chunks

    before = served.output()
    with ThreadPoolExecutor(6) as pool:
        played = list(pool.map(play, range(40, 46)))
    assert "exited" not in served.output()[len(before):], served.output()[len(before):]
    local = pipeline.streaming()
    for seed, (applies_from, chunks) in zip(range(40, 46), played):
        assert [c.chunk for c in chunks] == [0, 1, 2] and 0 <= applies_from <= 3
        expected = stream(local, f"together-{seed}", applies_from, seed=seed)
        local.change(f"together-{seed}", action="left")
        expected += [local.next_chunk(f"together-{seed}") for _ in range(3 - applies_from)]
        local.close(f"together-{seed}")
        # Rows batched with other sessions' differ from a session alone in float rounding (as in process).
        assert np.abs(frames_of(chunks).astype(int) - frames_of(expected).astype(int)).max() <= 1


def test_a_long_play_reaches_the_sampler_in_segments_as_one_stream_that_loses_no_chunk(pipeline, client, served):
    """NAME_stream plays a session SEGMENT_CHUNKS chunks per call to the sampler (a Python-backend response
    stream keeps every response read from it: one call for a whole session held all its chunks in the relay);
    the client still reads one stream: every chunk once, in order, as in process, and its count at the end."""
    import urllib.request

    from machgen.contract.sessions import SEGMENT_CHUNKS

    def sampler_requests() -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{served.metrics}/metrics", timeout=5) as response:
            lines = response.read().decode().splitlines()
        return sum(float(line.split()[-1]) for line in lines
                   if line.startswith('nv_inference_request_success{model="tiny-stream_sampler"'))

    total = SEGMENT_CHUNKS + 3
    before = sampler_requests()
    session = client.open_session("tiny-stream", prompt=PROMPT, seed=71, height=HEIGHT, width=WIDTH, chunks=total)
    chunks = list(session)
    assert [c.chunk for c in chunks] == list(range(total))
    assert session.info["state"] == "open" and session.info["chunks_sent"] == total
    assert sampler_requests() - before == 2  # the start with SEGMENT_CHUNKS, then a play of the rest
    local = pipeline.streaming()
    assert np.array_equal(frames_of(chunks), frames_of(stream(local, "long", total, seed=71)))
    local.close("long")
    assert session.stop()["state"] == "closed"


def test_a_stream_closed_mid_play_and_played_again_at_once_loses_no_chunk(client):
    """A client's stream closed while the sampler waits to make its next chunk (paced: chunk 2 is due 0.8 s
    after the first frame), and the session played again at once (a reconnect, a handoff): the new play takes
    over and gets every chunk from that one on (the old play, waiting for it, once took it or left both plays
    waiting for ever)."""
    for attempt in range(3):
        session = client.open_session("tiny-stream", prompt=PROMPT, seed=60 + attempt, height=HEIGHT, width=WIDTH)
        chunks = iter(session)
        read = [next(chunks).chunk, next(chunks).chunk]
        session.close()
        again = [c.chunk for c in session.play(chunks=2)]
        assert read == [0, 1] and again == [2, 3], (read, again)
        session.stop()


def test_bad_session_requests_are_refused_naming_the_field_and_the_server_serves_on(client):
    from machgen.client import GenerationError

    def refused(inputs: dict, model: str = "tiny-stream") -> GenerationError:
        with pytest.raises(GenerationError) as error:
            client.infer(model, [client.make_input(name, value) for name, value in inputs.items()],
                         outputs=("session_info",))
        assert "INVALID_ARGUMENT" in error.value.status, error.value
        return error.value

    assert "'session_op'" in str(refused({"session": "s1", "session_op": "start", "prompt": PROMPT}))
    assert "'session'" in str(refused({"session": "nope", "session_op": "interact", "prompt": "x"}))
    assert "'session_op'" in str(refused({"session": "s1", "session_op": "dance"}))
    assert "'session'" in str(refused({"session": "bad id!", "session_op": "stop"}))
    assert "'parent_session'" in str(refused({"session": "s2", "session_op": "fork"}))
    assert "'chunks'" in str(refused({"session": "s1", "session_op": "stop", "chunks": 2}))
    with pytest.raises(GenerationError, match="'height'") as error:
        list(client.open_session("tiny-stream", prompt=PROMPT, height=50, width=WIDTH, chunks=1))
    with pytest.raises(GenerationError, match="'action'"):
        list(client.open_session("tiny-stream", action="jump", chunks=1))
    with pytest.raises(GenerationError, match="'prompt'"):
        list(client.open_session("tiny-stream", chunks=1))
    images = client.generate("tiny-stream", PROMPT, seed=1, num_frames=5, num_inference_steps=2)
    assert images.shape == (5, HEIGHT, WIDTH, 3)


def test_machgen_session_writes_the_chunks_to_an_mp4_steered_where_asked(served, pipeline, tmp_path):
    import subprocess
    import sys

    from machgen.client.video import read_mp4, write_mp4

    out = tmp_path / "session.mp4"
    run = subprocess.run([sys.executable, "-m", "machgen.cli", "session", "--url", served.grpc_url, "--model",
                          "tiny-stream", "--prompt", PROMPT, "--seed", "3", "--chunks", "3", "--steer", "2:left",
                          "--height", str(HEIGHT), "--width", str(WIDTH), "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert [line.split(":")[0] for line in run.stdout.splitlines()[:3]] == ["chunk 0", "chunk 1", "chunk 2"]
    frames, fps = read_mp4(out)
    local = pipeline.streaming()
    expected = stream(local, "cli", 2, seed=3)
    local.change("cli", action="left")
    expected.append(local.next_chunk("cli"))
    write_mp4(frames_of(expected), tmp_path / "expected.mp4", 16)
    assert frames.shape == (21, HEIGHT, WIDTH, 3) and fps == 16
    # H.264 is lossy: the same frames encoded here decode to the same pictures.
    assert np.array_equal(frames, read_mp4(tmp_path / "expected.mp4")[0])


def test_a_killed_sampler_ends_its_sessions_streams_at_once_and_new_sessions_play_once_it_is_back(served,
                                                                                                  client):
    """The sessions live in the sampler's process: killed, each playing stream ends UNAVAILABLE within
    seconds (not a hang); machgen serve loads the sampler again and a new session plays."""
    import os
    import signal
    import time

    import psutil

    from machgen.client import GenerationError
    from machgen.runtime.processes import instances_of, stub_of

    playing = client.open_session("tiny-stream", prompt=PROMPT, seed=9, height=HEIGHT, width=WIDTH)
    chunks = iter(playing)
    next(chunks)
    (triton,) = [child for child in psutil.Process(served.process.pid).children() if child.name() == "tritonserver"]
    stubs = instances_of("tiny-stream_sampler", [stub for stub in map(stub_of, triton.children()) if stub])
    for stub in stubs:
        os.kill(stub.pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(GenerationError) as ended:
        for _ in chunks:
            pass
    assert time.monotonic() - killed < 15 and "UNAVAILABLE" in ended.value.status, ended.value
    assert "the session went with it: open it again" in str(ended.value), ended.value
    deadline = time.monotonic() + 120
    while True:
        try:
            session = client.open_session("tiny-stream", prompt=PROMPT, seed=9, height=HEIGHT, width=WIDTH,
                                          chunks=1)
            again = list(session)
            break
        except GenerationError:
            assert time.monotonic() < deadline, "the sampler did not come back"
            time.sleep(1)
    assert len(again) == 1 and again[0].chunk == 0
    assert session.stop()["sessions"] == 0
