import numpy as np
import onnx
from onnx import TensorProto, helper

from machgen.ensembles.onnx_runner import OnnxSession


def _scale_model(path):
    """y = 2 * x over [batch, n] float32."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_requests_with_equal_shapes_run_together_and_split_back(tmp_path, monkeypatch):
    session = OnnxSession(_scale_model(tmp_path / "m.onnx"))
    forwards = []
    original = session.run
    monkeypatch.setattr(session, "run", lambda inputs: forwards.append(inputs["x"].shape) or original(inputs))
    requests = [{"x": np.full((1, 3), 1, np.float32)}, {"x": np.full((2, 3), 2, np.float32)},
                {"x": np.full((1, 5), 3, np.float32)}, {"x": np.full((1, 3), 4, np.float32)}]
    results = session.run_batches(requests)
    # arrival order is kept: the [*, 5] request splits the run of [*, 3] ones
    assert forwards == [(3, 3), (1, 5), (1, 3)]
    for request, result in zip(requests, results):
        np.testing.assert_array_equal(result["y"], request["x"] * 2)
