"""machgen-build calibrate: fit a model's cache reuse to a quality target (builder/calibrate.py), registered on
machgen-build's app by builder/cli.py. Its own module: the build command's options fill cli.py."""

from __future__ import annotations

from pathlib import Path

import typer

from machgen.contract.manifest import PipelineManifest, find_pipeline_dir
from machgen.contract.tasks import long_task_name, short_task_name


def _prompt_file(path: Path, count: int, first_seed: int) -> list[tuple[str, int]]:
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return [(prompt, first_seed + index) for index, prompt in enumerate(lines[:count])]


# A held-out prompt file's seeds start here: a prompt in both files is still two different pairs.
HOLDOUT_FILE_FIRST_SEED = 1_000_000
PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def _picture(path: Path):
    """An image file as uint8 [height, width, 3]."""
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def calibrate(
    target: Path = typer.Argument(..., exists=True, file_okay=False,
                                  help="a diffusers model folder (the result goes into its machgen.json, so every "
                                       "later build serves it) or a model repository (into its pipeline.json)"),
    name: str = typer.Option(None, "--name", help="the pipeline to calibrate in a repository holding several"),
    target_psnr: float = typer.Option(30.0, "--target-psnr", help="mean PSNR (dB) against uncached to hold"),
    worst_psnr: float = typer.Option(None, "--worst-psnr", help="PSNR all but --worst-tail reach (default target - 7)"),
    confidence: float = typer.Option(0.95, "--confidence", min=0.5, max=0.9999,
                                     help="one-sided confidence of the fit's bounds on the held-out mean and tail"),
    worst_tail: float = typer.Option(0.05, "--worst-tail", min=0.001, max=0.5,
                                     help="share of requests the worst-case promise leaves out: at least 1 - this "
                                          "share get --worst-psnr or better (a minimum bounds no later set's)"),
    prompts_file: Path = typer.Option(None, "--prompts", exists=True, dir_okay=False,
                                      help="fit prompts, one per line, seeds 0, 1, ... (default: captions of the "
                                           "shapes dataset, or of the moving-shapes one for a video model)"),
    count: int = typer.Option(None, "--count", min=1, help="fit prompt/seed pairs (default: 64)"),
    holdout_file: Path = typer.Option(None, "--holdout-prompts", exists=True, dir_okay=False,
                                      help="held-out prompts, one per line, seeds 1000000, 1000001, ... (default: "
                                           "shapes captions from a generator the fit set does not use)"),
    holdout_count: int = typer.Option(None, "--holdout-count", min=1,
                                      help="held-out prompt/seed pairs (default: 64)"),
    warmup_steps: int = typer.Option(None, "--warmup-steps",
                                     help="first steps always computed (default: fitted, 3 or 4)"),
    final_steps: int = typer.Option(None, "--final-steps", help="last steps always computed (default: 0)"),
    max_consecutive_skips: int = typer.Option(None, "--max-consecutive-skips", help="(default: fitted, 2, 3 or 4)"),
    negative_interval: int = typer.Option(None, "--negative-interval",
                                          help="true CFG: steps between runs of the negative row "
                                               "(default: fitted, 1, 3 or 5)"),
    policies: list[str] = typer.Option(None, "--policy",
                                       help="a cache policy to fit, repeatable (default: fbcache and magcache)"),
    task: str = typer.Option(None, "--task",
                             help="the requests to fit the settings for, one of the model's tasks: t2i, i2i, t2v, "
                                  "i2v or r2v (default: its first); another task's settings are served to its "
                                  "requests only, beside the first's. A task from a picture (i2i, i2v) runs each "
                                  "pair from one"),
    pictures: Path = typer.Option(None, "--pictures", exists=True, file_okay=False,
                                  help="a task from a picture: the fit pairs' pictures, one image file per prompt in "
                                       "name order (default for a video model: first frames of moving-shapes "
                                       "clips of each caption's motion)"),
    holdout_pictures: Path = typer.Option(None, "--holdout-pictures", exists=True, file_okay=False,
                                          help="the held-out pairs' pictures, as --pictures"),
    reference_model: Path = typer.Option(None, "--reference-model", exists=True, file_okay=False,
                                         help="a quantized build (--precision int8): the diffusers model folder it "
                                              "was built from, whose float build's uncached output every PSNR is "
                                              "then against (the repository keeps no float weights; default: the "
                                              "folder the build recorded, while its files are unchanged)"),
) -> None:
    """Fit each cache policy's threshold (and MagCache's ratios) to a PSNR target on one prompt set, report it
    on a held-out one; store the best as default (of the model, or of one --task). A quantized build is fitted
    against the float output: its promise holds for precision and cache reuse together."""
    import tempfile

    from machgen.datasets import moving_shapes, shapes
    from machgen.builder.build import build_repository
    from machgen.builder.calibrate import (CONTROL_GRID, FIT_PAIRS, FIT_PROMPTS_SEED, HOLDOUT_PAIRS,
                                           HOLDOUT_PROMPTS_SEED, THRESHOLD_GRIDS, QualityTargets, makes_video,
                                           with_task, write_settings)
    from machgen.builder.calibrate import calibrate as fit
    from machgen.runtime.cache import CacheControls
    from machgen.runtime.local import LocalPipeline

    count, holdout_count = count or FIT_PAIRS, holdout_count or HOLDOUT_PAIRS
    unknown = set(policies or ()) - set(THRESHOLD_GRIDS)
    if unknown:
        raise typer.BadParameter(f"{', '.join(sorted(unknown))}: calibrate fits {', '.join(THRESHOLD_GRIDS)}",
                                 param_hint="--policy")
    threshold_grids = {policy: grid for policy, grid in THRESHOLD_GRIDS.items() if not policies or policy in policies}

    def prompt_sets(video: bool) -> tuple[list, list]:
        dataset = moving_shapes if video else shapes
        if prompts_file is not None:
            prompts = _prompt_file(prompts_file, count, 0)
        else:
            prompts = [(prompt, seed) for prompt, seed, _ in dataset.evaluation_prompts(count, seed=FIT_PROMPTS_SEED)]
        if holdout_file is not None:
            holdout = _prompt_file(holdout_file, holdout_count, HOLDOUT_FILE_FIRST_SEED)
        else:
            holdout = [(prompt, seed) for prompt, seed, _ in
                       dataset.evaluation_prompts(holdout_count, seed=HOLDOUT_PROMPTS_SEED)]
        return prompts, holdout

    def with_pictures(pairs: list, folder: Path | None, from_file: bool, video: bool, seed: int, option: str) -> list:
        """``pairs`` with a picture each: from ``folder``, else (the default moving-shapes pairs, ``from_file``
        false) the first frame of a clip of each caption's motion, drawn with the pair's seed."""
        if folder is not None:
            files = sorted(path for path in folder.iterdir() if path.suffix.lower() in PICTURE_SUFFIXES)
            if len(files) < len(pairs):
                raise typer.BadParameter(f"{len(files)} pictures in {folder} for {len(pairs)} prompts",
                                         param_hint=option)
            return [(prompt, pair_seed, _picture(path)) for (prompt, pair_seed), path in zip(pairs, files)]
        if not video or from_file:
            raise typer.BadParameter(f"--task {task} starts from a picture: give the pairs' pictures",
                                     param_hint=option)
        cases = moving_shapes.evaluation_pictures(len(pairs), seed=seed)  # the pairs' own, with a first frame
        return [(prompt, pair_seed, picture) for (prompt, pair_seed), (_, _, picture, _) in zip(pairs, cases)]

    targets = QualityTargets(target_psnr, target_psnr - 7 if worst_psnr is None else worst_psnr, confidence,
                             worst_tail)
    fixed = {key: value for key, value in {
        "warmup_steps": warmup_steps, "final_steps": final_steps, "max_consecutive_skips": max_consecutive_skips,
        "negative_interval": negative_interval}.items() if value is not None}
    grid = [c for c in CONTROL_GRID if all(getattr(c, key) == value for key, value in fixed.items())]
    grid = grid or [CacheControls(**fixed)]
    model_folder = (target / "model_index.json").is_file()
    if reference_model is not None and (model_folder or not (reference_model / "model_index.json").is_file()):
        raise typer.BadParameter(f"{target} is a model folder, whose calibration build is float: its own uncached "
                                 "output is the float output" if model_folder else
                                 f"{reference_model} is not a diffusers model folder (no model_index.json)",
                                 param_hint="--reference-model")
    with tempfile.TemporaryDirectory(prefix="machgen-calibrate-") as scratch:
        repository, pipeline_name = target, name
        if model_folder:
            repository, pipeline_name = Path(scratch), "calibration"
            build_repository(target, pipeline_name, repository, log=typer.echo)
        try:
            pipeline_name = PipelineManifest.read(find_pipeline_dir(repository, pipeline_name)).name
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--name") from None
        pipeline = LocalPipeline(repository, pipeline_name)
        tasks = pipeline.manifest.tasks
        if task is not None and long_task_name(task) not in tasks:
            raise typer.BadParameter(f"{task!r} is not a task of this model "
                                     f"({', '.join(short_task_name(each) or each for each in tasks)})",
                                     param_hint="--task")
        chosen_task = long_task_name(task) or tasks[0]
        video = makes_video(pipeline)
        prompts, holdout = prompt_sets(video)
        if chosen_task.startswith("image-to-"):
            prompts = with_pictures(prompts, pictures, prompts_file is not None, video, FIT_PROMPTS_SEED, "--pictures")
            holdout = with_pictures(holdout, holdout_pictures, holdout_file is not None, video, HOLDOUT_PROMPTS_SEED,
                                    "--holdout-pictures")
        model_settings = pipeline.sampler.cache_settings
        reference = _float_reference(pipeline, target, reference_model, Path(scratch) / "float-reference")
        try:
            fitted, _ = fit(pipeline, prompts, holdout, targets, control_grid=grid, threshold_grids=threshold_grids,
                            log=typer.echo, task=chosen_task, reference=reference)
        except ValueError as err:
            raise typer.BadParameter(str(err), param_hint="--holdout-prompts") from None
    settings = with_task(model_settings, fitted, chosen_task, tasks[0])
    written = write_settings(target, pipeline_name, settings)
    typer.echo(f"wrote the cache defaults into {written}")


def _float_reference(pipeline, target: Path, reference_model: Path | None, scratch: Path):
    """A quantized build's FloatReference: a float build of ``reference_model`` in ``scratch`` (None for a float
    build); refused where it is needed and not given, or is not the build's model at its served defaults."""
    from machgen.builder.build import build_repository
    from machgen.builder.calibrate import FloatReference, check_reference, precision_words, quantized_components
    from machgen.runtime.local import LocalPipeline

    quantized = quantized_components(pipeline.manifest)
    if not quantized and reference_model is not None:
        raise typer.BadParameter(f"{target} is a float build: its own uncached output is the float output; the "
                                 "option is for a quantized one", param_hint="--reference-model")
    if not quantized:
        return None
    lora = None
    if reference_model is None:
        reference_model, lora = _recorded_source(pipeline.manifest, target, precision_words(quantized))
    typer.echo(f"{pipeline.manifest.name} is built in {precision_words(quantized)}: building the float reference "
               f"from {reference_model}{f' with the LoRA {lora} fused' if lora else ''}")
    try:
        build_repository(reference_model, "reference", scratch, lora=lora, log=typer.echo, preview=False)
        float_pipeline = LocalPipeline(scratch, "reference")
        check_reference(pipeline.manifest, float_pipeline.manifest)
    except (ValueError, KeyError, FileNotFoundError) as err:
        raise typer.BadParameter(f"{reference_model}: {err}", param_hint="--reference-model") from None
    return FloatReference(float_pipeline, str(reference_model), quantized, None if lora is None else str(lora))


def _recorded_source(manifest, target: Path, precision: str) -> tuple[Path, Path | None]:
    """The model folder (and the LoRA it fused) that a quantized build recorded it came from (the manifest's
    ``built_from``), while every file of it is as it was at the build; else a refusal that says what was recorded
    and asks for --reference-model."""
    refusal = (f"{target} is built in {precision}: calibration scores it against the float output, and the "
               "repository keeps no float weights")
    recorded = manifest.built_from
    if not recorded:
        raise typer.BadParameter(f"{refusal}: give the model folder it was built from (this build recorded none: "
                                 "built before machgen recorded it)", param_hint="--reference-model")
    model, lora = Path(recorded["model"]), recorded.get("lora")
    changes = _changes(model, recorded["files"])
    if lora is not None:
        changes += [f"the LoRA it fused: {change}" for change in _changes(Path(lora["path"]), lora["files"])]
    fused = f" with the LoRA {lora['path']} fused" if lora else ""
    if changes:
        raise typer.BadParameter(f"{refusal}; the build recorded the model folder {model}{fused} "
                                 f"({len(recorded['files'])} files), but {'; '.join(changes)}: pass "
                                 "--reference-model, a folder with the weights it was built from",
                                 param_hint="--reference-model")
    typer.echo(f"--reference-model not given: the float reference is the folder this build recorded, {model}{fused} "
               "(every file as it was at the build)")
    return model, None if lora is None else Path(lora["path"])


def _changes(path: Path, recorded: dict[str, str]) -> list[str]:
    """How ``path`` differs from its ``recorded`` file digests (build.source_digests), in words ([]: not at
    all)."""
    from machgen.builder.build import source_digests

    if not path.exists():
        return [f"{path} is gone"]
    now = source_digests(path)
    kinds = {"changed": [name for name in recorded if name in now and now[name] != recorded[name]],
             "gone": [name for name in recorded if name not in now],
             "new": [name for name in now if name not in recorded]}
    said = [f"{len(names)} file{'s' if len(names) > 1 else ''} "
            f"{kind if kind == 'changed' else ('are ' if len(names) > 1 else 'is ') + kind} "
            f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})" for kind, names in kinds.items() if names]
    return [f"since the build {', '.join(said)}"] if said else []
