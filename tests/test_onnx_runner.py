import numpy as np
import onnx
from onnx import TensorProto, helper

from machgen.runtime.onnx_runner import CheckedWideRunner, OnnxSession, group_requests


def _scale_model(path, factor: float = 2.0):
    """y = factor * x over [batch, n] float32."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "n"])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [factor])])
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
    # one forward per shape bucket, in order of each bucket's first arrival
    assert forwards == [(4, 3), (1, 5)]
    for request, result in zip(requests, results):
        np.testing.assert_array_equal(result["y"], request["x"] * 2)


def test_a_forward_never_carries_more_than_the_maximum_rows(tmp_path, monkeypatch):
    session = OnnxSession(_scale_model(tmp_path / "m.onnx"))
    forwards = []
    original = session.run
    monkeypatch.setattr(session, "run", lambda inputs: forwards.append(len(inputs["x"])) or original(inputs))
    requests = [{"x": np.full((2, 3), i, np.float32)} for i in range(5)]
    results = session.run_batches(requests, max_rows=4)
    assert forwards == [4, 4, 2]
    for request, result in zip(requests, results):
        np.testing.assert_array_equal(result["y"], request["x"] * 2)


def _counting(session, calls: list, label: str):
    original = session.run
    session.run = lambda inputs: calls.append(label) or original(inputs)
    return session


def test_a_wide_session_takes_a_shapes_lone_calls_only_once_it_gave_the_same_bits(tmp_path):
    path = _scale_model(tmp_path / "m.onnx")
    calls = []
    runner = CheckedWideRunner(_counting(OnnxSession(path, intra_op_threads=1), calls, "narrow"),
                               _counting(OnnxSession(path, intra_op_threads=2), calls, "wide"))
    x = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    for _ in range(3):
        np.testing.assert_array_equal(runner.run_batches([x])[0]["y"], x["x"] * 2)
    # the first call runs on both and answers the narrow session's; the shape's later calls, the wide one alone
    assert calls == ["narrow", "wide", "wide", "wide"]
    calls.clear()
    other = {"x": np.ones((1, 5), np.float32)}
    runner.run_batches([other])
    runner.run_batches([other])
    assert calls == ["narrow", "wide", "wide"]  # a new shape is checked anew


def test_a_wide_session_that_rounds_differently_never_answers(tmp_path):
    calls, logged = [], []
    narrow = _counting(OnnxSession(_scale_model(tmp_path / "narrow.onnx"), intra_op_threads=1), calls, "narrow")
    # A session whose result differs in the last bit, as a wider split of a reduction may round.
    differing = float(np.nextafter(np.float32(2.0), np.float32(3.0)))
    wide = _counting(OnnxSession(_scale_model(tmp_path / "wide.onnx", differing), intra_op_threads=2), calls, "wide")
    runner = CheckedWideRunner(narrow, wide, logged.append)
    x = {"x": np.arange(1, 7, dtype=np.float32).reshape(2, 3)}
    for _ in range(3):
        np.testing.assert_array_equal(runner.run_batches([x])[0]["y"], x["x"] * 2)
    assert calls == ["narrow", "wide", "narrow", "narrow"]
    assert len(logged) == 1 and "rounds differently" in logged[0] and "(2, 3)" in logged[0]


def test_grouping_is_fifo_per_bucket_and_serves_every_request_once():
    rng = np.random.default_rng(0)
    for _ in range(200):
        count = int(rng.integers(1, 24))
        keys = [int(k) for k in rng.integers(0, 3, count)]
        sizes = [int(s) for s in rng.integers(1, 3, count)]
        max_rows = int(rng.integers(2, 9))
        groups = group_requests(keys, sizes, max_rows)
        assert sorted(i for group in groups for i in group) == list(range(count))
        for group in groups:
            assert len({keys[i] for i in group}) == 1, "shape buckets mixed"
            assert group == sorted(group), "arrival order broken inside a forward"
            assert len(group) == 1 or sum(sizes[i] for i in group) <= max_rows
        # within a bucket, an earlier request never runs in a later forward (no overtaking)
        for bucket in set(keys):
            bucket_groups = [g for g in groups if keys[g[0]] == bucket]
            assert [i for g in bucket_groups for i in g] == [i for i in range(count) if keys[i] == bucket]
        # buckets are served in order of their first request's arrival
        assert list(dict.fromkeys(keys[g[0]] for g in groups)) == list(dict.fromkeys(keys))
    assert group_requests(["a", "b", "a"], [1, 1, 1]) == [[0, 2], [1]]
    assert group_requests(["a"], [5], max_rows=2) == [[0]]
