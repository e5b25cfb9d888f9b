"""Parallel layouts on CPU ranks (gloo): what they send, what control costs,
what the ring's overlap hides, and a step-time model for NVLink GPUs.

1. bytes: each rank's sent bytes in one self-attention layer, counted at the
   collectives, next to the formulas (per layer, S tokens, hidden = heads x
   head_dim, e bytes an element): Ulysses 4(k-1)/k^2 x S x hidden x e, ring
   2(k-1)/k x S x hidden x e, USP the sum over its two axes.
2. control: a ``RankPool`` call that does no work (the parent sends a call's
   message to every rank and collects their answers): p50 and p99.
3. overlap: ring attention with the next block in flight while the current
   one is computed, against the same ring waiting for each block first; and
   Ulysses with its heads in two groups (the second group's exchange in
   flight while the first is computed, the first's output leaving while the
   second is), against one exchange each way; and four Ulysses layers with
   their values sent first (parallel/values_first.py) against diffusers'
   order (V projected last).
4. model: a step's time on 1, 2, 4 and 8 GPUs over NVLink at Flux 1024^2
   and Wan 720p, from the step's FLOPs (linear layers and attention) and
   the Ulysses bytes above, calibrated on a published one-GPU time. No
   multi-GPU machine ran this: the model is arithmetic, stated as such.
5. decode: parallel VAE decode (parallel/rows.py), Wan 2.1's VAE on 1, 2
   and 4 ranks: time, each rank's largest activation and memory growth,
   bytes sent (halo rows, the mid-block's keys), the frames against one rank's.
6. quality (``--parts quality``, slow: an export and dozens of clips): the
   trained video default (models/shapes-wan) built for the torch target
   with a parallel layout, run in process under each layout it allows on
   held-out prompts with its served settings (calibrated cache reuse on):
   PSNR against one rank over every frame, mean and worst clip, and the
   detector's accuracy (colour, shape, direction) per layout; the stale-keys
   layouts (DistriFusion, not exact) with the share of calls on stale keys.

    python perf/bench_parallel.py --record perf/RESULTS.md
    python perf/bench_parallel.py --parts quality --count 8 --record perf/RESULTS.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import record  # noqa: E402

SECTION = "bench_parallel"


# --- run on the ranks ------------------------------------------------------------------------------------------

def _counting(sent: list[int]):
    """torch.distributed's collectives wrapped to add what this rank sends to ``sent``."""
    import torch.distributed as dist

    all_to_all, batch, gather = dist.all_to_all_single, dist.batch_isend_irecv, dist.all_gather

    def all_to_all_single(output, input, *args, group=None, **kwargs):
        degree = dist.get_world_size(group)
        sent[0] += input.numel() * input.element_size() * (degree - 1) // degree  # its own slice stays
        return all_to_all(output, input, *args, group=group, **kwargs)

    def batch_isend_irecv(ops):
        sent[0] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return batch(ops)

    def all_gather(tensors, tensor, group=None, **kwargs):
        sent[0] += tensor.numel() * tensor.element_size() * (dist.get_world_size(group) - 1)
        return gather(tensors, tensor, group=group, **kwargs)

    dist.all_to_all_single, dist.batch_isend_irecv, dist.all_gather = all_to_all_single, batch_isend_irecv, all_gather


def layer_bytes(mesh, tokens: int, heads: int, dim: int) -> int:
    """Bytes this rank sends in one sequence-parallel attention over ``tokens`` (float32)."""
    import torch

    from machgen.parallel.usp import sequence_parallel_attention

    sent = [0]
    _counting(sent)
    local = tokens // mesh.layout.sequence_degree
    q, k, v = (torch.randn(1, local, heads, dim) for _ in range(3))
    sequence_parallel_attention(q, k, v, mesh)
    return sent[0]


def overlap_times(mesh, tokens: int, heads: int, dim: int, repeats: int) -> dict[str, float]:
    """Median seconds of sequence-parallel attention, overlapped and serialized, alternating."""
    import torch
    import torch.distributed as dist

    from machgen.parallel.usp import sequence_parallel_attention

    local = tokens // mesh.layout.sequence_degree
    q, k, v = (torch.randn(1, local, heads, dim) for _ in range(3))
    times: dict[str, list[float]] = {"overlapped": [], "serialized": []}
    for _ in range(repeats):
        for mode in times:
            dist.barrier()
            start = time.perf_counter()
            sequence_parallel_attention(q, k, v, mesh, overlap=mode == "overlapped")
            dist.barrier()
            times[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(values) for mode, values in times.items()}


def decode_by_rows(mesh, height: int, width: int, frames: int) -> dict:
    """Wan 2.1's VAE (its architecture, seeded random weights) decoding a seeded clip's latents split by rows
    over the ranks (parallel/rows.py): this rank's band of frames, seconds, bytes sent, the most elements a
    convolution read and its resident memory's growth during the decode."""
    import resource

    import diffusers
    import torch

    from machgen.families.wan.vae_chunks import SplitVaeDecoderFirst, SplitVaeDecoderNext, chunk_layout
    from machgen.parallel.state import set_mesh, split_sequence

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan().eval()
    factor = vae.config.scale_factor_spatial
    latents = torch.randn(1, vae.config.z_dim, (frames - 1) // vae.config.scale_factor_temporal + 1,
                          height // factor, width // factor, generator=torch.Generator().manual_seed(1))
    band = latents.chunk(mesh.layout.world_size, dim=3)[mesh.rank]
    layout = chunk_layout(vae, "decoder", {"decoder": (SplitVaeDecoderFirst, SplitVaeDecoderNext)})
    first, following = SplitVaeDecoderFirst(vae), SplitVaeDecoderNext(vae, *layout)
    widest, sent = [0], [0]
    for conv in (sub for sub in vae.decoder.modules() if isinstance(sub, torch.nn.Conv3d)):
        conv.register_forward_pre_hook(lambda module, args: widest.__setitem__(0, max(widest[0], args[0].numel())))
    _counting(sent)
    set_mesh(mesh)
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * resource.getpagesize()
    start = time.perf_counter()
    with split_sequence(True), torch.no_grad():
        decoded, cache = first(band[:, :, :1])
        decoded = [decoded]
        for index in range(1, band.shape[2]):
            chunk, cache = following(band[:, :, index:index + 1], cache)
            decoded.append(chunk)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"frames": torch.cat(decoded, dim=2), "seconds": seconds, "sent": sent[0], "widest": widest[0],
            "growth": peak - resident}


def idle_handler(mesh):
    return lambda message: None


# --- the parent ------------------------------------------------------------------------------------------------

def ulysses_formula(k: int, tokens: int, hidden: int, element: int) -> float:
    return 4 * (k - 1) / k ** 2 * tokens * hidden * element


def ring_formula(k: int, tokens: int, hidden: int, element: int) -> float:
    return 2 * (k - 1) / k * tokens * hidden * element


def bytes_table(tokens: int, heads: int, dim: int) -> str:
    from machgen.parallel.layout import ParallelLayout
    from machgen.parallel.ranks import run_on_ranks

    hidden = heads * dim
    rows = ["| layout | sent per rank per layer (measured) | formula | ratio |", "| --- | --- | --- | --- |"]
    for text in ("ulysses=2", "ulysses=4", "ring=2", "ring=4", "ulysses=2,ring=2"):
        layout = ParallelLayout.parse(text)
        measured = max(run_on_ranks(layout, "bench_parallel:layer_bytes", tokens, heads, dim))
        # USP: the Ulysses exchange over the S/r tokens of a ring chunk, then the ring over the ring group's
        # chunks, of 1/u of the heads (hidden/u).
        formula = (ulysses_formula(layout.ulysses, tokens // layout.ring, hidden, 4) if layout.ulysses > 1 else 0) + \
            (ring_formula(layout.ring, tokens, hidden // layout.ulysses, 4) if layout.ring > 1 else 0)
        rows.append(f"| {layout} | {measured / 2**20:.3f} MiB | {formula / 2**20:.3f} MiB | "
                    f"{measured / formula:.3f} |")
    return "\n".join(rows)


def control_table(calls: int) -> str:
    from machgen.parallel.layout import ParallelLayout
    from machgen.parallel.ranks import RankPool

    from timing import clock_ms

    rows = ["| ranks | p50 | p99 |", "| --- | --- | --- |"]
    for degree in (2, 4):
        with RankPool(ParallelLayout(ring=degree), "bench_parallel:idle_handler") as pool:
            times = clock_ms(lambda: pool.call("nothing"), calls, warmup=20)
        rows.append(f"| {degree} | {times[len(times) // 2]:.3f} ms | {times[int(len(times) * 0.99)]:.3f} ms |")
    return "\n".join(rows)


def overlap_table(tokens: int, heads: int, dim: int, repeats: int) -> str:
    from gpu_parallel import stale_rows, values_first_rows

    from machgen.parallel.layout import ParallelLayout
    from machgen.parallel.ranks import run_on_ranks

    rows = ["| layout | tokens | overlapped (s) | serialized (s) | serialized / overlapped |",
            "| --- | --- | --- | --- | --- |"]
    for text in ("ring=2", "ring=4", "ulysses=2", "ulysses=4"):
        layout = ParallelLayout.parse(text)
        results = run_on_ranks(layout, "bench_parallel:overlap_times", tokens, heads, dim, repeats)
        overlapped = max(r["overlapped"] for r in results)
        serialized = max(r["serialized"] for r in results)
        rows.append(f"| {layout} | {tokens} | {overlapped:.4f} | {serialized:.4f} | "
                    f"{serialized / overlapped:.2f}x |")
    # Stale keys (not exact): the exchange left in flight for the rest of a step, against the exact ring.
    rows += [""] + stale_rows((2, 4), lambda degree: (tokens,), lambda layout, count: run_on_ranks(
        layout, "gpu_parallel:stale_times", count, heads, dim, repeats, 8, "cpu"))
    # Values first: V's exchange started before Q and K are projected, against diffusers' order.
    rows += [""] + values_first_rows((2,), lambda degree: (tokens,), lambda layout, count: run_on_ranks(
        layout, "gpu_parallel:values_first_times", count, heads, dim, repeats, 4, "cpu"))
    return "\n".join(rows)


def decode_table(height: int, width: int, frames: int) -> str:
    """Parallel VAE decode by rows: Wan 2.1's VAE on 1, 2 and 4 ranks, against one rank's frames."""
    import torch

    from machgen.parallel.layout import ParallelLayout
    from machgen.parallel.ranks import run_on_ranks

    rows = ["| ranks | decode s (slowest rank) | largest convolution input per rank | resident growth per rank "
            "(largest) | halo and keys sent per rank | max difference to one rank |",
            "| --- | --- | --- | --- | --- | --- |"]
    whole = None
    for degree in (1, 2, 4):
        results = run_on_ranks(ParallelLayout(ring=degree), "bench_parallel:decode_by_rows", height, width, frames)
        decoded = torch.cat([torch.as_tensor(result["frames"]) for result in results], dim=3)
        whole = decoded if whole is None else whole
        difference = (decoded - whole).abs().max().item() * 127.5  # [-1, 1] in levels of 255
        widest = max(result["widest"] for result in results)
        rows.append(f"| {degree} | {max(result['seconds'] for result in results):.1f} | "
                    f"{widest * 4 / 2**20:.1f} MiB | {max(result['growth'] for result in results) / 2**20:.0f} MiB | "
                    f"{max(result['sent'] for result in results) / 2**20:.2f} MiB | {difference:.4f} / 255 |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


# A step's work, from the models' configs (bf16, 2 bytes an element). FLOPs: 2 x parameters x tokens for the
# linear layers, 4 x tokens^2 x hidden per layer for attention (QK^T and PV), times the forwards per step.
MODELS = {
    # FLUX.1-dev, 1024x1024: 4096 image + 512 text tokens, 19 + 38 blocks, hidden 3072 (24 x 128), 11.9 B
    # parameters, guidance distilled (one forward a step); xDiT's H100 figures, 28 steps: 4.30 s on one GPU,
    # 1.63 s with Ulysses-4.
    "Flux.1-dev 1024x1024": dict(tokens=4608, layers=57, hidden=3072, heads=24, params=11.9e9, forwards=1,
                                  steps=28, published={1: 4.30, 4: 1.63}),
    # Wan 2.2 A14B, 1280x720, 81 frames: latents 21 x 90 x 160, patches 1x2x2 -> 75600 tokens; 40 layers,
    # hidden 5120 (40 x 128), 14 B parameters an expert, CFG (two forwards a step), 40 steps.
    "Wan 2.2 A14B 720p": dict(tokens=75600, layers=40, hidden=5120, heads=40, params=14e9, forwards=2,
                               steps=40, published={}),
}
NVLINK_BYTES_S = 450e9  # H100/H200 SXM: 900 GB/s NVLink, each direction half
DENSE_BF16_FLOPS = 989e12  # H100 SXM dense BF16; H200 the same compute
ASSUMED_MFU = 0.5  # where no published one-GPU time calibrates the model


def model_table() -> str:
    rows = ["| model | GPUs (Ulysses) | compute / step | Ulysses bytes / step / GPU | NVLink time / step | "
            "modelled s / generation, overlapped | serialized | published |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in MODELS.items():
        flops = m["forwards"] * (2 * m["params"] * m["tokens"] + 4 * m["tokens"] ** 2 * m["hidden"] * m["layers"])
        one_gpu = m["published"].get(1)
        rate = flops * m["steps"] / one_gpu if one_gpu else DENSE_BF16_FLOPS * ASSUMED_MFU
        for gpus in (1, 2, 4, 8):
            if m["heads"] % gpus:
                continue
            compute = flops / gpus / rate
            sent = m["forwards"] * m["layers"] * ulysses_formula(gpus, m["tokens"], m["hidden"], 2)
            link = sent / NVLINK_BYTES_S
            published = m["published"].get(gpus)
            rows.append(f"| {name} | {gpus} | {compute * 1e3:.0f} ms | {sent / 2**30:.2f} GiB | {link * 1e3:.1f} ms | "
                        f"{max(compute, link) * m['steps']:.2f} | {(compute + link) * m['steps']:.2f} | "
                        f"{f'{published:.2f} s (xDiT, H100)' if published else '-'} |")
    note = ("Compute rate: calibrated on the published one-GPU time where there is one (Flux: "
            f"{MODELS['Flux.1-dev 1024x1024']['published'][1]} s), else {ASSUMED_MFU:.0%} of {DENSE_BF16_FLOPS / 1e12:.0f}"
            " dense BF16 TFLOP/s. Steps only: text encoders and VAE decode are not in it. Not measured on GPUs.")
    return "\n".join(rows) + "\n\n" + note


QUALITY_LAYOUTS = ("cfg=2", "ulysses=2", "ring=2", "ulysses=2,ring=2", "cfg=2,ulysses=2",
                   "ring=2,stale", "ulysses=2,ring=2,stale", "cfg=2,ring=2,stale", "ring=2,stale=1",
                   "ring=2,stale=8")
# The stale layout also run with every step computed (cache reuse off), against one rank so run.
STALE_UNCACHED = "ring=2,stale"


def quality_table(model_dir: Path, count: int) -> str:
    """The trained video model under each layout against one rank (and the detector), in process."""
    import tempfile

    import numpy as np

    from bench_video import holdout_cases
    from machgen.datasets import moving_shapes
    from machgen.builder.build import build_repository
    from machgen.builder.evaluate import psnr, score_motion
    from machgen.parallel.layout import ParallelLayout
    from machgen.runtime.local import LocalPipeline

    prompts, _ = holdout_cases(count, "text-to-video")
    motions = [motion for _, _, motion in prompts]
    rows = []
    with tempfile.TemporaryDirectory(prefix="machgen-bench-parallel-") as scratch:
        build_repository(model_dir, "video", Path(scratch), target="torch", preview=False,
                         parallel=ParallelLayout.parse("cfg=2,ulysses=2"), log=lambda line: print(line, flush=True))
        with LocalPipeline(Path(scratch), "video", layout=ParallelLayout()) as pipeline:
            def clips(label: str, **options):
                start = time.perf_counter()
                made = [pipeline.generate(prompt, seed=seed, **options)[0] for prompt, seed, _ in prompts]
                print(f"{label}: {len(made)} clips in {time.perf_counter() - start:.1f} s", flush=True)
                return made

            def stale_share() -> float:
                counted = [runner for runner in pipeline.opened_runners().values()
                           if hasattr(runner, "stale_calls")]
                return sum(runner.stale_calls for runner in counted) / max(sum(runner.calls for runner in counted), 1)

            # label -> (clips, the one-rank clips they are measured against, share of calls on stale keys)
            one_rank = clips("one rank")
            results = {"one rank": (one_rank, one_rank, None)}
            for layout in QUALITY_LAYOUTS:
                pipeline.use_layout(ParallelLayout.parse(layout))
                results[layout] = (clips(layout), one_rank, stale_share())
            # Stale keys with every step computed: blocks one step old, not one computed step old.
            pipeline.use_layout(ParallelLayout())
            one_rank_uncached = clips("one rank, cache reuse off", cache_policy="none")
            results["one rank, cache reuse off"] = (one_rank_uncached, one_rank_uncached, None)
            pipeline.use_layout(ParallelLayout.parse(STALE_UNCACHED))
            results[f"{STALE_UNCACHED}, cache reuse off"] = (clips(STALE_UNCACHED, cache_policy="none"),
                                                              one_rank_uncached, stale_share())
            pipeline.use_layout(ParallelLayout())
    for label, (made, one_rank, share) in results.items():
        accuracy = score_motion(made, motions)
        per_clip = [psnr(clip, reference) for clip, reference in zip(made, one_rank)]
        worst_frame = min(psnr(frame, reference_frame) for clip, reference in zip(made, one_rank)
                          for frame, reference_frame in zip(clip, reference))
        biggest = max(int(np.abs(clip.astype(int) - reference.astype(int)).max())
                      for clip, reference in zip(made, one_rank))
        stale = "-" if share is None else f"{100 * share:.0f} %"
        rows.append(f"| {label} | {np.mean(per_clip):.1f} dB ({np.min(per_clip):.1f} dB) | {worst_frame:.1f} dB | "
                    f"{biggest} | {100 * accuracy.direction:.1f} % | {100 * accuracy.all_three:.1f} % | "
                    f"{np.mean([moving_shapes.flicker(clip) for clip in made]):.2f} | {stale} |")
        print(rows[-1], flush=True)
    return "\n".join([
        f"`{model_dir.name}` built for the torch target with --parallel cfg=2,ulysses=2 and run in process "
        f"under each layout on {count} held-out text-to-video prompts (perf/bench_video.py's, no calibration saw "
        "them) at its served settings, calibrated cache reuse on; PSNR against the one-rank clips (99 dB: "
        "identical). Stale: the layouts with stale keys (parallel/stale.py, DistriFusion: a ring over the other "
        "ranks' keys and values of the previous step; not exact), and the share of the ranks' denoiser calls "
        "that attended over stale blocks (the others exact: each clip's first N steps with stale=N, 4 by "
        "default, and steps whose inputs moved too far); the last two rows with cache reuse off, against one "
        "rank so run.",
        "",
        "| layout | PSNR vs one rank, mean (worst clip) | worst frame | max level difference | direction | "
        "colour, shape and direction | flicker | calls on stale keys |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1152, help="sequence length of the measured layers")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--ring-tokens", type=int, default=4096, help="sequence length of the overlap timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=300, help="control calls timed per rank count")
    parser.add_argument("--record", type=Path, help="write the tables into this markdown file")
    parser.add_argument("--parts", default="bytes,control,overlap,model,decode",
                        help="which tables to measure (also: quality)")
    parser.add_argument("--decode-size", type=int, default=128, help="decode: the clip's height and width")
    parser.add_argument("--decode-frames", type=int, default=9, help="decode: the clip's frames")
    parser.add_argument("--model-dir", type=Path, default=Path("models/shapes-wan"), help="quality: the model")
    parser.add_argument("--count", type=int, default=8, help="quality: held-out prompts")
    args = parser.parse_args()
    parts = args.parts.split(",")

    import os
    import platform

    when = time.strftime("%Y-%m-%d %H:%M")
    header = (f"CPU ranks (gloo, one thread each), {os.cpu_count()} CPU cores ({platform.machine()}), float32, "
              f"measured {when}.")
    measurements = {
        "bytes": lambda: (f"{header} One attention layer, {args.tokens} tokens, {args.heads} heads x "
                          f"{args.head_dim}: bytes each rank sends, counted at the collectives.\n\n"
                          + bytes_table(args.tokens, args.heads, args.head_dim)),
        "control": lambda: (f"{header} A call that does no work on the ranks, {args.calls} timed after 20 warm-up "
                            "(goal: at most 1 ms).\n\n" + control_table(args.calls)),
        "overlap": lambda: (f"{header} Ring and Ulysses attention, {args.heads} heads x {args.head_dim}, median of "
                            f"{args.repeats}, alternating.\n\n"
                            + overlap_table(args.ring_tokens, args.heads, args.head_dim, args.repeats)),
        "model": model_table,
        "decode": lambda: (f"{header} Wan 2.1's VAE (its architecture, random weights) decoding one "
                           f"{args.decode_size}x{args.decode_size} clip of {args.decode_frames} frames chunk by chunk, "
                           "split by rows over the ranks (parallel/rows.py); the ranks share the machine's cores.\n\n"
                           + decode_table(args.decode_size, args.decode_size, args.decode_frames)),
        "quality": lambda: f"{header}\n\n" + quality_table(args.model_dir, args.count),
    }
    unknown = set(parts) - set(measurements)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {', '.join(measurements)}")
    for part in parts:
        table = measurements[part]()
        print(f"\n{part}\n{table}")
        if args.record:
            subject = args.model_dir.name if part == "quality" else "cpu-ranks"
            record(args.record, f"{SECTION}-{part}:{subject}", table, f"Parallel layouts: {part} (perf/bench_parallel.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
