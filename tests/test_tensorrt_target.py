"""The tensorrt target where TensorRT is absent (here): what is derived and
checked without it, and a clear refusal to build. Engine building itself
runs only where TensorRT and a GPU are (``test_engine_builds_and_records_its_host``)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from machgen.builder.model_folder import served_defaults
from machgen.builder.repository import TargetServing, render_repository
from machgen.builder.tensorrt_engine import shape_profile
from machgen.contract.engines import EngineMetadata, EngineMismatch, check_engine
from machgen.families.registry import get_family

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture(scope="module")
def flux(tiny_flux_dir, tiny_flux_pipeline):
    family = get_family("flux")
    exporter = family.exporter()
    defaults = served_defaults(tiny_flux_dir, family, tiny_flux_pipeline)
    return family, exporter.specs(tiny_flux_pipeline), defaults, exporter.sampler_settings(tiny_flux_pipeline,
                                                                                             defaults)


def test_every_input_gets_a_profile_covering_the_served_sizes(flux):
    family, specs, defaults, settings = flux
    ranges = family.exporter().axis_ranges(defaults, settings)
    for spec in specs.values():
        profile = shape_profile(spec, ranges, max_batch_size=16)
        assert set(profile) == {t.name for t in spec.inputs}
        for smallest, best, largest in profile.values():
            assert all(a <= b <= c for a, b, c in zip(smallest, best, largest))
    head = shape_profile(specs["denoiser_head"], ranges, max_batch_size=16)
    # tiny model: 64x64 default, 256x256 at most, VAE factor 2 and 2x2 packing: (64/4)^2 and (256/4)^2 tokens
    assert head["hidden_states"] == ((1, 1, 16), (2, 256, 16), (16, 4096, 16))
    assert head["encoder_hidden_states"][2][1] == defaults.max_sequence_length
    decoder = shape_profile(specs["vae_decoder"], ranges, max_batch_size=16)
    assert decoder["latents"][2] == (16, 4, 128, 128)


def test_rendered_tensorrt_repository_serves_engines_on_the_gpu(flux):
    family, specs, defaults, settings = flux
    files = render_repository("flux", family, specs, defaults, settings, serving=TargetServing("tensorrt"))
    # No component runs inside the sampler: each engine is a TensorRT-backend model.
    assert {"flux_denoiser_reuse/config.pbtxt", "flux_postprocess/config.pbtxt"} <= set(files)
    tail = files["flux_denoiser_tail/config.pbtxt"]
    assert 'platform: "tensorrt_plan"' in tail and "kind: KIND_GPU" in tail and "backend" not in tail
    # Python models: the public one, its streaming twin and the sampler only.
    assert not [path for path in files if path.startswith("flux_") and path.endswith("model.py")
                and not path.startswith(("flux_sampler/", "flux_stream/"))]
    assert '"target": "tensorrt"' in files["flux_sampler/1/pipeline.json"]


def test_rendered_torch_repository_on_cuda_asks_for_gpu_instances(flux):
    family, specs, defaults, settings = flux
    files = render_repository("flux", family, specs, defaults, settings,
                              serving=TargetServing("torch", torch_device="cuda", torch_dtype="bfloat16"))
    tail = files["flux_denoiser_tail/config.pbtxt"]
    assert "kind: KIND_GPU" in tail and 'string_value: "bfloat16"' in tail
    assert "flux_denoiser_reuse/config.pbtxt" not in files  # runs in the sampler's process, on its GPU


METADATA = EngineMetadata(tensorrt_version="10.13.0", gpu_name="NVIDIA H200", compute_capability="9.0",
                          precision="bf16", refittable=True)


def test_engine_metadata_round_trips(tmp_path):
    METADATA.write(tmp_path)
    assert EngineMetadata.read(tmp_path) == METADATA


@pytest.mark.parametrize("host, message", [
    (("10.9.0", "NVIDIA H200", "9.0"), "TensorRT 10.13.0, this server has 10.9.0"),
    (("10.13.0", "NVIDIA A100-SXM4-80GB", "8.0"), "compute capability 9.0 (NVIDIA H200), this GPU is 8.0"),
    (("10.13.0", "NVIDIA H100 80GB HBM3", "9.0"), "NVIDIA H200 (tactics are timed per GPU model)"),
])
def test_an_engine_from_another_host_is_refused_by_name(host, message):
    with pytest.raises(EngineMismatch, match="denoiser_tail: the engine was built for") as raised:
        check_engine("denoiser_tail", METADATA, *host)
    assert message in str(raised.value) and "machgen-build build" in str(raised.value)


def test_an_engine_on_its_own_host_or_an_unknown_one_is_accepted():
    check_engine("denoiser_tail", METADATA, "10.13.0", "NVIDIA H200", "9.0")
    check_engine("denoiser_tail", METADATA, None, None, None)  # what the host cannot tell is not compared


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed")
def test_tensorrt_build_without_tensorrt_says_so_and_fails(tiny_flux_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "machgen.builder.cli", "build", str(tiny_flux_dir), "--name", "x",
                           "--target", "tensorrt", "--out", str(tmp_path / "repo")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "the tensorrt target needs TensorRT" in done.stderr
    assert not (tmp_path / "repo").exists()  # refused before any export


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TENSORRT, reason="needs TensorRT")
def test_engine_builds_and_records_its_host(tiny_flux_dir, tmp_path):
    from machgen.builder.build import build_repository

    build_repository(tiny_flux_dir, "flux", tmp_path, target="tensorrt", log=lambda line: None)
    metadata = EngineMetadata.read(tmp_path / "flux_denoiser_tail" / "1")
    check_engine("denoiser_tail", metadata, *_host())
    assert (tmp_path / "flux_denoiser_tail" / "1" / "model.plan").stat().st_size > 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TENSORRT, reason="needs TensorRT")
def test_an_fp8_build_quantizes_the_block_layers_and_builds_fp8_engines(tiny_flux_dir, tmp_path):
    """--precision fp8: the denoiser parts' ONNX files carry calibrated E4M3 Q/DQ (tests/test_precision.py checks
    them without TensorRT); TensorRT builds engines from them and the manifest records each layer's scales."""
    import json

    from machgen.builder.build import TargetOptions, build_repository

    build_repository(tiny_flux_dir, "flux", tmp_path, target="tensorrt", log=lambda line: None,
                     target_options=TargetOptions(precision="fp8"))
    manifest = json.loads((tmp_path / "flux_sampler" / "1" / "pipeline.json").read_text())
    for part in ("denoiser_head", "denoiser_tail"):
        assert manifest["precision"][part]["precision"] == "fp8" and manifest["precision"][part]["layers"]
        metadata = EngineMetadata.read(tmp_path / f"flux_{part}" / "1")
        assert metadata.precision == "fp8"
        assert (tmp_path / f"flux_{part}" / "1" / "model.plan").stat().st_size > 0


def _host():
    import tensorrt

    from machgen.contract.engines import host_gpu

    return (tensorrt.__version__, *host_gpu())


def test_the_public_model_checks_every_engine_it_calls(tmp_path):
    from machgen.contract.engines import check_repository_engines

    components = {"denoiser_head": "flux_denoiser_head", "denoiser_tail": "flux_denoiser_tail"}
    for model in ("flux_denoiser_head", "flux_denoiser_tail"):
        (tmp_path / model / "1").mkdir(parents=True)
    METADATA.write(tmp_path / "flux_denoiser_head" / "1")
    with pytest.raises(EngineMismatch, match="denoiser_tail: .* has no engine.json"):
        check_repository_engines(tmp_path, components, ("10.13.0", "NVIDIA H200", "9.0"))
    METADATA.write(tmp_path / "flux_denoiser_tail" / "1")
    check_repository_engines(tmp_path, components, ("10.13.0", "NVIDIA H200", "9.0"))
    with pytest.raises(EngineMismatch, match="denoiser_head: the engine was built for TensorRT 10.13.0"):
        check_repository_engines(tmp_path, components, ("10.14.1", "NVIDIA H200", "9.0"))
