"""The parallel layouts on CUDA with NCCL (perf/gpu_parallel.sh runs it where 2 or more GPUs are visible):
sequence-parallel attention against whole-sequence SDPA on each layout that fits, the ring and Ulysses
with their transfers overlapped against the same exchanges serialized, a step of ring attentions
over stale keys (parallel/stale.py) against the exact ring, and Ulysses layers with their values sent
first (parallel/values_first.py) against the order diffusers' processors project them in."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def attention_error(mesh, tokens: int, heads: int, dim: int, dtype: str) -> float:
    import torch
    import torch.nn.functional as F

    from machgen.parallel.usp import sequence_parallel_attention

    device = torch.device("cuda", mesh.rank)
    torch.cuda.set_device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, tokens, heads, dim, generator=generator, device=device, dtype=getattr(torch, dtype))
               for _ in range(3))
    whole = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    degree = mesh.layout.sequence_degree
    chunk = lambda t: t.chunk(degree, dim=1)[mesh.sequence_rank].contiguous()  # noqa: E731
    out = sequence_parallel_attention(chunk(q), chunk(k), chunk(v), mesh)
    return float((out.float() - chunk(whole).float()).abs().max())


def alternating_medians(runs: dict, repeats: int, device: str = "cuda") -> dict[str, float]:
    """Median seconds of each of ``runs`` (mode: call), the modes taken in turn ``repeats`` times after two
    rounds of warm-up, every rank starting each together (a barrier) and the device synchronized around it."""
    import torch
    import torch.distributed as dist

    def synchronize() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    times: dict[str, list[float]] = {mode: [] for mode in runs}
    for _ in range(repeats + 2):
        for mode, run in runs.items():
            dist.barrier()
            synchronize()
            start = time.perf_counter()
            run()
            synchronize()
            times[mode].append(time.perf_counter() - start)
    return {mode: statistics.median(values[2:]) for mode, values in times.items()}


def overlap_times(mesh, tokens: int, heads: int, dim: int, repeats: int) -> dict[str, float]:
    """Median seconds of sequence-parallel attention (bfloat16), overlapped and serialized, alternating."""
    import torch

    from machgen.parallel.usp import sequence_parallel_attention

    device = torch.device("cuda", mesh.rank)
    torch.cuda.set_device(device)
    q, k, v = (torch.randn(1, tokens // mesh.layout.sequence_degree, heads, dim, device=device,
                           dtype=torch.bfloat16) for _ in range(3))
    return alternating_medians({mode: lambda overlap=mode == "overlapped": sequence_parallel_attention(
        q, k, v, mesh, overlap=overlap) for mode in ("overlapped", "serialized")}, repeats)


def stale_times(mesh, tokens: int, heads: int, dim: int, repeats: int, layers: int = 8,
                device: str = "cuda") -> dict[str, float]:
    """Median seconds of a step of ``layers`` ring attentions (a stale layout's mesh): exact, and over stale
    blocks (parallel/stale.py, warmed up: each layer's all-gather has the other layers to arrive), alternating."""
    import torch

    from machgen.parallel.stale import StaleKeys
    from machgen.parallel.state import attending
    from machgen.parallel.usp import sequence_parallel_attention

    if device == "cuda":
        torch.cuda.set_device(torch.device("cuda", mesh.rank))
        device = f"cuda:{mesh.rank}"
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    q, k, v = (torch.randn(1, tokens // mesh.layout.sequence_degree, heads, dim, device=device, dtype=dtype)
               for _ in range(3))
    stale = StaleKeys(warmup=1)

    def step(blocks) -> None:
        if blocks is not None:
            blocks.begin("step", {}, continued=True)
        with attending(blocks):
            for _ in range(layers):
                sequence_parallel_attention(q, k, v, mesh)

    medians = alternating_medians({"exact": lambda: step(None), "stale": lambda: step(stale)}, repeats, device)
    stale.drop()
    return medians


def values_first_times(mesh, tokens: int, heads: int, dim: int, repeats: int, layers: int = 4,
                       device: str = "cuda") -> dict[str, float]:
    """Median seconds of ``layers`` self-attention layers (projections, Q and K normalised, the sequence
    attention, the output projection) on this rank's chunk, as diffusers orders them and rewritten values first
    (parallel/values_first.py), alternating."""
    import torch
    import torch.nn.functional as F

    from machgen.parallel.state import split_sequence
    from machgen.parallel.values_first import values_first

    if device == "cuda":
        torch.cuda.set_device(torch.device("cuda", mesh.rank))
        device = f"cuda:{mesh.rank}"
    dtype = torch.bfloat16 if device != "cpu" else torch.float32
    width = heads * dim

    class Layers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weights = torch.nn.ModuleList(torch.nn.Linear(width, 4 * width) for _ in range(layers))

        def forward(self, hidden):
            for weight in self.weights:
                to_q, to_k, to_v, to_out = weight.weight.chunk(4)
                normed = F.layer_norm(hidden, (width,))
                q, k, v = (F.linear(normed, w).unflatten(-1, (heads, dim)) for w in (to_q, to_k, to_v))
                q, k = F.rms_norm(q, (dim,)), F.rms_norm(k, (dim,))
                hidden = hidden + F.linear(torch.ops.machgen.sequence_attention(q, k, v, 0.0).flatten(2), to_out)
            return hidden

    torch.manual_seed(0)
    hidden = torch.randn(1, tokens // mesh.layout.sequence_degree, width, device=device, dtype=dtype)
    layers_module = Layers().to(device, dtype).eval()
    programs = {mode: torch.export.export(layers_module, (hidden,)).module() for mode in ("as traced", "values first")}
    values_first(programs["values first"])

    def run(program) -> None:
        with torch.no_grad(), split_sequence(True):
            program(hidden)

    return alternating_medians({mode: lambda program=program: run(program) for mode, program in programs.items()},
                               repeats, device)


def values_first_rows(degrees, tokens_for, run) -> list[str]:
    """The values-first table's rows (``run(layout, tokens)``: every rank's values_first_times)."""
    from machgen.parallel.layout import ParallelLayout

    rows = ["| layout | tokens | 4 layers as traced (ms) | values first (ms) | as traced / values first |",
            "| --- | --- | --- | --- | --- |"]
    for degree in degrees:
        layout = ParallelLayout(ulysses=degree)
        for tokens in tokens_for(degree):
            results = run(layout, tokens)
            traced, first = (max(r[mode] for r in results) for mode in ("as traced", "values first"))
            rows.append(f"| {layout} | {tokens} | {traced * 1e3:.2f} | {first * 1e3:.2f} | {traced / first:.2f}x |")
    return rows


def stale_rows(degrees, tokens_for, run) -> list[str]:
    """The stale-keys table's rows: a step of 8 ring attentions, exact and stale (``run(layout, tokens)``:
    every rank's stale_times)."""
    from machgen.parallel.layout import ParallelLayout

    rows = ["| layout | tokens | exact ring, 8 layers (ms) | stale keys, 8 layers (ms) | exact / stale |",
            "| --- | --- | --- | --- | --- |"]
    for degree in degrees:
        layout = ParallelLayout(ring=degree, stale=1)
        for tokens in tokens_for(degree):
            results = run(layout, tokens)
            exact, stale = (max(r[mode] for r in results) for mode in ("exact", "stale"))
            rows.append(f"| {layout} | {tokens} | {exact * 1e3:.2f} | {stale * 1e3:.2f} | {exact / stale:.2f}x |")
    return rows


def main() -> int:
    import torch

    from machgen.parallel.layout import ParallelLayout
    from machgen.parallel.ranks import run_on_ranks

    gpus = torch.cuda.device_count()
    layouts = [text for text in ("ulysses=2", "ring=2", "ulysses=2,ring=2", "ulysses=4", "ring=4", "ulysses=4,ring=2")
               if ParallelLayout.parse(text).world_size <= gpus]
    print(f"{gpus} GPUs ({torch.cuda.get_device_name(0)}), NCCL")
    print("| layout | dtype | max abs error against SDPA |\n| --- | --- | --- |")
    for text in layouts:
        for dtype in ("float32", "bfloat16"):
            errors = run_on_ranks(ParallelLayout.parse(text), "gpu_parallel:attention_error", 8192, 24, 128, dtype,
                                  backend="nccl")
            print(f"| {text} | {dtype} | {max(errors):.2e} |")
    print("\n| layout | tokens | overlapped (ms) | serialized (ms) | serialized / overlapped |\n"
          "| --- | --- | --- | --- | --- |")
    for degree in (2, 4, 8):
        if degree > gpus:
            break
        for layout in (ParallelLayout(ring=degree), ParallelLayout(ulysses=degree)):
            for tokens in (32768, 75600 // degree * degree):
                results = run_on_ranks(layout, "gpu_parallel:overlap_times", tokens, 24, 128, 5, backend="nccl")
                overlapped, serialized = (max(r[mode] for r in results) for mode in ("overlapped", "serialized"))
                print(f"| {layout} | {tokens} | {overlapped * 1e3:.2f} | {serialized * 1e3:.2f} | "
                      f"{serialized / overlapped:.2f}x |")
    print("\n" + "\n".join(stale_rows(
        [degree for degree in (2, 4, 8) if degree <= gpus], lambda degree: (32768, 75600 // degree * degree),
        lambda layout, tokens: run_on_ranks(layout, "gpu_parallel:stale_times", tokens, 24, 128, 5,
                                            backend="nccl"))))
    print("\n" + "\n".join(values_first_rows(
        [degree for degree in (2, 4, 8) if degree <= gpus], lambda degree: (32768, 75600 // degree * degree),
        lambda layout, tokens: run_on_ranks(layout, "gpu_parallel:values_first_times", tokens, 24, 128, 5,
                                            backend="nccl"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
