"""Text-to-video with sound on the tiny LTX-2 (LTX-2.3's layout): the served
pipeline against diffusers' LTX2Pipeline on the same model, seed and
settings, every frame and the whole sound track, with each guidance the
pipeline has (classifier-free, spatio-temporal, modality isolation,
rescale; the sound's own scales); cache reuse and batching across requests."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import api_on, build_tiny_repository, levels, load_diffusers, picture, serving, write_tiny

MAX_PIXEL_DIFF = 2  # of 255, over all frames
MAX_AUDIO_DIFF = 1e-4  # of samples in [-1, 1] (the tiny model's sound peaks near 0.1)
NAME = "ltx2"
# Image-to-video and the sparse-attention build: other pipelines of the module's one repository.
I2V_NAME = "ltx2_i2v"
PROMPT = "a robot dancing"
# Every guidance off: one row per step.
UNGUIDED = {"guidance_scale": 1.0, "stg_scale": 0.0, "modality_scale": 1.0, "audio_guidance_scale": 1.0,
            "audio_stg_scale": 0.0, "audio_modality_scale": 1.0}


@pytest.fixture(scope="module")
def tiny_ltx2_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "ltx2")


@pytest.fixture(scope="module")
def ltx2_pipeline(tiny_ltx2_dir):
    return load_diffusers(tiny_ltx2_dir)


@pytest.fixture(scope="module")
def ltx2_repository(tiny_ltx2_dir, tmp_path_factory):
    # The tiny model's head and tail cost about the same, so concurrent requests fall into step with
    # each other across the two (one in the head while another is in the tail) and rarely meet at
    # either: a per-step wait of 50 ms makes their calls meet (those released by one forward arrive
    # within a few ms; the served default, 0, is for CPU latency).
    return build_tiny_repository(tmp_path_factory, tiny_ltx2_dir, NAME, in_flight=3,
                                 step_queue_delay_us=50_000)


@pytest.fixture(scope="module")
def ltx2_server(ltx2_repository):
    with serving(ltx2_repository) as server:
        yield server


@pytest.fixture(scope="module")
def local_ltx2(ltx2_repository):
    from machgen.runtime.local import LocalPipeline

    return LocalPipeline(ltx2_repository, NAME)


def diffusers_clip(pipe, defaults, seed: int, **call) -> tuple[np.ndarray, np.ndarray]:
    """LTX2Pipeline's frames as uint8 levels (int16) [frames, H, W, 3] and its
    sound [channels, samples], for the API's names of the settings."""
    import torch

    settings = {key: defaults[key] for key in ("height", "width", "num_frames", "num_inference_steps",
                                               "guidance_scale", "max_sequence_length", "negative_prompt")}
    settings.update(defaults["family_inputs"])
    settings.update(call)
    settings["frame_rate"] = settings.pop("fps", defaults["fps"])
    settings["spatio_temporal_guidance_blocks"] = settings.pop("stg_blocks")
    # (LTX2ImageToVideoPipeline takes the image first: every argument by name)
    out = pipe(prompt=PROMPT, generator=torch.Generator().manual_seed(seed), output_type="np", **settings)
    return levels(out.frames[0]), out.audio[0].float().numpy()


def assert_same_clip(frames, audio, expected) -> None:
    want_frames, want_audio = expected
    assert frames.shape == want_frames.shape and audio.shape == want_audio.shape
    assert np.abs(frames.astype(np.int16) - want_frames).max() <= MAX_PIXEL_DIFF
    assert np.abs(audio - want_audio).max() <= MAX_AUDIO_DIFF


@pytest.mark.parametrize("call, rows", [
    ({}, 4),  # the served defaults: 5 frames at 25 fps, 4 steps, CFG + STG (last block) + modality, rescaled
    ({"num_frames": 9, "height": 64, "width": 32, "num_inference_steps": 5, "guidance_scale": 4.0, "fps": 12,
      "negative_prompt": "a blue square", "stg_scale": 3.0, "stg_blocks": [0, 1], "audio_guidance_scale": 2.0,
      "modality_scale": 1.0, "audio_modality_scale": 1.0, "guidance_rescale": 0.0}, 3),
    ({**UNGUIDED, "num_inference_steps": 3, "num_frames": 1}, 1),
], ids=["defaults", "9-frames-12-fps-stg-two-blocks", "one-frame-unguided"])
def test_in_process_video_and_sound_equal_diffusers(local_ltx2, ltx2_pipeline, call, rows):
    defaults = local_ltx2.manifest.defaults.to_json()
    frames, audio, stats = local_ltx2.generate_with_audio(PROMPT, seed=5, cache_policy="none", **call)
    assert_same_clip(frames, audio, diffusers_clip(ltx2_pipeline, defaults, 5, **call))
    steps = call.get("num_inference_steps", defaults["num_inference_steps"])
    assert (stats.frames, stats.fps, stats.sample_rate) == (len(frames), call.get("fps", 25), 16000)
    assert stats.denoiser_tail_passes == rows * steps  # every guidance pass is a row of the step's one call


@pytest.mark.parametrize("off", [
    {"guidance_scale": 1.0, "audio_guidance_scale": 1.0},
    {"stg_scale": 0.0, "audio_stg_scale": 0.0},
    {"modality_scale": 1.0, "audio_modality_scale": 1.0},
    {"guidance_rescale": 0.0, "audio_guidance_rescale": 0.0},
    {"audio_guidance_scale": 2.0},
], ids=["cfg", "stg", "modality", "rescale", "sound-scale"])
def test_each_guidance_changes_the_clip_beyond_the_tolerances(local_ltx2, off):
    """So that the parity above checks every pass: each one, left out, moves
    the frames or the sound by more than the parity tolerance."""
    strong = {"stg_scale": 3.0}  # the tiny model's spatio-temporal guidance is weak at the default 1
    frames, audio, _ = local_ltx2.generate_with_audio(PROMPT, seed=6, cache_policy="none", **strong)
    other_frames, other_audio, _ = local_ltx2.generate_with_audio(PROMPT, seed=6, cache_policy="none",
                                                                  **{**strong, **off})
    assert (np.abs(frames.astype(np.int16) - other_frames).max() > 2 * MAX_PIXEL_DIFF
            or np.abs(audio - other_audio).max() > 10 * MAX_AUDIO_DIFF)


def test_the_frame_rate_sets_the_sound_length_and_moves_the_video(local_ltx2):
    at_25, audio_25, _ = local_ltx2.generate_with_audio(PROMPT, seed=7, fps=25, num_frames=9, cache_policy="none")
    at_12, audio_12, _ = local_ltx2.generate_with_audio(PROMPT, seed=7, fps=12, num_frames=9, cache_policy="none")
    assert np.abs(at_25.astype(np.int16) - at_12).max() > 2
    # 9 frames: 0.36 s at 25 fps, 0.75 s at 12 fps
    assert audio_12.shape[1] > 1.8 * audio_25.shape[1]


def test_first_block_cache_skips_steps_of_video_and_sound(local_ltx2):
    uncached, sound, plain = local_ltx2.generate_with_audio(PROMPT, seed=8, num_inference_steps=12,
                                                           cache_policy="none")
    cached, cached_sound, stats = local_ltx2.generate_with_audio(PROMPT, seed=8, num_inference_steps=12,
                                                                cache_policy="fbcache", cache_threshold=0.5)
    assert stats.denoiser_tail_passes < plain.denoiser_tail_passes
    psnr = 10 * np.log10(255.0 ** 2 / max(np.mean((cached.astype(float) - uncached.astype(float)) ** 2), 1e-12))
    assert psnr > 25, f"cached video {psnr:.1f} dB from the uncached one"
    assert np.abs(cached_sound - sound).max() < 0.2 * np.abs(sound).max()


def test_requests_are_validated_against_the_model(local_ltx2):
    from machgen.contract.validation import InvalidArgument

    for options, field in [({"stg_blocks": [2]}, "stg_blocks"), ({"stg_blocks": [1, 1]}, "stg_blocks"),
                           ({"guidance_rescale": 1.5}, "guidance_rescale"), ({"audio_stg_scale": -1.0},
                                                                             "audio_stg_scale"),
                           ({"num_frames": 4}, "num_frames"), ({"height": 48}, "height"),
                           ({"true_cfg_scale": 2.0}, "true_cfg_scale")]:
        with pytest.raises(InvalidArgument) as error:
            local_ltx2.generate(PROMPT, **options)
        assert error.value.field == field


def test_only_a_model_with_sound_declares_the_audio_output(ltx2_repository):
    from machgen.builder.repository import ServingOptions, render_public_config
    from machgen.families.registry import get_family

    assert 'name: "audio"' in (ltx2_repository / NAME / "config.pbtxt").read_text()
    assert 'name: "audio"' not in render_public_config("silent", get_family("flux"), ServingOptions())


@pytest.mark.integration
def test_served_video_and_sound_equal_diffusers_and_concurrent_requests_share_forwards(ltx2_server,
                                                                                       local_ltx2, ltx2_pipeline,
                                                                                       tmp_path):
    from machgen.client import MachgenClient
    from machgen.client.video import read_audio, read_mp4

    defaults = local_ltx2.manifest.defaults.to_json()
    # One size, so that every step's rows can share a forward (the CLI below makes another size).
    requests = [dict(seed=10 + i, num_frames=5, num_inference_steps=(4, 4, 3)[i],
                     **({"stg_blocks": [0], "negative_prompt": "a blue square"} if i == 1 else {}))
                for i in range(3)]

    def generate(settings, url):
        with MachgenClient(url) as client:
            return client.generate_all(NAME, PROMPT, cache_policy="none", **settings)

    server = ltx2_server
    solo = [generate(settings, server.grpc_url) for settings in requests]
    with MachgenClient(server.grpc_url) as client:
        # A step that runs the whole denoiser calls the joined head and tail, NAME_denoiser.
        before = client.rows_and_forwards(f"{NAME}_denoiser")
        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(lambda settings: generate(settings, server.grpc_url), requests))
        after = client.rows_and_forwards(f"{NAME}_denoiser")
    with MachgenClient(server.http_url, protocol="http") as client:
        over_http = client.generate_all(NAME, PROMPT, cache_policy="none", **requests[0])
    from typer.testing import CliRunner

    from machgen.cli import app

    clip = tmp_path / "clip.mp4"
    done = CliRunner().invoke(app, ["generate", "--url", server.grpc_url, "--model", NAME, "--task", "t2v",
                                    "--prompt", PROMPT, "--seed", "3", "--num-frames", "9", "--out", str(clip)])
    assert done.exit_code == 0, done.output
    for settings, generated in zip(requests, solo):
        expected = diffusers_clip(ltx2_pipeline, defaults, settings["seed"],
                                  **{k: v for k, v in settings.items() if k != "seed"})
        assert_same_clip(generated.images, generated.audio, expected)
        assert (generated.stats["frames"], generated.stats["sample_rate"]) == (settings["num_frames"], 16000)
    assert np.array_equal(over_http.images, solo[0].images) and np.array_equal(over_http.audio, solo[0].audio)
    for alone, batched in zip(solo, together):
        assert np.abs(batched.images.astype(np.int16) - alone.images).max() <= MAX_PIXEL_DIFF
        assert np.abs(batched.audio - alone.audio).max() <= MAX_AUDIO_DIFF
    rows, forwards = after[0] - before[0], after[1] - before[1]
    # The first request's steps before the others arrived ran in the sampler (it was alone).
    in_sampler = sum(generated.stats["passes_in_sampler"] for generated in together)
    assert rows + in_sampler == 4 * sum(settings["num_inference_steps"] for settings in requests)
    assert rows / forwards > 5, f"{rows} denoiser rows in {forwards} forwards"  # 4 per request and call
    frames, fps = read_mp4(clip)
    sound, rate = read_audio(clip)
    _, generated, _ = local_ltx2.generate_with_audio(PROMPT, seed=3, num_frames=9)
    assert (len(frames), fps, rate, sound.shape[0]) == (9, 25.0, 16000, 2)
    # AAC codes whole frames of 1024 samples (the tiny vocoder makes far fewer samples than its rate says)
    assert generated.shape[1] <= sound.shape[1] <= generated.shape[1] + 2048


# A machgen that does not know LTX-2, in a subprocess: its registry finds every family package but ltx2's, an
# import of LTX-2's code fails, and at exit none was imported. Then runs machgen's CLI with the arguments after -c.
WITHOUT_LTX2 = """
import pkgutil, sys, types
from machgen.families import registry
registry.pkgutil = types.SimpleNamespace(
    iter_modules=lambda path: [m for m in pkgutil.iter_modules(path) if m.name != "ltx2"])
sys.modules["machgen.families.ltx2"] = None
assert "ltx2" not in registry.family_names() and "flux" in registry.family_names()
try:
    from machgen.cli import app
    app(prog_name="machgen")
finally:
    assert not [m for m in sys.modules if m.startswith("machgen.families.ltx2") and sys.modules[m]], \
        "LTX-2's code was imported"
"""


def machgen_without_ltx2(*args: str, timeout: float = 300.0):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", WITHOUT_LTX2, *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.integration
def test_the_http_api_lists_the_models_own_inputs_as_the_model_publishes_them(ltx2_server, api_keys,
                                                                               tmp_path_factory):
    """GET /v1/models/{name} and /v1/models carry LTX-2's own inputs (its guidance beyond every model's) with the
    types, shapes, defaults and help its card publishes: what `machgen inputs` lists, read from the served
    model, not from the API's knowledge of the family."""
    import httpx

    from machgen.client import MachgenClient

    with MachgenClient(ltx2_server.grpc_url) as client:
        published = client.model_card(NAME)["inputs"]
    with api_on(ltx2_server.grpc_url, api_keys, tmp_path_factory, "ltx2-api") as api:
        headers = {"Authorization": f"Bearer {api.key}"}
        one = httpx.get(f"{api.url}/v1/models/{NAME}", headers=headers, timeout=30)
        listed = httpx.get(f"{api.url}/v1/models", headers=headers, timeout=30)
        missing = httpx.get(f"{api.url}/v1/models/no-such-model", headers=headers, timeout=30)
    assert one.status_code == 200, one.text
    inputs = {entry["name"]: entry for entry in one.json()["inputs"]}
    assert inputs == {entry["name"]: entry for entry in published}
    # the tiny model's card sets its own default (machgen.json), which the API passes on as published
    assert inputs["stg_blocks"]["datatype"] == "INT32" and inputs["stg_blocks"]["shape"] == [-1]
    assert inputs["stg_blocks"]["default"] == [1] and inputs["stg_blocks"]["repeatable"]
    assert inputs["audio_guidance_rescale"]["default"] == pytest.approx(0.7)
    assert {"stg_scale", "modality_scale", "guidance_rescale"} <= set(inputs)
    assert all(entry["doc"] for entry in inputs.values())
    assert [model["inputs"] for model in listed.json()["data"] if model["id"] == NAME] == [one.json()["inputs"]]
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model", missing.text


@pytest.mark.integration
def test_a_client_that_does_not_know_the_family_sends_its_inputs_as_the_model_publishes_them(ltx2_server,
                                                                                             tmp_path):
    """machgen generate and machgen api learn LTX-2's guidance inputs from the served model (its card on a
    plain model-config call), not from their registry: the flags, typed as published, reach the model."""
    from PIL import Image

    from machgen.client import MachgenClient

    listed = machgen_without_ltx2("inputs", "--model", NAME, "--url", ltx2_server.grpc_url)
    assert listed.returncode == 0, listed.stderr
    # the tiny model's card sets its own default (machgen.json), which it publishes
    assert "--stg-block VALUE (repeatable): stg_blocks, INT32 [K], default [1]." in listed.stdout
    assert "--audio-guidance-rescale VALUE: audio_guidance_rescale, FP32 [1], default 0.7." in listed.stdout

    common = dict(seed=5, num_frames=5, num_inference_steps=2, cache_policy="none")
    guided = dict(stg_blocks=[0], stg_scale=3.0, guidance_rescale=0.0)
    out = tmp_path / "frame.png"
    made = machgen_without_ltx2(
        "generate", "--url", ltx2_server.grpc_url, "--model", NAME, "--prompt", PROMPT, "--no-progress",
        "--seed", "5", "--num-frames", "5", "--steps", "2", "--cache-policy", "none", "--out", str(out),
        "--stg-block", "0", "--stg-scale=3", "--input", "guidance_rescale=0")
    assert made.returncode == 0, made.stderr
    frames = np.stack([np.asarray(Image.open(tmp_path / f"frame-{i}.png")) for i in range(5)])
    with MachgenClient(ltx2_server.grpc_url) as client:
        expected = client.generate(NAME, PROMPT, **common, **guided)
        unguided = client.generate(NAME, PROMPT, **common)
    assert np.array_equal(frames, expected)
    assert np.abs(frames.astype(np.int16) - unguided).max() > MAX_PIXEL_DIFF  # the inputs had their effect

    # A value the model refuses comes back as the server's INVALID_ARGUMENT naming the input (over HTTP too).
    refused = machgen_without_ltx2(
        "generate", "--url", ltx2_server.http_url, "--protocol", "http", "--model", NAME, "--prompt", PROMPT,
        "--num-frames", "5", "--steps", "1", "--out", str(tmp_path / "refused.png"), "--stg-block", "7")
    assert refused.returncode == 2 and "invalid input 'stg_blocks'" in refused.stderr, refused.stderr
    # another family's input is not this model's flag: refused by name, with the model's own
    foreign = machgen_without_ltx2(
        "generate", "--url", ltx2_server.grpc_url, "--model", NAME, "--prompt", PROMPT,
        "--out", str(tmp_path / "foreign.png"), "--guidance-scale-2", "4")
    assert foreign.returncode == 2 and "--guidance-scale-2" in foreign.stderr and "--stg-block" in foreign.stderr

    api_without_ltx2(ltx2_server, tmp_path)


def api_without_ltx2(server, tmp_path) -> None:
    """machgen api, not knowing LTX-2, takes its inputs by the published description: their type and shape
    checked, their values passed on to the server, whose INVALID_ARGUMENT names the input."""
    import json
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request

    from conftest import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "api.log"
    with open(log, "wb") as output:
        api = subprocess.Popen([sys.executable, "-c", WITHOUT_LTX2, "api", "--triton", server.grpc_url,
                                "--port", str(port), "--data-dir", str(tmp_path / "api")],
                               stdout=output, stderr=subprocess.STDOUT)

    def call(method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def finished(video: dict) -> dict:
        deadline = time.monotonic() + 120
        while video["status"] in ("queued", "in_progress") and time.monotonic() < deadline:
            time.sleep(0.2)
            video = call("GET", f"/v1/videos/{video['id']}")[1]
        return video

    try:
        deadline = time.monotonic() + 60
        while True:
            assert api.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if call("GET", "/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        video = {"model": NAME, "prompt": PROMPT, "num_frames": 5, "num_inference_steps": 2, "seed": 5}
        for field, value, code in [("stg_blocks", ["first"], "invalid_value"),
                                   ("stg_blocks", [[0]], "invalid_value"),
                                   ("stg_scale", [1.0, 2.0], "invalid_value"),
                                   ("guidance_scale_2", 4.0, "unknown_parameter")]:
            status, answer = call("POST", "/v1/videos", {**video, field: value})
            assert (status, answer["error"]["param"], answer["error"]["code"]) == (400, field, code), answer
        status, answer = call("POST", "/v1/videos", {**video, "stg_blocks": [7]})
        assert status == 200, answer
        failed = finished(answer)
        assert failed["status"] == "failed" and failed["error"]["param"] == "stg_blocks", failed
        assert "invalid input 'stg_blocks'" in failed["error"]["message"]
        done = finished(call("POST", "/v1/videos", {**video, "stg_blocks": [0], "stg_scale": 3.0})[1])
        assert done["status"] == "completed", done
    finally:
        api.terminate()
        api.wait(timeout=30)
    # (uvicorn ends by raising the SIGTERM it handled)
    assert api.returncode in (0, -15) and "Traceback" not in log.read_text(), log.read_text()[-3000:]


# --------------------------------------------------------------- image-to-video
@pytest.fixture(scope="module")
def tiny_ltx2_i2v_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory, "ltx2-i2v")


@pytest.fixture(scope="module")
def local_ltx2_i2v(tiny_ltx2_i2v_dir, ltx2_repository, tmp_path_factory):
    from machgen.runtime.local import LocalPipeline

    build_tiny_repository(tmp_path_factory, tiny_ltx2_i2v_dir, I2V_NAME, in_flight=1, into=ltx2_repository)
    return LocalPipeline(ltx2_repository, I2V_NAME)


@pytest.mark.parametrize("size, call", [
    ((32, 64), {}),
    ((64, 32), {"num_frames": 9, "num_inference_steps": 5, "fps": 12, **UNGUIDED}),
], ids=["defaults", "9-frames-unguided"])
def test_in_process_image_to_video_and_sound_equal_diffusers(local_ltx2_i2v, tiny_ltx2_i2v_dir, size, call):
    from PIL import Image

    image = picture(*size, seed=4)
    frames, audio, stats = local_ltx2_i2v.generate_with_audio(PROMPT, image=image, seed=9, cache_policy="none", **call)
    pipe = load_diffusers(tiny_ltx2_i2v_dir)
    expected = diffusers_clip(pipe, local_ltx2_i2v.manifest.defaults.to_json(), 9, image=Image.fromarray(image),
                              height=size[0], width=size[1], **call)
    assert_same_clip(frames, audio, expected)
    assert stats.frames == call.get("num_frames", 5)


def test_image_to_video_needs_its_picture_at_the_video_size(local_ltx2_i2v):
    from machgen.contract.validation import InvalidArgument

    for options, field in [({}, "image"), ({"image": picture(48, 32, 0)}, "image"),
                           ({"image": picture(32, 64, 0), "height": 64}, "image")]:
        with pytest.raises(InvalidArgument) as error:
            local_ltx2_i2v.generate(PROMPT, **options)
        assert error.value.field == field


@pytest.mark.parametrize("layout", ["2.0", "2.3"])
def test_head_and_tail_equal_the_transformer_for_every_pass(layout):
    """The split transformer, with a row per guidance pass (plain; STG on the
    last block and modality isolation), against LTX2VideoTransformer3DModel
    called as the pipeline calls it for each pass; for LTX-2.0's layout
    (caption projections, no prompt modulation) as for LTX-2.3's (the
    served tiny model's). In torch, within 1e-5."""
    import diffusers
    import torch

    from machgen.families.ltx2.export import DenoiserHead as head
    from machgen.families.ltx2.export import DenoiserTail as tail

    torch.manual_seed(0)
    later = layout != "2.0"
    transformer = diffusers.LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=4,
        audio_cross_attention_dim=8, num_layers=2, caption_channels=16, rope_type="split", perturbed_attn=True,
        gated_attn=later, audio_gated_attn=later, cross_attn_mod=later, audio_cross_attn_mod=later,
        use_prompt_embeddings=not later).eval()
    text_dims = (16, 8) if later else (16, 16)
    gen = torch.Generator().manual_seed(1)
    frames, height, width, audio_frames, rows = 2, 4, 3, 5, 2
    inputs = {
        "hidden_states": torch.randn(rows, frames * height * width, 4, generator=gen),
        "audio_hidden_states": torch.randn(rows, audio_frames, 4, generator=gen),
        "encoder_hidden_states": torch.randn(rows, 6, text_dims[0], generator=gen),
        "audio_encoder_hidden_states": torch.randn(rows, 6, text_dims[1], generator=gen),
        "encoder_attention_mask": torch.tensor([[1.0] * 6, [0.0, 0.0] + [1.0] * 4]),
        "timestep": torch.tensor([[600.0], [600.0]]),
        "video_coords": transformer.rope.prepare_video_coords(rows, frames, height, width, "cpu", fps=24.0),
        "audio_coords": transformer.audio_rope.prepare_audio_coords(rows, audio_frames, "cpu"),
        "perturbation_mask": torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        "cross_modal_mask": torch.tensor([[1.0], [0.0]]),
    }
    with torch.no_grad():
        video_hidden, audio_hidden, _ = head(transformer)(**inputs)
        noise, _ = tail(transformer)(video_hidden, audio_hidden, **{k: v for k, v in inputs.items() if k not in (
            "hidden_states", "audio_hidden_states")})

        def whole(row: int, **passes):
            one = {name: value[row:row + 1] for name, value in inputs.items()}
            video, audio = transformer(
                hidden_states=one["hidden_states"], audio_hidden_states=one["audio_hidden_states"],
                encoder_hidden_states=one["encoder_hidden_states"],
                audio_encoder_hidden_states=one["audio_encoder_hidden_states"], timestep=one["timestep"][:, 0],
                sigma=one["timestep"][:, 0], encoder_attention_mask=one["encoder_attention_mask"],
                audio_encoder_attention_mask=one["encoder_attention_mask"], video_coords=one["video_coords"],
                audio_coords=one["audio_coords"], use_cross_timestep=True, return_dict=False, **passes)
            return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

        torch.testing.assert_close(noise[:1], whole(0), rtol=0, atol=1e-5)
        perturbed = whole(1, spatio_temporal_guidance_blocks=[1], isolate_modalities=True)
        torch.testing.assert_close(noise[1:], perturbed, rtol=0, atol=1e-5)
        # the masks are not no-ops: the same row as a plain pass is another prediction
        assert (whole(1) - perturbed).abs().max() > 1e-2


def test_every_input_axis_has_a_tensorrt_profile(ltx2_pipeline, tiny_ltx2_dir):
    from machgen.builder.model_folder import served_defaults
    from machgen.builder.tensorrt_engine import shape_profile
    from machgen.families.registry import get_family

    for name in ("ltx2", "ltx2-i2v"):
        family = get_family(name)
        exporter = family.exporter()
        defaults = served_defaults(tiny_ltx2_dir, family, ltx2_pipeline)
        ranges = exporter.axis_ranges(defaults, exporter.sampler_settings(ltx2_pipeline, defaults))
        for spec in exporter.specs(ltx2_pipeline).values():
            for smallest, best, largest in shape_profile(spec, ranges, max_batch_size=16).values():
                assert all(1 <= a <= b <= c for a, b, c in zip(smallest, best, largest)), spec.name
        # the defaults' packed row: 3 latent frames of 16 x 16 tokens (4 channels), 5 sound tokens (0.2 s; 4 channels)
        assert ranges["packed_latents"].opt == 3 * 16 * 16 * 4 + 5 * 4


def test_a_prompt_length_past_the_text_encoders_sliding_window_is_refused(ltx2_pipeline):
    from dataclasses import replace

    from machgen.families.registry import get_family

    family = get_family("ltx2")
    exporter = family.exporter()
    _, defaults = family.tiny_model()
    window = ltx2_pipeline.text_encoder.config.get_text_config().sliding_window
    assert exporter.sampler_settings(ltx2_pipeline, replace(defaults, max_sequence_length=window))
    with pytest.raises(ValueError, match="sliding window"):
        exporter.sampler_settings(ltx2_pipeline, replace(defaults, max_sequence_length=window + 1))


SPARSE_NAME = "ltx2_sparse"


@pytest.fixture(scope="module")
def sparse_ltx2_build(tiny_ltx2_dir, ltx2_repository, tmp_path_factory):
    """(repository, attention options, build log), built after the dense one (its exports in the cache)."""
    from machgen.builder.build import AttentionOptions, build_repository

    attention = AttentionOptions("sparse-fp8", block=4, mask_method="topk", topk_ratio=0.25)
    logs: list[str] = []
    build_repository(tiny_ltx2_dir, SPARSE_NAME, ltx2_repository, attention=attention, log=logs.append,
                     preview=False)
    return ltx2_repository, attention, logs


@pytest.fixture(scope="module")
def sparse_ltx2_repository(sparse_ltx2_build):
    return sparse_ltx2_build[:2]


def test_a_sparse_build_exports_only_what_holds_the_swapped_layers(sparse_ltx2_build):
    """The text connectors' attention is of the transformer's class but none of the swapped layers: the
    text encoder, like the decoders, comes from the dense build's exports."""
    logs = sparse_ltx2_build[2]
    progress = {line.split(":")[0].split("] ")[1]: line for line in logs if "max |" in line}
    exported = {name for name, line in progress.items() if not line.endswith("(export cache)")}
    assert exported == {"denoiser_head", "denoiser_tail", "denoiser_reuse"}


def test_sparse_attention_takes_the_video_self_attention_only(sparse_ltx2_repository, ltx2_pipeline):
    """One SparseAttention per block: the video's self-attention, not the
    sound's (as long as its queries too), nor the audio-video attention."""
    import onnx

    from conftest import component_onnx
    from machgen.plugins.schema import DOMAIN, OP_TYPE

    repository, _ = sparse_ltx2_repository
    blocks = ltx2_pipeline.transformer.config.num_layers
    video_heads = ltx2_pipeline.transformer.config.num_attention_heads
    counted = 0
    for component in ("denoiser_head", "denoiser_tail"):
        model = onnx.load(component_onnx(repository, component, SPARSE_NAME))
        nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == OP_TYPE]
        shapes = {info.name: info.type.tensor_type.shape for info in model.graph.value_info}
        for node in nodes:  # q [batch, video tokens, video heads, head_dim]
            assert shapes[node.input[0]].dim[2].dim_value == video_heads
        counted += len(nodes)
    assert counted == blocks


def test_served_sparse_clip_equals_diffusers_with_the_operator(sparse_ltx2_repository, tiny_ltx2_dir,
                                                               ltx2_pipeline):
    from machgen.builder.model_folder import detect_family, served_defaults
    from machgen.runtime.local import LocalPipeline
    from machgen.plugins.ops import attention_swapped

    repository, attention = sparse_ltx2_repository
    family = detect_family(tiny_ltx2_dir)
    exporter = family.exporter()
    config = attention.config(exporter, served_defaults(tiny_ltx2_dir, family, ltx2_pipeline))
    served = LocalPipeline(repository, SPARSE_NAME)
    defaults = served.manifest.defaults.to_json()
    frames, audio, _ = served.generate_with_audio(PROMPT, seed=5, cache_policy="none")
    with attention_swapped(exporter.attention_modules, config, exporter.sparse_attention_layers(ltx2_pipeline)):
        expected = diffusers_clip(ltx2_pipeline, defaults, 5)
    assert_same_clip(frames, audio, expected)
    # Dropping 3/4 of the video's key blocks shows in the sound beyond its tolerance (the tiny model's
    # frames barely move: measured 2 levels, 5e-4 in the sound), so the parity above checks the operator.
    dense_audio = diffusers_clip(ltx2_pipeline, defaults, 5)[1]
    assert np.abs(dense_audio - expected[1]).max() > 2 * MAX_AUDIO_DIFF
