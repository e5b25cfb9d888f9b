"""Prompt accuracy of a shapes model: generate a fixed prompt/seed set, read
each image (or clip) back with the detector, count what matches the prompt.

Two ways to generate, scored identically: diffusers' pipeline on a model
folder (at the model card's settings), or a served model through Triton
(sending only prompt and seed, so the served defaults apply). Video models
(the moving-shapes default, machgen/datasets/moving_shapes.py) are scored
on colour, shape and direction of motion; image-to-video also on whether
the first frame is the given picture through the VAE's round trip.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from machgen.datasets import moving_shapes, shapes

# Image-to-video: the first frame must be the picture's VAE round trip at least this closely.
FIRST_FRAME_PSNR = 30.0

@dataclass(frozen=True)
class Accuracy:
    count: int
    colour_shape: float
    position: float
    all_three: float
    nothing_found: int


def score(images: Sequence[np.ndarray], labels: Sequence[shapes.Label], palette=shapes.PALETTE) -> Accuracy:
    found = [shapes.detect(image, palette) for image in images]
    colour_shape = [f is not None and (f.colour, f.shape) == (l.colour, l.shape) for f, l in zip(found, labels)]
    position = [f is not None and f.position == l.position for f, l in zip(found, labels)]
    return Accuracy(len(labels), round(float(np.mean(colour_shape)), 4), round(float(np.mean(position)), 4),
                    round(float(np.mean([f == l for f, l in zip(found, labels)])), 4),
                    sum(f is None for f in found))


def generate_with_diffusers(model_dir: Path, prompts, chunk: int = 35, lora: Path | None = None,
                            adapters: Sequence[tuple[Path, float]] = (), **overrides) -> np.ndarray:
    """Images from FluxPipeline at the model card's settings (machgen.json),
    with a LoRA loaded by diffusers' own loader when given, or several
    (``adapters``: folder and weight each, as set_adapters weighs them)."""
    import torch

    from machgen.builder.model_folder import detect_family, load_pipeline, served_defaults

    family = detect_family(model_dir)
    pipe = load_pipeline(model_dir, family)
    if lora is not None:
        pipe.load_lora_weights(lora)
    for index, (folder, _) in enumerate(adapters):
        pipe.load_lora_weights(folder, adapter_name=f"adapter{index}")
    if adapters:
        pipe.set_adapters([f"adapter{index}" for index in range(len(adapters))],
                          adapter_weights=[weight for _, weight in adapters])
    pipe.set_progress_bar_config(disable=True)
    defaults = served_defaults(model_dir, family, pipe)
    call = dict(height=defaults.height, width=defaults.width, num_inference_steps=defaults.num_inference_steps,
                guidance_scale=defaults.guidance_scale, true_cfg_scale=defaults.true_cfg_scale,
                max_sequence_length=defaults.max_sequence_length)
    call.update(overrides)
    negative = defaults.negative_prompt
    images = []
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        extra = {"negative_prompt": [negative] * len(part)} if negative is not None else {}
        out = pipe([p for p, _, _ in part], generator=[torch.Generator("cpu").manual_seed(s) for _, s, _ in part],
                   output_type="np", **extra, **call).images
        images.append((out * 255).round().astype(np.uint8))
    return np.concatenate(images)


def generate_served(url: str, model: str, prompts, protocol: str = "grpc", pictures=None, video: bool = False,
                    **options) -> np.ndarray:
    """Images (``video``: clips [N, F, H, W, 3]) from a served model, sending
    only prompt and seed (and ``options``; ``pictures``: a first frame per
    prompt, for image-to-video)."""
    from machgen.client import MachgenClient

    with MachgenClient(url, protocol) as client:
        results = []
        for index, (prompt, seed, _) in enumerate(prompts):
            picture = {"image": pictures[index]} if pictures is not None else {}
            frames = client.generate(model, prompt, seed=seed, **picture, **options)
            results.append(frames if video else frames[0])
        return np.stack(results)


def save_grid(images: np.ndarray, path: Path, columns: int = 10, scale: int = 2) -> None:
    from PIL import Image

    rows = (len(images) + columns - 1) // columns
    size = images.shape[1]
    grid = np.zeros((rows * (size + 2), columns * (size + 2), 3), np.uint8)
    for i, image in enumerate(images):
        r, c = divmod(i, columns)
        grid[r * (size + 2) + 1:r * (size + 2) + 1 + size, c * (size + 2) + 1:c * (size + 2) + 1 + size] = image
    Image.fromarray(grid).resize((grid.shape[1] * scale, grid.shape[0] * scale), Image.NEAREST).save(path)


def psnr(image: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio of two uint8 images, dB (99 when identical)."""
    mse = float(np.mean((image.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return 99.0 if mse == 0 else float(10 * np.log10(255.0**2 / mse))


def _box_mean(channel: np.ndarray, size: int) -> np.ndarray:
    """Mean over each valid size x size window."""
    total = np.cumsum(np.cumsum(np.pad(channel, ((1, 0), (1, 0))), axis=0), axis=1)
    return (total[size:, size:] - total[:-size, size:] - total[size:, :-size] + total[:-size, :-size]) / size**2


def ssim(image: np.ndarray, reference: np.ndarray, window: int = 7) -> float:
    """Structural similarity of two uint8 HxWx3 images: 7x7 uniform windows,
    the usual constants, averaged over windows and channels (as scikit-image's
    default)."""
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    scores = []
    for channel in range(image.shape[-1]):
        x = image[..., channel].astype(np.float64)
        y = reference[..., channel].astype(np.float64)
        n = window**2
        mx, my = _box_mean(x, window), _box_mean(y, window)
        # sample (co)variances, as scikit-image computes them
        vx = (_box_mean(x * x, window) - mx * mx) * n / (n - 1)
        vy = (_box_mean(y * y, window) - my * my) * n / (n - 1)
        cov = (_box_mean(x * y, window) - mx * my) * n / (n - 1)
        scores.append(((2 * mx * my + c1) * (2 * cov + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2))).mean())
    return float(np.mean(scores))


# --------------------------------------------------------------------- video
@dataclass(frozen=True)
class MotionAccuracy:
    count: int
    colour_shape: float
    direction: float
    all_three: float
    nothing_found: int
    # Image-to-video: mean PSNR of the first frame against the picture's VAE round trip, and the share of
    # clips that read right with a first frame at least FIRST_FRAME_PSNR close.
    first_frame_psnr: float | None = None
    all_with_first_frame: float | None = None


def score_motion(videos: Sequence[np.ndarray], motions: Sequence[moving_shapes.Motion],
                 round_trips: Sequence[np.ndarray] | None = None) -> MotionAccuracy:
    found = [moving_shapes.detect(video) for video in videos]
    colour_shape = [f is not None and (f.colour, f.shape) == (m.colour, m.shape) for f, m in zip(found, motions)]
    direction = [f is not None and f.direction == m.direction for f, m in zip(found, motions)]
    right = [f == m for f, m in zip(found, motions)]
    first = None
    if round_trips is not None:
        first = [psnr(video[0], picture) for video, picture in zip(videos, round_trips)]
        together = [r and p >= FIRST_FRAME_PSNR for r, p in zip(right, first)]
    return MotionAccuracy(len(motions), round(float(np.mean(colour_shape)), 4), round(float(np.mean(direction)), 4),
                          round(float(np.mean(right)), 4), sum(f is None for f in found),
                          None if first is None else round(float(np.mean(first)), 2),
                          None if first is None else round(float(np.mean(together)), 4))


def video_round_trips(model_dir: Path, pictures: np.ndarray) -> np.ndarray:
    """Each picture through the model's VAE (encoded as a one-frame clip, decoded): what image-to-video's
    first frame is."""
    import diffusers

    from machgen.builder.vae_clips import decode_latents, encode_clips

    vae = diffusers.AutoencoderKLWan.from_pretrained(model_dir / "vae")
    return decode_latents(vae, encode_clips(vae, np.asarray(pictures)[:, None]))[:, 0]


def generate_videos_with_diffusers(model_dir: Path, prompts, pictures=None, seconds: list | None = None,
                                   chunk: int = 1, **overrides) -> np.ndarray:
    """Clips [N, F, H, W, 3] from diffusers' WanPipeline (or, with
    ``pictures``, WanImageToVideoPipeline on the same folder) at the model
    card's settings (machgen.json); ``seconds`` gets each clip's time;
    ``chunk``: text-to-video clips a call (sample_videos)."""
    from machgen.builder.model_folder import detect_family, load_pipeline, served_defaults

    family = detect_family(model_dir)
    pipe = load_pipeline(model_dir, family)
    return sample_videos(pipe, served_defaults(model_dir, family, pipe), prompts, pictures, seconds, chunk,
                         **overrides)


def sample_videos(pipe, defaults, prompts, pictures=None, seconds: list | None = None, chunk: int = 1,
                  **overrides) -> np.ndarray:
    """Clips [N, F, H, W, 3] from a loaded WanPipeline at ``defaults`` (ServedDefaults), one per (prompt, seed,
    _) with its own generator; with ``pictures``, image-to-video through WanImageToVideoPipeline.from_pipe.
    Text-to-video runs ``chunk`` clips a call (each row its own generator: the clips of one-at-a-time calls
    within a level; a full-size model's activations ``chunk`` times over, so one by default); one at a time
    where ``seconds`` gets each clip's time, and from pictures (diffusers' Wan image-to-video takes one picture
    a call)."""
    import time

    import diffusers
    import torch
    from PIL import Image

    if pictures is not None:
        pipe = diffusers.WanImageToVideoPipeline.from_pipe(pipe)
    pipe.set_progress_bar_config(disable=True)
    call = dict(height=defaults.height, width=defaults.width, num_frames=defaults.num_frames,
                num_inference_steps=defaults.num_inference_steps, guidance_scale=defaults.guidance_scale,
                max_sequence_length=defaults.max_sequence_length)
    call.update(overrides)
    negative = call.pop("negative_prompt", defaults.negative_prompt) or ""
    per_call = 1 if seconds is not None or pictures is not None else max(chunk, 1)
    videos = []
    for first in range(0, len(prompts), per_call):
        part = prompts[first:first + per_call]
        picture = {"image": Image.fromarray(pictures[first])} if pictures is not None else {}
        start = time.perf_counter()
        frames = pipe(prompt=[prompt for prompt, _, _ in part], negative_prompt=[negative] * len(part),
                      generator=[torch.Generator("cpu").manual_seed(seed) for _, seed, _ in part], output_type="np",
                      **picture, **call).frames
        videos += [(clip * 255).round().astype(np.uint8) for clip in frames]
        if seconds is not None:
            seconds.append(time.perf_counter() - start)
    return np.stack(videos)


def report(accuracy: "Accuracy | MotionAccuracy") -> str:
    return json.dumps(asdict(accuracy))
