"""The committed trained model: its quality under diffusers; served by
Triton uncached, the same pixels; served with only prompt and seed sent (its
calibrated cache policy then applies), the same quality."""

import json
from pathlib import Path

import numpy as np
import pytest

from machgen.builder import evaluate
from machgen.datasets import shapes

from conftest import serving

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "shapes-flux"
PROMPTS = shapes.evaluation_prompts(70)
MAX_PIXEL_DIFF = 2
# The committed LoRAs (each teaches a colour the dataset lacks; their cards say how well).
ADAPTERS = {concept: MODEL_DIR.parent / f"shapes-flux-{concept}-lora" for concept in ("orange", "gray")}


def test_clip_tokenizer_gives_openai_clip_ids():
    from transformers import CLIPTokenizer

    tokenizer = CLIPTokenizer.from_pretrained(MODEL_DIR / "tokenizer")
    assert tokenizer("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    assert len(tokenizer) == 49408


def test_model_folder_is_small_and_safetensors():
    files = [p for p in MODEL_DIR.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 30 * 2**20
    assert not [p for p in files if p.suffix in (".bin", ".pt", ".pth")]


@pytest.fixture(scope="module")
def diffusers_images():
    return evaluate.generate_with_diffusers(MODEL_DIR, PROMPTS)


def test_diffusers_accuracy_at_the_model_card_settings(diffusers_images):
    accuracy = evaluate.score(diffusers_images, [label for _, _, label in PROMPTS])
    assert accuracy.colour_shape >= 0.90 and accuracy.position >= 0.95, accuracy


@pytest.fixture(scope="module")
def shapes_repository(tmp_path_factory):
    """The default model, built to serve per-request adapters too, with the committed ones added."""
    from machgen.builder.adapters import add_adapter
    from machgen.builder.build import build_repository
    from machgen.builder.repository import ServingOptions

    repository = tmp_path_factory.mktemp("shapes-repository")
    build_repository(MODEL_DIR, "shapes", repository, log=lambda line: None,
                     options=ServingOptions(max_lora_rank=32))
    for name, folder in ADAPTERS.items():
        add_adapter(repository, name, folder)
    return repository


@pytest.fixture(scope="module")
def shapes_server(shapes_repository):
    with serving(shapes_repository) as server:
        yield server


def test_served_model_gives_the_same_images_and_accuracy(diffusers_images, shapes_server):
    uncached = evaluate.generate_served(shapes_server.grpc_url, "shapes", PROMPTS, cache_policy="none")
    served = evaluate.generate_served(shapes_server.grpc_url, "shapes", PROMPTS)
    labels = [label for _, _, label in PROMPTS]
    assert np.abs(uncached.astype(int) - diffusers_images.astype(int)).max() <= MAX_PIXEL_DIFF
    reference = evaluate.score(diffusers_images, labels)
    assert evaluate.score(uncached, labels) == reference
    # the defaults: prompt accuracy within 2 points of uncached diffusers
    accuracy = evaluate.score(served, labels)
    assert accuracy.colour_shape >= reference.colour_shape - 0.02 and accuracy.position >= 0.95, accuracy
    assert not np.array_equal(served, uncached)  # the calibrated cache policy did apply


def test_stats_report_the_quality_calibration_measured_on_held_out_prompts(shapes_server):
    from machgen.client import MachgenClient

    cache = json.loads((MODEL_DIR / "machgen.json").read_text())["cache"]
    held_out = cache["calibration"]["held_out"][cache["default_policy"]]
    assert held_out["meets_targets"] and cache["calibration"]["holdout_prompts"] >= 64
    with MachgenClient(shapes_server.grpc_url) as client:
        _, stats = client.generate_with_stats("shapes", PROMPTS[0][0], seed=PROMPTS[0][1])
        _, uncached = client.generate_with_stats("shapes", PROMPTS[0][0], seed=PROMPTS[0][1], cache_policy="none")
        _, adapted = client.generate_with_stats("shapes", PROMPTS[0][0], seed=PROMPTS[0][1], lora=["orange"])
    assert (stats["cache_policy"], stats["cache_threshold"]) == (cache["default_policy"], held_out["threshold"])
    assert (stats["expected_psnr"], stats["expected_psnr_worst"]) == (held_out["psnr_mean"], held_out["psnr_worst"])
    assert uncached["expected_psnr"] is None and adapted["expected_psnr"] is None


@pytest.mark.parametrize("adapters", [{"orange": 1.0}, {"gray": 1.0}, {"orange": 0.7, "gray": 0.4}],
                         ids=["orange", "gray", "orange0.7+gray0.4"])
def test_committed_adapters_served_per_request_equal_diffusers(adapters, shapes_server):
    from machgen.builder.lora_training import concept_palette

    concept = next(iter(adapters))
    prompts = shapes.evaluation_prompts(8, colours=(concept,))
    expected = evaluate.generate_with_diffusers(MODEL_DIR, prompts, adapters=[(ADAPTERS[name], weight)
                                                                              for name, weight in adapters.items()])
    served = evaluate.generate_served(shapes_server.grpc_url, "shapes", prompts, cache_policy="none",
                                      lora=list(adapters), lora_scale=list(adapters.values()))
    assert np.abs(served.astype(int) - expected.astype(int)).max() <= MAX_PIXEL_DIFF
    if len(adapters) == 1:  # the adapter does what its card says: most of its colour's prompts come out right
        accuracy = evaluate.score(served, [label for _, _, label in prompts], concept_palette(concept))
        assert accuracy.colour_shape >= 0.75, accuracy
