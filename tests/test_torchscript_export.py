"""The TorchScript-based exporter's path (builder/export.py export_torchscript, with the translations of
builder/torchscript_translations.py): every component of the tiny families takes it, each translation's file
equals torch at sizes the trace never saw, and the numerically identical replacements the families trace
(Wan's and LTX-2's rotary embeddings) equal diffusers' own, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from machgen.builder.export import export_torchscript
from machgen.builder.family_export import ExportableComponent
from machgen.contract.specs import ComponentSpec, TensorSpec
from machgen.runtime.onnx_runner import OnnxSession

from conftest import write_tiny

# Per family, the components that took the dynamo exporter before the translations (heads and tails of every
# denoiser, LTX's VAE, LTX-2's text encoder and vocoder, HiDream's Llama); their other components took the
# TorchScript exporter already. Wan 2.2 I2V's and LTX-Video I2V's are Wan's and LTX-Video's.
ONCE_DYNAMO = {
    "flux": ("denoiser_head", "denoiser_tail"),
    "hidream": ("text_encoder_4",),
    "ltx": ("denoiser_head", "denoiser_tail", "vae_decoder"),
    "ltx2": ("text_encoder", "denoiser_head", "denoiser_tail", "audio_decoder"),
    "wan": ("denoiser_head", "denoiser_tail"),
    "wan-ti2v": ("denoiser_head", "denoiser_tail"),
    "wan-vace": ("denoiser_head", "denoiser_tail"),
}


@pytest.mark.export
@pytest.mark.parametrize("family", sorted(ONCE_DYNAMO))
def test_the_tiny_families_components_take_the_torchscript_exporter(family, tmp_path_factory, tmp_path):
    """export_torchscript keeps its file (the parity checks at the sample sizes, the first row alone and other
    sizes included) for the components that fell back to the dynamo exporter, 15-50x slower."""
    from machgen.builder.model_folder import detect_family, load_pipeline

    model_dir = write_tiny(tmp_path_factory, family)
    detected = detect_family(model_dir)
    components = {c.spec.name: c for c in detected.exporter().components(load_pipeline(model_dir, detected))}
    refused = [name for name in ONCE_DYNAMO[family]
               if not export_torchscript(components[name], tmp_path / f"{name}.onnx")]
    assert not refused


def _exported(tmp_path, module, inputs: dict, shapes: dict, outputs: dict, **component) -> OnnxSession:
    """``module`` through export_torchscript (which must keep its file), opened in ONNX Runtime."""
    spec = ComponentSpec("part", inputs=tuple(TensorSpec(name, "float32", shape) for name, shape in shapes.items()),
                         outputs=tuple(TensorSpec(name, "float32", shape) for name, shape in outputs.items()),
                         tolerance=1e-5)
    path = tmp_path / "part.onnx"
    assert export_torchscript(ExportableComponent(spec, module.eval(), inputs, **component), path)
    return OnnxSession(path)


def _assert_runs_as_torch(session: OnnxSession, module, inputs: dict, atol: float = 1e-5) -> None:
    with torch.no_grad():
        expected = module(**inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = session.run({name: value.numpy() for name, value in inputs.items()})
    for have, want in zip(got.values(), expected):
        assert have.shape == tuple(want.shape)
        np.testing.assert_allclose(have, want.numpy(), rtol=0, atol=atol)


class _JointHeads(torch.nn.Module):
    """Flux's joint attention input: text and image tokens joined, split into heads, rotated as pairs."""

    def __init__(self):
        super().__init__()
        self.project = torch.nn.Linear(8, 8)

    def forward(self, text, image, cos):
        joined = self.project(torch.cat([text, image], dim=1)).unflatten(2, (2, -1))  # [batch, tokens, 2, 4]
        real, imaginary = joined.reshape(*joined.shape[:-1], -1, 2).unbind(-1)
        return torch.stack([-imaginary, real], dim=-1).flatten(3) * cos


@pytest.mark.export
def test_a_split_into_heads_after_joined_streams_keeps_batch_and_tokens_dynamic(tmp_path):
    """The exporter's own unflatten left the joined tokens' count and the batch constants of the file."""
    module = _JointHeads()
    shapes = {"text": ("batch", "text_tokens", 8), "image": ("batch", "image_tokens", 8),
              "cos": ("joint_tokens", 1, 4)}
    sample = {"text": torch.randn(2, 3, 8), "image": torch.randn(2, 5, 8), "cos": torch.randn(8, 1, 4)}
    session = _exported(tmp_path, module, sample, shapes, {"rotated": ("batch", "joint_tokens", 2, 4)},
                        axis_growth={"joint_tokens": 2})
    _assert_runs_as_torch(session, module, {"text": torch.randn(1, 6, 8), "image": torch.randn(1, 9, 8),
                                            "cos": torch.randn(15, 1, 4)})


class _RotaryPairs(torch.nn.Module):
    """LTX-Video's rotary embedding: its table widened by repeat_interleave(dim=-1), the tokens' channels unbound
    as pairs along -1, the same traced constant -1 for both."""

    def forward(self, x, freqs):
        cos = freqs.cos().repeat_interleave(2, dim=-1)
        real, imaginary = x.unflatten(2, (-1, 2)).unbind(-1)
        return x * cos + torch.stack([-imaginary, real], dim=-1).flatten(2) * cos


@pytest.mark.export
def test_a_repeat_interleave_along_minus_one_leaves_the_other_uses_of_minus_one_alone(tmp_path):
    module = _RotaryPairs()
    sample = {"x": torch.randn(2, 6, 8), "freqs": torch.randn(2, 6, 4)}
    session = _exported(tmp_path, module, sample, {"x": ("batch", "tokens", 8), "freqs": ("batch", "tokens", 4)},
                        {"y": ("batch", "tokens", 8)})
    _assert_runs_as_torch(session, module, {"x": torch.randn(3, 11, 8), "freqs": torch.randn(3, 11, 4)})


class _ChannelsLast(torch.nn.Module):
    """LTX's VAE norm: channels moved last and back, by negative and positive dims."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(3)

    def forward(self, x):
        return self.norm(x.movedim(1, -1)).movedim(-1, 1), x.movedim([1, -1], [-1, 2])


@pytest.mark.export
def test_movedim_by_negative_dims_exports_torchs_permutation(tmp_path):
    module = _ChannelsLast()
    session = _exported(tmp_path, module, {"x": torch.randn(2, 3, 4, 5, 3)},
                        {"x": ("batch", 3, "frames", "height", 3)},
                        {"normed": ("batch", 3, "frames", "height", 3), "moved": ("batch", "frames", 3, "height", 3)})
    _assert_runs_as_torch(session, module, {"x": torch.randn(1, 3, 7, 6, 3)})


@pytest.mark.export
def test_same_padding_with_a_dilation_exports_torchs_pads(tmp_path):
    """LTX-2's vocoder: ONNX Runtime refuses the exporter's auto_pad with a dilation."""
    module = torch.nn.Sequential(torch.nn.Conv1d(2, 3, 4, dilation=3, padding="same"),
                                 torch.nn.Conv1d(3, 2, 3, dilation=2, padding="same"))

    class Vocoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.convs = module

        def forward(self, audio):
            return self.convs(audio)

    vocoder = Vocoder()
    session = _exported(tmp_path, vocoder, {"audio": torch.randn(2, 2, 17)}, {"audio": ("batch", 2, "samples")},
                        {"out": ("batch", 2, "samples")})
    _assert_runs_as_torch(session, vocoder, {"audio": torch.randn(1, 2, 30)})


@pytest.mark.export
def test_an_adapted_component_is_also_checked_and_served_with_no_adapters(tmp_path):
    """The adapter bank's axes are empty in a call without adapters, which no sample shows: export_torchscript
    checks that call too, and the file serves it."""
    from machgen.builder.adapters import adapted, make_adaptable
    from machgen.contract.adapters import ROW_SCALES_INPUT, ROWS_INPUT, down_input, up_input

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.GELU(), torch.nn.Linear(6, 8))

        def forward(self, hidden):
            return self.inner(hidden)

    block = Block().eval()
    make_adaptable(block)
    spec = ComponentSpec("block", inputs=(TensorSpec("hidden", "float32", ("batch", "tokens", 8)),),
                         outputs=(TensorSpec("out", "float32", ("batch", "tokens", 8)),), tolerance=1e-5)
    component, layers = adapted(ExportableComponent(spec, block, {"hidden": torch.randn(2, 5, 8)}), block)
    path = tmp_path / "block.onnx"
    assert export_torchscript(component, path)
    hidden = torch.randn(3, 7, 8)
    # What the runtime sends without adapters (runtime/adapters.py bank_feeds): no rows, a bank of rank 0.
    feeds = {"hidden": hidden, ROWS_INPUT: torch.zeros(0, dtype=torch.int64), ROW_SCALES_INPUT: torch.zeros(0, 0)}
    for index, layer in enumerate(layers):
        feeds[down_input(index)] = torch.zeros(0, layer.in_features)
        feeds[up_input(index)] = torch.zeros(layer.out_features, 0)
    (got,) = OnnxSession(path).run({name: value.numpy() for name, value in feeds.items()}).values()
    with torch.no_grad():
        np.testing.assert_allclose(got, block(hidden).numpy(), rtol=0, atol=1e-6)


def test_ltx2s_out_of_place_rotary_is_diffusers_own_bit_for_bit():
    """What the TorchScript exporter traces for LTX-2 (families/ltx2/export.py) in both of diffusers' layouts:
    x [batch, tokens, heads x dim] with a table per head, and x [batch, heads, tokens, dim]."""
    from diffusers.models.transformers import transformer_ltx2

    from machgen.families.ltx2.export import _split_rotary_out_of_place, rotary_out_of_place

    generator = torch.Generator().manual_seed(0)
    for x_shape, table_shape in (((2, 9, 16), (2, 2, 9, 4)), ((2, 2, 9, 8), (2, 2, 9, 4))):
        x = torch.randn(*x_shape, generator=generator)
        freqs = (torch.randn(*table_shape, generator=generator), torch.randn(*table_shape, generator=generator))
        assert torch.equal(_split_rotary_out_of_place(x, freqs), transformer_ltx2.apply_split_rotary_emb(x, freqs))
    kept = transformer_ltx2.apply_split_rotary_emb
    with rotary_out_of_place():
        assert transformer_ltx2.apply_split_rotary_emb is _split_rotary_out_of_place
    assert transformer_ltx2.apply_split_rotary_emb is kept


def test_wans_paired_rotary_attention_is_diffusers_own_bit_for_bit():
    """What the TorchScript exporter traces for Wan (families/wan/export.py): the transformer with its attention
    processors swapped computes what diffusers' computes, and gets them back after."""
    import diffusers

    from machgen.families.wan.export import paired_rotary

    torch.manual_seed(0)
    transformer = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32).eval()
    inputs = {"hidden_states": torch.randn(2, 4, 3, 6, 4), "timestep": torch.tensor([700, 300]),
              "encoder_hidden_states": torch.randn(2, 5, 16)}
    processors = [module.processor for module in transformer.modules() if hasattr(module, "processor")]
    with torch.no_grad():
        expected = transformer(**inputs, return_dict=False)[0]
        with paired_rotary(transformer)():
            swapped = [module.processor for module in transformer.modules() if hasattr(module, "processor")]
            got = transformer(**inputs, return_dict=False)[0]
    assert all(type(processor).__name__ == "_PairedRotaryProcessor" for processor in swapped)
    assert torch.equal(got, expected)
    assert [module.processor for module in transformer.modules() if hasattr(module, "processor")] == processors
