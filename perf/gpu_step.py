"""One denoising step of full-size models on a GPU, through the torch target,
against diffusers' own module. Run by perf/gpu_check.sh (speed only: the
weights are random, created directly on the GPU; quality needs real ones).

- Flux.1-dev's transformer (12B) at 1024x1024: 4,096 image and 512 text
  tokens, one row (guidance-distilled: no second pass), bf16. Rows:
  diffusers' FluxTransformer2DModel.forward; the torch target's programs
  (denoiser_head + denoiser_tail, traced by the same code as
  ``machgen-build build --target torch``, run by TorchProgram) eager, as
  CUDA graphs, and torch.compile'd; a reused step (denoiser_reuse: what a
  cache-skipped step costs) and what cache reuse saves over 28 steps at a
  given share of computed steps. Against the floor of the GPU issue: 75 ms
  a step in BF16 at the H200's dense 989 TFLOP/s (38 ms in FP8).
- Wan 2.1 14B's transformer at 480p (832x480), 81 frames: 32,760 tokens,
  bf16: diffusers' WanTransformer3DModel.forward eager and as a CUDA graph,
  and with its self-attention on the SparseAttention op (our Triton kernel,
  top-k 50 % of key blocks). Wan has no machgen family yet (issue 7): the
  module is timed as diffusers defines it.

FLOPs are counted by torch's FlopCounterMode on one forward (matrix
products and attention). ``--scale tiny --device cpu`` runs every path that
needs no CUDA on tiny configs (the test suite does, so this script cannot
rot while no GPU is at hand).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import median_ms  # noqa: E402

FLUX_DEV = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                axes_dims_rope=(16, 56, 56))
FLUX_TINY = dict(FLUX_DEV, num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                 joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6), in_channels=16)
WAN_14B = dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
               text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
WAN_TINY = dict(WAN_14B, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=16, ffn_dim=37,
                num_layers=2)
# (image tokens, text tokens) of Flux at 1024x1024; latent frames x height x width of Wan at 480p, 81 frames.
SIZES = {"full": dict(flux=(4096, 512), wan=(21, 60, 104), wan_text=512),
         "tiny": dict(flux=(64, 8), wan=(3, 8, 8), wan_text=8)}
FLUX_FLOOR_MS = {"bf16": 75.0, "fp8": 38.0}  # the GPU issue's floor: ~74 TFLOP a step at 989 / 1,979 TFLOP/s


class Timer:
    """``median_ms`` with this run's device and repeat count."""

    def __init__(self, device: torch.device, repeats: int, warmup: int = 2):
        self.device, self.repeats, self.warmup = device, repeats, warmup

    def __call__(self, function) -> float:
        return median_ms(function, self.device, self.repeats, self.warmup)


def count_flops(function) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        function()
    return float(counter.get_total_flops())


def random_module(cls, config: dict, device: torch.device, dtype: torch.dtype):
    """A diffusers model with random weights made where it runs, in its dtype (no host copy of 12-14B weights)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            return cls(**config).eval().requires_grad_(False)
    finally:
        torch.set_default_dtype(previous)


def flux_pipeline(transformer):
    """A FluxPipeline around ``transformer`` with the tiny model's text encoders
    and VAE (not timed; they only give the family its shapes). The CLIP's
    width matches the transformer's pooled projection, as a real pipeline's does."""
    import diffusers
    import transformers

    from machgen.families.registry import get_family

    tiny, _ = get_family("flux").tiny_model()
    clip_config = tiny.text_encoder.config
    clip_config.hidden_size = transformer.config.pooled_projection_dim
    tiny.text_encoder = transformers.CLIPTextModel(clip_config).eval()
    return diffusers.FluxPipeline(scheduler=tiny.scheduler, vae=tiny.vae, text_encoder=tiny.text_encoder,
                                  tokenizer=tiny.tokenizer, text_encoder_2=tiny.text_encoder_2,
                                  tokenizer_2=tiny.tokenizer_2, transformer=transformer)


def flux_rows(scale: str, device: torch.device, dtype_name: str, timer: Timer, compile_program: bool,
              computed_share: float, log) -> list[tuple[str, float, float]]:
    """(what, ms, TFLOP) rows for one Flux step."""
    import diffusers

    from machgen.builder.export import trace_torch
    from machgen.families.registry import get_family
    from machgen.runtime.torch_runner import TorchProgram

    dtype = getattr(torch, dtype_name)
    log(f"flux: building the {scale} transformer on {device}")
    transformer = random_module(diffusers.FluxTransformer2DModel, FLUX_DEV if scale == "full" else FLUX_TINY,
                                device, dtype)
    image_tokens, text_tokens = SIZES[scale]["flux"]
    config = transformer.config
    side = int(image_tokens ** 0.5)
    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype)

    img_ids = torch.zeros(side, side, 3, device=device)
    img_ids[..., 1] += torch.arange(side, device=device)[:, None]
    img_ids[..., 2] += torch.arange(side, device=device)[None, :]
    inputs = dict(hidden_states=randn(1, image_tokens, config.in_channels),
                  encoder_hidden_states=randn(1, text_tokens, config.joint_attention_dim),
                  pooled_projections=randn(1, config.pooled_projection_dim),
                  timestep=torch.full((1, 1), 0.7, device=device, dtype=dtype),
                  img_ids=img_ids.reshape(1, image_tokens, 3).to(dtype), txt_ids=torch.zeros(1, text_tokens, 3,
                                                                                           device=device, dtype=dtype),
                  guidance=torch.full((1, 1), 3.5, device=device, dtype=dtype))

    def diffusers_step():
        return transformer(hidden_states=inputs["hidden_states"], encoder_hidden_states=inputs["encoder_hidden_states"],
                           pooled_projections=inputs["pooled_projections"], timestep=inputs["timestep"].reshape(1),
                           img_ids=inputs["img_ids"][0], txt_ids=inputs["txt_ids"][0],
                           guidance=inputs["guidance"].reshape(1), return_dict=False)[0]

    with torch.inference_mode():
        flops = count_flops(diffusers_step)
        rows = [("diffusers FluxTransformer2DModel, eager", timer(diffusers_step), flops)]
    log(f"flux: {flops / 1e12:.1f} TFLOP a step; diffusers eager {rows[0][1]:.1f} ms")

    components = {c.spec.name: c for c in get_family("flux").exporter().components(flux_pipeline(transformer))}
    modes = [("eager", dict(cuda_graphs=False)), ("CUDA graphs", dict(cuda_graphs=True))]
    if compile_program:
        modes.append(("torch.compile", dict(cuda_graphs=False, compile=True)))
    traced = {}
    for name in ("denoiser_head", "denoiser_tail", "denoiser_reuse"):
        start = time.perf_counter()
        traced[name] = trace_torch(components[name], dtype_name, str(device))
        log(f"flux: traced {name} in {time.perf_counter() - start:.0f} s")
    head_inputs = {n: inputs[n] for n in traced["denoiser_head"][1].inputs}
    for label, run_options in modes:
        if run_options.get("cuda_graphs") and device.type != "cuda":
            continue
        programs = {name: TorchProgram(program, replace(info, **run_options), str(device))
                    for name, (program, info) in traced.items()}

        def target_step():
            head = programs["denoiser_head"].run(head_inputs)
            tail_inputs = {**head_inputs, **head}
            return programs["denoiser_tail"].run(tail_inputs)

        start = time.perf_counter()
        target_step()  # first call: captures the graph or compiles
        log(f"flux: torch target ({label}) first step {time.perf_counter() - start:.1f} s")
        rows.append((f"torch target (head + tail), {label}", timer(target_step), flops))
        if label == "eager" or label == "CUDA graphs":
            reuse_inputs = {n: inputs[n] for n in traced["denoiser_reuse"][1].inputs if n in inputs}
            reuse_inputs["blocks_residual"] = randn(1, image_tokens, config.num_attention_heads
                                                    * config.attention_head_dim).float()
            reuse_ms = timer(lambda: programs["denoiser_reuse"].run(reuse_inputs))
            full_ms = rows[-1][1]
            computed = round(28 * computed_share)
            cached_ms = computed * full_ms + (28 - computed) * reuse_ms
            rows.append((f"reused step (denoiser_reuse), {label}", reuse_ms, 0.0))
            rows.append((f"28 steps, {computed} computed ({computed_share:.0%}) and {28 - computed} reused, "
                         f"{label}: {cached_ms / 1e3:.2f} s vs {28 * full_ms / 1e3:.2f} s uncached "
                         f"({28 * full_ms / cached_ms:.2f}x)", cached_ms / 28, flops * computed / 28))
    return rows


def wan_rows(scale: str, device: torch.device, dtype_name: str, timer: Timer, log) -> list[tuple[str, float, float]]:
    import diffusers

    from machgen.plugins.ops import attention_swapped
    from machgen.plugins.schema import SparseAttentionConfig
    from machgen.runtime.torch_runner import CudaGraphs

    dtype = getattr(torch, dtype_name)
    log(f"wan: building the {scale} transformer on {device}")
    model = random_module(diffusers.WanTransformer3DModel, WAN_14B if scale == "full" else WAN_TINY, device, dtype)
    frames, height, width = SIZES[scale]["wan"]
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, model.config.in_channels, frames, height, width, generator=gen,
                                            device=device, dtype=dtype),
                  timestep=torch.full((1,), 700, device=device, dtype=torch.long),
                  encoder_hidden_states=torch.randn(1, SIZES[scale]["wan_text"], model.config.text_dim,
                                                    generator=gen, device=device, dtype=dtype))
    tokens = frames * (height // 2) * (width // 2)

    def step(**values):
        return model(**values, return_dict=False)[0]

    rows = []
    with torch.inference_mode():
        flops = count_flops(lambda: step(**inputs))
        log(f"wan: {tokens} tokens, {flops / 1e12:.1f} TFLOP a step")
        rows.append((f"diffusers WanTransformer3DModel ({tokens} tokens), eager", timer(lambda: step(**inputs)),
                     flops))
        if device.type == "cuda":
            graphed = CudaGraphs(step, max_graphs=1)
            rows.append(("the same as a CUDA graph", timer(lambda: graphed(**inputs)), flops))
        sparse = SparseAttentionConfig(block_q=64, block_k=64, mask_method="topk", topk_ratio=0.5,
                                       dense_diagonal=1, precision="fp8_e4m3")
        with attention_swapped(("diffusers.models.transformers.transformer_wan",), sparse):
            rows.append(("self-attention on SparseAttention (fp8, top-k 50 % of key blocks), eager",
                         timer(lambda: step(**inputs)), flops))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", choices=("full", "tiny"), default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--models", default="flux,wan")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="also time the programs under torch.compile")
    parser.add_argument("--computed-share", type=float, default=14 / 40,
                        help="share of steps cache reuse computes (default: the shapes model's calibrated "
                             "MagCache, 14 of 40 passes)")
    parser.add_argument("--out", type=Path, default=None, help="markdown table")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to time (run with --scale tiny --device cpu to check the script)")
        return 0
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    timer = Timer(device, args.repeats)

    def log(line: str) -> None:
        print(line, flush=True)

    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [f"{card}, torch {torch.__version__}, {dtype}, {args.scale} configs, median of {args.repeats} after "
             f"2 warm-ups, {time.strftime('%Y-%m-%d %H:%M')}", "",
             "| model | what | ms | TFLOP | TFLOP/s | vs floor |", "| --- | --- | --- | --- | --- | --- |"]
    failed = False
    for model in args.models.split(","):
        try:
            if model == "flux":
                rows = flux_rows(args.scale, device, dtype, timer, args.compile, args.computed_share, log)
            else:
                rows = wan_rows(args.scale, device, dtype, timer, log)
        except Exception as err:  # noqa: BLE001 - one model's failure must not hide the other's table
            import traceback

            traceback.print_exc()
            lines.append(f"| {model} | FAILED: {type(err).__name__}: {str(err)[:200]} | | | | |")
            failed = True
            continue
        for what, ms, flops in rows:
            rate = f"{flops / ms / 1e9:.0f}" if flops else ""
            floor = f"{ms / FLUX_FLOOR_MS['bf16']:.2f}x" if model == "flux" and args.scale == "full" else ""
            lines.append(f"| {model} | {what} | {ms:.2f} | {flops / 1e12:.2f} | {rate} | {floor} |")
        # The next model needs the memory of this one's weights back.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out is not None:
        args.out.write_text(table)
    return 1 if failed else 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
