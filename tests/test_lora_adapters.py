"""Per-request LoRA adapters: added to a built repository without a rebuild
(machgen-build lora add), served per request equal to diffusers'
load_lora_weights + set_adapters, different adapters sharing one denoiser
forward, an adapter added to or removed from a running server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from machgen.client import GenerationError, MachgenClient, RetryPolicy
from machgen.contract.manifest import PipelineManifest, pipeline_dir

from conftest import ADAPTER_RANK, PIPELINE_NAME, solo_then_together
from test_image_to_image import PROMPT, _diffusers_img2img, _image
from test_integration import MAX_PIXEL_DIFF, diffusers_image

BATCHED = "flux_batched"  # conftest.VARIANTS: per-step calls wait for each other
# (name, rank, alpha, target modules): one with a saved alpha (scale 2) over attention and the single blocks,
# one without alphas over feed-forwards, AdaLN and the embedders (components head, tail and reuse all change).
ADAPTERS = {
    "attn": (4, 8, ["to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "proj_mlp", "proj_out"]),
    "ff": (2, None, ["ff.net.0.proj", "ff.net.2", "ff_context.net.2", "norm1.linear", "x_embedder", "linear_1",
                     "norm_out.linear"]),
    "late": (3, None, ["to_v", "norm.linear"]),
}
NO_RETRY = RetryPolicy(attempts=1)


def write_random_adapter(model_dir: Path, out: Path, rank: int, alpha: int | None, targets: list[str],
                         seed: int) -> Path:
    """A diffusers-format LoRA with random weights (large enough to change the picture), saved as a trainer
    would: with its LoRA config when it has an alpha of its own, else plain tensors (diffusers then takes
    alpha = rank)."""
    import diffusers
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = diffusers.FluxPipeline.from_pretrained(model_dir, local_files_only=True)
    torch.manual_seed(seed)
    pipe.transformer.add_adapter(LoraConfig(r=rank, lora_alpha=alpha or rank, init_lora_weights="gaussian",
                                            target_modules=targets))
    with torch.no_grad():
        for name, parameter in pipe.transformer.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.3)
    metadata = pipe.transformer.peft_config["default"].to_dict() if alpha else None
    diffusers.FluxPipeline.save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
                                             transformer_lora_adapter_metadata=metadata)
    return out


@pytest.fixture(scope="module")
def adapter_dirs(tiny_flux_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_random_adapter(tiny_flux_dir, root / name, rank, alpha, targets, seed)
            for seed, (name, (rank, alpha, targets)) in enumerate(ADAPTERS.items())}


def machgen_build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "machgen.builder.cli", *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def adapted_repository(built_repository, adapter_dirs) -> Path:
    """The session's tiny Flux with "attn" and "ff" added (by the CLI, as a user adds them); "late" is added by
    a test, to a running server."""
    repository, _ = built_repository
    for name in ("attn", "ff"):
        added = machgen_build("lora", "add", str(repository), str(adapter_dirs[name]), "--name", name)
        assert added.returncode == 0, added.stderr
        assert f"added adapter '{name}'" in added.stdout
    return repository


@pytest.fixture(scope="module")
def reference(tiny_flux_pipeline, adapter_dirs):
    """diffusers' FluxPipeline with every adapter loaded (set_adapters chooses per call)."""
    for name, folder in adapter_dirs.items():
        tiny_flux_pipeline.load_lora_weights(folder, adapter_name=name)
    tiny_flux_pipeline.set_progress_bar_config(disable=True)

    def run(adapters: dict[str, float], call=diffusers_image, *args, **kwargs):
        if adapters:
            tiny_flux_pipeline.enable_lora()
            tiny_flux_pipeline.set_adapters(list(adapters), adapter_weights=list(adapters.values()))
        else:
            tiny_flux_pipeline.disable_lora()
        return call(tiny_flux_pipeline, *args, **kwargs)

    yield run
    tiny_flux_pipeline.unload_lora_weights()


@pytest.fixture(scope="module")
def defaults(adapted_repository):
    return PipelineManifest.read(pipeline_dir(adapted_repository, PIPELINE_NAME)).defaults.to_json()


def _lora(adapters: dict[str, float]) -> dict:
    return {"lora": list(adapters), "lora_scale": list(adapters.values())} if adapters else {}


def _max_diff(a, b) -> int:
    return int(np.abs(a.astype(int) - b.astype(int)).max())


CASES = [{"attn": 1.0}, {"ff": 1.0}, {"attn": 0.7, "ff": 0.4}, {}]


@pytest.mark.parametrize("adapters", CASES, ids=["attn", "ff", "attn0.7+ff0.4", "none"])
def test_served_adapters_equal_diffusers_set_adapters(adapters, adapted_repository, triton_server, reference,
                                                      defaults):
    expected = reference(adapters, diffusers_image, defaults, "a red cat", 5)
    with MachgenClient(triton_server.grpc_url) as client:
        images, stats = client.generate_with_stats(PIPELINE_NAME, "a red cat", seed=5, cache_policy="none",
                                                   **_lora(adapters))
    assert _max_diff(images[0], expected) <= MAX_PIXEL_DIFF
    assert stats["adapters"] == adapters
    if adapters:  # the adapters really change the picture
        assert _max_diff(expected, reference({}, diffusers_image, defaults, "a red cat", 5)) > 20


def test_adapters_with_true_cfg_image_to_image_and_cache_reuse(adapted_repository, triton_server, reference,
                                                               defaults):
    adapters = {"attn": 0.7, "ff": 0.4}
    picture = _image(defaults["height"], defaults["width"], seed=4)
    with MachgenClient(triton_server.grpc_url) as client:
        guided = client.generate(PIPELINE_NAME, "a red cat", negative_prompt="a blue dog", true_cfg_scale=4.0,
                                 seed=6, cache_policy="none", **_lora(adapters))
        redrawn = client.generate(PIPELINE_NAME, PROMPT, image=picture, strength=0.75, seed=7,
                                  cache_policy="none", **_lora(adapters))
        cached, stats = client.generate_with_stats(PIPELINE_NAME, "a red cat", seed=8, cache_policy="fbcache",
                                                   cache_threshold=0.5, num_inference_steps=10, **_lora(adapters))
    expected = reference(adapters, diffusers_image, defaults, "a red cat", 6, negative_prompt="a blue dog",
                         true_cfg_scale=4.0)
    assert _max_diff(guided[0], expected) <= MAX_PIXEL_DIFF  # both rows carry the request's adapters
    expected = reference(adapters, _diffusers_img2img, picture, 7, 0.75,
                         num_inference_steps=defaults["num_inference_steps"],
                         guidance_scale=defaults["guidance_scale"],
                         max_sequence_length=defaults["max_sequence_length"])
    assert np.abs(redrawn[0].astype(np.int16) - expected).max() <= MAX_PIXEL_DIFF
    # Cache reuse per request: the same steps skipped as in-process, the same picture.
    from machgen.runtime.local import LocalPipeline

    local, local_stats = LocalPipeline(adapted_repository, PIPELINE_NAME).generate(
        "a red cat", seed=8, cache_policy="fbcache", cache_threshold=0.5, num_inference_steps=10, **_lora(adapters))
    assert stats["denoiser_tail_calls"] == local_stats.denoiser_tail_calls < 10
    assert _max_diff(cached[0], local[0]) <= MAX_PIXEL_DIFF


def test_mixed_adapters_share_denoiser_forwards_and_equal_their_solo_runs(variant_repository, variant_server,
                                                                          adapter_dirs):
    from machgen.builder.adapters import add_adapter

    for name in ("attn", "ff"):
        add_adapter(variant_repository, name, adapter_dirs[name], pipeline=BATCHED)
    sets = [{}, {"attn": 1.0}, {"ff": 1.0}, {"attn": 0.7, "ff": 0.4}]
    requests = [dict(prompt="a red cat", seed=200 + i, num_inference_steps=6, **_lora(sets[i % 4]))
                for i in range(8)]

    solo, together, rows, forwards = solo_then_together(variant_server, BATCHED, requests, cache_policy="none")
    for settings, alone, batched in zip(requests, solo, together):
        assert _max_diff(alone, batched) <= MAX_PIXEL_DIFF, settings
    assert rows == 6 * len(requests)
    assert rows / forwards > 1.5  # different adapters, one forward


@pytest.mark.integration
def test_an_adapter_added_to_a_running_server_is_served_and_once_removed_refused(adapted_repository, triton_server,
                                                                                  adapter_dirs, reference, defaults):
    with MachgenClient(triton_server.grpc_url, retry=NO_RETRY) as client:
        with pytest.raises(GenerationError, match="invalid input 'lora': unknown adapter 'late'") as refused:
            client.generate(PIPELINE_NAME, "a red cat", seed=9, lora=["late"])
        assert refused.value.status == "StatusCode.INVALID_ARGUMENT"
        added = machgen_build("lora", "add", str(adapted_repository), str(adapter_dirs["late"]), "--name", "late")
        assert added.returncode == 0, added.stderr
        listed = machgen_build("lora", "list", str(adapted_repository))
        assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == ["attn", "ff", "late"]
        served = client.generate(PIPELINE_NAME, "a red cat", seed=9, cache_policy="none", lora=["late"],
                                 lora_scale=[1.5])
        assert _max_diff(served[0], reference({"late": 1.5}, diffusers_image, defaults, "a red cat", 9)) \
            <= MAX_PIXEL_DIFF
        removed = machgen_build("lora", "remove", str(adapted_repository), "late")  # or --name late
        assert removed.returncode == 0, removed.stderr
        with pytest.raises(GenerationError, match="unknown adapter 'late'") as refused:
            client.generate(PIPELINE_NAME, "a red cat", seed=9, lora=["late"])
        assert refused.value.status == "StatusCode.INVALID_ARGUMENT"


@pytest.mark.parametrize("options, field, message", [
    ({"lora": ["nobody"]}, "lora", "unknown adapter 'nobody'"),
    ({"lora": ["attn", "attn"]}, "lora", "names an adapter twice"),
    ({"lora": ["attn"], "lora_scale": [float("nan")]}, "lora_scale", "must be finite"),
    ({"lora": ["attn"], "lora_scale": [1.0, 2.0]}, "lora_scale", "expected 1 numbers"),
    ({"lora_scale": [1.0]}, "lora_scale", "given without lora"),
    ({"lora": ["attn", "ff", "a", "b", "c"]}, "lora", "at most 4"),
], ids=["unknown", "repeated", "nan", "count", "scale-alone", "too-many"])
def test_bad_adapter_inputs_answer_invalid_argument_and_the_server_serves_on(options, field, message,
                                                                             adapted_repository, triton_server):
    with MachgenClient(triton_server.grpc_url, retry=NO_RETRY) as client:
        with pytest.raises(GenerationError, match=f"invalid input '{field}': .*{message}") as refused:
            client.generate(PIPELINE_NAME, "a red cat", seed=1, num_inference_steps=2, **options)
        assert refused.value.status == "StatusCode.INVALID_ARGUMENT"
        assert client.generate(PIPELINE_NAME, "a red cat", seed=1, num_inference_steps=2, lora=["attn"]).shape[0] == 1


def test_the_http_api_takes_adapters_by_name(api_server, adapted_repository, triton_server):
    import base64

    import httpx

    from test_openai_api import assert_close, auth, openai_client, png_pixels

    adapters = {"lora": ["attn", "ff"], "lora_scale": [0.7, 0.4]}
    result = openai_client(api_server).images.generate(
        model=PIPELINE_NAME, prompt="a red cat", size="32x32", extra_body={"seed": 5, "num_inference_steps": 3,
                                                                           **adapters})
    with MachgenClient(triton_server.grpc_url) as client:
        expected = client.generate(PIPELINE_NAME, "a red cat", seed=5, num_inference_steps=3, width=32, height=32,
                                   **adapters)[0]
    assert_close(png_pixels(base64.b64decode(result.data[0].b64_json)), expected)
    refused = httpx.post(f"{api_server.url}/v1/images/generations", headers=auth(api_server), timeout=60,
                         json={"model": PIPELINE_NAME, "prompt": "a red cat", "lora": "nobody"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora"
    assert "unknown adapter 'nobody'" in refused.json()["error"]["message"]

def _save(path: Path, tensors: dict) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    save_file({key: value.contiguous() for key, value in tensors.items()}, str(path / "pytorch_lora_weights.safetensors"))
    return path


def test_lora_add_refuses_what_does_not_fit_the_model(adapted_repository, adapter_dirs, tmp_path):
    from machgen.builder.adapters import add_adapter, list_adapters

    layer = "transformer.transformer_blocks.0.attn.to_q"
    good = {f"{layer}.lora_A.weight": torch.zeros(2, 32), f"{layer}.lora_B.weight": torch.zeros(32, 2)}
    cases = {
        "no-such-layer": ({"transformer.nowhere.lora_A.weight": torch.zeros(2, 32),
                           "transformer.nowhere.lora_B.weight": torch.zeros(32, 2)}, "has no such linear layer"),
        "wrong-shape": ({f"{layer}.lora_A.weight": torch.zeros(2, 31), f"{layer}.lora_B.weight": torch.zeros(32, 2)},
                        "do not fit"),
        "rank-too-big": ({f"{layer}.lora_A.weight": torch.zeros(ADAPTER_RANK + 1, 32),
                          f"{layer}.lora_B.weight": torch.zeros(32, ADAPTER_RANK + 1)}, "over the repository's maximum"),
        "text-encoder": ({**good, "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight":
                          torch.zeros(2, 32),
                          "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_B.weight":
                          torch.zeros(32, 2)}, "change the denoiser alone"),
    }
    pickled = _save(tmp_path / "pickled", good)
    (pickled / "pytorch_lora_weights.bin").write_bytes(b"not loaded")
    cases["pickled"] = (good, "pickle")
    for case, (tensors, message) in cases.items():
        folder = pickled if case == "pickled" else _save(tmp_path / case, tensors)
        with pytest.raises(ValueError, match=message):
            add_adapter(adapted_repository, case, folder)
    for name, message in (("attn", "already in"), ("../x", "adapter name")):
        with pytest.raises(ValueError, match=message):
            add_adapter(adapted_repository, name, adapter_dirs["attn"])
    # The CLI says why and exits 1.
    result = machgen_build("lora", "add", str(adapted_repository), str(tmp_path / "wrong-shape"), "--name", "x")
    assert result.returncode == 1 and "do not fit" in result.stderr, result.stderr
    assert sorted(list_adapters(adapted_repository)) == ["attn", "ff"]


# --- a rebuild of a repository that holds added adapters (the rest of what a rebuild keeps: test_rebuild.py)

@pytest.fixture(scope="module")
def rebuilt_repository(built_repository, tiny_flux_dir, adapter_dirs, tmp_path_factory) -> Path:
    """The tiny Flux in a repository of its own (every component from the export cache built_repository
    filled), with "attn" (rank 4) and "ff" (rank 2) added by the CLI."""
    from machgen.builder.build import build_repository
    from machgen.builder.repository import ServingOptions

    out = tmp_path_factory.mktemp("rebuilt-repository")
    build_repository(tiny_flux_dir, PIPELINE_NAME, out, log=lambda line: None, preview=False,
                     options=ServingOptions(in_flight=2, component_instances=1, max_lora_rank=ADAPTER_RANK))
    for name in ("attn", "ff"):
        added = machgen_build("lora", "add", str(out), str(adapter_dirs[name]), "--name", name)
        assert added.returncode == 0, added.stderr
    return out


def rebuild(repository: Path, model_dir: Path, *options: str) -> subprocess.CompletedProcess:
    return machgen_build("build", str(model_dir), "--name", PIPELINE_NAME, "--out", str(repository), "--no-preview",
                         "--component-instances", "1", *options)


def test_a_rebuild_keeps_the_added_adapters_and_serves_both(rebuilt_repository, tiny_flux_dir, reference):
    from machgen.contract.adapters import adapters_root
    from machgen.runtime.local import LocalPipeline

    folder = pipeline_dir(rebuilt_repository, PIPELINE_NAME)
    stored = {name: (adapters_root(folder) / name / "adapter.safetensors").read_bytes() for name in ("attn", "ff")}
    # Other serving options: every generated file is written again, the adapters stay.
    rebuilt = rebuild(rebuilt_repository, tiny_flux_dir, "--max-lora-rank", str(ADAPTER_RANK), "--in-flight", "3")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "carried over adapters: attn, ff" in rebuilt.stdout
    assert "count: 3" in (rebuilt_repository / PIPELINE_NAME / "config.pbtxt").read_text()
    listed = machgen_build("lora", "list", str(rebuilt_repository))
    assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == ["attn", "ff"]
    assert {name: (adapters_root(folder) / name / "adapter.safetensors").read_bytes() for name in stored} == stored
    defaults = PipelineManifest.read(folder).defaults.to_json()
    pipeline = LocalPipeline(rebuilt_repository, PIPELINE_NAME)
    for adapters in ({"attn": 1.0}, {"ff": 1.0}):
        images, stats = pipeline.generate("a red cat", seed=5, cache_policy="none", **_lora(adapters))
        assert _max_diff(images[0], reference(adapters, diffusers_image, defaults, "a red cat", 5)) \
            <= MAX_PIXEL_DIFF, adapters


def test_a_rebuild_the_adapters_no_longer_fit_is_refused_by_name_unless_they_are_dropped(rebuilt_repository,
                                                                                          tiny_flux_dir):
    from machgen.builder.adapters import list_adapters
    from machgen.builder.build import build_repository
    from machgen.builder.rebuild import RebuildRefused
    from machgen.builder.repository import ServingOptions

    before = {path: path.stat().st_mtime_ns for path in rebuilt_repository.rglob("*")}
    # Without adapter inputs none can be served; refused before any export.
    with pytest.raises(RebuildRefused) as refused:
        build_repository(tiny_flux_dir, PIPELINE_NAME, rebuilt_repository, log=lambda line: None, preview=False,
                         options=ServingOptions(max_lora_rank=0))
    for name in ("attn", "ff"):
        assert f"adapter '{name}': this build serves no per-request adapters" in str(refused.value)
    # A smaller maximum rank: "attn" (rank 4) no longer fits, "ff" (rank 2) does.
    refused = rebuild(rebuilt_repository, tiny_flux_dir, "--max-lora-rank", "3")
    assert refused.returncode == 1
    assert "adapter 'attn': " in refused.stderr and "rank 4 is over this build's maximum 3" in refused.stderr
    assert "'ff'" not in refused.stderr and "--drop-unfit-adapters" in refused.stderr
    assert {path: path.stat().st_mtime_ns for path in rebuilt_repository.rglob("*")} == before
    assert sorted(list_adapters(rebuilt_repository)) == ["attn", "ff"]

    dropped = rebuild(rebuilt_repository, tiny_flux_dir, "--max-lora-rank", "3", "--drop-unfit-adapters")
    assert dropped.returncode == 0, dropped.stderr
    assert "deleted adapter 'attn' (--drop-unfit-adapters): " in dropped.stdout
    assert "rank 4 is over this build's maximum 3" in dropped.stdout
    assert sorted(list_adapters(rebuilt_repository)) == ["ff"]


# --- the component side and the API's validation, without a server

def _write_adapter(root: Path, name: str, layers: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    import json

    from safetensors.numpy import save_file

    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for layer, (down, up) in layers.items():
        tensors[f"{layer}.down"], tensors[f"{layer}.up"] = down.astype(np.float32), up.astype(np.float32)
    save_file(tensors, str(folder / "adapter.safetensors"))
    (folder / "adapter.json").write_text(json.dumps({"name": name, "rank": 3, "layers": len(layers), "source": "-",
                                                     "sha256": "-"}))


def test_a_forwards_bank_gives_each_row_the_sum_of_its_adapters(tmp_path):
    from machgen.contract.adapters import AdapterLayer, down_input, up_input
    from machgen.runtime.adapters import AdapterStore

    rng = np.random.default_rng(0)
    layers = (AdapterLayer("first", 3, 4), AdapterLayer("second", 4, 2))
    weights = {"A": {"first": (rng.normal(size=(2, 3)), rng.normal(size=(4, 2))),
                     "second": (rng.normal(size=(1, 4)), rng.normal(size=(2, 1)))},
               "B": {"second": (rng.normal(size=(3, 4)), rng.normal(size=(2, 3)))}}
    for name, adapter in weights.items():
        _write_adapter(tmp_path, name, adapter)
    store = AdapterStore(tmp_path, max_loaded=4)
    names = np.array([[b"A", b"B", b"", b""], [b"", b"", b"", b""], [b"B", b"", b"", b""]], dtype=object)
    scales = np.array([[0.7, 0.4, 0, 0], [0, 0, 0, 0], [2.0, 0, 0, 0]], np.float32)
    feeds = store.bank_feeds(layers, names, scales)
    x = rng.normal(size=(3, 5, 3)).astype(np.float32), rng.normal(size=(3, 5, 4)).astype(np.float32)
    row_adapters = [{"A": 0.7, "B": 0.4}, {}, {"B": 2.0}]
    assert feeds["lora_rows"].tolist() == [0, 2]  # row 1 names none: not in the low-rank products
    for index, layer in enumerate(layers):
        selected = x[index][feeds["lora_rows"]]
        low = np.einsum("bti,ri->btr", selected, feeds[down_input(index)]) * feeds["lora_row_scales"][:, None, :]
        got = np.zeros((3, 5, layer.out_features))
        got[feeds["lora_rows"]] = np.einsum("btr,or->bto", low, feeds[up_input(index)])
        for row, adapters in enumerate(row_adapters):
            want = sum((scale * x[index][row] @ weights[name][layer.name][0].T @ weights[name][layer.name][1].T
                        for name, scale in adapters.items() if layer.name in weights[name]),
                       np.zeros((5, layer.out_features)))
            np.testing.assert_allclose(got[row], want, atol=1e-5)
    # A forward whose rows name no adapter: a bank of rank 0.
    empty = store.bank_feeds(layers, names[1:2], scales[1:2])
    assert empty["lora_rows"].shape == (0,) and empty["lora_row_scales"].shape == (0, 0)
    assert empty[down_input(0)].shape == (0, 3)


def test_the_store_keeps_the_most_recently_used_and_reads_a_replaced_adapter_again(tmp_path):
    import os

    from machgen.runtime.adapters import AdapterNotFound, AdapterStore

    for name, value in (("A", 1.0), ("B", 2.0)):
        _write_adapter(tmp_path, name, {"layer": (np.full((1, 2), value), np.ones((2, 1)))})
    store = AdapterStore(tmp_path, max_loaded=1)
    store.weights("A")
    store.weights("B")
    assert store.loaded == ["B"]
    _write_adapter(tmp_path, "B", {"layer": (np.full((1, 2), 5.0), np.ones((2, 1)))})
    info = tmp_path / "B" / "adapter.json"
    os.utime(info, ns=(info.stat().st_mtime_ns + 10**9,) * 2)
    assert store.weights("B")["layer"][0][0, 0] == 5.0
    import shutil

    shutil.rmtree(tmp_path / "A")
    with pytest.raises(AdapterNotFound):
        store.weights("A")


def test_the_api_checks_adapters_against_the_model():
    from machgen.contract.api import API_INPUTS, input_array
    from machgen.contract.request import parse_request
    from machgen.contract.specs import Capabilities, ServedDefaults
    from machgen.contract.validation import InvalidArgument

    defaults = ServedDefaults(height=64, width=64, num_inference_steps=4, guidance_scale=3.5)

    def parse(adapters, **inputs):
        arrays = {"prompt": np.array([b"a cat"], dtype=object), **inputs}
        return parse_request(arrays.get, defaults, size_multiple=16, capabilities=Capabilities(),
                             adapters=adapters)

    lora = input_array(next(tensor for tensor in API_INPUTS if tensor.name == "lora"), ["x", "y"])
    assert lora.tolist() == [b"x", b"y"]
    request = parse(lambda: {"x", "y"}, lora=lora, lora_scale=np.array([0.7, 0.4], np.float32))
    assert request.adapters == (("x", 0.7), ("y", 0.4))
    assert parse(lambda: {"x"}, lora=lora[:1]).adapters == (("x", 1.0),)
    assert parse(None).adapters == ()
    with pytest.raises(InvalidArgument, match="'lora': this model serves no adapters"):
        parse(None, lora=lora[:1])
    with pytest.raises(InvalidArgument, match="'lora_scale': .*finite"):
        parse(lambda: {"x"}, lora=lora[:1], lora_scale=np.array([np.inf], np.float32))
