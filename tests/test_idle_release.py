"""Memory given back when a model goes idle (issue 61): ONNX Runtime's CPU arena keeps its peak for as long as
its session lives, so an idle model reopens its sessions (onnx_runner.OnnxSession.release_memory)."""

import json
import sys
import threading
import time
import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from machgen.contract.manifest import IDLE_RELEASE_PARAMETER, LONE_THREADS_PARAMETER
from machgen.contract.streaming import StreamingSettings
from machgen.runtime.onnx_runner import CheckedWideRunner, IdleRelease, OnnxSession, release_delay, release_memory
from machgen.runtime.streaming.engine import CacheShape, StreamingEngine


def _dense_model(path, width: int = 64, seed: int = 0):
    """relu(x @ W1) @ W2 over [batch, width] float32: matrix products whose buffers the arena keeps."""
    rng = np.random.default_rng(seed)
    weights = [helper.make_tensor(name, TensorProto.FLOAT, [width, width],
                                  rng.standard_normal((width, width)).astype(np.float32).ravel())
               for name in ("w1", "w2")]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])], "dense",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])], weights)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _inputs(rows: int, seed: int = 1) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)}


def test_a_released_session_gives_the_same_bits_while_another_thread_runs_on_it(tmp_path):
    session = OnnxSession(_dense_model(tmp_path / "m.onnx"), intra_op_threads=1)
    small, large = _inputs(3), _inputs(512, seed=2)
    expected = {rows: session.run(x)["y"] for rows, x in ((3, small), (512, large))}
    stop, runs, wrong = threading.Event(), [0], []

    def keep_running():
        while not stop.is_set():
            for x in (small, large):
                y = session.run(x)["y"]
                if not np.array_equal(y, expected[len(x["x"])]):
                    wrong.append(len(x["x"]))
            runs[0] += 1

    runner = threading.Thread(target=keep_running)
    runner.start()
    try:
        opened = []
        for _ in range(5):
            opened.append(session._session)
            release_memory(session)
            assert session._session is not opened[-1]  # a fresh InferenceSession: the old one's arena goes with it
    finally:
        stop.set()
        runner.join()
    assert runs[0] > 0 and not wrong
    for rows, x in ((3, small), (512, large)):
        np.testing.assert_array_equal(session.run(x)["y"], expected[rows])


def test_a_release_reaches_both_sessions_of_a_checked_wide_runner_and_skips_runners_without_arenas(tmp_path):
    path = _dense_model(tmp_path / "m.onnx")
    narrow, wide = OnnxSession(path, intra_op_threads=1), OnnxSession(path, intra_op_threads=2)
    runner = CheckedWideRunner(narrow, wide)
    x = _inputs(4)
    before = runner.run_batches([x])[0]["y"]
    sessions = (narrow._session, wide._session)
    release_memory(runner, object())  # a runner without sessions (a torch program) is left alone
    assert narrow._session is not sessions[0] and wide._session is not sessions[1]
    np.testing.assert_array_equal(runner.run_batches([x])[0]["y"], before)


def test_idle_release_comes_after_the_idle_time_never_during_a_call_and_once_per_idle_spell():
    now, released = [0.0], []
    idle = IdleRelease(lambda: released.append(now[0]), idle_s=10.0, clock=lambda: now[0])
    now[0] = 100.0
    assert not idle.check()  # nothing ran: nothing grew
    with idle.running():
        now[0] = 200.0
        assert not idle.check()  # a call running, however long
    now[0] = 209.0
    assert not idle.check()  # 9 s after the call ended
    now[0] = 210.0
    assert idle.check() and released == [210.0]
    now[0] = 500.0
    assert not idle.check()  # one release per idle spell
    with idle.running():
        pass
    now[0] = 510.0
    assert idle.check() and released == [210.0, 510.0] and idle.releases == 2
    never = IdleRelease(lambda: released.append("never"), idle_s=0.0, clock=lambda: now[0])
    with never.running():
        pass
    now[0] = 1e9
    assert not never.check() and released[-1] != "never"


def test_a_call_that_comes_during_a_release_waits_for_it():
    entered, finish, order = threading.Event(), threading.Event(), []

    def slow_release():
        entered.set()
        finish.wait(5)
        order.append("released")

    now = [0.0]
    idle = IdleRelease(slow_release, idle_s=1.0, clock=lambda: now[0])
    with idle.running():
        pass
    now[0] = 2.0
    releasing = threading.Thread(target=idle.check)
    releasing.start()
    assert entered.wait(5)

    def call():
        with idle.running():
            order.append("call")

    calling = threading.Thread(target=call)
    calling.start()
    calling.join(0.2)
    assert order == []  # the call waits
    finish.set()
    releasing.join()
    calling.join()
    assert order == ["released", "call"]


@pytest.fixture
def component_model(tmp_path, monkeypatch):
    """triton_models.components.OnnxComponentModel under a stand-in for Triton's stub module (its Logger and
    tensors; the model's own code and sessions are the real ones), on a dense model's file."""
    stub = types.ModuleType("triton_python_backend_utils")
    stub.Logger = types.SimpleNamespace(log_info=print, log_warn=print, log_error=print)

    class Tensor:
        def __init__(self, name, array):
            self._name, self._array = name, array

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    stub.Tensor = Tensor
    stub.InferenceResponse = lambda tensors=(), error=None: types.SimpleNamespace(tensors=tensors, error=error)
    stub.get_input_tensor_by_name = lambda request, name: request.inputs[name]
    for name in ("triton_python_backend_utils", "machgen.runtime.triton_models.backend",
                 "machgen.runtime.triton_models.components"):
        monkeypatch.setitem(sys.modules, name, None)  # restored (removed) after the test
        del sys.modules[name]
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", stub)
    from machgen.runtime.triton_models.components import OnnxComponentModel

    version = tmp_path / "stage" / "1"
    version.mkdir(parents=True)
    _dense_model(version / "model.onnx")
    models = []

    def load(parameters: dict):
        config = {"name": "stage", "max_batch_size": 16,
                  "parameters": {key: {"string_value": value} for key, value in parameters.items()}}
        model = OnnxComponentModel()
        model.initialize({"model_config": json.dumps(config), "model_repository": str(tmp_path / "stage"),
                          "model_version": "1"})
        models.append(model)
        return model

    yield load, Tensor
    for model in models:
        model.finalize()
    import machgen.runtime.triton_models as package

    for module in ("backend", "components"):  # the stand-in's modules leave no trace for later imports
        package.__dict__.pop(module, None)


def test_a_component_model_releases_its_sessions_after_its_idle_time(component_model):
    load, Tensor = component_model
    model = load({"intra_op_threads": "1", LONE_THREADS_PARAMETER: "2", IDLE_RELEASE_PARAMETER: "0.4"})
    # 0.4 s, or longer where its two sessions took long to open (a loaded machine)
    assert model.lone_runner is not None and model.idle.idle_s == release_delay(0.4, model.lone_runner) >= 0.4
    x = _inputs(2)["x"]
    request = types.SimpleNamespace(inputs={"x": Tensor("x", x)}, parameters=lambda: "")
    before = model.execute([request])[0].tensors[0].as_numpy()
    opened = (model.runner._session, model.lone_runner.wide._session)
    deadline = time.monotonic() + model.idle.idle_s + 5  # its thread checks every 0.2 s
    while not model.idle.releases and time.monotonic() < deadline:
        threading.Event().wait(0.1)
    assert model.idle.releases == 1
    assert model.runner._session is not opened[0] and model.lone_runner.wide._session is not opened[1]
    np.testing.assert_array_equal(model.execute([request])[0].tensors[0].as_numpy(), before)
    assert load({"intra_op_threads": "1"}).idle.idle_s == 0  # a repository built before the parameter: never


def _engine(released: list) -> StreamingEngine:
    """An engine whose family runtime only embeds prompts and sizes latents: opening and closing sessions is
    all this test does."""
    import torch

    runtime = types.SimpleNamespace(settings={"latent_channels": 4}, latent_size=lambda h, w: (h // 8, w // 8),
                                    encode_prompts=lambda prompts: {"encoder_hidden_states": torch.zeros(1, 3, 8)})
    return StreamingEngine(StreamingSettings(chunk_frames=2, timesteps=(1000.0, 500.0)), runtime,
                           lambda name, inputs: {}, CacheShape(layers=1, heads=1, head_dim=4),
                           idle_timeout_s=5.0, clock=lambda: 0.0, release_memory=lambda: released.append(1))


def test_the_engine_releases_once_its_last_session_has_closed_or_been_evicted():
    released = []
    engine = _engine(released)
    assert not engine.release_if_idle()  # nothing has run
    engine.open("a", "a red circle", 1, 32, 32)
    engine.open("b", "a red circle", 2, 32, 32)
    engine.close("a")
    assert not engine.release_if_idle() and released == []  # "b" is open
    engine.close("b")
    assert engine.release_if_idle() and released == [1]
    assert not engine.release_if_idle()  # once until sessions close again
    engine.open("c", "a red circle", 3, 32, 32)
    engine.clock = lambda: 10.0
    assert engine.evict_idle() == ["c"]
    assert engine.release_if_idle() and released == [1, 1]


def test_a_session_slow_to_reopen_waits_for_a_longer_idle_spell_and_the_engine_for_its_delay(tmp_path):
    """A release costs the next call a reopening at most: a model that takes seconds to open (a large one) is
    released only after RELEASE_COST_SHARE times that; the engine only release_after_s after its last close."""
    from machgen.runtime.onnx_runner import RELEASE_COST_SHARE, release_delay

    path = _dense_model(tmp_path / "m.onnx")
    narrow, wide = OnnxSession(path, intra_op_threads=1), OnnxSession(path, intra_op_threads=2)
    assert 0 < narrow.open_seconds < 10
    assert release_delay(10.0, narrow) == max(10.0, RELEASE_COST_SHARE * narrow.open_seconds)
    narrow.open_seconds = wide.open_seconds = 3.0  # as a large model's
    assert release_delay(10.0, CheckedWideRunner(narrow, wide), object()) == RELEASE_COST_SHARE * 6.0
    assert release_delay(0.0, narrow) == 0.0  # never

    released = []
    engine = _engine(released)
    engine.release_after_s = 5.0
    engine.open("a", "a red circle", 1, 32, 32)
    engine.close("a")  # at 0.0
    assert not engine.release_if_idle()
    engine.clock = lambda: 5.0
    assert engine.release_if_idle() and released == [1]


def test_an_idle_release_drops_the_old_session_before_it_opens_the_new_one(tmp_path):
    """IdleRelease's callers run nothing meanwhile: the old session (its weights and grown arena) is gone before
    the new one opens, so the weights are never held twice; a reopening that failed is tried again by the next
    run."""
    import weakref

    path = _dense_model(tmp_path / "m.onnx")
    session = OnnxSession(path, intra_op_threads=1)
    x = _inputs(3)
    before = session.run(x)["y"]
    old = weakref.ref(session._session)
    seen_while_opening = []
    opening = session._open

    def open_watched():
        seen_while_opening.append(old() is None)
        return opening()

    session._open = open_watched
    release_memory(session, idle=True)
    assert seen_while_opening == [True]
    session._session = None  # as a failed reopening leaves it
    np.testing.assert_array_equal(session.run(x)["y"], before)
