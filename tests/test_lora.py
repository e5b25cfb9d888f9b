"""LoRA: a few fine-tuning steps save a diffusers-format adapter, and
`machgen-build build --lora` serves the fused weights."""

import numpy as np
import pytest
import torch

from machgen.builder.lora_training import LoraSettings, concept_palette, train_lora
from machgen.runtime.onnx_runner import OnnxSession


@pytest.mark.export
def test_lora_trains_saves_and_fuses_into_the_exported_denoiser(tiny_flux_dir, tmp_path):
    from diffusers import FluxPipeline

    from machgen.builder.build import build_repository
    from machgen.families.registry import get_family

    adapter = tmp_path / "lora"
    record = train_lora(tiny_flux_dir, adapter, LoraSettings(concept_samples=16, replay_samples=16, steps=4, batch=4,
                                                             lr=1e-2), log=lambda line: None)
    assert record["steps"] == 4 and (adapter / "pytorch_lora_weights.safetensors").is_file()

    pipe = FluxPipeline.from_pretrained(tiny_flux_dir, local_files_only=True)
    base_head = get_family("flux").exporter().components(pipe)[2]
    pipe.load_lora_weights(adapter)  # diffusers' own loader, unfused
    inputs = base_head.sample_inputs
    with torch.no_grad():
        lora_output = get_family("flux").exporter().components(pipe)[2].module(**inputs)[0].numpy()
        pipe.disable_lora()
        base_output = get_family("flux").exporter().components(pipe)[2].module(**inputs)[0].numpy()
    assert np.abs(lora_output - base_output).max() > 1e-4  # the adapter changes the model

    repository = tmp_path / "repository"
    build_repository(tiny_flux_dir, "fused", repository, lora=adapter, log=lambda line: None,
                     preview=False)
    session = OnnxSession(repository / "fused_denoiser_head" / "1" / "model.onnx")
    served = session.run({k: v.numpy() for k, v in inputs.items()})["image_hidden"]
    assert np.abs(served - lora_output).max() <= 1e-4


def test_concept_palette_extends_the_dataset_colours():
    palette = concept_palette("orange")
    assert palette["orange"] == (250, 140, 20) and palette["red"] == (220, 40, 40)
