"""Shared fixtures: one tiny Flux folder, one built repository, one server per session.

The tiny model is written and loaded back through the same code a user's
model takes (save_pretrained / from_pretrained, machgen-build build).

Tiers: a test that exports components or builds a repository is marked
``export`` (by its fixtures or its own mark), one that starts a server
``integration``; ``make test-fast`` runs the others.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Without a GPU the sparse-attention kernel runs under Triton's interpreter. Triton reads this when it is
# first imported, which other tests' imports (torch's exporter) do before test_triton_kernel.py runs.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
warnings.filterwarnings("ignore", category=FutureWarning)

PIPELINE_NAME = "flux"


def component_onnx(repository: Path, component: str, pipeline: str = PIPELINE_NAME) -> Path:
    """A built component's ONNX file: in its Triton model, or under the sampler when it runs there."""
    from machgen.contract.manifest import PipelineManifest, pipeline_dir

    sampler_dir = pipeline_dir(repository, pipeline)
    entry = PipelineManifest.read(sampler_dir).components[component]
    return sampler_dir / entry.file if entry.file else repository / entry.model / "1" / "model.onnx"


def write_tiny(tmp_path_factory, family: str) -> Path:
    """A tiny random-weight model folder of ``family``, as `machgen-build tiny` writes it."""
    from machgen.builder.model_folder import write_tiny_model
    from machgen.families.registry import get_family

    return write_tiny_model(get_family(family), tmp_path_factory.mktemp("models") / f"tiny-{family}")


def write_tiny_streaming(tmp_path_factory) -> Path:
    """A tiny one-transformer Wan (Wan 2.1's layout) whose card declares a streaming mode (families/wan/tiny.py
    TINY_STREAMING), as `machgen-build tiny wan --streaming` writes it: a realtime model."""
    from machgen.builder.model_folder import write_tiny_model
    from machgen.families.registry import get_family

    return write_tiny_model(get_family("wan"), tmp_path_factory.mktemp("models") / "tiny-wan-streaming",
                            streaming=True)


def runtime_for(model_dir: Path, run_component):
    """The family runtime of a tiny model folder over ``run_component`` (a
    closed-form fake, say), with the settings its build would record: no export."""
    from machgen.builder.model_folder import detect_family, load_pipeline, served_defaults
    from machgen.contract.manifest import load_object

    family = detect_family(model_dir)
    pipe = load_pipeline(model_dir, family)
    settings = family.exporter().sampler_settings(pipe, served_defaults(model_dir, family, pipe))
    return load_object(family.runtime)(settings, str(model_dir), run_component)


def load_diffusers(model_dir: Path):
    """The diffusers pipeline the folder's model_index.json names, loaded from it, quiet."""
    import diffusers

    pipe = diffusers.DiffusionPipeline.from_pretrained(model_dir, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def build_tiny_repository(tmp_path_factory, model_dir: Path, name: str, in_flight: int = 2, preview: bool = False,
                          into: Path | None = None, target: str = "onnxruntime", parallel=None, attention=None,
                          **options) -> Path:
    """A model repository of ``model_dir`` served as ``name`` (one instance per
    component; ``options``: other ServingOptions). Without the preview
    projection unless asked (``preview``): fitting it runs a few generations,
    seconds per build that only the tests of previews need. ``into``: an
    existing repository that gets this pipeline beside its others (a family
    module's task variants share one repository, and so one server);
    ``target``, ``parallel`` (a ParallelLayout) and ``attention`` (AttentionOptions): build_repository's."""
    from machgen.builder.build import AttentionOptions, build_repository
    from machgen.builder.repository import ServingOptions

    out = into if into is not None else tmp_path_factory.mktemp(f"{name}-repository")
    build_repository(model_dir, name, out, options=ServingOptions(in_flight=in_flight, component_instances=1,
                                                                  **options),
                     log=lambda line: None, preview=preview, target=target, parallel=parallel,
                     attention=attention or AttentionOptions())
    return out


def levels(pixels):
    """Pixels in [0, 1] (diffusers' "np" output) as uint8 levels, int16 to take differences."""
    import numpy as np

    return (np.asarray(pixels) * 255).round().astype(np.int16)


def picture(height: int, width: int, seed: int):
    """A uint8 [H, W, 3] test picture: smooth gradients plus noise."""
    import numpy as np

    rows, cols = np.mgrid[0:height, 0:width] / max(height, width)
    noise = np.random.default_rng(seed).integers(0, 60, (height, width, 3))
    return (np.stack([rows, cols, rows * cols], axis=-1) * 190 + noise).clip(0, 255).astype(np.uint8)


def run_tensorrt_form(model, feeds: dict) -> list:
    """A graph lowered for TensorRT (plugins/tensorrt_plugin.py) run on the CPU:
    standard ops by ONNX's reference evaluator, each plugin node by its Triton
    kernel (under the interpreter) launched as TensorRT launches it."""
    import numpy as np
    import torch
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.op_run import OpRun

    from machgen.plugins import tensorrt_plugin, triton_kernel
    from machgen.plugins.schema import DOMAIN

    torch_types = {name: dtype for dtype, name in triton_kernel.TRITON_TYPES.items()}
    fp8 = torch.float8_e4m3fn

    class GatherElements(OpRun):  # onnx 1.23's reference implementation mishandles a negative axis
        def _run(self, data, indices, axis=None):
            return (np.take_along_axis(data, indices, axis=axis),)

    class PluginOp(OpRun):
        op_domain = DOMAIN

        def _run(self, *arrays, **attributes):
            plugin = tensorrt_plugin.PLUGINS[type(self).__name__]
            fields = {f.name: getattr(self, f.name) for f in plugin.fields}
            fields = {name: value.decode() if isinstance(value, bytes) else value for name, value in fields.items()}
            # numpy has no float8: float8 tensors travel between the nodes as their bytes (uint8)
            tensors = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
            tensors = [t.view(fp8) if t.dtype == torch.uint8 else t for t in tensors]
            outputs, _ = tensorrt_plugin.launch_plan(plugin, [t.shape for t in tensors],
                                                     [triton_kernel.TRITON_TYPES[t.dtype] for t in tensors], fields)
            results = [torch.empty(shape, dtype=torch_types[kind]) for shape, kind in outputs]
            tensorrt_plugin.launch_kernel(plugin, tensors, results, fields)
            return tuple((r.view(torch.uint8) if r.dtype == fp8 else r).numpy() for r in results)

    plugins = [type(name, (PluginOp,), {}) for name in tensorrt_plugin.PLUGINS]
    return ReferenceEvaluator(model, new_ops=[GatherElements, *plugins]).run(None, feeds)


def _ephemeral_ports_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_HANDED_OUT: set[int] = set()


def _worker_ports() -> range:
    """This xdist worker's share of the ports below the ephemeral range: two workers never hand out the same
    one (seen: both picked one within the seconds before either server bound it, and one server died)."""
    low, high = 10000, _ephemeral_ports_start()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    share = (high - low) // count
    return range(low + index % count * share, low + (index % count + 1) * share)


def free_port() -> int:
    """A port nothing listens on, not handed out before by this worker nor ever by another of the run, and below the
    kernel's ephemeral range: a port of that range (what binding port 0 gives) can become the local end of any
    outgoing connection, a client's of another test, before the server binds it."""
    import random

    ports = _worker_ports()
    for _ in range(200):
        port = random.randrange(ports.start, ports.stop)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


class ScorerHandler(BaseHTTPRequestHandler):
    """An agent's scorer of explore jobs: answers the check at once and each scoring with ``scores`` after
    ``delay`` seconds; ``asked`` keeps each request's headers and body."""

    scores: list[float] = []
    delay = 0.0
    asked: list = []
    url = ""

    def do_POST(self):
        import json

        body = self.rfile.read(int(self.headers["content-length"]))
        payload = json.loads(body)
        type(self).asked.append((dict(self.headers), body))
        if payload["type"] == "explore.score":
            time.sleep(type(self).delay)
        answer = json.dumps({"scores": type(self).scores} if payload["type"] == "explore.score" else {}).encode()
        try:
            self.send_response(200)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
        except OSError:  # the API gave up waiting
            pass

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def agent_scorer():
    """A scorer on a free local port: its handler class, whose ``scores`` and ``delay`` a test sets, at ``url``."""
    import threading

    handler = type("Scorer", (ScorerHandler,), {"scores": [], "delay": 0.0, "asked": []})
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    handler.url = f"http://127.0.0.1:{server.server_address[1]}/score"
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield handler
    finally:
        server.shutdown()


@pytest.fixture(scope="session", autouse=True)
def fast_tier_refuses_exports_and_servers():
    """Under ``make test-fast`` (MACHGEN_TEST_TIER=fast) an export or a server start fails the test that
    asks for it: such a test belongs to the ``export`` or ``integration`` tier and must be marked so."""
    if os.environ.get("MACHGEN_TEST_TIER") != "fast":
        yield
        return
    from machgen.builder import export
    from machgen.server import TritonServer

    def refused(what):
        def refuse(*args, **kwargs):
            raise AssertionError(f"{what} in the fast tier: mark the test export or integration")
        return refuse

    saved = export.export_onnx, export.export_torch, export.trace_torch, export.trace, TritonServer.start
    export.export_onnx, export.export_torch, export.trace_torch, export.trace = (refused("an export"),) * 4
    TritonServer.start = refused("a server")
    yield
    export.export_onnx, export.export_torch, export.trace_torch, export.trace, TritonServer.start = saved


def session_root(tmp_path_factory) -> Path:
    """A folder of this test run that every xdist worker shares (the run's own folder without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def one_at_a_time(tmp_path_factory, name: str):
    """Held by one xdist worker at a time: the second to build a repository the other builds too then copies
    every component from the shared export cache instead of exporting it again."""
    import fcntl

    with open(session_root(tmp_path_factory) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session", autouse=True)
def session_export_cache(tmp_path_factory):
    """One export cache for every build of the run, shared by its xdist workers
    (machgen/builder/export_cache.py): the tiny Wan models share their VAE and text encoder, the LoRA and
    sparse-attention builds of the tiny Flux its text encoders and VAE. Never the developer's own cache.

    The builds' ONNX files come from the TorchScript-based exporter where it applies (builder/export.py
    export_torchscript; tens of times faster on these models, perf/RESULTS.md "ONNX export"), unless the run
    names an exporter itself: MACHGEN_ONNX_EXPORTER=dynamo runs every build as a user's runs by default."""
    from machgen.builder.export import ONNX_EXPORTER_ENV
    from machgen.builder.export_cache import CACHE_ENV

    saved = {name: os.environ.get(name) for name in (CACHE_ENV, ONNX_EXPORTER_ENV)}
    os.environ[CACHE_ENV] = str(session_root(tmp_path_factory) / "export-cache")
    os.environ.setdefault(ONNX_EXPORTER_ENV, "torchscript")
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


# The tests of the dynamo exporter's own translations, which call export_onnx themselves: the exporter they test.
DYNAMO_EXPORTER_TESTS = {
    "test_export.py": ("test_a_squeeze_of_an_axis_that_is_not_one_exports_as_torch_means_it",
                       "test_interleaved_writes_of_the_last_axis_export_as_pairs_with_the_same_values")}


@pytest.fixture(autouse=True)
def dynamo_exporter_where_tested(request, monkeypatch):
    if request.node.originalname in DYNAMO_EXPORTER_TESTS.get(request.node.path.name, ()):
        from machgen.builder.export import ONNX_EXPORTER_ENV

        monkeypatch.setenv(ONNX_EXPORTER_ENV, "dynamo")


@pytest.fixture(scope="session")
def tiny_flux_dir(tmp_path_factory) -> Path:
    return write_tiny(tmp_path_factory, "flux")


@pytest.fixture(scope="session")
def tiny_flux_pipeline(tiny_flux_dir):
    import diffusers

    return diffusers.FluxPipeline.from_pretrained(tiny_flux_dir, local_files_only=True)


# The session's tiny Flux repositories serve per-request LoRA adapters up to this rank: every test of them runs
# the adapted denoiser (with no adapter, a bank of rank 0), and tests/test_lora_adapters.py adds adapters.
ADAPTER_RANK = 16


@pytest.fixture(scope="session")
def built_repository(tiny_flux_dir, tmp_path_factory):
    """(repository path, per-component parity results) of the tiny Flux."""
    from machgen.builder.build import build_repository
    from machgen.builder.repository import ServingOptions

    out = tmp_path_factory.mktemp("repository")
    with one_at_a_time(tmp_path_factory, "tiny-flux"):
        results = build_repository(tiny_flux_dir, PIPELINE_NAME, out, log=lambda line: None,
                                   options=ServingOptions(max_lora_rank=ADAPTER_RANK))
    return out, results


_STOPPING: list = []  # (server, the thread stopping it) while the tests go on
# At the end of the session a server still stopping gets this long to finish what it runs, then is killed.
_LAST_GRACE_S = 1.0


def stop_in_background(server) -> None:
    """Stop ``server`` while the tests go on: most of a stop is Triton waiting (a second per Python model
    instance, one instance after another), not work. The session ends once every one has stopped."""
    import threading

    thread = threading.Thread(target=server.stop, name="stop-server", daemon=True)
    thread.start()
    _STOPPING.append((server, thread))


@pytest.fixture(scope="session", autouse=True)
def servers_stopped():
    """Every server stopped by the end of the session. The session's own servers stop last, when no test
    needs them: after a short grace they are killed (their shared memory removed), not waited for (up to half
    a minute of Triton unloading instances one by one, the tail of every xdist worker's run)."""
    yield
    deadline = time.monotonic() + _LAST_GRACE_S
    for server, thread in _STOPPING:
        thread.join(timeout=max(deadline - time.monotonic(), 0))
        if thread.is_alive():
            server.kill()
            thread.join()
    leftover = [region for server, _ in _STOPPING for region in server.shm_regions()]
    assert not leftover, f"shared memory left by the test servers: {leftover}"


SERVER_START_S = 360.0
# A start whose log stays silent and whose processes idle this long has hung (a load computes; seen: a wedged one
# whose 22 stubs used 0.1-0.2 s of CPU each in 150 s, which cost a full run 150 s before it was tried again).
SERVER_STALL_S = 40.0
# What a failed `machgen serve` start prints where starting it again may serve (it starts its server twice itself).
RESTARTED_STARTS = ("already in use", "lock_exception", "made no progress", "was killed by")
# Starts of one server at most; between two, the server's own growing pause (seen: three lock_exception aborts
# in 20 s while the other worker exported, which three starts one after another did not outlast).
SERVER_STARTS = 5


@contextlib.contextmanager
def serving(repository: Path, **options):
    """A Triton server of ``repository`` on free ports (``options``: TritonServer's), stopped on exit."""
    from machgen.server import START_RETRY_PAUSE_S, Ports, ServerError, StartAborted, StartStalled, TritonServer

    for attempt in range(SERVER_STARTS):
        if attempt:
            time.sleep(START_RETRY_PAUSE_S * attempt)
        server = TritonServer(repository, Ports(free_port(), free_port(), free_port()), **options)
        try:
            # Several servers of the session run at once on two cores: a big repository's start can take minutes.
            server.start(timeout=SERVER_START_S, stall_timeout=SERVER_STALL_S)
            break
        except ServerError as error:
            # A port found free can be taken before the server binds it (another test's server): then again on
            # other ports. On a loaded machine the Python backend can abort at start-up with
            # boost::interprocess::lock_exception (triton-inference-server/server#8882), or hang with every
            # model's instances initialized and some never reported loaded (seen: 5 minutes, log silent): again.
            server.stop()
            restarted = isinstance(error, (StartStalled, StartAborted)) or "already in use" in str(error)
            if not restarted or attempt == SERVER_STARTS - 1:
                raise
            with contextlib.suppress(OSError):  # kept beside the log the next start writes anew, for the record
                server.log_file.with_name(f"failed-start-{attempt}.txt").write_text(
                    f"{error}\n\n--- its log ---\n{server.log_file.read_text(errors='replace')}")
    _SERVING.append(server)
    try:
        yield server
    finally:
        _SERVING.remove(server)
        stop_in_background(server)


_SERVING: list = []  # the servers that tests use now


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report says which of the servers in use had died, how, and their log's tail: a server
    gone from under a test is otherwise only a refused connection."""
    report = (yield).get_result()
    if not report.failed:
        return
    import signal

    import psutil

    for server in _SERVING:
        code = server.process.poll() if server.process is not None else None
        if code is None:
            continue
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        memory = psutil.virtual_memory()
        report.sections.append((f"tritonserver of {server.model_repository.name} died", (
            f"{how}; memory now: {memory.available / 2**30:.1f} GiB available of {memory.total / 2**30:.1f}\n"
            f"{server.log_tail(60)}")))


def _kept_log(tmp_path_factory, name: str) -> Path:
    """A server log under pytest's base temp, there after the run (pytest keeps the last three)."""
    return tmp_path_factory.mktemp(name) / "tritonserver.log"


@pytest.fixture(scope="session")
def triton_server(built_repository, tmp_path_factory):
    repository, _ = built_repository
    with serving(repository, log_file=_kept_log(tmp_path_factory, "triton-server")) as server:
        yield server


# The tiny Flux served under other settings than the session server's, one pipeline each in one repository.
VARIANTS = {
    # Per-step calls wait up to 50 ms for the calls of other requests: those released by one forward arrive
    # within a few ms of each other, so concurrent requests' steps share forwards by construction, not by chance.
    # Its cache controls are as a calibration writes them (CALIBRATED_CACHE); its default policy stays none.
    "flux_batched": {"step_queue_delay_us": 50_000},
    # One request in flight and one waiting.
    "flux_queue": {"in_flight": 1, "max_queue_size": 1},
}
CALIBRATED = "flux_batched"
CALIBRATED_CONTROLS = {"warmup_steps": 2, "final_steps": 0, "max_consecutive_skips": 2, "negative_interval": 2}
# MagCache ratios and a thinned-out negative row.
CALIBRATED_CACHE = {"magnitude_ratios": [1.0] + [0.95] * 9,
                    "controls": {"fbcache": CALIBRATED_CONTROLS, "magcache": CALIBRATED_CONTROLS}}


@pytest.fixture(scope="session")
def variant_repository(tiny_flux_dir, built_repository, tmp_path_factory) -> Path:
    """VARIANTS in one repository, every component from the session's export cache."""
    from dataclasses import replace

    from machgen.builder.build import build_repository
    from machgen.builder.repository import ServingOptions
    from machgen.contract.manifest import PipelineManifest, pipeline_dir

    out = tmp_path_factory.mktemp("variants")
    for name, options in VARIANTS.items():
        build_repository(tiny_flux_dir, name, out, preview=False,
                         options=ServingOptions(**{"component_instances": 1, "max_lora_rank": ADAPTER_RANK,
                                                   **options}),
                         log=lambda line: None)
    folder = pipeline_dir(out, CALIBRATED)
    manifest = PipelineManifest.read(folder)
    replace(manifest, cache={**manifest.cache, **CALIBRATED_CACHE}).write(folder)
    return out


@pytest.fixture(scope="session")
def variant_server(variant_repository, tmp_path_factory):
    with serving(variant_repository, log_file=_kept_log(tmp_path_factory, "variant-server")) as server:
        yield server


def solo_then_together(server, model: str, requests: list[dict], **common) -> tuple[list, list, int, int]:
    """Each request (MachgenClient.generate's options, plus ``common``) alone, then all at once: both
    results, and the rows and forwards ``model``'s denoiser tail ran for the concurrent ones."""
    from concurrent.futures import ThreadPoolExecutor

    from machgen.client import MachgenClient

    def generate(settings):
        with MachgenClient(server.grpc_url) as client:
            return client.generate(model, **settings, **common)

    solo = [generate(settings) for settings in requests]
    tail = f"{model}_denoiser_tail"
    with MachgenClient(server.grpc_url) as client:
        rows_before, forwards_before = client.rows_and_forwards(tail)
        with ThreadPoolExecutor(len(requests)) as pool:
            together = list(pool.map(generate, requests))
        rows, forwards = client.rows_and_forwards(tail)
    return solo, together, rows - rows_before, forwards - forwards_before


def metric(server, name: str, model: str) -> float:
    """A Prometheus metric of ``model`` from the server's metrics endpoint."""
    import re
    import urllib.request

    with urllib.request.urlopen(f"http://{server.host}:{server.ports.metrics}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(rf'^{name}{{model="{model}",version="1"}} (\S+)$', text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def steps_after_stop_asked(server, request_id: str, timeout: float = 30.0) -> int:
    """How many steps the sampler ran after its relay (NAME or NAME_stream) asked it to stop request
    ``request_id``, from the server's log. A client's cancellation reaches the sampler within milliseconds
    (the relay sees it at the next progress response, a step of a real model later at most); the tiny
    models' steps take milliseconds too, so what is checked in steps is the sampler's own promise: it stops
    at its next step boundary."""
    import re

    # Either line may come first: the sampler's thread can stop and log before the relay's own log line
    # (written after the stop is set) reaches the server's log.
    asked = re.compile(rf"request {re.escape(request_id)}: asked to stop after step (\d+)")
    cancelled = re.compile(rf"request {re.escape(request_id)}: cancelled after (\d+) of")
    deadline = time.monotonic() + timeout
    while True:
        log = server.log_file.read_text(errors="replace")
        asked_at, stopped_at = asked.search(log), cancelled.search(log)
        if asked_at and stopped_at:
            return int(stopped_at.group(1)) - int(asked_at.group(1))
        if time.monotonic() > deadline:
            lines = [line for line in log.splitlines() if request_id in line]
            raise AssertionError(f"no stop of request {request_id} in the server log; its lines:\n"
                                 + "\n".join(lines[-20:]))
        time.sleep(0.1)


def wait_until(condition, timeout: float = 60.0, what: str = "the condition") -> None:
    """Poll ``condition`` until it holds (no fixed sleeps: the tests wait for what they need)."""
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.02)


@contextlib.contextmanager
def single_rank_pipeline(repository: Path, name: str):
    """A LocalPipeline of a parallel build on one rank, for a module's tests to run under each layout
    (``under_layout``): what runs in process under every layout is loaded once for them all, and the ranks of
    each world size once (use_layout puts them aside between layouts). Every rank is gone when it ends."""
    import multiprocessing

    from machgen.parallel.layout import ParallelLayout
    from machgen.runtime.local import LocalPipeline

    others = set(multiprocessing.active_children())  # another module's pipeline's ranks, put aside
    with LocalPipeline(repository, name, layout=ParallelLayout()) as pipeline:
        yield pipeline
    assert not set(multiprocessing.active_children()) - others


@contextlib.contextmanager
def under_layout(pipeline, layout):
    """``pipeline`` (single_rank_pipeline's) running ``layout`` inside the block, one rank again after it."""
    from machgen.parallel.layout import ParallelLayout

    pipeline.use_layout(layout)
    try:
        yield pipeline
    finally:
        pipeline.use_layout(ParallelLayout())


@pytest.fixture(scope="session")
def runtime_factory(tiny_flux_dir):
    """Flux's runtime over any run_component (a closed-form fake, for example), built without an export."""
    return lambda run: runtime_for(tiny_flux_dir, run)


SESSION_REPOSITORIES = {"built_repository", "variant_repository"}
SESSION_SERVERS = {"triton_server", "variant_server", "api_server", "postgres_server"}


# A fixture named *_repository builds one (and exports, or copies from the export cache), one named local* runs
# one in-process: a test using either, directly or through another fixture, is in the ``export`` tier; one using
# a *_server fixture is an integration test. Tests that export or serve by themselves carry the mark.
def _builds(item) -> set[str]:
    """The repositories a test's module builds for itself (the session's are built once anyway)."""
    return {name for name in getattr(item, "fixturenames", ())
            if (name.endswith("_repository") or name.startswith("local")) and name not in SESSION_REPOSITORIES}


# Modules that start many processes (servers, replicas, rank processes) and hold them to deadlines (a killed stub
# back within 30 s): one after another on one xdist worker, never two of them at once. Each meets its deadlines
# with the other worker running anything else; beside each other on two cores they did not (a replica killed
# under load took 213 s instead of 12 beside test_parallel_wan's ranks).
MANY_PROCESSES = ("test_faults", "test_parallel", "test_parallel_wan", "test_parallel_wan_ti2v",
                  "test_parallel_hidream", "test_parallel_ltx2")
# Modules whose time no fixture count shows (test_examples: every documented example, ~7 minutes on one worker,
# its builds in its pages' shell blocks): handed out right after the group, before the modules counted below.
LONG_UNCOUNTED = ("test_examples",)


def pytest_xdist_make_scheduler(config, log):
    """`make test`'s --dist loadfile, with MANY_PROCESSES as one file (xdist's loadgroup would do it with marks,
    but xdist 3.8 renames a test by a field pytest 9 no longer reads), handed out in the order of the collection
    (pytest_collection_modifyitems: the longest first), not xdist's own (the most tests first: a module of a
    few tests and a long build came last, and one worker waited on it)."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False

    class ModulesAndOneGroup(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "many-processes" if Path(module).stem in MANY_PROCESSES else module

    return ModulesAndOneGroup(config, log)


def pytest_collection_modifyitems(items):
    # The longest first, so that the xdist workers of `make test` (a module each at a time) finish together
    # rather than one waiting on the other's last long module: the MANY_PROCESSES group (about half a worker's
    # time), then the modules that build the most repositories, start the most servers of their own, have the
    # most tests marked export or integration by themselves, the most tests (LONG_UNCOUNTED after the group).
    builds: dict = {}
    servers: dict = {}
    marked: dict = {}
    tests: dict = {}
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        builds.setdefault(item.path, set()).update(_builds(item))
        servers.setdefault(item.path, set()).update(name for name in fixtures if name.endswith("_server")
                                                     and name not in SESSION_SERVERS)
        heavy = bool(item.get_closest_marker("export") or item.get_closest_marker("integration"))
        marked[item.path] = marked.get(item.path, 0) + heavy
        tests[item.path] = tests.get(item.path, 0) + 1
    items.sort(key=lambda item: (item.path.stem not in MANY_PROCESSES, item.path.stem not in LONG_UNCOUNTED,
                                 -len(builds[item.path]),
                                 -len(servers[item.path]), -marked[item.path], -tests[item.path], str(item.path)))
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if any(name.endswith("_server") for name in fixtures):
            item.add_marker(pytest.mark.integration)
        if (any(name.endswith("_repository") or name.startswith("local") for name in fixtures)
                or item.get_closest_marker("integration")):
            item.add_marker(pytest.mark.export)


class ApiProcess:
    """``machgen api`` as a user starts it, on a free port: ``url``, ``key`` (a valid API key), ``model``."""

    def __init__(self, triton_url: str, data_dir: Path, keys_file: Path | None, key: str, webhook_secret: str,
                 log_file: Path, *extra: str, allow_private_callbacks: bool = True):
        import subprocess
        import sys

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.key, self.model, self.data_dir, self.webhook_secret = key, PIPELINE_NAME, data_dir, webhook_secret
        self.log_file = log_file
        with open(log_file, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "machgen.cli", "api", "--triton", triton_url, "--port", str(self.port),
                 "--data-dir", str(data_dir), *(["--keys-file", str(keys_file)] if keys_file else []),
                 "--webhook-retry-delay", "0.2",
                 *(["--allow-private-callbacks"] if allow_private_callbacks else []),
                 "--webhook-secret", webhook_secret, *extra], stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> "ApiProcess":
        import time
        import urllib.request

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"machgen api exited:\n{self.log_file.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"machgen api not ready after {timeout} s:\n{self.log_file.read_text()[-3000:]}")

    def stop(self) -> None:
        import signal

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()


class PostgresServer:
    """Debian's PostgreSQL server in a temporary folder, on a free port (initdb, pg_ctl); as the ``postgres``
    user where the tests run as root (initdb refuses root). ``database()`` makes a fresh database: its URL."""

    def __init__(self):
        import glob
        import shutil
        import subprocess
        import tempfile

        found = shutil.which("initdb") or next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))), None)
        if found is None:
            pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql; make system-tools "
                        "installs it): the API's tests on PostgreSQL need its server")
        self.bin = Path(found).parent
        self.folder = Path(tempfile.mkdtemp(prefix="machgen-postgres-"))
        self.as_user: list[str] = []
        if os.geteuid() == 0:
            shutil.chown(self.folder, "postgres", "postgres")
            self.as_user = ["runuser", "-u", "postgres", "--"]
        self._run("initdb", "-D", str(self.folder / "data"), "-A", "trust", "-U", "machgen", "-E", "UTF8",
                  "--no-sync")
        for _ in range(5):
            self.port = free_port()
            started = subprocess.run(
                [*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.folder / "data"), "-l",
                 str(self.folder / "server.log"), "-w", "-t", "60", "-o",
                 f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off", "start"],
                capture_output=True, text=True)
            if started.returncode == 0:
                break
        else:
            raise RuntimeError(f"PostgreSQL did not start:\n{(self.folder / 'server.log').read_text()[-3000:]}")
        self._count = 0

    def _run(self, tool: str, *args: str) -> None:
        import subprocess

        subprocess.run([*self.as_user, str(self.bin / tool), *args], check=True, capture_output=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://machgen@127.0.0.1:{self.port}/{database}"

    def database(self) -> str:
        import psycopg

        self._count += 1
        name = f"machgen_test_{os.getpid()}_{self._count}"
        with psycopg.connect(self.url(), autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        import shutil
        import subprocess

        subprocess.run([*self.as_user, str(self.bin / "pg_ctl"), "-D", str(self.folder / "data"), "-m",
                        "immediate", "-w", "stop"], capture_output=True)
        shutil.rmtree(self.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_server():
    server = PostgresServer()
    try:
        yield server
    finally:
        server.stop()


def events_of(api: "ApiProcess", job_id: str) -> list[tuple[str, dict]]:
    """Every Server-Sent Event of a job, to its terminal one, read through ``api`` (with its key, if it has one)."""
    import json

    import httpx

    headers = {"Authorization": f"Bearer {api.key}"} if api.key else {}
    events = []
    with httpx.stream("GET", f"{api.url}/v1/jobs/{job_id}/events", headers=headers, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[len("data: "):])))
    return events


@pytest.fixture(scope="session")
def api_keys(tmp_path_factory):
    """(keys file, a valid key, another valid key whose limit is one job in flight)."""
    from machgen.api.keys import add_key

    keys_file = tmp_path_factory.mktemp("api-keys") / "keys.txt"
    return keys_file, add_key(keys_file, "tester"), add_key(keys_file, "one-at-a-time", max_jobs=1)


@contextlib.contextmanager
def api_on(triton_url: str, api_keys, tmp_path_factory, name: str, allow_private_callbacks: bool = True):
    """``machgen api`` on the Triton server at ``triton_url``, keys required, a fresh data folder."""
    from machgen.api.webhooks import new_secret

    keys_file, key, _ = api_keys
    folder = tmp_path_factory.mktemp(name)
    api = ApiProcess(triton_url, folder / "data", keys_file, key, new_secret(), folder / "api.log",
                     allow_private_callbacks=allow_private_callbacks)
    try:
        yield api.wait_ready()
    finally:
        api.stop()


@pytest.fixture(scope="session")
def api_server(triton_server, api_keys, tmp_path_factory):
    """``machgen api`` on the session's Triton server (the tiny Flux, "flux")."""
    with api_on(triton_server.grpc_url, api_keys, tmp_path_factory, "api") as api:
        yield api


SLOW_STOP_S = 20.0  # a drain with nothing in flight takes seconds


class SlowStop(UserWarning):
    """A machgen serve whose drain outlasted SLOW_STOP_S, in pytest's warnings summary (also from xdist workers)."""


class ServeProcess:
    """``machgen serve REPOSITORY`` as a user runs it (``extra``: more of its options), on free ports, and what
    it printed. ``http``, ``grpc``, ``metrics`` and ``supervisor`` are its ports."""

    def __init__(self, repository: Path, *extra: str):
        import subprocess
        import sys
        import threading

        for attempt in range(3):  # as serving(): a port taken before the server bound it, or a start that hung
            self.http, self.grpc, self.metrics, self.supervisor = free_port(), free_port(), free_port(), free_port()
            self.process = subprocess.Popen(
                [sys.executable, "-m", "machgen.cli", "serve", str(repository), "--http-port", str(self.http),
                 "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics),
                 "--supervisor-metrics-port", str(self.supervisor), *extra],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            self.lines: list[str] = []
            threading.Thread(target=self._read, daemon=True).start()
            try:
                wait_until(lambda: any(line.startswith("ready:") for line in self.lines)
                           or self.process.poll() is not None, timeout=180, what="machgen serve ready")
            except AssertionError as late:
                self.process.terminate()  # machgen serve stops its tritonserver (a kill would leave it running)
                try:
                    self.process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
                raise AssertionError(f"{late}; it printed:\n{self.output()[-6000:]}") from None
            if self.process.poll() is None:
                return
            if not any(sign in self.output() for sign in RESTARTED_STARTS) or attempt == 2:
                raise AssertionError(self.output())

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http}"

    def metric(self, line_start: str) -> float:
        """The sum of the supervisor metrics' series that start with ``line_start``."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.supervisor}/metrics", timeout=5) as response:
            text = response.read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start))

    def stop(self, timeout: float = 90.0) -> None:
        """SIGTERM (a drain), killed after ``timeout``; then any tritonserver or stub it leaves (its own
        session, so a killed machgen serve orphans it) is killed too: no test leaves a server running."""
        import signal
        import subprocess

        import psutil

        try:
            started = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            started = []
        if self.process.poll() is None:
            asked = time.monotonic()
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            if time.monotonic() - asked > SLOW_STOP_S:  # a drain that waited on a request: which model held it
                said = self.output()
                warnings.warn(f"machgen serve took {time.monotonic() - asked:.0f} s to stop; it said:\n"
                              + said[said.rfind("stopping tritonserver"):][-12000:], SlowStop)
        left = []
        for process in started:
            try:
                left += [process, *process.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        for process in left:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=10)


@contextlib.contextmanager
def machgen_serve(repository: Path, *extra: str):
    """A ServeProcess, drained and stopped on exit."""
    served = ServeProcess(repository, *extra)
    try:
        yield served
    finally:
        served.stop()
