"""machgen-build: model folders in, Triton model repositories out."""

from __future__ import annotations

from pathlib import Path

import typer

from machgen.builder.build import TARGETS, AttentionOptions, TargetOptions
from machgen.builder.cli_calibrate import calibrate
from machgen.builder.precision_sweep import SWEEP_HELP, sweep_settings
from machgen.builder.repository import ServingOptions
from machgen.contract.tasks import long_task_name
from machgen.families.registry import all_families, family_inputs, family_names

_SERVING = ServingOptions()
_ATTENTION = AttentionOptions()
_TARGET = TargetOptions()

app = typer.Typer(help="Export diffusion models and write Triton model repositories.", no_args_is_help=True,
                  add_completion=False)


@app.command("families")
def list_families(
    api_table: bool = typer.Option(False, "--api-table", help="print the rows of the families' own API inputs, "
                                                              "as docs/model-api.md's table has them"),
) -> None:
    """List the supported model families (with their diffusers pipeline, tasks and own inputs)."""
    if api_table:
        for declared, _ in family_inputs().values():
            typer.echo(declared.markdown_row())
        return
    for family in all_families():
        own = f"  inputs: {', '.join(i.name for i in family.inputs)}" if family.inputs else ""
        typer.echo(f"{family.name}\t{family.diffusers_pipeline}\t{', '.join(family.capabilities.tasks)}{own}")


@app.command()
def tiny(
    family: str = typer.Argument(..., help=f"model family: {', '.join(family_names())}"),
    out: Path = typer.Argument(..., help="folder to write the diffusers pipeline into"),
    streaming: bool = typer.Option(False, "--streaming", help="with a streaming mode (realtime sessions; wan)"),
) -> None:
    """Write a tiny deterministic random-weight pipeline folder (for tests and demos)."""
    from machgen.builder.model_folder import write_tiny_model
    from machgen.families.registry import get_family

    try:
        chosen = get_family(family)
    except KeyError as err:
        raise typer.BadParameter(str(err.args[0]), param_hint="FAMILY") from None
    try:
        write_tiny_model(chosen, out, streaming=streaming)
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--streaming") from None
    typer.echo(f"wrote tiny {family} pipeline{' with a streaming mode' if streaming else ''} to {out}")


def _streaming_option(text: str | None):
    """--streaming: StreamingSettings of inline JSON or a JSON file, or None."""
    import json

    from machgen.contract.streaming import StreamingSettings, StreamingSettingsError

    if text is None:
        return None
    try:
        # Inline JSON is an object; anything else names a file (a long JSON is no file name: the OS refuses it).
        source = text if text.lstrip().startswith("{") else Path(text).read_text()
        return StreamingSettings.from_json(json.loads(source))
    except (json.JSONDecodeError, StreamingSettingsError, TypeError, OSError) as err:
        raise typer.BadParameter(str(err), param_hint="--streaming") from None


@app.command()
def build(
    model_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="diffusers model folder"),
    name: str = typer.Option(..., "--name", help="public model name the pipeline is served under"),
    target: str = typer.Option("onnxruntime", "--target",
                               help=f"where components run: {', '.join(TARGETS)} (onnxruntime: CPU; torch: PyTorch "
                                    "on CUDA, or the CPU; tensorrt: TensorRT engines, needs TensorRT and a GPU)"),
    out: Path = typer.Option(Path("model_repository"), "--out", help="model repository to write into"),
    lora: Path = typer.Option(None, "--lora", exists=True, help="a LoRA (diffusers format) to fuse before export"),
    in_flight: int = typer.Option(_SERVING.in_flight, "--in-flight", "--sampler-instances", min=1,
                                  help="requests in flight at once (instances of the public model; one sampler "
                                       "process runs them all)"),
    max_queue_size: int = typer.Option(_SERVING.max_queue_size, "--max-queue-size", min=0,
                                       help="requests waiting for an instance; beyond it: UNAVAILABLE"),
    component_instances: int = typer.Option(_SERVING.component_instances, "--component-instances", min=1,
                                            help="forwards each component runs at once"),
    spread_rows: bool = typer.Option(_SERVING.spread_rows, "--spread-rows/--no-spread-rows",
                                     help="cut a lone request's denoiser call over the idle instances (CPU)"),
    batching: bool = typer.Option(_SERVING.batching, "--batching/--no-batching",
                                  help="batch the calls of concurrent requests in each component"),
    max_batch_size: int = typer.Option(_SERVING.max_batch_size, "--max-batch-size", min=1,
                                       help="rows one component forward may carry"),
    step_queue_delay_us: int = typer.Option(_SERVING.step_queue_delay_us, "--step-queue-delay-us", min=0,
                                            help="how long a denoiser call waits for other requests' calls"),
    stage_queue_delay_us: int = typer.Option(_SERVING.stage_queue_delay_us, "--stage-queue-delay-us", min=0,
                                             help="the same for the text encoders and the VAE decoder"),
    intra_op_threads: int = typer.Option(_SERVING.intra_op_threads, "--intra-op-threads", min=0,
                                         help="ONNX Runtime threads per component (0: one per core)"),
    lone_stage_threads: int = typer.Option(_SERVING.lone_stage_threads, "--lone-stage-threads", min=0,
                                           help="ONNX Runtime threads of a text encoder's or VAE's call while "
                                                "its request runs alone (0: one per core; 1: off)"),
    lone_steps_in_sampler: bool = typer.Option(_SERVING.lone_steps_in_sampler,
                                               "--lone-steps-in-sampler/--no-lone-steps-in-sampler",
                                               help="run a lone request's denoiser steps in the sampler's own "
                                                    "process (onnxruntime: its weights once more per session)"),
    denoiser_nice: int = typer.Option(_SERVING.denoiser_nice, "--denoiser-nice", min=0, max=19,
                                      help="with lone steps in the sampler: the OS nice value of the denoiser's "
                                           "instances, while the one interactive request among batch ones "
                                           "computes its steps in the sampler (0: off)"),
    idle_release_s: float = typer.Option(_SERVING.idle_release_s, "--idle-release-s", min=0.0,
                                         help="seconds without a request after which an onnxruntime component "
                                              "gives back the memory its runs grew (0: never)"),
    attention: str = typer.Option(_ATTENTION.kind, "--attention",
                                  help="denoiser attention: dense, or sparse-fp8 (the machgen SparseAttention op)"),
    attention_block: int = typer.Option(_ATTENTION.block, "--attention-block", min=1,
                                        help="sparse-fp8: tokens per query and key block"),
    attention_mask: str = typer.Option(_ATTENTION.mask_method, "--attention-mask",
                                       help="sparse-fp8: how query blocks pick key blocks: cdf or topk"),
    attention_cdf_threshold: float = typer.Option(_ATTENTION.cdf_threshold, "--attention-cdf-threshold",
                                                  min=0.0, max=1.0,
                                                  help="cdf: predicted attention mass each query block keeps"),
    attention_topk_ratio: float = typer.Option(_ATTENTION.topk_ratio, "--attention-topk-ratio", min=0.0, max=1.0,
                                               help="topk: share of key blocks each query block keeps"),
    device: str = typer.Option(_TARGET.device, "--device",
                               help="torch: cuda, cpu or auto (cuda when this machine has it)"),
    dtype: str = typer.Option(_TARGET.dtype, "--dtype",
                              help="torch: bfloat16, float16, float32 or auto (bfloat16 on cuda, float32 on cpu)"),
    cuda_graphs: bool = typer.Option(_TARGET.cuda_graphs, "--cuda-graphs/--no-cuda-graphs",
                                     help="torch on cuda: replay each shape bucket as a CUDA graph"),
    compile_programs: bool = typer.Option(_TARGET.compile, "--compile/--no-compile",
                                          help="torch: torch.compile the programs at load"),
    precision: str = typer.Option(None, "--precision", help="the linear layers' precision: onnxruntime float "
                                  "(default) or int8 (the denoiser's); tensorrt bf16 (default) or fp8; torch float"),
    sweep: bool = typer.Option(True, "--precision-sweep/--no-precision-sweep", help=SWEEP_HELP["sweep"]),
    min_psnr: float = typer.Option(None, "--int8-min-psnr", help=SWEEP_HELP["min_psnr"]),
    sweep_pairs: int = typer.Option(None, "--precision-sweep-pairs", min=1, help=SWEEP_HELP["pairs"]),
    refittable: bool = typer.Option(_TARGET.refittable, "--refittable/--no-refittable",
                                    help="tensorrt: engines whose weights can be swapped without a rebuild"),
    timing_cache: Path = typer.Option(None, "--timing-cache", dir_okay=False,
                                      help="tensorrt: tactic timing cache file, read and rewritten"),
    onnx_exporter: str = typer.Option("dynamo", "--onnx-exporter", envvar="MACHGEN_ONNX_EXPORTER",
                                      help="onnxruntime, tensorrt: dynamo, or torchscript (the TorchScript-based "
                                           "exporter where a component's file passes its checks, dynamo elsewhere; "
                                           "much faster)"),
    export_cache: Path = typer.Option(None, "--export-cache", file_okay=False,
                                      help="a folder of exported, checked components: what is already there "
                                           "(same weights, code, options) is copied, not exported again "
                                           "(default: $MACHGEN_EXPORT_CACHE, else none)"),
    max_lora_rank: int = typer.Option(_SERVING.max_lora_rank, "--max-lora-rank", min=0,
                                      help="serve per-request LoRA adapters (machgen-build lora add) of rank up to "
                                           "this; 0: none (the denoiser without adapter inputs)"),
    max_loras: int = typer.Option(_SERVING.max_loras, "--max-loras", min=1,
                                  help="adapters each denoiser component process keeps in memory (LRU)"),
    preview: bool = typer.Option(True, "--preview/--no-preview",
                                 help="fit the latent-to-RGB projection that draws progress previews without the "
                                      "VAE (a few generations at the served defaults, stored in the repository)"),
    drop_unfit_adapters: bool = typer.Option(False, "--drop-unfit-adapters",
                                             help="rebuilding: delete the added adapters (lora add) that this "
                                                  "build cannot serve, instead of refusing to build"),
    parallel: str = typer.Option("none", "--parallel", metavar="LAYOUT",
                                 help="torch target: run each denoising step on several ranks (GPUs), e.g. "
                                      "cfg=2,ulysses=2,ring=2: cfg splits the guidance rows, ulysses (which "
                                      "must divide the head count) and ring the token sequence; their product "
                                      "is the GPUs per replica. A layout the model does not allow is refused. "
                                      "Add 'stale' (ring=2,stale; stale=N: after N exact steps, 4 by default) "
                                      "for a ring over the other ranks' keys of the previous step (DistriFusion: "
                                      "its exchange hidden under a whole step; not exact)"),
    discard_changes: bool = typer.Option(False, "--discard-changes",
                                         help="rebuilding: replace or delete what was changed or added in the "
                                              "pipeline's models since the last build (a calibration, edited or "
                                              "added files) where this build writes its own, instead of refusing"),
    streaming: str = typer.Option(None, "--streaming", metavar="JSON",
                                  help="the model's streaming mode (realtime sessions), JSON or a JSON file, in "
                                       "place of its card's \"streaming\" section (docs/realtime.md)"),
    max_sessions: int = typer.Option(_SERVING.max_sessions, "--max-sessions", min=1,
                                     help="realtime: sessions open at once"),
    session_idle_s: float = typer.Option(_SERVING.session_idle_s, "--session-idle-s", min=1.0,
                                         help="realtime: seconds a session may go unread and unsteered"),
    session_memory_mb: int = typer.Option(_SERVING.session_memory_mb, "--session-memory-mb", min=1,
                                          help="realtime: megabytes of keys and values all sessions may cache"),
    session_rows: int = typer.Option(_SERVING.session_rows, "--session-rows", min=1,
                                     help="realtime: the most sessions' chunks one denoiser call carries"),
    session_lead_s: float = typer.Option(_SERVING.session_lead_s, "--session-lead-s", min=0.0,
                                         help="realtime: seconds a chunk may be made before it is due, beyond "
                                              "its making (less: a key shows sooner, a late chunk is likelier)"),
) -> None:
    """Export every component, check it against torch, and write the model repository.

    Over an earlier build of the same --name in --out, what was added since is kept: adapters (checked against
    this build), a calibration and other changes to the manifest or configs, files of your own. Where this build
    cannot keep something, it refuses before exporting and names it."""
    from machgen.builder.build import build_repository
    from machgen.builder.export import ParityError
    from machgen.builder.tensorrt_engine import TensorRTUnavailable
    from machgen.parallel.layout import LayoutError, ParallelLayout

    if not name.replace("_", "").replace("-", "").isalnum():
        raise typer.BadParameter("use letters, digits, '_' and '-'", param_hint="--name")
    from machgen.builder.export import ONNX_EXPORTERS

    if onnx_exporter not in ONNX_EXPORTERS:
        raise typer.BadParameter(f"{onnx_exporter!r} is not one of {', '.join(ONNX_EXPORTERS)}",
                                 param_hint="--onnx-exporter")
    try:
        layout = ParallelLayout.parse(parallel)
    except LayoutError as err:
        raise typer.BadParameter(str(err), param_hint="--parallel") from None
    options = ServingOptions(in_flight=in_flight, max_queue_size=max_queue_size,
                             component_instances=component_instances, spread_rows=spread_rows, batching=batching,
                             max_batch_size=max_batch_size, step_queue_delay_us=step_queue_delay_us,
                             stage_queue_delay_us=stage_queue_delay_us, intra_op_threads=intra_op_threads,
                             lone_stage_threads=lone_stage_threads, lone_steps_in_sampler=lone_steps_in_sampler,
                             denoiser_nice=denoiser_nice, idle_release_s=idle_release_s, max_lora_rank=max_lora_rank,
                             max_loras=max_loras, max_sessions=max_sessions, session_idle_s=session_idle_s,
                             session_memory_mb=session_memory_mb, session_rows=session_rows,
                             session_lead_s=session_lead_s)
    try:
        build_repository(model_dir, name, out, target=target, lora=lora, options=options, log=typer.echo,
                         attention=AttentionOptions(attention, attention_block, attention_mask,
                                                    attention_cdf_threshold, attention_topk_ratio),
                         target_options=TargetOptions(device=device, dtype=dtype, cuda_graphs=cuda_graphs,
                                                      compile=compile_programs, precision=precision,
                                                      refittable=refittable, timing_cache=timing_cache,
                                                      onnx_exporter=onnx_exporter, precision_sweep=sweep,
                                                      sweep=sweep_settings(precision, sweep, min_psnr, sweep_pairs)),
                         export_cache=export_cache, preview=preview, drop_unfit_adapters=drop_unfit_adapters,
                         discard_changes=discard_changes, parallel=layout,
                         streaming=_streaming_option(streaming))
    except (ParityError, ValueError, KeyError, FileNotFoundError, TensorRTUnavailable) as err:
        typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None


# Here, between build and train: the order machgen-build --help lists the commands in.
app.command()(calibrate)


@app.command()
def train(
    out: Path = typer.Argument(..., help="training folder: checkpoints, logs, and the model in OUT/model "
                                         "(with --lora: the adapter)"),
    clip_vocab: Path = typer.Option(None, "--clip-vocab", exists=True, dir_okay=False,
                                    help="the open_clip_torch wheel (or its bpe_simple_vocab_16e6.txt.gz): "
                                         "pip download --no-deps open_clip_torch==3.3.0"),
    vae_steps: int = typer.Option(6000, "--vae-steps"),
    vae_minutes: float = typer.Option(None, "--vae-minutes", help="time budget of the VAE stage"),
    decoder_steps: int = typer.Option(3000, "--decoder-steps", min=0,
                                      help="steps of the last stage: the VAE decoder alone (--world: the first "
                                           "stage; 0: none, the base's decoder as it is)"),
    decoder_minutes: float = typer.Option(None, "--decoder-minutes", help="time budget of the decoder stage"),
    steps: int = typer.Option(20000, "--steps", help="transformer (or LoRA) steps"),
    minutes: float = typer.Option(None, "--minutes", help="time budget of the transformer (or LoRA) stage"),
    batch: int = typer.Option(32, "--batch"),
    seed: int = typer.Option(0, "--seed"),
    bf16: bool = typer.Option(False, "--bf16", help="bf16 autocast (slower than fp32 on small CPUs)"),
    resume: bool = typer.Option(True, "--resume/--restart", help="continue from OUT/checkpoints"),
    lora: bool = typer.Option(False, "--lora", help="fine-tune a LoRA on --base instead of training from scratch"),
    base: Path = typer.Option(None, "--base", exists=True, file_okay=False, help="base model folder (--lora, --world)"),
    concept: str = typer.Option("orange", "--concept", help="the new concept a LoRA learns (--lora)"),
    rank: int = typer.Option(32, "--rank", help="LoRA rank (--lora)"),
    lr: float = typer.Option(None, "--lr", help="learning rate of --lora (default 0.003) or of --world's "
                                                "transformer stage (default 0.0003)"),
    video: bool = typer.Option(False, "--video", help="train the moving-shapes video model (Wan 2.2 TI2V layout: "
                                                      "text-to-video and image-to-video) instead of the image one"),
    world: bool = typer.Option(False, "--world", help="fine-tune --base (default models/shapes-wan) into the "
                                                      "steerable world model (streaming; docs/realtime.md)"),
    chunk_frames: int = typer.Option(None, "--chunk-frames", min=1,
                                     help="--world: latent frames a streamed chunk (1 or 2; default: the base "
                                          "card's, else 2); sink and window stay 2 and 6 latent frames"),
) -> None:
    """Train the shapes model (or, --video, the moving-shapes video model) from scratch, or (--lora) teach a model
    a new concept."""
    if chunk_frames is not None and not world:
        raise typer.BadParameter("only --world trains a streamed chunk", param_hint="--chunk-frames")
    if lr is not None and not (world or lora):
        raise typer.BadParameter("only --lora and --world take a learning rate", param_hint="--lr")
    if video:
        from machgen.builder.video_training import VideoTrainingSettings, train_video_model

        settings = VideoTrainingSettings(seed=seed, vae_steps=vae_steps, vae_minutes=vae_minutes, steps=steps,
                                         minutes=minutes, batch=batch)
        record = train_video_model(out, settings, resume=resume, log=typer.echo)
        typer.echo(f"trained: {record['transformer_steps']} transformer steps; model in {out / 'model'}")
        return
    if lr is not None and not lr > 0:
        raise typer.BadParameter(f"must be positive, not {lr}", param_hint="--lr")
    if world:
        _train_world(out, base, steps=steps, minutes=minutes, batch=batch, seed=seed, resume=resume, lr=lr,
                     decoder_steps=decoder_steps, decoder_minutes=decoder_minutes, chunk_frames=chunk_frames)
        return
    if lora:
        from machgen.builder.lora_training import LoraSettings, train_lora

        if base is None:
            raise typer.BadParameter("--lora needs --base MODEL_DIR", param_hint="--base")
        settings = LoraSettings(concept=concept, rank=rank, steps=steps, minutes=minutes, batch=batch, seed=seed,
                                **({} if lr is None else {"lr": lr}))
        try:
            train_lora(base, out, settings, log=typer.echo)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--concept") from None
        typer.echo(f"LoRA saved in {out}; fuse it with: machgen-build build {base} --lora {out} ...")
        return
    from machgen.builder.training import TrainingSettings, train_shapes_model

    if clip_vocab is None:
        raise typer.BadParameter("training from scratch needs the CLIP vocabulary", param_hint="--clip-vocab")
    settings = TrainingSettings(seed=seed, vae_steps=vae_steps, vae_minutes=vae_minutes, decoder_steps=decoder_steps,
                                decoder_minutes=decoder_minutes, steps=steps,
                                minutes=minutes, batch=batch, bf16=bf16)
    record = train_shapes_model(out, settings, clip_vocab, resume=resume, log=typer.echo)
    typer.echo(f"trained: {record['transformer_steps']} transformer steps; model in {out / 'model'}")


def _train_world(out: Path, base: Path | None, *, chunk_frames: int | None, lr: float | None, resume: bool,
                 **values) -> None:
    """train --world: one thread (the machine's other work keeps a core)."""
    import torch

    from machgen.builder.world_training import BASE_MODEL, base_chunk_frames, chunked_settings, train_world_model

    base = base or BASE_MODEL
    try:
        settings = chunked_settings(chunk_frames or base_chunk_frames(base), **values,
                                    **({} if lr is None else {"lr": lr}))
    except ValueError as err:
        raise typer.BadParameter(str(err), param_hint="--chunk-frames") from None
    torch.set_num_threads(1)
    record = train_world_model(out, settings, base, resume=resume, log=typer.echo)
    typer.echo(f"trained: {record['transformer_steps']} steps; model in {out / 'model'}")


@app.command("eval")
def evaluate(
    model_dir: Path = typer.Argument(None, help="diffusers model folder (scored with FluxPipeline)"),
    url: str = typer.Option(None, "--url", help="score a served model instead: host:port"),
    name: str = typer.Option("flux", "--name", help="served model name (with --url)"),
    protocol: str = typer.Option("grpc", "--protocol"),
    count: int = typer.Option(None, "--count", min=1, help="prompt/seed pairs (default: 70 for images, 84 for "
                                                           "clips: every colour, shape and direction once)"),
    grid: Path = typer.Option(None, "--grid", help="save the generated images as one PNG"),
    lora: Path = typer.Option(None, "--lora", exists=True, help="load this LoRA into the pipeline (MODEL_DIR)"),
    adapters: list[str] = typer.Option(None, "--adapter", help="a per-request LoRA adapter the served model "
                                                               "applies, by name (with --url; repeatable)"),
    concept: str = typer.Option(None, "--concept", help="score prompts of this new concept (e.g. orange) "
                                                         "instead of the dataset's"),
    read_with: str = typer.Option(None, "--read-with", help="read colours against the dataset palette plus this "
                                                          "concept's colour (default: --concept's)"),
    task: str = typer.Option(None, "--task", help="t2i, t2v or i2v (default: MODEL_DIR's first task; with --url, "
                                                  "t2i)"),
    round_trip_model: Path = typer.Option(None, "--vae-from", exists=True, file_okay=False,
                                          help="i2v with --url: the model folder whose VAE makes the "
                                               "first frame the served clip is checked against"),
    cache_policy: str = typer.Option(None, "--cache-policy", help="with --url: ask for this cache policy (none: "
                                                                  "every step computed) instead of the model's "
                                                                  "served default"),
) -> None:
    """Prompt accuracy on a fixed prompt/seed set of the shapes dataset (a video model: the moving-shapes
    dataset, colour, shape and direction; image-to-video also its first frame)."""
    from machgen.builder import evaluate as ev
    from machgen.datasets import shapes
    from machgen.builder.lora_training import concept_palette

    if (model_dir is None) == (url is None):
        raise typer.BadParameter("give a MODEL_DIR or --url, not both")
    if cache_policy is not None and url is None:
        raise typer.BadParameter("a cache policy is asked of a served model: give --url", param_hint="--cache-policy")
    served_options = {"cache_policy": cache_policy} if cache_policy is not None else {}
    chosen_task = long_task_name(task)
    if chosen_task is None and model_dir is not None:
        from machgen.builder.model_folder import detect_family

        chosen_task = detect_family(model_dir).capabilities.tasks[0]
    if chosen_task in ("text-to-video", "image-to-video"):
        _evaluate_video(model_dir, url, name, protocol, chosen_task, count or 84, grid,
                        round_trip_model or model_dir, served_options)
        return
    if chosen_task not in (None, "text-to-image"):
        raise typer.BadParameter(f"no evaluation set for {task or chosen_task!r}", param_hint="--task")
    palette = concept_palette(read_with or concept) if (read_with or concept) else shapes.PALETTE
    colours = (concept,) if concept else tuple(shapes.PALETTE)
    prompts = shapes.evaluation_prompts(count or 70, colours=colours)
    images = ev.generate_with_diffusers(model_dir, prompts, lora=lora) if model_dir else \
        ev.generate_served(url, name, prompts, protocol, **({"lora": adapters} if adapters else {}), **served_options)
    if grid:
        ev.save_grid(images, grid)
    typer.echo(ev.report(ev.score(images, [label for _, _, label in prompts], palette)))


def _evaluate_video(model_dir: Path | None, url: str | None, name: str, protocol: str, task: str, count: int,
                    grid: Path | None, vae_folder: Path | None, served_options: dict) -> None:
    import numpy as np

    from machgen.builder import evaluate as ev
    from machgen.datasets import moving_shapes

    pictures = round_trips = None
    if task == "image-to-video":
        if vae_folder is None:
            raise typer.BadParameter("image-to-video through --url checks the first frame against the model's VAE: "
                                     "give the model folder", param_hint="--vae-from")
        cases = moving_shapes.evaluation_pictures(count)
        prompts = [(prompt, seed, motion) for prompt, seed, _, motion in cases]
        pictures = np.stack([picture for _, _, picture, _ in cases])
        round_trips = ev.video_round_trips(vae_folder, pictures)
    else:
        prompts = moving_shapes.evaluation_prompts(count)
    videos = ev.generate_videos_with_diffusers(model_dir, prompts, pictures) if model_dir else \
        ev.generate_served(url, name, prompts, protocol, pictures=pictures, video=True, **served_options)
    if grid:
        ev.save_grid(videos[:, ::4].reshape(-1, *videos.shape[2:]), grid, columns=videos[:, ::4].shape[1] * 2)
    typer.echo(ev.report(ev.score_motion(videos, [motion for _, _, motion in prompts], round_trips)))


lora_app = typer.Typer(help="Per-request LoRA adapters of a built repository (machgen-build build --max-lora-rank): "
                            "a running server serves an added one from its next request.", no_args_is_help=True)
app.add_typer(lora_app, name="lora")
_PIPELINE = typer.Option(None, "--model", help="the served model (the public name) when the repository has several")


def _lora_failed(err: Exception) -> None:
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)
    raise typer.Exit(1)


@lora_app.command("add")
def lora_add(
    repository: Path = typer.Argument(..., exists=True, file_okay=False, help="model repository"),
    adapter_dir: Path = typer.Argument(..., exists=True, help="a diffusers-format LoRA folder "
                                                              "(pytorch_lora_weights.safetensors) or its file"),
    name: str = typer.Option(..., "--name", help="the name requests give it (lora input)"),
    pipeline: str = _PIPELINE,
    replace_existing: bool = typer.Option(False, "--replace", help="replace an adapter of that name"),
) -> None:
    """Check an adapter against the served model (every layer it changes exists, shapes fit, rank within the
    maximum) and add it to the repository."""
    from machgen.builder.adapters import add_adapter

    try:
        info = add_adapter(repository, name, adapter_dir, pipeline, replace_existing)
    except (ValueError, FileNotFoundError) as err:
        _lora_failed(err)
    typer.echo(f"added adapter '{info.name}': rank {info.rank}, {info.layers} layers")


@lora_app.command("list")
def lora_list(
    repository: Path = typer.Argument(..., exists=True, file_okay=False, help="model repository"),
    pipeline: str = _PIPELINE,
) -> None:
    """The adapters a repository serves: name, rank, layers changed, where each came from."""
    from machgen.builder.adapters import list_adapters

    try:
        found = list_adapters(repository, pipeline)
    except ValueError as err:
        _lora_failed(err)
    for info in found.values():
        typer.echo(f"{info.name}\trank {info.rank}\t{info.layers} layers\t{info.source}")


@lora_app.command("remove")
def lora_remove(
    repository: Path = typer.Argument(..., exists=True, file_okay=False, help="model repository"),
    adapter: str = typer.Argument(None, help="the adapter to remove (or --name)"),
    name: str = typer.Option(None, "--name", help="the adapter to remove"),
    pipeline: str = _PIPELINE,
) -> None:
    """Remove an adapter: requests that name it are refused from then on (INVALID_ARGUMENT)."""
    from machgen.builder.adapters import remove_adapter

    if (adapter is None) == (name is None):
        raise typer.BadParameter("name the adapter once: NAME or --name NAME")
    name = name or adapter
    try:
        remove_adapter(repository, name, pipeline)
    except ValueError as err:
        _lora_failed(err)
    typer.echo(f"removed adapter '{name}'")


if __name__ == "__main__":  # pragma: no cover
    app()
