"""Wan 2.2 TI2V-5B on its tiny layout (a timestep per token, the patchified
Wan 2.2 VAE): the served pipeline against diffusers' WanPipeline
(text-to-video) and WanImageToVideoPipeline (image-to-video), both with
``expand_timesteps``, on the same model, seed and settings, over every
frame, in process and through Triton; cache reuse on it."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import api_on, build_tiny_repository, levels, load_diffusers, metric, picture, serving, write_tiny

pytestmark = [pytest.mark.export,
              pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

MAX_PIXEL_DIFF = 2  # of 255, over all frames
# A refine with its parent's prompt against the parent's clip (Wan's UniPC restarts its history at the step).
SAME_PROMPT_PSNR = 30.0
NAME = "ti2v"
PROMPT = "a red circle at the top"


@pytest.fixture(scope="module")
def tiny_ti2v_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "wan-ti2v")


@pytest.fixture(scope="module")
def ti2v_repository(tiny_ti2v_dir, tmp_path_factory):
    return build_tiny_repository(tmp_path_factory, tiny_ti2v_dir, NAME, in_flight=3, preview=True)


@pytest.fixture(scope="module")
def ti2v_server(ti2v_repository):
    with serving(ti2v_repository) as server:
        yield server


@pytest.fixture(scope="module")
def ti2v_api(ti2v_server, api_keys, tmp_path_factory):
    """``machgen api`` on the served TI2V: the suite's video model for the videos API."""
    with api_on(ti2v_server.grpc_url, api_keys, tmp_path_factory, "ti2v-api") as api:
        yield api


@pytest.fixture(scope="module")
def local_ti2v(ti2v_repository):
    from machgen.runtime.local import LocalPipeline

    return LocalPipeline(ti2v_repository, NAME)


def diffusers_video(tiny_dir, defaults, seed: int, image: np.ndarray | None = None, **call) -> np.ndarray:
    """The pipeline's frames as uint8 levels (int16), [frames, H, W, 3]: WanPipeline without an
    image, WanImageToVideoPipeline on the same folder with one."""
    import diffusers
    import torch
    from PIL import Image

    settings = {key: defaults[key] for key in ("height", "width", "num_frames", "num_inference_steps",
                                               "guidance_scale", "max_sequence_length")}
    if image is None:
        pipe = load_diffusers(tiny_dir)
    else:
        pipe = diffusers.WanImageToVideoPipeline.from_pretrained(tiny_dir, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        settings.update(image=Image.fromarray(image), height=image.shape[0], width=image.shape[1])
    return levels(pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(seed), output_type="np",
                       **{**settings, **call}).frames[0])


def max_diff(ours: np.ndarray, theirs: np.ndarray) -> int:
    assert ours.shape == theirs.shape
    return int(np.abs(ours.astype(np.int16) - theirs).max())


def test_the_folder_is_served_by_its_own_family(tiny_ti2v_dir):
    from machgen.builder.model_folder import detect_family

    family = detect_family(tiny_ti2v_dir)
    assert family.name == "wan-ti2v" and family.capabilities.tasks == ("text-to-video", "image-to-video")


@pytest.mark.parametrize("call", [
    {},  # the served defaults: 64 x 64, 9 frames, 4 steps, CFG 5
    {"num_frames": 17, "height": 32, "width": 96, "num_inference_steps": 5, "guidance_scale": 3.0,
     "negative_prompt": "a blue square"},
    {"num_frames": 1, "guidance_scale": 1.0},  # one frame, no CFG pass
], ids=["defaults", "17-frames-wide", "one-frame-no-cfg"])
def test_in_process_text_to_video_equals_diffusers(local_ti2v, tiny_ti2v_dir, call):
    defaults = local_ti2v.manifest.defaults.to_json()
    frames, stats = local_ti2v.generate(PROMPT, seed=3, cache_policy="none", **call)
    expected = diffusers_video(tiny_ti2v_dir, defaults, 3, **call)
    assert max_diff(frames, expected) <= MAX_PIXEL_DIFF
    assert expected.std() > 5  # a real video, not a constant one
    steps = call.get("num_inference_steps", defaults["num_inference_steps"])
    cfg_rows = 1 if call.get("guidance_scale", defaults["guidance_scale"]) <= 1 else 2
    assert (stats.frames, stats.fps, stats.denoiser_tail_passes) == (len(frames), 24, cfg_rows * steps)


@pytest.mark.parametrize("size, call", [
    ((64, 64), {}),
    ((32, 96), {"num_frames": 13, "num_inference_steps": 5, "guidance_scale": 2.0}),
], ids=["defaults", "13-frames-wide"])
def test_in_process_image_to_video_equals_diffusers(local_ti2v, tiny_ti2v_dir, size, call):
    image = picture(*size, seed=7)
    frames, stats = local_ti2v.generate(PROMPT, image=image, seed=8, cache_policy="none", **call)
    expected = diffusers_video(tiny_ti2v_dir, local_ti2v.manifest.defaults.to_json(), 8, image=image, **call)
    assert max_diff(frames, expected) <= MAX_PIXEL_DIFF
    # the picture conditions the video: the same request without it is another one
    text_only, _ = local_ti2v.generate(PROMPT, seed=8, cache_policy="none", height=size[0], width=size[1], **call)
    assert max_diff(frames, text_only.astype(np.int16)) > 10


def test_cache_reuse_skips_steps_close_to_the_uncached_video(local_ti2v):
    uncached, plain = local_ti2v.generate(PROMPT, seed=4, num_inference_steps=12, cache_policy="none")
    cached, stats = local_ti2v.generate(PROMPT, seed=4, num_inference_steps=12, cache_policy="fbcache",
                                        cache_threshold=0.3)
    assert stats.denoiser_tail_calls < plain.denoiser_tail_calls == 12
    psnr = 10 * np.log10(255.0 ** 2 / np.mean((cached.astype(float) - uncached.astype(float)) ** 2))
    assert psnr > 30, f"cached video {psnr:.1f} dB from the uncached one"


def test_image_to_video_is_calibrated_apart_and_its_requests_run_and_report_its_settings(ti2v_repository,
                                                                                          local_ti2v, tmp_path):
    """machgen-build calibrate --task image-to-video fits settings that requests from a picture run, and report
    the held-out figures of, beside the text's, which stay as they were."""
    import json
    import re
    import shutil

    from PIL import Image
    from typer.testing import CliRunner

    from machgen.builder.cli import app
    from machgen.contract.manifest import pipeline_dir
    from machgen.contract.validation import InvalidArgument
    from machgen.runtime.local import LocalPipeline

    repository = tmp_path / "repository"
    shutil.copytree(ti2v_repository, repository)
    before = json.loads((pipeline_dir(repository, NAME) / "pipeline.json").read_text())["cache"]
    height, width = local_ti2v.manifest.defaults.height, local_ti2v.manifest.defaults.width
    arguments = []
    for kind, first_seed in (("prompts", 0), ("holdout-prompts", 100)):
        (tmp_path / f"{kind}.txt").write_text(f"{PROMPT}\na blue square moves down\n")
        folder = tmp_path / f"{kind}-pictures"
        folder.mkdir()
        for index in range(2):
            Image.fromarray(picture(height, width, seed=first_seed + index)).save(folder / f"{index}.png")
        arguments += [f"--{kind}", str(tmp_path / f"{kind}.txt"),
                      "--pictures" if kind == "prompts" else "--holdout-pictures", str(folder)]
    fit = ["calibrate", str(repository), "--count", "2", "--holdout-count", "2", "--target-psnr", "12",
           "--worst-psnr", "6", "--confidence", "0.5", "--worst-tail", "0.25", "--warmup-steps", "1",
           "--final-steps", "0", "--max-consecutive-skips", "2", "--policy", "magcache"]
    result = CliRunner().invoke(app, [*fit, "--task", "image-to-video", *arguments])
    assert result.exit_code == 0, result.output
    assert "(image-to-video)" in result.output
    cache = json.loads((pipeline_dir(repository, NAME) / "pipeline.json").read_text())["cache"]
    task = cache.pop("tasks")["image-to-video"]
    assert cache == before  # the text's settings as they were
    assert task["calibration"]["task"] == "image-to-video" and task["default_policy"] == "magcache"
    held_out = task["calibration"]["held_out"]["magcache"]

    local = LocalPipeline(repository, NAME)
    image = np.asarray(Image.open(tmp_path / "prompts-pictures" / "0.png"))
    _, stats = local.generate(PROMPT, image=image, seed=0)
    assert (stats.cache_policy, stats.cache_threshold) == ("magcache", task["thresholds"]["magcache"])
    assert (stats.expected_psnr, stats.expected_psnr_worst) == (held_out["psnr_mean"], held_out["psnr_worst"])
    _, text = local.generate(PROMPT, seed=0)
    assert text.cache_policy == before["default_policy"] and text.expected_psnr is None
    # MagCache by name: served where its ratios were fitted, the picture's task here, and refused for text
    assert not before["magnitude_ratios"]
    _, asked = local.generate(PROMPT, image=image, seed=0, cache_policy="magcache")
    assert asked.cache_policy == "magcache" and asked.expected_psnr == held_out["psnr_mean"]
    with pytest.raises(InvalidArgument, match="'magcache' is not served for text-to-video") as refused:
        local.generate(PROMPT, seed=0, cache_policy="magcache")
    assert refused.value.field == "cache_policy"

    # a task the model does not do, and a task from a picture without pictures for a prompt file, are refused
    def refusal(*extra: str) -> str:
        refused = CliRunner().invoke(app, [*fit, *extra])
        assert refused.exit_code == 2
        return " ".join(re.sub("[│╭╮╰╯─]", " ", refused.output).split())  # the error box's text, unwrapped

    assert "--task: 'text-to-image' is not a task of this model" in refusal("--task", "text-to-image")
    assert ("--pictures: --task image-to-video starts from a picture: give the pairs' pictures"
            in refusal("--task", "image-to-video", *arguments[:2]))


def test_requests_are_validated_against_the_model(local_ti2v):
    from machgen.contract.validation import InvalidArgument

    for options, field in [({"num_frames": 8}, "num_frames"), ({"height": 48}, "height"),
                           ({"guidance_scale_2": 2.0}, "guidance_scale_2"), ({"image": picture(48, 64, 0)}, "image"),
                           ({"image": picture(64, 64, 0), "strength": 0.5}, "strength")]:
        with pytest.raises(InvalidArgument) as error:
            local_ti2v.generate(PROMPT, **options)
        assert error.value.field == field


@pytest.mark.integration
def test_served_text_and_image_to_video_equal_diffusers(ti2v_server, local_ti2v, tiny_ti2v_dir):
    from machgen.client import MachgenClient

    defaults = local_ti2v.manifest.defaults.to_json()
    image = picture(64, 64, seed=9)
    progress = []
    with MachgenClient(ti2v_server.grpc_url) as client:
        text_frames, text_stats = client.generate_with_stats(NAME, PROMPT, seed=2, num_inference_steps=3,
                                                             on_progress=progress.append, preview_interval=1)
        image_frames, image_stats = client.generate_with_stats(NAME, PROMPT, image=image, seed=2,
                                                               num_inference_steps=3)
    assert max_diff(text_frames, diffusers_video(tiny_ti2v_dir, defaults, 2, num_inference_steps=3)) <= MAX_PIXEL_DIFF
    assert max_diff(image_frames, diffusers_video(tiny_ti2v_dir, defaults, 2, image=image,
                                                  num_inference_steps=3)) <= MAX_PIXEL_DIFF
    assert text_stats["frames"] == image_stats["frames"] == defaults["num_frames"]
    # A video's preview: a few of its latent frames (first and last among them), the latents' size.
    previews = [p.preview for p in progress if p.preview is not None]
    assert [p.step for p in progress] == [1, 2, 3] and len(previews) == 2
    assert 1 < len(previews[0]) <= 4 and previews[0].shape[1] < text_frames.shape[1]


@pytest.mark.integration
def test_a_lone_request_runs_its_steps_in_the_sampler_with_the_bits_of_the_served_model(ti2v_server):
    """A request alone computes its steps on the sampler's own sessions of the joined head and tail (no call
    reaches NAME_denoiser); requests running together call it, and each gets the frames it got alone."""
    from concurrent.futures import ThreadPoolExecutor

    from machgen.client import MachgenClient

    chain = f"{NAME}_denoiser"
    requests = [dict(seed=seed, num_inference_steps=4, cache_policy="none") for seed in (3, 4, 5)]

    def calls() -> float:
        return metric(ti2v_server, "nv_inference_request_success", chain)

    def generate(request):
        with MachgenClient(ti2v_server.grpc_url) as client:
            return client.generate(NAME, PROMPT, **request)

    before = calls()
    alone = [generate(request) for request in requests]
    assert calls() == before
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(generate, requests))
    assert calls() > before
    for one, other in zip(alone, together):
        np.testing.assert_array_equal(one, other)


@pytest.mark.integration
def test_the_one_interactive_request_among_batch_ones_runs_its_steps_in_the_sampler_and_batch_calls_are_niced(
        ti2v_server, ti2v_repository):
    """Beside an agent's batch requests (ServingOptions.denoiser_nice), a person's request computes every step on
    the sampler's own sessions, not on NAME_denoiser's instances, which the batch calls reach and whose every
    thread runs at nice 10; its frames are the ones it gets alone, bit for bit."""
    import os
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    import psutil

    from machgen.client import MachgenClient
    from machgen.runtime.processes import stub_of

    chain = f"{NAME}_denoiser"
    person = dict(seed=6, num_inference_steps=3, cache_policy="none")
    with MachgenClient(ti2v_server.grpc_url) as client:
        alone = client.generate(NAME, PROMPT, **person)
    before = metric(ti2v_server, "nv_inference_request_success", chain)
    seeds, batch_steps = (7, 8), 80
    stepped = dict.fromkeys(seeds, 0)  # the last step each batch request reported
    connected = threading.Barrier(len(seeds))  # both sent at once, not one alone for its first steps

    def batch(seed: int):
        with MachgenClient(ti2v_server.grpc_url) as client:
            client.is_ready(NAME)
            connected.wait(60)
            return client.generate_with_stats(NAME, PROMPT, seed=seed, num_inference_steps=batch_steps,
                                              cache_policy="none", priority="batch", owner="agent",
                                              on_progress=lambda progress: stepped.__setitem__(seed, progress.step))

    with ThreadPoolExecutor(len(seeds)) as pool:
        burst = [pool.submit(batch, seed) for seed in seeds]
        deadline = time.monotonic() + 120
        while min(stepped.values()) < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        with MachgenClient(ti2v_server.grpc_url) as client:
            frames, stats = client.generate_with_stats(NAME, PROMPT, **person)
        steps_by_then = dict(stepped)
        burst_stats = [future.result()[1] for future in burst]
    assert 1 <= min(steps_by_then.values()) and max(steps_by_then.values()) < batch_steps, (
        f"the batch requests were not both stepping while the person's ran ({steps_by_then}): lengthen them")
    assert stats["priority"] == "interactive" and stats["passes_in_sampler"] == stats["denoiser_tail_passes"] > 0, stats
    np.testing.assert_array_equal(frames, alone)
    assert metric(ti2v_server, "nv_inference_request_success", chain) > before
    assert all(one["passes_in_sampler"] < one["denoiser_tail_passes"] for one in burst_stats), burst_stats
    stubs = [process for process in psutil.process_iter()
             if (stub := stub_of(process)) is not None and stub.model == chain
             and str(ti2v_repository.resolve()) in " ".join(process.cmdline())]
    assert stubs
    assert {os.getpriority(os.PRIO_PROCESS, thread.id) for stub in stubs for thread in stub.threads()} == {10}


def _video_bytes_frames(data: bytes, folder) -> np.ndarray:
    from machgen.client.video import read_mp4

    path = folder / "video.mp4"
    path.write_bytes(data)
    return read_mp4(path)[0]


@pytest.mark.integration
def test_the_openai_videos_api_makes_the_served_video_and_its_mp4(ti2v_server, ti2v_api, tmp_path):
    """videos.create (text, and an input_reference picture), retrieve until completed, download_content:
    the MP4's frames are those of the Triton output's own encoding; each answer one of OpenAI's schemas."""
    import io
    import time

    import httpx
    import openai
    from PIL import Image

    from openai_schema import validate

    from machgen.client import MachgenClient
    from machgen.client.video import read_mp4, write_mp4

    client = openai.OpenAI(base_url=f"{ti2v_api.url}/v1", api_key=ti2v_api.key, max_retries=0)
    start = picture(64, 64, seed=9)
    buffer = io.BytesIO()
    Image.fromarray(start).save(buffer, format="PNG")
    text = client.videos.create(model=NAME, prompt=PROMPT, size="64x64", extra_body={"seed": 3,
                                                                                      "num_inference_steps": 3})
    from_image = client.videos.create(model=NAME, prompt=PROMPT, size="64x64",
                                      input_reference=("start.png", buffer.getvalue(), "image/png"),
                                      extra_body={"seed": 3, "num_inference_steps": 3})
    assert text.status in ("queued", "in_progress") and text.object == "video"
    headers = {"Authorization": f"Bearer {ti2v_api.key}"}
    validate(httpx.get(f"{ti2v_api.url}/v1/videos/{text.id}", headers=headers).json(), "VideoResource")
    expected_options = [{}, {"image": start}]
    with MachgenClient(ti2v_server.grpc_url) as triton:
        for video, options in zip((text, from_image), expected_options):
            deadline = time.monotonic() + 120
            while video.status not in ("completed", "failed") and time.monotonic() < deadline:
                time.sleep(0.1)
                video = client.videos.retrieve(video.id)
            assert video.status == "completed" and video.progress == 100, video
            validate(httpx.get(f"{ti2v_api.url}/v1/videos/{video.id}", headers=headers).json(), "VideoResource")
            frames, stats = triton.generate_with_stats(NAME, PROMPT, seed=3, num_inference_steps=3, **options)
            write_mp4(frames, tmp_path / "expected.mp4", fps=stats["fps"])
            expected = read_mp4(tmp_path / "expected.mp4")[0]
            served = _video_bytes_frames(client.videos.download_content(video.id).content, tmp_path)
            assert served.shape == expected.shape == frames.shape
            assert np.abs(served.astype(int) - expected.astype(int)).max() <= MAX_PIXEL_DIFF
            thumbnail = client.videos.download_content(video.id, variant="thumbnail")
            assert thumbnail.response.headers["content-type"] == "image/webp"  # OpenAI's thumbnail format
            assert np.array_equal(np.asarray(Image.open(io.BytesIO(thumbnail.content))), frames[0])  # lossless
    spritesheet = httpx.get(f"{ti2v_api.url}/v1/videos/{text.id}/content?variant=spritesheet", headers=headers)
    assert spritesheet.status_code == 400 and spritesheet.json()["error"]["code"] == "unsupported_value"
    listed = [video.id for video in client.videos.list()]
    assert listed[:2] == [from_image.id, text.id]
    newest = httpx.get(f"{ti2v_api.url}/v1/videos?limit=1", headers=headers).json()
    validate(newest, "VideoListResource")
    assert [v["id"] for v in newest["data"]] == [from_image.id] and newest["has_more"]
    oldest_first = client.videos.list(order="asc", after=text.id, limit=100)
    assert [video.id for video in oldest_first.data][:1] == [from_image.id] and not oldest_first.has_more


@pytest.mark.integration
def test_deleting_a_running_video_stops_it_within_two_steps(ti2v_server, ti2v_api):
    """videos.delete: OpenAI's deleted object, the video gone (404 after); the server stops its request
    within two steps of seeing the withdrawal, and the slot is free for the next video."""
    import time

    import httpx
    import openai

    from openai_schema import validate

    from conftest import steps_after_stop_asked

    client = openai.OpenAI(base_url=f"{ti2v_api.url}/v1", api_key=ti2v_api.key, max_retries=0)
    # The most steps: the video must still run when the delete comes, even on loaded cores (500 ended first once).
    video = client.videos.create(model=NAME, prompt=PROMPT, extra_body={"num_inference_steps": 1000})
    deadline = time.monotonic() + 60
    while client.videos.retrieve(video.id).progress < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    deleted = httpx.delete(f"{ti2v_api.url}/v1/videos/{video.id}", headers={"Authorization": f"Bearer {ti2v_api.key}"},
                           timeout=60).json()
    validate(deleted, "DeletedVideoResource")
    assert deleted == {"id": video.id, "object": "video.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    with pytest.raises(openai.NotFoundError):
        client.videos.delete(video.id)
    assert steps_after_stop_asked(ti2v_server, f"{video.id}-0") <= 1
    again = client.videos.create(model=NAME, prompt=PROMPT, extra_body={"num_inference_steps": 2})
    while again.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.1)
        again = client.videos.retrieve(again.id)
    assert again.status == "completed"


@pytest.mark.integration
def test_a_video_request_the_model_refuses_is_400_naming_the_field(ti2v_api):
    import httpx

    headers = {"Authorization": f"Bearer {ti2v_api.key}"}
    for body, param in [({"num_frames": 6}, "num_frames"), ({"size": "60x64"}, "width"),
                        ({"seconds": "-1"}, "seconds")]:
        response = httpx.post(f"{ti2v_api.url}/v1/videos", headers=headers,
                              json={"model": NAME, "prompt": PROMPT, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


@pytest.mark.integration
def test_a_video_refine_goes_on_from_its_parents_latents(ti2v_server, ti2v_api, tmp_path):
    """keep_latents on a video job; a refine (parent, step or strength) gives what the model gives for its prompt
    from the parent's latents at that step, asked directly (with the parent's prompt, near the parent's clip);
    OpenAI's remix is one; an image-to-video parent's refine takes its picture again; its length is the parent's."""
    import base64
    import io
    import time

    import httpx
    from PIL import Image

    from machgen.builder.evaluate import psnr
    from machgen.client import MachgenClient
    from machgen.client.video import read_mp4, write_mp4

    from openai_schema import validate

    headers = {"Authorization": f"Bearer {ti2v_api.key}"}
    settings = {"seed": 3, "num_inference_steps": 4, "cache_policy": "none", "size": "64x64"}
    buffer = io.BytesIO()
    Image.fromarray(picture(64, 64, seed=9)).save(buffer, format="PNG")
    start = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()

    def create(**fields) -> httpx.Response:
        return httpx.post(f"{ti2v_api.url}/v1/videos", headers=headers, timeout=60,
                          json={"model": NAME, "prompt": PROMPT, **settings, **fields})

    def finished(**fields) -> tuple[dict, np.ndarray]:
        answer = create(**fields)
        assert answer.status_code == 200, answer.text
        return finished_video(answer.json()["id"])

    def finished_video(video_id: str) -> tuple[dict, np.ndarray]:
        video, deadline = {"id": video_id, "status": "queued"}, time.monotonic() + 120
        while video["status"] not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.1)
            video = httpx.get(f"{ti2v_api.url}/v1/videos/{video['id']}", headers=headers, timeout=30).json()
        assert video["status"] == "completed", video
        validate(video, "VideoResource")
        content = httpx.get(f"{ti2v_api.url}/v1/videos/{video['id']}/content", headers=headers, timeout=30)
        (tmp_path / "served.mp4").write_bytes(content.content)
        return video, read_mp4(tmp_path / "served.mp4")[0]

    def difference(a: np.ndarray, b: np.ndarray) -> int:
        return int(np.abs(a.astype(int) - b.astype(int)).max())

    def direct_refine(prompt: str) -> np.ndarray:
        """What the model gives for ``prompt`` from the parent's latents after step 2, asked directly."""
        with MachgenClient(ti2v_server.grpc_url) as client:
            trajectory = client.generate_all(NAME, PROMPT, seed=3, num_inference_steps=4, cache_policy="none",
                                             trajectory_steps=[2]).trajectory
            expected, stats = client.generate_with_stats(NAME, prompt, seed=3, num_inference_steps=4,
                                                         cache_policy="none", start_step=2,
                                                         start_latents=trajectory[0])
        write_mp4(expected, tmp_path / "expected.mp4", fps=stats["fps"])
        return read_mp4(tmp_path / "expected.mp4")[0]

    parent, parent_frames = finished(keep_latents=True)
    assert [entry["steps"] for entry in parent["latents"]] == [[1, 2, 3]]
    again, same_prompt = finished(parent=parent["id"], step=2)
    assert again["remixed_from_video_id"] == parent["id"]
    assert again["refines"] == {"parent": parent["id"], "parent_index": 0, "step": 2}
    assert again["stats"][0]["steps"] == 2 and difference(same_prompt, direct_refine(PROMPT)) <= MAX_PIXEL_DIFF
    # Wan's multistep UniPC restarts its history at the step (docs/model-api.md start_step): near the parent's
    # clip, not equal to it as a Flux refine is.
    assert psnr(same_prompt, parent_frames) >= SAME_PROMPT_PSNR, psnr(same_prompt, parent_frames)

    new_prompt = "a green square at the bottom"
    refined, frames = finished(prompt=new_prompt, parent=parent["id"], strength=0.5)
    assert difference(frames, direct_refine(new_prompt)) <= MAX_PIXEL_DIFF
    assert difference(frames, same_prompt) > MAX_PIXEL_DIFF  # the new prompt reached the steps
    # OpenAI's remix: the same refine, from half the steps
    import openai

    remix = openai.OpenAI(base_url=f"{ti2v_api.url}/v1", api_key=ti2v_api.key, max_retries=0).videos.remix(
        parent["id"], prompt=new_prompt)
    assert remix.remixed_from_video_id == parent["id"]
    remixed, remixed_frames = finished_video(remix.id)
    assert remixed["refines"]["step"] == 2 and difference(remixed_frames, frames) == 0

    from_picture, picture_frames = finished(input_reference=start, keep_latents=[2])
    refused = create(parent=from_picture["id"], step=2)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input_reference", refused.text
    _, frames = finished(parent=from_picture["id"], step=2, input_reference=start)
    assert psnr(frames, picture_frames) >= SAME_PROMPT_PSNR, psnr(frames, picture_frames)
    for fields, param in [({"num_frames": parent["num_frames"] + 4}, "num_frames"), ({"step": 4}, "step"),
                          ({"explore": {"keep": 1, "scorer": "shapes"}}, "explore"),
                          ({"num_inference_steps": 6}, "num_inference_steps")]:
        refused = create(parent=parent["id"], **{"step": 2, **fields})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (fields, refused.text)


@pytest.mark.integration
def test_a_video_explore_continues_only_the_best_clips(ti2v_server, ti2v_api, tmp_path):
    """POST /v1/videos with n variants and an explore: every clip runs to the scoring step, the agent's scorer
    gets each early clip (an MP4), the best explore.keep continue (near their seeds' full runs: Wan's UniPC
    restarts its history at the step), the others stop there; the video object lists them ranked."""
    import base64
    import json
    import time

    import httpx

    from conftest import agent_scorer
    from machgen.builder.evaluate import psnr
    from machgen.client import MachgenClient
    from machgen.client.video import write_mp4

    headers = {"Authorization": f"Bearer {ti2v_api.key}"}
    body = {"model": NAME, "prompt": PROMPT, "seed": 50, "num_inference_steps": 4, "cache_policy": "none",
            "size": "64x64"}

    def create(**fields) -> httpx.Response:
        return httpx.post(f"{ti2v_api.url}/v1/videos", headers=headers, timeout=60, json={**body, **fields})

    def content(video_id: str, **params) -> httpx.Response:
        return httpx.get(f"{ti2v_api.url}/v1/videos/{video_id}/content", headers=headers, params=params, timeout=30)

    with agent_scorer() as scorer:
        scorer.scores = [0.2, 0.9, 0.5]
        answer = create(n=3, explore={"keep": 2, "at_step": 1, "scorer": scorer.url})
        assert answer.status_code == 200, answer.text
        video, deadline = answer.json(), time.monotonic() + 120
        while video["status"] not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.1)
            video = httpx.get(f"{ti2v_api.url}/v1/videos/{video['id']}", headers=headers, timeout=30).json()
        assert video["status"] == "completed", video
        sent = next(json.loads(b)["data"] for _, b in scorer.asked if json.loads(b)["type"] == "explore.score")
    ranked = [(v["index"], v["status"], v["steps"]) for v in video["explored"]["variants"]]
    assert ranked == [(1, "continued", 4), (2, "continued", 4), (0, "pruned", 1)]
    assert video["n"] == 2 and video["seed"] == 51 and len(video["stats"]) == 2
    assert [v["seed"] for v in sent["variants"]] == [50, 51, 52]
    early_clip = base64.b64decode(sent["variants"][0]["video"].split(",", 1)[1])
    assert sent["variants"][0]["video"].startswith("data:video/mp4;base64,") and early_clip[4:8] == b"ftyp"
    early = content(video["id"], early=0)
    assert early.status_code == 200 and early.headers["content-type"] == "video/mp4" and early.content == early_clip
    # The continued clips, best first, near their seeds' full runs.
    with MachgenClient(ti2v_server.grpc_url) as client:
        for index, seed in enumerate((51, 52)):
            frames, stats = client.generate_with_stats(NAME, PROMPT, seed=seed, num_inference_steps=4,
                                                       cache_policy="none", width=64, height=64)
            write_mp4(frames, tmp_path / "expected.mp4", fps=stats["fps"])
            served = _video_bytes_frames(content(video["id"], index=index).content, tmp_path)
            full = _video_bytes_frames((tmp_path / "expected.mp4").read_bytes(), tmp_path)
            assert psnr(served, full) >= SAME_PROMPT_PSNR, (seed, psnr(served, full))
    assert content(video["id"], index=2).json()["error"]["param"] == "index"
    # The built-in scorer reads each early clip with the moving-shapes detector (none on random weights: 0).
    detected = create(n=2, explore={"keep": 1, "scorer": "shapes"})
    assert detected.status_code == 200, detected.text
    while detected.json()["status"] not in ("completed", "failed"):
        time.sleep(0.1)
        detected = httpx.get(f"{ti2v_api.url}/v1/videos/{detected.json()['id']}", headers=headers, timeout=30)
    explored = detected.json()["explored"]
    assert detected.json()["status"] == "completed" and explored["problem"] is None, detected.json()
    assert all(0.0 <= v["score"] <= 1.0 for v in explored["variants"])
    for fields, param in [({"n": 2}, "n"), ({"prompts": ["a blue square"]}, "prompts"),
                          ({"n": 2, "explore": {"keep": 2, "scorer": "shapes"}}, "explore.keep")]:
        refused = create(**fields)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (fields, refused.text)
