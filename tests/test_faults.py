"""machgen serve as a user runs it, the HTTP API beside it (--api-port), under faults: stub processes killed
while requests run (a component's, the public model's, its streaming twin's, the sampler's), the server
itself killed, and a SIGTERM that drains."""

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from machgen.client import NO_RETRY, GenerationError, MachgenClient, RetryPolicy

from conftest import PIPELINE_NAME, free_port, wait_until

pytestmark = pytest.mark.integration

STEPS = 80  # a second or two per request on two cores: long enough to be killed mid-way
SEEDS = (0, 1, 2, 3)  # odd seeds stream their progress (NAME_stream), even ones are plain requests
ANSWER_WITHIN_S = 30.0
DRAIN_TIMEOUT_S = 10.0


class Served:
    """A ``machgen serve`` process and what it printed."""

    def __init__(self, repository: Path, drain_timeout: float, api_data_dir: Path):
        self.http, self.grpc, self.supervisor, self.api = free_port(), free_port(), free_port(), free_port()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "machgen.cli", "serve", str(repository), "--http-port", str(self.http),
             "--grpc-port", str(self.grpc), "--metrics-port", str(free_port()),
             "--supervisor-metrics-port", str(self.supervisor), "--drain-timeout", str(drain_timeout),
             "--api-port", str(self.api), "--api-data-dir", str(api_data_dir)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        wait_until(lambda: any(line.startswith("ready:") for line in self.lines) or self.process.poll() is not None,
                   timeout=180, what="machgen serve ready")
        assert self.process.poll() is None, self.output()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)

    def output(self) -> str:
        return "".join(self.lines)

    def api_answers(self) -> bool:
        import httpx

        try:
            return httpx.get(f"http://127.0.0.1:{self.api}/health").status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def tritonserver(self):
        import psutil

        (server,) = [child for child in psutil.Process(self.process.pid).children()
                     if child.name() == "tritonserver"]
        return server

    def kill_instances(self, model: str) -> list[str]:
        """SIGKILL every stub process of ``model``; their instance names."""
        from machgen.runtime.processes import instances_of, stub_of

        stubs = instances_of(model, [stub for stub in map(stub_of, self.tritonserver().children()) if stub])
        for stub in stubs:
            os.kill(stub.pid, signal.SIGKILL)
        return [stub.instance for stub in stubs]

    def metric(self, line_start: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.supervisor}/metrics", timeout=5) as response:
            text = response.read().decode()
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(line_start)]
        return sum(values)


@pytest.fixture(scope="module")
def served(built_repository, tmp_path_factory):
    repository, _ = built_repository
    served = Served(repository, drain_timeout=DRAIN_TIMEOUT_S, api_data_dir=tmp_path_factory.mktemp("api"))
    yield served
    if served.process.poll() is None:
        served.process.send_signal(signal.SIGTERM)
        try:
            served.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            served.process.kill()


def generate(url: str, seed: int, retry: RetryPolicy = NO_RETRY, steps: int = STEPS, on_progress=None,
             **options):
    with MachgenClient(url, retry=retry) as client:
        return client.generate(PIPELINE_NAME, "a red cat", seed=seed, num_inference_steps=steps,
                               on_progress=on_progress, **options)


@pytest.fixture(scope="module")
def expected(served):
    return {seed: generate(served.grpc_url, seed) for seed in SEEDS}


class Requests:
    """SEEDS' requests on threads, with retries: when each first got an answer (an image or an error) and
    what each ended with."""

    def __init__(self, url: str):
        self.first_answer: dict[int, float] = {}
        self.results: dict[int, object] = {}
        self.progressed = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(url, seed), daemon=True) for seed in SEEDS]
        for thread in self.threads:
            thread.start()

    def _run(self, url: str, seed: int) -> None:
        def answered(*_) -> None:
            self.first_answer.setdefault(seed, time.monotonic())

        def on_progress(progress) -> None:
            self.progressed.set()

        retry = RetryPolicy(attempts=8, first_delay_s=0.25, max_delay_s=4.0)
        try:
            # A lost stream is known after 8 s of silence (the default 20 s, shortened to spare the suite).
            with MachgenClient(url, retry=retry, on_retry=answered, stream_silence_s=8.0) as client:
                self.results[seed] = client.generate(PIPELINE_NAME, "a red cat", seed=seed, num_inference_steps=STEPS,
                                                     on_progress=on_progress if seed % 2 else None)
        except GenerationError as err:
            self.results[seed] = err
        answered()

    def join(self) -> None:
        for thread in self.threads:
            thread.join(timeout=180)


def test_ready_with_the_api_beside_it(served):
    import httpx

    (ready,) = [line for line in served.lines if line.startswith("ready:")]
    assert f"HTTP 127.0.0.1:{served.http}" in ready and f"supervisor metrics 127.0.0.1:{served.supervisor}" in ready
    with MachgenClient(f"127.0.0.1:{served.http}", "http") as client:
        assert client.is_ready(PIPELINE_NAME)
    wait_until(served.api_answers, what="the API beside the server")
    models = httpx.get(f"http://127.0.0.1:{served.api}/v1/models").json()["data"]
    assert [model["id"] for model in models] == [PIPELINE_NAME]


@pytest.mark.parametrize("component", ["denoiser_tail", "public", "stream", "sampler"])
def test_a_killed_stub_is_brought_back_and_requests_in_flight_end_right(component, served, expected):
    """Every stub of a model SIGKILLed while requests run: each request in flight gets an answer within
    30 s (UNAVAILABLE, or its image: a component call is run again once the component is back), the
    model serves the right image again within 30 s, and with the client's retries every request ends
    with its right image."""
    model = PIPELINE_NAME if component == "public" else f"{PIPELINE_NAME}_{component}"
    # A dead NAME_stream never ends its streams: their clients hear no heartbeat and send them again.
    streamed = (lambda progress: None) if component == "stream" else None
    recovered_before = served.metric(f'machgen_model_recoveries_total{{model="{model}"}}')
    requests = Requests(served.grpc_url)
    assert requests.progressed.wait(timeout=60), "no request got going"
    killed_at = time.monotonic()
    assert served.kill_instances(model)

    def serves_right() -> bool:
        try:
            return np.array_equal(generate(served.grpc_url, SEEDS[0], on_progress=streamed), expected[SEEDS[0]])
        except GenerationError:
            return False

    wait_until(serves_right, timeout=ANSWER_WITHIN_S, what=f"{model} serving again")
    requests.join()
    late = {seed: round(at - killed_at, 1) for seed, at in requests.first_answer.items()
            if at - killed_at > ANSWER_WITHIN_S}
    assert not late, f"answered more than {ANSWER_WITHIN_S:.0f} s after the kill: {late}"
    wrong = {seed: result for seed, result in requests.results.items()
             if not isinstance(result, np.ndarray) or not np.array_equal(result, expected[seed])}
    assert not wrong and len(requests.results) == len(SEEDS), wrong
    assert f"of model {model} died" in served.output()
    assert served.metric(f'machgen_model_recoveries_total{{model="{model}"}}') == recovered_before + 1


def test_a_dead_server_is_started_again(served, expected):
    served.tritonserver().kill()
    wait_until(lambda: "tritonserver serves again" in served.output(), timeout=120, what="the server restarted")
    assert np.array_equal(generate(served.grpc_url, SEEDS[1], retry=RetryPolicy()), expected[SEEDS[1]])
    assert served.metric("machgen_server_restarts_total") == 1


def test_sigterm_drains_requests_in_flight(served):
    """SIGTERM: no new request is taken, a request in flight finishes with its image, one that outlasts the
    drain timeout (10 s) is stopped at a step and answered UNAVAILABLE; machgen serve exits 0, the server
    and the API beside it are gone, and no shared memory is left."""
    short_steps = 3 * STEPS  # about 4 s here; the long one, 1000 steps at the largest size, over a minute
    expected_short = generate(served.grpc_url, SEEDS[1], steps=short_steps)
    results, finished = {}, {}
    started = threading.Event()

    def run(tag: str, seed: int, steps: int, **options) -> None:
        try:
            results[tag] = generate(served.grpc_url, seed, steps=steps, on_progress=lambda progress: started.set(),
                                    **options)
        except GenerationError as err:
            results[tag] = err
        finished[tag] = time.monotonic()

    threads = [threading.Thread(target=run, args=("short", SEEDS[1], short_steps)),
               threading.Thread(target=run, args=("long", SEEDS[2], 1000), kwargs={"height": 256, "width": 256})]
    for thread in threads:
        thread.start()
    assert started.wait(timeout=60)
    served.process.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining" in served.output(), timeout=10, what="the drain")
    draining = time.monotonic()
    with pytest.raises(GenerationError):
        generate(served.grpc_url, SEEDS[0], steps=2)
    for thread in threads:
        thread.join(timeout=90)
    assert served.process.wait(timeout=90) == 0, served.output()
    assert np.array_equal(results["short"], expected_short) and finished["short"] > draining
    assert isinstance(results["long"], GenerationError) and results["long"].status == "StatusCode.UNAVAILABLE"
    assert "stopping" in str(results["long"])
    assert not list(Path("/dev/shm").glob(f"machgen_{served.process.pid}_*"))
    with MachgenClient(f"127.0.0.1:{served.http}", "http") as client:
        assert not client.is_ready(PIPELINE_NAME)
    assert not served.api_answers()
