"""The per-model serving knobs a build writes into the generated configs (``machgen-build build``'s options;
machgen/builder/repository.py renders them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServingOptions:
    """Per-model serving knobs written into the generated configs.

    Batching across requests comes from two settings together: several
    requests are in flight at once (the sampler runs each one's loop on its
    own thread, mostly waiting on component calls), and every component
    model has Triton's dynamic batcher, so the calls of all in-flight
    requests that reach a component together run as one forward (per
    denoising step: requests join and leave at step boundaries).
    """

    # Requests in flight at once: instances of the public model, each a
    # small relaying process (one sampler process runs all their loops).
    in_flight: int = 8
    # Requests waiting for a free instance beyond that; more are refused
    # with UNAVAILABLE instead of queueing without bound. Those of the
    # streaming twin (NAME_stream, what the HTTP API calls) wait at the
    # sampler's step gate, where priority and owner decide whose denoising
    # steps run (runtime/scheduling.py); the public model's wait in Triton's
    # queue, first come, first served.
    max_queue_size: int = 64
    # Batch requests' minimum share of denoiser time while interactive ones wait too.
    batch_min_share: float = 0.1
    # Forwards each component runs at once (one ONNX Runtime session each).
    # Two on the 2-core CPU: with one, the tail forward was the serial
    # bottleneck (1.66 of 2 cores busy at concurrency 8, 11.6 requests/s);
    # with two, 1.97 cores and 13.9 requests/s (perf/RESULTS.md).
    component_instances: int = 2
    # A denoiser call of several rows (a video's two guidance rows) while
    # instances idle is cut over them, so a request alone uses every core
    # (runtime/spread.py; the onnxruntime target only). Busy servers send calls whole.
    spread_rows: bool = True
    # False: components run each call alone (no dynamic batcher): the
    # baseline the batching benchmark compares against.
    batching: bool = True
    # Rows one forward may carry (a true-CFG request sends two per denoiser call).
    max_batch_size: int = 16
    # How long a per-step call (denoiser) waits for calls of other requests,
    # and the same for once-per-request stages (text encoders, VAE decoder).
    # 0: no waiting; calls that queue while a forward runs still go together
    # (3.1 rows per tail forward at concurrency 8 on the shapes model). On the
    # CPU a wait only adds latency: the tiny model took 65 ms a request at
    # 500/2000 us, 49 ms at 0, with no throughput gained.
    step_queue_delay_us: int = 0
    stage_queue_delay_us: int = 0
    # ONNX Runtime threads per component session; 0: one per core the server
    # may use. One is for throughput with small images: a lone shapes-model
    # request (64x64) ran no faster with two (183 ms either way) while the
    # second thread took the core that concurrent requests need. Large
    # images at low concurrency want 0 (tiny model at 256x256: 1.75 s a
    # request with one thread, 1.01 s with two).
    intra_op_threads: int = 1
    # ONNX Runtime threads of a once-per-request stage's call (text encoders,
    # VAE encoder and decoders) while its request is the only one the
    # sampler runs; 0: one per core the server may use, 1 (or no more than
    # intra_op_threads): off. Each such component instance keeps a second
    # session of this width (its weights twice in memory), used for the
    # input shapes on which it gave the one-thread session's outputs bit for
    # bit (runtime/onnx_runner.CheckedWideRunner). The denoiser's rows are
    # spread instead (spread_rows). Measured: a lone 17-frame clip of
    # shapes-wan decodes in about 130 ms instead of 190 (perf/RESULTS.md).
    lone_stage_threads: int = 0
    # A request that runs alone computes its denoiser steps in the sampler's
    # own process (onnxruntime target): on as many one-ONNX-Runtime-session
    # copies of the joined head and tail (fused_chains) as a call's rows are
    # spread over, opened as the instances open theirs, so its output is
    # what the instances would give. Its steps skip the BLS round trips: a
    # lone shapes-wan clip's computed step 22 ms -> 16 ms, the clip 409 ->
    # 326 ms (perf/RESULTS.md). Costs the denoiser's weights once more per
    # session in the sampler process.
    lone_steps_in_sampler: bool = True
    # With lone_steps_in_sampler, the OS nice value (1-19) of the joined
    # denoiser's Triton instances; 0: off. Their calls are then batch work
    # (and interactive requests' when several run at once), while the one
    # interactive request among batch ones computes its steps on the
    # sampler's own sessions at the server's priority, on every core, with no
    # slot at the step gate: the batch calls take the cores it leaves (Linux
    # gives a thread at nice 10 about a tenth of a core that one at 0 wants),
    # and the batch requests lose less throughput than beside it at the gate.
    # Measured on shapes-flux under an agent's burst of 48 (perf/RESULTS.md).
    denoiser_nice: int = 10
    # Seconds without a request after which an onnxruntime component gives back the memory its runs grew (0: never).
    idle_release_s: float = 10.0
    # Prompts whose text-encoder outputs the sampler keeps, shared by its requests (0: none).
    prompt_cache_size: int = 256
    # Steps between the previews NAME_stream sends when a request does not
    # say (0: none). A preview is a least-squares projection of the predicted
    # clean latents (runtime/preview.py): well under a millisecond.
    preview_interval: int = 4
    # Per-request LoRA adapters (machgen-build lora add): the largest rank an
    # added adapter may have; 0 builds the denoiser without adapter inputs
    # (what a model serving no adapters saves: perf/bench_lora.py).
    max_lora_rank: int = 0
    # Adapters each denoiser component process keeps in memory (least recently used leave first).
    max_loras: int = 8
    # Realtime sessions (a model built with a streaming mode; docs/realtime.md): sessions open at once,
    # seconds one may go unread and unsteered before it is closed, megabytes of keys and values all sessions
    # may cache, the most sessions' chunks one streaming denoiser call carries, and the seconds a chunk may be
    # made before its first frame is due beyond the time making it takes (a key waits that much more).
    max_sessions: int = 8
    session_idle_s: float = 60.0
    session_memory_mb: int = 1024
    session_rows: int = 8
    session_lead_s: float = 0.5
