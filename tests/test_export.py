"""Export parity per component: ONNX Runtime against torch, at the traced
sizes (checked by the build) and at sizes the trace never saw."""

import numpy as np
import pytest
import torch

from machgen.contract.adapters import ADAPTER_NAMES_INPUT, adapters_root
from machgen.contract.manifest import pipeline_dir
from machgen.families.registry import get_family
from machgen.runtime.components import open_component
from machgen.runtime.onnx_runner import OnnxSession
from machgen.runtime.sampler import adapter_rows

from conftest import PIPELINE_NAME, component_onnx

# Sizes for every dynamic axis, all different from the traced ones.
UNSEEN_SIZES = {"batch": 3, "image_tokens": 48, "text_tokens": 19, "latent_height": 12, "latent_width": 8,
                "height": 24, "width": 16}


def test_build_reports_parity_within_tolerance_for_every_component(built_repository):
    _, results = built_repository
    assert [r.name for r in results] == ["text_encoder", "text_encoder_2", "denoiser_head", "denoiser_tail",
                                         "denoiser_reuse", "vae_decoder", "vae_encoder", "postprocess"]
    for result in results:
        assert 0.0 <= result.max_abs_diff <= result.tolerance, result


def _random_input(spec, generator):
    shape = [UNSEEN_SIZES[d] if isinstance(d, str) else d for d in spec.shape]
    if spec.dtype == "int64":
        return torch.randint(0, 100, shape, generator=generator)
    return torch.randn(shape, generator=generator)


@pytest.mark.parametrize("component", ["text_encoder", "text_encoder_2", "denoiser_head", "denoiser_tail",
                                       "denoiser_reuse", "vae_decoder", "vae_encoder", "postprocess"])
def test_onnx_matches_torch_on_unseen_dynamic_sizes(component, built_repository, tiny_flux_pipeline):
    repository, _ = built_repository
    exportable = {c.spec.name: c for c in get_family("flux").exporter().components(tiny_flux_pipeline)}[component]
    spec = exportable.spec
    generator = torch.Generator().manual_seed(7)
    inputs = {t.name: _random_input(t, generator) for t in spec.inputs}
    if component == "postprocess":
        inputs["image"] = inputs["image"].clamp(-1.2, 1.2)
    with torch.no_grad():
        expected = exportable.module(**inputs)
    expected = expected if isinstance(expected, tuple) else (expected,)
    # The denoiser's components take per-request adapters (conftest.ADAPTER_RANK): here none, a bank of rank 0.
    runner = open_component(component_onnx(repository, component),
                            adapters=adapters_root(pipeline_dir(repository, PIPELINE_NAME)))
    feeds = {k: v.numpy() for k, v in inputs.items()}
    if ADAPTER_NAMES_INPUT in runner.input_names:
        feeds.update(adapter_rows((), UNSEEN_SIZES["batch"]))
    got = runner.run(feeds)
    for tensor, want in zip(spec.outputs, expected):
        have = got[tensor.name]
        assert have.shape == tuple(want.shape)
        assert have.dtype == np.dtype(tensor.dtype)
        diff = np.abs(have.astype(np.float64) - want.numpy().astype(np.float64)).max()
        assert diff <= spec.tolerance, f"{component}.{tensor.name}: {diff}"


def test_split_denoiser_equals_the_whole_transformer(tiny_flux_pipeline):
    """head then tail is FluxTransformer2DModel.forward, bit for bit in torch."""
    components = {c.spec.name: c for c in get_family("flux").exporter().components(tiny_flux_pipeline)}
    head, tail, reuse = components["denoiser_head"], components["denoiser_tail"], components["denoiser_reuse"]
    inputs = head.sample_inputs
    with torch.no_grad():
        image_hidden, text_hidden, temb, first_block_residual = head.module(**inputs)
        split, tail_residual = tail.module(image_hidden, text_hidden, temb, inputs["img_ids"], inputs["txt_ids"])
        whole = tiny_flux_pipeline.transformer(
            hidden_states=inputs["hidden_states"], encoder_hidden_states=inputs["encoder_hidden_states"],
            pooled_projections=inputs["pooled_projections"], timestep=inputs["timestep"].reshape(-1),
            guidance=inputs["guidance"].reshape(-1), img_ids=inputs["img_ids"][0], txt_ids=inputs["txt_ids"][0],
            return_dict=False)[0]
        # the blocks' residuals put back on the input embedding give the same prediction
        reused = reuse.module(**{name: inputs[name] for name in ("hidden_states", "pooled_projections", "timestep",
                                                                  "guidance")},
                              blocks_residual=first_block_residual + tail_residual)
    assert torch.equal(split, whole)
    torch.testing.assert_close(reused, whole, rtol=0, atol=1e-5)


@pytest.mark.export
def test_a_squeeze_of_an_axis_that_is_not_one_exports_as_torch_means_it(tmp_path):
    """torch leaves x.squeeze(2) alone when axis 2 is not 1; the exported file must too
    (onnxscript writes a Squeeze that ONNX Runtime refuses: LTX-2's transformer)."""
    from machgen.builder.export import export_onnx
    from machgen.builder.family_export import ExportableComponent
    from machgen.contract.specs import ComponentSpec, TensorSpec

    class Gate(torch.nn.Module):
        def forward(self, x):
            return x.squeeze(2) * 2 + x.unsqueeze(2).squeeze(2)  # axis 2 is 5, then a real unit axis

    spec = ComponentSpec("gate", inputs=(TensorSpec("x", "float32", ("batch", "tokens", 5)),),
                         outputs=(TensorSpec("y", "float32", ("batch", "tokens", 5)),), tolerance=1e-6)
    x = torch.randn(2, 3, 5)
    export_onnx(ExportableComponent(spec, Gate().eval(), {"x": x}), tmp_path / "gate.onnx")
    unseen = torch.randn(4, 7, 5)
    (got,) = OnnxSession(tmp_path / "gate.onnx").run({"x": unseen.numpy()}).values()
    assert np.allclose(got, (unseen * 3).numpy(), atol=1e-6)


@pytest.mark.export
def test_interleaved_writes_of_the_last_axis_export_as_pairs_with_the_same_values(tmp_path):
    """Wan's rotary embedding writes ``out[..., 0::2]`` then ``out[..., 1::2]`` of an empty tensor: the file
    joins the two writes as pairs (no ScatterND, whose translation transposes the tensor back and forth), and
    equals torch (exactly where only values move: a lone odd write over real values), on sizes the trace
    never saw."""
    import onnx

    from machgen.builder.export import export_onnx
    from machgen.builder.family_export import ExportableComponent
    from machgen.contract.specs import ComponentSpec, TensorSpec

    class Rotate(torch.nn.Module):
        def forward(self, x, angle):
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            out = torch.empty_like(x)
            out[..., 0::2] = x1 * angle.cos() - x2 * angle.sin()
            out[..., 1::2] = x1 * angle.sin() + x2 * angle.cos()
            odd_only = x.clone()
            odd_only[..., 1::2] = x1 * 3
            return out, odd_only

    spec = ComponentSpec("rotate", inputs=(TensorSpec("x", "float32", ("batch", "tokens", 4, 8)),
                                           TensorSpec("angle", "float32", ("batch", "tokens", 4, 4))),
                         outputs=(TensorSpec("rotated", "float32", ("batch", "tokens", 4, 8)),
                                  TensorSpec("odd_written", "float32", ("batch", "tokens", 4, 8))), tolerance=0)
    module = Rotate().eval()
    export_onnx(ExportableComponent(spec, module, {"x": torch.randn(2, 3, 4, 8), "angle": torch.randn(2, 3, 4, 4)}),
                tmp_path / "rotate.onnx")
    assert "ScatterND" not in {node.op_type for node in onnx.load(tmp_path / "rotate.onnx").graph.node}
    x, angle = torch.randn(3, 5, 4, 8), torch.randn(3, 5, 4, 4)
    got = OnnxSession(tmp_path / "rotate.onnx").run({"x": x.numpy(), "angle": angle.numpy()})
    with torch.no_grad():
        rotated, odd_written = module(x, angle)
    assert np.allclose(got["rotated"], rotated.numpy(), rtol=0, atol=1e-6)  # cos, sin and products: rounding
    assert np.array_equal(got["odd_written"], odd_written.numpy())
