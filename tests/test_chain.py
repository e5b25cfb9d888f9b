"""A denoiser's head and tail joined into one ONNX graph (builder/chain.py): the same outputs as the two
sessions run one after the other, however the parts name their insides."""

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from machgen.builder.chain import fuse_head_and_tail
from machgen.runtime.onnx_runner import OnnxSession


def _values(*names):
    return [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", "n"]) for name in names]


def _save(path, nodes, inputs, outputs, weights):
    graph = helper.make_graph(nodes, path.stem, _values(*inputs), _values(*outputs),
                              [helper.make_tensor(name, TensorProto.FLOAT, [], [value])
                               for name, value in weights.items()])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _head(path):
    # hidden = 2x, its residual hidden - x, and an embedding of t; the inside value "h" and weight "w" are
    # names the tail uses for its own.
    return _save(path, [helper.make_node("Mul", ["x", "w"], ["h"]), helper.make_node("Identity", ["h"], ["hidden"]),
                        helper.make_node("Sub", ["h", "x"], ["first_block_residual"]),
                        helper.make_node("Add", ["t", "w"], ["temb"])],
                 ["x", "t"], ["hidden", "first_block_residual", "temb"], {"w": 2.0})


def _tail(path, inputs=("hidden", "temb", "x"), output="noise_pred"):
    # noise = 3 * hidden + temb - x: takes two head outputs and one of the head's own inputs.
    return _save(path, [helper.make_node("Mul", ["hidden", "w"], ["h"]), helper.make_node("Add", ["h", "temb"], ["s"]),
                        helper.make_node("Sub", ["s", inputs[2]], [output]),
                        helper.make_node("Sub", ["h", "hidden"], ["tail_residual"])],
                 list(inputs), [output, "tail_residual"], {"w": 3.0})


def test_the_joined_graph_gives_what_head_then_tail_give(tmp_path):
    head, tail = _head(tmp_path / "head.onnx"), _tail(tmp_path / "tail.onnx")
    joined = OnnxSession(fuse_head_and_tail(head, tail, tmp_path / "chain" / "model.onnx", ["first_block_residual"]))
    assert joined.input_names == ["x", "t"]
    assert sorted(joined.output_names) == ["first_block_residual", "noise_pred", "tail_residual"]
    rng = np.random.default_rng(0)
    inputs = {"x": rng.standard_normal((3, 5), np.float32), "t": rng.standard_normal((3, 5), np.float32)}
    head_outputs = OnnxSession(head).run(inputs)
    tail_session = OnnxSession(tail)
    expected = tail_session.run({name: {**inputs, **head_outputs}[name] for name in tail_session.input_names})
    outputs = joined.run(inputs)
    np.testing.assert_array_equal(outputs["noise_pred"], expected["noise_pred"])
    np.testing.assert_array_equal(outputs["tail_residual"], expected["tail_residual"])
    np.testing.assert_array_equal(outputs["first_block_residual"], head_outputs["first_block_residual"])
    np.testing.assert_allclose(outputs["noise_pred"], 6 * inputs["x"] + inputs["t"] + 2 - inputs["x"], rtol=1e-6)


def test_a_tail_input_the_head_does_not_have_is_refused(tmp_path):
    head, tail = _head(tmp_path / "head.onnx"), _tail(tmp_path / "tail.onnx", inputs=("hidden", "temb", "mask"))
    with pytest.raises(ValueError, match="'mask' is neither an input nor an output of the head"):
        fuse_head_and_tail(head, tail, tmp_path / "chain.onnx", ["first_block_residual"])


def test_a_tail_output_named_like_a_value_of_the_head_is_refused(tmp_path):
    head, tail = _head(tmp_path / "head.onnx"), _tail(tmp_path / "tail.onnx", output="temb_out")
    fuse_head_and_tail(head, tail, tmp_path / "chain.onnx", ["first_block_residual"])
    clashing = _tail(tmp_path / "clashing.onnx", output="h")
    with pytest.raises(ValueError, match=r"outputs \['h'\] are names in the head's graph"):
        fuse_head_and_tail(head, clashing, tmp_path / "chain.onnx", ["first_block_residual"])
    with pytest.raises(ValueError, match="no output"):
        fuse_head_and_tail(head, tail, tmp_path / "chain.onnx", ["blocks_residual"])


def test_the_joined_graph_names_each_opset_domain_once_and_passes_the_full_check(tmp_path):
    joined = fuse_head_and_tail(_head(tmp_path / "head.onnx"), _tail(tmp_path / "tail.onnx"),
                                tmp_path / "joined.onnx", ["first_block_residual"])
    model = onnx.load(joined)
    assert [(entry.domain, entry.version) for entry in model.opset_import] == [("", 17)]
    onnx.checker.check_model(model, full_check=True)


def check_every_graph(repository, joined: bool) -> None:
    """onnx.checker with shape inference on every ONNX file of ``repository`` (``joined``: a joined denoiser
    among them)."""
    files = sorted(repository.rglob("*.onnx"))
    assert files and (not joined or any(path.parent.parent.name.endswith("_denoiser") for path in files)), files
    for path in files:
        onnx.checker.check_model(str(path), full_check=True)


@pytest.mark.export
def test_every_model_a_build_writes_passes_onnx_s_full_check(built_repository):
    """The standard tools (onnx.checker with shape inference, ONNX Runtime's quantizer) take every graph a
    build writes (the tiny Flux with adapter inputs here; tests/test_streaming.py checks a Wan build's, the
    joined denoiser and the in-sampler streaming denoiser among them)."""
    repository, results = built_repository
    check_every_graph(repository, joined=False)
    # The build reports each component's weights as written: a component served as its own model holds them.
    for result in results:
        folder = repository / f"flux_{result.name}" / "1"
        if folder.is_dir():
            assert result.file_bytes == sum(item.stat().st_size for item in folder.iterdir()
                                            if item.name.startswith("model.onnx")), result.name
