"""Realtime sessions (issue 60), in process, one run: the streaming engine
(runtime/streaming/) over a built model's exported streaming denoiser, its
session's chunks decoded as they finish, through LocalPipeline (no Triton).

    python perf/bench_realtime.py                          # a random Wan it writes (64x64, see below)
    python perf/bench_realtime.py --random tiny            # the streaming tests' tiny model (48x32)
    python perf/bench_realtime.py --model models/shapes-world
    python perf/bench_realtime.py --quick                  # a short smoke run
    python perf/bench_realtime.py --record perf/RESULTS.md

--model: a diffusers Wan folder whose machgen.json has a "streaming" section
(built into a scratch repository, or give --repository, built from it).
Without it the script writes a random-weight Wan at the size of the shapes
video default (models/shapes-wan: 4 layers, 4 heads of 32, ffn 384; the
tests' tiny text encoder and VAE), 64x64 frames at 8 fps, streaming as
Self-Forcing and LongLive do: chunks of 3 latent frames in 4 steps (1000,
750, 500, 250, shift 5), a sink of 3 frames and a window of 12. --random
tiny: the streaming tests' tiny model (families/wan/tiny.py
tiny_wan_streaming: chunks of 2 frames in 3 steps, sink 2, window 4; 48x32
at 16 fps), where per-call costs weigh more than the arithmetic.

What it measures:
1. One session alone, as fast as the calls go: time to its first chunk
   (open, prompt encoded, first chunk denoised and decoded), its frames per
   second after that, the real-time factor (generated fps / the model's fps).
2. K sessions at once (K = 1, 2, 4, 8): batched across sessions (one
   denoiser call carries a row of every session: the engine's max_rows=K)
   against the same sessions each in its own calls (max_rows=1, as open
   servers run them). Unpaced, once every session's cache is full (its
   sink and window), in rounds where both take turns: aggregate frames per
   second, where the time went (denoiser calls, decode), the ratio. Paced
   at the model's fps (max_ahead_s, sessions opened together): deadline
   misses, the worst lateness and the share of real time the calls took.
   Then the most sessions held at the model's fps with no deadline miss:
   batched and paced, 1, 2, 4, 6, 8, 12, ... sessions until one misses.
3. The cache against recomputing the whole prefix each chunk, at chunk 10
   and 40: our StreamingChunkDenoiser (families/wan/streaming.py) in torch
   eager with every earlier chunk cached, against diffusers'
   SkyReelsV2Transformer3DModel on the same weights, eager, one forward per
   step over all earlier clean chunks and the chunk with its block-causal
   mask (their way: no cache); also the cache with the card's sink and
   window, and the exported ONNX streaming denoiser with the whole cache.
   Time per chunk (its steps, plus the cached path's pass that writes the
   chunk's keys and values) and the two outputs' largest difference.
4. A fork against a new session that replays the parent's history: time to
   the child's first new chunk, and the cache memory it adds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import record  # noqa: E402

SECTION = "bench_realtime"
PROMPTS = ("a red circle moves to the right", "a blue square moves to the left", "a green triangle moves up",
           "a yellow circle moves down")
# The random model's streaming mode: Self-Forcing's chunks and steps, LongLive's sink and window.
RANDOM_STREAMING = {"chunk_frames": 3, "timesteps": [1000, 750, 500, 250], "shift": 5.0, "sink_frames": 3,
                    "window_frames": 12, "max_frames": 256,
                    "actions": {"left": "a red circle moves to the left", "right": "a red circle moves to the right"}}
GOAL_BATCHED_AT_8 = 2.0  # issue 60: batched against separate at K = 8, on these 2 cores


@dataclasses.dataclass(frozen=True)
class Plan:
    """How much each part runs (--quick shrinks it)."""

    ttfc_repeats: int = 5
    alone_chunks: int = 20
    sessions: tuple[int, ...] = (1, 2, 4, 8)
    chunks: int = 48  # unpaced: in all (at least ``min_chunks`` a session), once the caches are full
    min_chunks: int = 6
    rounds: int = 3
    paced_chunks: int = 6
    prefix_chunks: tuple[int, ...] = (10, 40)
    prefix_repeats: int = 3
    fork_after: int = 10
    # Sessions held at real time: batched and paced, more sessions until one misses a deadline.
    held_sessions: tuple[int, ...] = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48)
    held_chunks: int = 8


QUICK = Plan(ttfc_repeats=2, alone_chunks=3, sessions=(1, 2), chunks=4, min_chunks=2, rounds=1, paced_chunks=2,
             prefix_chunks=(3,), prefix_repeats=1, fork_after=2, held_sessions=(1, 2), held_chunks=2)


def write_random_model(folder: Path, scale: str) -> Path:
    """A random-weight Wan 2.1-layout pipeline with a card: at the shapes video default's transformer size
    (``shapes``), or the streaming tests' tiny model (``tiny``, its positions tabled far enough for chunk
    40)."""
    import diffusers
    import torch

    from machgen.families.wan.tiny import TINY_DEFAULTS, tiny_text_encoder_and_vae, tiny_wan_streaming

    if scale == "tiny":
        pipe, defaults, streaming = tiny_wan_streaming()
        streaming = {**streaming, "max_frames": max(streaming["max_frames"], 41 * streaming["chunk_frames"])}
    else:
        torch.manual_seed(0)
        tokenizer, text_encoder, vae = tiny_text_encoder_and_vae()
        transformer = diffusers.WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=32, in_channels=16, out_channels=16,
            text_dim=text_encoder.config.d_model, freq_dim=256, ffn_dim=384, num_layers=4, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", rope_max_seq_len=64)
        pipe = diffusers.WanPipeline(
            tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer.eval(),
            scheduler=diffusers.UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                        flow_shift=3.0))
        defaults = dataclasses.replace(TINY_DEFAULTS, height=64, width=64, max_height=128, max_width=128, fps=8)
        streaming = RANDOM_STREAMING
    pipe.save_pretrained(folder, safe_serialization=True)
    (folder / "machgen.json").write_text(json.dumps({"serving": defaults.to_json(), "streaming": streaming}))
    return folder


def transformer_size(model_dir: Path) -> str:
    config = json.loads((model_dir / "transformer" / "config.json").read_text())
    return (f"{config['num_layers']} layers, {config['num_attention_heads']} heads of {config['attention_head_dim']}, "
            f"ffn {config['ffn_dim']}")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def median(values) -> float:
    return float(statistics.median(values))


class TimedDenoiser:
    """The engine's run_component, counting the seconds its denoiser calls take."""

    def __init__(self, run_component):
        self.run_component = run_component
        self.seconds = 0.0
        self.calls = 0

    def __call__(self, name, inputs):
        start = time.perf_counter()
        try:
            return self.run_component(name, inputs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def new_engine(pipeline, **options):
    engine = pipeline.streaming(max_sessions=64, idle_timeout_s=3600.0, **options)
    engine.run_component = TimedDenoiser(engine.run_component)
    return engine


def open_sessions(engine, count: int, size: tuple[int, int], first_seed: int = 0) -> list[str]:
    ids = [f"s{first_seed + index}" for index in range(count)]
    for index, session_id in enumerate(ids):
        engine.open(session_id, PROMPTS[index % len(PROMPTS)], first_seed + index, *size)
    return ids


def run_wanted(engine, ids: list[str], chunks: int, poll_s: float = 0.002) -> list:
    """Asks every session for ``chunks`` more chunks and steps until they are made (waiting while pacing holds
    them back); the chunks made."""
    for session_id in ids:
        engine.want(session_id, chunks)
    made = []
    while any(engine.session(session_id).wants for session_id in ids):
        results = engine.step()
        if not results and not engine.next_rows():
            time.sleep(poll_s)
        made += results
    for session_id in ids:
        engine.session(session_id).outbox.clear()
    return made


# 1. One session alone

def alone(pipeline, size, plan: Plan) -> dict:
    engine = new_engine(pipeline, max_rows=1)
    run_wanted(engine, open_sessions(engine, 1, size, first_seed=100), 2)  # first calls' allocations
    firsts = []
    for repeat in range(plan.ttfc_repeats):
        session_id = f"first{repeat}"
        start = time.perf_counter()
        engine.open(session_id, PROMPTS[repeat % len(PROMPTS)], repeat, *size)
        engine.next_chunk(session_id)
        firsts.append(time.perf_counter() - start)
        if repeat:
            engine.close(session_id)
    latencies, frames = [], 0
    start = time.perf_counter()
    for _ in range(plan.alone_chunks):
        begin = time.perf_counter()
        frames += len(engine.next_chunk("first0").frames)
        latencies.append(time.perf_counter() - begin)
    seconds = time.perf_counter() - start
    fps = frames / seconds
    row = {"ttfc_ms": median(firsts) * 1e3, "ttfc_max_ms": max(firsts) * 1e3, "fps": fps,
           "realtime_factor": fps / engine.fps, "chunk_ms": median(latencies) * 1e3,
           "chunk_max_ms": max(latencies) * 1e3, "frames_per_chunk": frames / plan.alone_chunks,
           "model_fps": engine.fps}
    print(f"alone: first chunk {row['ttfc_ms']:.1f} ms (median of {plan.ttfc_repeats}), {fps:.1f} frames/s "
          f"= {row['realtime_factor']:.1f}x the model's {engine.fps} fps, {row['chunk_ms']:.1f} ms a chunk", flush=True)
    return row


# 2. K sessions at once

def full_cache_chunks(settings) -> int:
    """Chunks after which a session's cache stops growing (the sink and the window full); 1 without a window."""
    if settings.window_frames is None:
        return 1
    return (settings.sink_frames + settings.window_frames) // settings.chunk_frames + 1


def decode_seconds(made) -> float:
    """Seconds of decoding: each chunk's share of the decode calls it rode in (chunks finished by one
    denoiser call decode together)."""
    return sum(result.stats["decode_ms"] / result.stats["decoded_together"] for result in made) / 1e3


def unpaced(pipeline, size, sessions: int, rows: int, chunks: int) -> dict:
    engine = new_engine(pipeline, max_rows=rows)
    ids = open_sessions(engine, sessions, size)
    run_wanted(engine, ids, full_cache_chunks(engine.settings))  # not timed: the first chunks, caches filling
    denoiser = engine.run_component
    denoiser.seconds, denoiser.calls = 0.0, 0
    start = time.perf_counter()
    made = run_wanted(engine, ids, chunks)
    seconds = time.perf_counter() - start
    frames = sum(len(result.frames) for result in made)
    return {"fps": frames / seconds, "seconds": seconds, "denoise_s": denoiser.seconds,
            "decode_s": decode_seconds(made), "calls": denoiser.calls,
            "rows_per_call": len(made) * (len(engine.settings.timesteps) + 1) / max(1, denoiser.calls)}


def paced(pipeline, size, sessions: int, rows: int, chunks: int, max_ahead_s: float) -> dict:
    engine = new_engine(pipeline, max_rows=rows, max_ahead_s=max_ahead_s)
    warm = open_sessions(engine, 1, size, first_seed=200)  # allocations for this engine's shapes, then gone
    engine.max_ahead_s = None
    run_wanted(engine, warm, 1)
    engine.close(warm[0])
    engine.max_ahead_s = max_ahead_s
    engine.run_component.seconds = 0.0
    ids = open_sessions(engine, sessions, size)
    cpu, start = time.process_time(), time.perf_counter()
    made = run_wanted(engine, ids, chunks)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    busy = engine.run_component.seconds + decode_seconds(made)
    return {"misses": sum(engine.session(sid).deadline_misses for sid in ids), "chunks": len(made),
            "late_ms": max(result.stats["late_ms"] for result in made), "busy_share": busy / seconds,
            "cores": cpu / seconds}


def sessions_at_once(pipeline, size, plan: Plan, max_ahead_s: float) -> list[dict]:
    rows = []
    for count in plan.sessions:
        settings = {"batched": count, "separate": 1}
        runs = {label: [] for label in settings}
        for round_ in range(plan.rounds):  # each takes its turn first every other round
            for label in (list(settings) if round_ % 2 == 0 else list(settings)[::-1]):
                runs[label].append(unpaced(pipeline, size, count, settings[label],
                                           max(plan.min_chunks, plan.chunks // count)))
        row = {"sessions": count}
        for label, measured in runs.items():
            best = sorted(measured, key=lambda m: m["fps"])[len(measured) // 2]  # the median run
            row[label] = dict(best, fps=median([m["fps"] for m in measured]))
            row[label]["paced"] = paced(pipeline, size, count, settings[label], plan.paced_chunks, max_ahead_s)
        row["ratio"] = row["batched"]["fps"] / row["separate"]["fps"]
        row["denoise_ratio"] = row["separate"]["denoise_s"] / row["batched"]["denoise_s"]
        print(f"K={count}: batched {row['batched']['fps']:.1f} frames/s, separate {row['separate']['fps']:.1f} "
              f"({row['ratio']:.2f}x; denoiser calls alone {row['denoise_ratio']:.2f}x); misses paced "
              f"{row['batched']['paced']['misses']} / {row['separate']['paced']['misses']}", flush=True)
        rows.append(row)
    return rows


def most_sessions_held(pipeline, size, plan: Plan, max_ahead_s: float) -> dict:
    """The most sessions played at the model's frame rate with no deadline miss: batched (every session a row
    of each call), paced, opened together, ``held_chunks`` chunks each; counts tried in order until one
    misses."""
    held, tried = 0, []
    for count in plan.held_sessions:
        run = paced(pipeline, size, count, count, plan.held_chunks, max_ahead_s)
        tried.append({"sessions": count, **run})
        print(f"held at real time? {count} sessions: {run['misses']} misses of {run['chunks']} chunks, busy "
              f"{100 * run['busy_share']:.0f} %", flush=True)
        if run["misses"]:
            break
        held = count
    return {"held": held, "tried": tried}


# 3. The cache against recomputing the prefix

def cache_against_prefix(model_dir: Path, pipeline, size, plan: Plan) -> list[dict]:
    import diffusers
    import torch

    from machgen.families.wan.block_causal_reference import allowed_mask, dense_forward
    from machgen.families.wan.streaming import StreamingChunkDenoiser
    from machgen.runtime.streaming.kv_cache import CacheEntry, SessionCache, padded_rows

    engine = pipeline.streaming()
    settings, shape = engine.settings, engine.cache_shape
    frames = settings.chunk_frames
    needed = (max(plan.prefix_chunks) + 1) * frames
    transformer = diffusers.WanTransformer3DModel.from_pretrained(model_dir / "transformer",
                                                                  torch_dtype=torch.float32).eval()
    ours = StreamingChunkDenoiser(transformer, max(settings.max_frames, needed)).eval()
    # Their RoPE table is as long as rope_max_seq_len; a longer one is the same formula (families/wan/streaming.py).
    sky = diffusers.SkyReelsV2Transformer3DModel.from_pretrained(
        model_dir / "transformer", torch_dtype=torch.float32, num_frame_per_block=frames,
        rope_max_seq_len=max(transformer.config.rope_max_seq_len, needed)).eval()
    text = torch.as_tensor(engine.runtime.encode_prompts([PROMPTS[0]])["encoder_hidden_states"])
    latent_height, latent_width = engine.runtime.latent_size(*size)
    chunk_shape = (1, transformer.config.in_channels, frames, latent_height, latent_width)
    patch = transformer.config.patch_size
    sigmas = settings.sigmas()

    def call(run, latents, timestep, first_frame, cache):
        keys, values, valid = padded_rows([cache], shape.layers, shape.heads, shape.head_dim, latents)
        return run({"hidden_states": latents, "timestep": torch.tensor([[timestep]], dtype=torch.float32),
                    "frame_offset": torch.tensor([first_frame]), "encoder_hidden_states": text,
                    "past_keys": keys, "past_values": values, "past_valid": valid})

    def eager(inputs):
        return dict(zip(("noise_pred", "chunk_keys", "chunk_values"), ours(**inputs)))

    def onnx(inputs):
        return {name: torch.as_tensor(value) for name, value in
                pipeline.run_component("streaming_denoiser", inputs).items()}

    def cached_chunk(run, cache, first_frame, noise):
        """A chunk's steps attending to ``cache``, then its pass writing its keys and values."""
        latents = noise[0]
        for step, sigma in enumerate(sigmas):
            predicted = torch.as_tensor(call(run, latents, sigma * 1000, first_frame, cache)["noise_pred"])
            clean = latents - sigma * predicted
            if step + 1 < len(sigmas):
                latents = (1 - sigmas[step + 1]) * clean + sigmas[step + 1] * noise[step + 1]
        call(run, clean, settings.context_timestep, first_frame, cache)
        return clean

    def sky_forward(whole, timesteps):
        """diffusers' SkyReels-V2 forward with its block-causal mask; for one-frame chunks, where that forward
        applies no mask (every frame would see the future), its blocks under the frame-causal mask passed in."""
        if frames > 1:
            return sky(whole, timesteps, text, enable_diffusion_forcing=True, return_dict=False)[0]
        count = whole.shape[2]
        whole_sequence = dataclasses.replace(settings, sink_frames=0, window_frames=None)
        allowed = allowed_mask(list(range(count)), 1, whole_sequence,
                               (latent_height // patch[1]) * (latent_width // patch[2]))
        return dense_forward(sky, whole, timesteps, text, torch.arange(count), allowed)

    def recomputed_chunk(prefix, noise):
        """SkyReels-V2's way: every step one forward over the clean prefix and the chunk, block-causal mask."""
        latents = noise[0]
        count = prefix.shape[2]
        for step, sigma in enumerate(sigmas):
            timesteps = torch.tensor([settings.context_timestep] * count + [sigma * 1000] * frames).reshape(1, -1)
            out = sky_forward(torch.cat([prefix, latents], dim=2), timesteps)[:, :, -frames:]
            clean = latents - sigma * out
            if step + 1 < len(sigmas):
                latents = (1 - sigmas[step + 1]) * clean + sigmas[step + 1] * noise[step + 1]
        return clean

    def timed(functions: dict, repeats: int) -> dict:
        """Median milliseconds and last result of each function, run in turns (a drift of the shared machine's
        speed then weighs on each alike), after one call each."""
        times, results = {name: [] for name in functions}, {}
        for name, function in functions.items():
            function()
        for _ in range(repeats):
            for name, function in functions.items():
                start = time.perf_counter()
                results[name] = function()
                times[name].append(time.perf_counter() - start)
        return {name: (median(times[name]) * 1e3, results[name]) for name in functions}

    rows = []
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for chunk in plan.prefix_chunks:
            prefix = torch.randn(*chunk_shape[:2], chunk * frames, *chunk_shape[3:], generator=generator)
            noise = [torch.randn(*chunk_shape, generator=generator) for _ in sigmas]
            whole = SessionCache(dataclasses.replace(settings, sink_frames=0, window_frames=None))
            for index in range(chunk):  # every earlier chunk's keys and values, each written after those before it
                clean = prefix[:, :, index * frames:(index + 1) * frames]
                out = call(eager, clean, settings.context_timestep, index * frames, whole)
                whole.append(CacheEntry(index * frames, out["chunk_keys"][0], out["chunk_values"][0], clean))
            windowed = SessionCache(settings, [entry for entry in whole.entries
                                               if settings.kept(entry.first_frame, chunk * frames)])
            first = chunk * frames
            row = {"chunk": chunk, "cached_tokens": whole.tokens, "window_tokens": windowed.tokens,
                   "frame_causal": frames == 1}
            measured = timed({"eager": lambda: cached_chunk(eager, whole, first, noise),
                              "window": lambda: cached_chunk(eager, windowed, first, noise),
                              "onnx": lambda: cached_chunk(onnx, whole, first, noise),
                              "sky": lambda: recomputed_chunk(prefix, noise)}, plan.prefix_repeats)
            row.update({f"{name}_ms": milliseconds for name, (milliseconds, _) in measured.items()})
            ours_clean, onnx_clean, sky_clean = (measured[name][1] for name in ("eager", "onnx", "sky"))
            row["difference"] = float((ours_clean - sky_clean).abs().max())
            row["onnx_difference"] = float((onnx_clean - sky_clean).abs().max())
            print(f"chunk {chunk}: cached eager {row['eager_ms']:.1f} ms, window {row['window_ms']:.1f} ms, ONNX "
                  f"{row['onnx_ms']:.1f} ms, SkyReels recompute {row['sky_ms']:.1f} ms; max |cached - SkyReels| "
                  f"{row['difference']:.1e}", flush=True)
            rows.append(row)
    return rows


# 4. A fork against a replay

def fork_against_replay(pipeline, size, plan: Plan) -> list[dict]:
    """Per change (a new seed: the child shares every cached entry; an action, where the model has some: a
    prompt switch, which re-caches the kept entries under the new prompt), the fork and the replay."""
    engine = new_engine(pipeline, max_rows=1)
    settings = engine.settings
    changes = [{"seed": 99}] + ([{"action": sorted(settings.actions)[0]}] if settings.actions else [])
    run_wanted(engine, open_sessions(engine, 1, size, first_seed=300), 2)  # first calls' allocations
    engine.close("s300")
    engine.open("parent", PROMPTS[0], 5, *size)
    for _ in range(plan.fork_after):
        engine.next_chunk("parent")
    parent_bytes = engine.cache_bytes()
    rows = []
    for change in changes:
        start = time.perf_counter()
        engine.fork("parent", "child", **change)
        forked = engine.next_chunk("child")
        fork_s = time.perf_counter() - start
        with_child = engine.cache_bytes()
        engine.close("child")

        start = time.perf_counter()
        engine.open("replay", PROMPTS[0], 5, *size)
        for _ in range(plan.fork_after):
            engine.next_chunk("replay")
        engine.change("replay", **change)
        replayed = engine.next_chunk("replay")
        replay_s = time.perf_counter() - start
        with_replay = engine.cache_bytes()
        engine.close("replay")
        row = {"after": plan.fork_after, "change": ", ".join(f"{k} {v}" for k, v in change.items()),
               "fork_ms": fork_s * 1e3, "replay_ms": replay_s * 1e3, "parent_bytes": parent_bytes,
               "fork_added": with_child - parent_bytes, "replay_added": with_replay - parent_bytes,
               "difference": float((forked.latents - replayed.latents).abs().max())}
        print(f"fork after {plan.fork_after} chunks ({row['change']}): child's first chunk {row['fork_ms']:.1f} ms, "
              f"replay {row['replay_ms']:.1f} ms; cache added {row['fork_added']} B against {row['replay_added']} B "
              f"(parent {parent_bytes} B); max |fork - replay| {row['difference']:.1e}", flush=True)
        rows.append(row)
    return rows


def tables(header: str, first: dict, together: list[dict], held: dict, prefix: list[dict], forks: list[dict],
           max_ahead_s: float) -> str:
    lines = [header, "",
             "One session alone, unpaced:", "",
             "| first chunk ms (median, worst) | ms a chunk (median, worst) | frames a chunk | frames/s | "
             "model fps | real-time factor |", "| --- | --- | --- | --- | --- | --- |",
             f"| {first['ttfc_ms']:.1f} ({first['ttfc_max_ms']:.1f}) | {first['chunk_ms']:.1f} "
             f"({first['chunk_max_ms']:.1f}) | {first['frames_per_chunk']:g} | {first['fps']:.1f} | "
             f"{first['model_fps']} | **{first['realtime_factor']:.1f}x** |", "",
             "K sessions at once: batched (one denoiser call carries a row of every session, max_rows=K) against "
             "separate (each session's rows in its own calls, max_rows=1). Unpaced, once every session's cache is "
             "full: aggregate frames/s (median of the rounds), rows per denoiser call, and the seconds of that "
             "run in denoiser calls and in decoding; paced at the model's "
             f"fps (sessions opened together, max_ahead_s={max_ahead_s:g}): deadline misses over the chunks, the "
             "worst lateness, the share of wall time in denoiser calls and decoding, the CPU cores the process "
             "used. At K = 1 both modes are the same configuration: their difference is the run's noise. The "
             "chunks one denoiser call finishes decode together (one VAE decoder call a latent frame for all of "
             "them, each with its session's cache): batched, a chunk of every session finishes in the same "
             "call.", "",
             "| K | mode | frames/s | batched / separate | rows per call | denoise s | decode s | paced: misses / "
             "chunks | worst late ms | busy share | CPU cores |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in together:
        for label in ("batched", "separate"):
            m, p = row[label], row[label]["paced"]
            ratio = f"**{row['ratio']:.2f}x** (denoiser {row['denoise_ratio']:.2f}x)" if label == "batched" else ""
            lines.append(f"| {row['sessions']} | {label} | {m['fps']:.1f} | {ratio} | {m['rows_per_call']:.1f} | "
                         f"{m['denoise_s']:.2f} | {m['decode_s']:.2f} | {p['misses']} / {p['chunks']} | "
                         f"{p['late_ms']:.0f} | {100 * p['busy_share']:.0f} % | {p['cores']:.2f} |")
    at_8 = [row for row in together if row["sessions"] == 8]
    if at_8:
        lines += ["", f"Goal (issue 60): batched at least {GOAL_BATCHED_AT_8:g}x separate at K = 8: "
                      f"{'met' if at_8[0]['ratio'] >= GOAL_BATCHED_AT_8 else 'not met'} ({at_8[0]['ratio']:.2f}x)."]
    lines += ["", "The most sessions held at the model's frame rate: batched, paced as above, opened together, "
                  "each playing its chunks; more sessions until one misses a deadline.", "",
              "| sessions | misses / chunks | worst late ms | busy share | CPU cores |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {run['sessions']} | {run['misses']} / {run['chunks']} | {run['late_ms']:.0f} | "
              f"{100 * run['busy_share']:.0f} % | {run['cores']:.2f} |" for run in held["tried"]]
    at_least = "at least " if held["tried"] and not held["tried"][-1]["misses"] else ""
    lines += ["", f"Held with no deadline miss: **{at_least}{held['held']} sessions** "
                  f"({held['held'] * first['model_fps']} frames/s in all, {first['model_fps']} each)."]
    lines += ["", "The cache against recomputing the whole prefix each chunk (diffusers' SkyReels-V2 way), per chunk "
                  "at chunk index N (N earlier chunks): its steps, plus the cached paths' pass writing the chunk's "
                  "keys and values. Eager: torch, the same weights; difference: the chunk's clean latents against "
                  "SkyReels' (same noise, same prefix)"
                  + (". One-frame chunks: SkyReels-V2's blocks under the frame-causal mask passed in (its forward "
                     "applies none to one-frame blocks)" if any(row["frame_causal"] for row in prefix) else "") + ".", "",
              "| chunk | cached tokens | cached, eager ms | sink + window, eager ms | cached, ONNX ms | SkyReels "
              "recompute, eager ms | recompute / cached (eager) | max difference (eager, ONNX) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in prefix:
        lines.append(f"| {row['chunk']} | {row['cached_tokens']} | {row['eager_ms']:.1f} | {row['window_ms']:.1f} "
                     f"({row['window_tokens']} tokens) | {row['onnx_ms']:.1f} | {row['sky_ms']:.1f} | "
                     f"**{row['sky_ms'] / row['eager_ms']:.1f}x** | {row['difference']:.1e}, "
                     f"{row['onnx_difference']:.1e} |")
    lines += ["", f"A fork after {forks[0]['after']} chunks against a new session replaying the history (open, "
                  f"{forks[0]['after']} chunks, the same change), per change: time to the child's first new chunk; "
                  "the KV cache it adds to the engine's (engine.cache_bytes(): a tensor shared by forks counted "
                  f"once; the parent's: {forks[0]['parent_bytes']:,} bytes); the two new chunks' largest difference. "
                  "An action is a prompt switch: the child re-caches the kept entries under its prompt, so shares "
                  "less.", "",
              "| change | fork ms | replay ms | replay / fork | fork adds bytes | replay adds bytes | difference |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for fork in forks:
        lines.append(f"| {fork['change']} | {fork['fork_ms']:.1f} | {fork['replay_ms']:.1f} | "
                     f"**{fork['replay_ms'] / fork['fork_ms']:.1f}x** | {fork['fork_added']:,} | "
                     f"{fork['replay_added']:,} | {fork['difference']:.1e} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a diffusers Wan folder with a streaming section (default: a "
                                                   "random one written here)")
    parser.add_argument("--random", choices=("shapes", "tiny"), default="shapes",
                        help="without --model: the random model's size (shapes: the shapes video default's "
                             "transformer at 64x64; tiny: the streaming tests' tiny model at 48x32)")
    parser.add_argument("--repository", type=Path, help="a repository already built from --model")
    parser.add_argument("--name", default="realtime", help="the model's name in the repository")
    parser.add_argument("--size", help="HxW of the sessions (default: the model's served size)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS") or
                                                            len(os.sched_getaffinity(0))),
                        help="torch and ONNX Runtime threads (default: $OMP_NUM_THREADS, else the cores)")
    parser.add_argument("--max-ahead", type=float, default=0.5,
                        help="paced runs: how far ahead of its next frame's deadline a session may run (s)")
    parser.add_argument("--quick", action="store_true", help="a short smoke run: K = 1, 2, a few chunks")
    parser.add_argument("--record", type=Path, help="write the tables into this markdown file")
    args = parser.parse_args()
    if args.repository and not args.model:
        parser.error("--repository needs --model (the folder it was built from: part 3 loads its weights)")
    if args.size and not re.fullmatch(r"\d+x\d+", args.size):
        parser.error(f"--size: HxW in pixels, such as 64x64, not {args.size!r}")
    if args.max_ahead < 0:
        parser.error(f"--max-ahead: seconds, at least 0, not {args.max_ahead}")
    if args.threads < 1:
        parser.error(f"--threads: at least 1, not {args.threads}")
    if args.model:
        from machgen.builder.model_folder import streaming_settings

        if not (args.model / "transformer" / "config.json").is_file():
            parser.error(f"--model: {args.model} is not a diffusers Wan folder (no transformer/config.json)")
        if streaming_settings(args.model) is None:
            parser.error(f"--model: {args.model}/machgen.json declares no \"streaming\" section (docs/realtime.md)")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from machgen.builder.build import build_repository
    from machgen.runtime.local import LocalPipeline

    plan = QUICK if args.quick else Plan()
    started, load = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="machgen-bench-realtime-") as scratch:
        model_dir = args.model or write_random_model(Path(scratch) / "random-wan-streaming",
                                                          args.random)
        repository = args.repository
        if repository is None:
            repository = Path(scratch) / "repository"
            print(f"building {model_dir}", flush=True)
            build_repository(model_dir, args.name, repository, log=lambda line: None, preview=False)
        with LocalPipeline(repository, args.name, intra_op_threads=args.threads) as pipeline:
            defaults = pipeline.manifest.defaults
            size = tuple(int(v) for v in args.size.split("x")) if args.size else (defaults.height, defaults.width)
            first = alone(pipeline, size, plan)
            together = sessions_at_once(pipeline, size, plan, args.max_ahead)
            held = most_sessions_held(pipeline, size, plan, args.max_ahead)
            prefix = cache_against_prefix(model_dir, pipeline, size, plan)
            forks = fork_against_replay(pipeline, size, plan)
            settings = pipeline.streaming().settings
        size_text = transformer_size(model_dir)
    label = args.model.name if args.model else f"random Wan, {args.random} size"
    model_text = (f"Model `{args.model}`" if args.model else
                  f"A random-weight Wan written by the script ({args.random} size: "
                  + ("the shapes video default's transformer, the tests' tiny text encoder and VAE)"
                     if args.random == "shapes" else "the streaming tests' tiny model)"))
    model_text += f", its transformer {size_text}"
    header = (f"{model_text}, {size[0]}x{size[1]}, streaming: chunks of {settings.chunk_frames} latent frames, "
              f"steps {', '.join(f'{t:g}' for t in settings.timesteps)} (shift {settings.shift:g}), sink "
              f"{settings.sink_frames}, window {settings.window_frames or 'none'}; ONNX Runtime target in process "
              f"(LocalPipeline, no Triton){' --quick' if args.quick else ''}. {len(os.sched_getaffinity(0))} CPU "
              f"cores ({cpu_model()}), {args.threads} threads (torch and ONNX Runtime), load average "
              f"{load:.2f} at the start, measured {time.strftime('%Y-%m-%d %H:%M')}, "
              f"{time.perf_counter() - started:.0f} s in all.")
    table = tables(header, first, together, held, prefix, forks, args.max_ahead)
    print(table)
    if args.record:
        record(args.record, f"{SECTION}:{label}", table, "Realtime sessions (perf/bench_realtime.py)")
        print(f"recorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
