"""machgen serve as a user runs it, the HTTP API beside it (--api-port), under faults: stub processes killed
while requests run (a component's, the public model's, its streaming twin's, the sampler's), the server
itself killed, and a SIGTERM that drains. Then machgen serve --replicas 2 (HAProxy in front of two
supervised servers): both protocols on one address, Prometheus scraping every replica, a replica SIGKILLed
under load and a rolling restart (SIGHUP) under load, with no request lost, whose first replica fails to start
once and is tried again."""

import json
import os
import shutil
import signal
import textwrap
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from machgen.api.webhooks import new_secret
from machgen.client import NO_RETRY, GenerationError, MachgenClient, RetryPolicy

from conftest import ADAPTER_RANK, PIPELINE_NAME, ServeProcess, free_port, wait_until

pytestmark = pytest.mark.integration

STEPS = 80  # a second or two per request on two cores: long enough to be killed mid-way
SEEDS = (0, 1, 2, 3)  # odd seeds stream their progress (NAME_stream), even ones are plain requests
ANSWER_WITHIN_S = 30.0
# A model loaded again serves in seconds (docs/faults.md: 1.5 s for a component, 7 s for the sampler on an idle
# machine). A load that Triton wedges (seen twice in full runs on two loaded cores: the sampler's, which never
# returned) is cut short after --load-timeout and the server started again, so the model serves again within
# that plus a server's start.
LOAD_TIMEOUT_S = 30.0
SERVES_AGAIN_WITHIN_S = LOAD_TIMEOUT_S + 60.0
DRAIN_TIMEOUT_S = 10.0


class Served(ServeProcess):
    """machgen serve with its HTTP API beside it (``api``: its port)."""

    api: int

    def api_answers(self) -> bool:
        import httpx

        try:
            return httpx.get(f"http://127.0.0.1:{self.api}/health").status_code == 200
        except httpx.HTTPError:
            return False

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


def lighter_repository(tiny_flux_dir, tmp_path_factory, name: str, **options) -> Path:
    """The session's tiny Flux (every export from the cache built_repository filled) with no more instances
    than these tests use: every server start, stop, drain and reload pays a process per instance."""
    from machgen.builder.build import build_repository
    from machgen.builder.repository import ServingOptions

    out = tmp_path_factory.mktemp(name)
    build_repository(tiny_flux_dir, PIPELINE_NAME, out, log=lambda line: None, preview=False,
                     options=ServingOptions(max_lora_rank=ADAPTER_RANK, **options))
    return out


@pytest.fixture(scope="module")
def faults_repository(built_repository, tiny_flux_dir, tmp_path_factory) -> Path:
    """As many requests in flight as the tests send at once; two instances per component, so that a short
    request does not wait behind a long one of another size (the drain test)."""
    return lighter_repository(tiny_flux_dir, tmp_path_factory, "faults-repository", in_flight=len(SEEDS))


@pytest.fixture(scope="module")
def served(faults_repository, tmp_path_factory):
    repository = faults_repository
    api = free_port()
    served = Served(repository, "--drain-timeout", str(DRAIN_TIMEOUT_S), "--load-timeout", str(LOAD_TIMEOUT_S),
                    "--api-port", str(api), "--api-data-dir", str(tmp_path_factory.mktemp("api")),
                    "--api-webhook-secret", new_secret())
    served.api = api
    try:
        yield served
    finally:
        served.stop()


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

        # Tries for over SERVES_AGAIN_WITHIN_S (each wait at least half of max_delay_s): a wedged load restarts
        # the server, and a request sent while it starts is refused its connection.
        retry = RetryPolicy(attempts=50, first_delay_s=0.25, max_delay_s=4.0)
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
    # Its webhook secret reached it: a callback is refused for where it points (loopback), not for want of one.
    refused = httpx.post(f"http://127.0.0.1:{served.api}/v1/images/generations", timeout=30, json={
        "model": PIPELINE_NAME, "prompt": "a cat", "num_inference_steps": 2, "callback_url": "http://127.0.0.1:9/"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "callback_refused", refused.text


@pytest.mark.parametrize("component", ["denoiser_tail", "public", "stream", "sampler"])
def test_a_killed_stub_is_brought_back_and_requests_in_flight_end_right(component, served, expected):
    """Every stub of a model SIGKILLed while requests run: each request in flight gets an answer within
    30 s (UNAVAILABLE, or its image: a component call is run again once the component is back), the
    model is loaded again (or, where Triton wedges that load, the server is started again after
    --load-timeout) and serves the right image again, and with the client's retries every request ends
    with its right image."""
    model = PIPELINE_NAME if component == "public" else f"{PIPELINE_NAME}_{component}"
    # A dead NAME_stream never ends its streams: their clients hear no heartbeat and send them again.
    streamed = (lambda progress: None) if component == "stream" else None
    recovered_before = served.metric(f'machgen_model_recoveries_total{{model="{model}"}}')
    restarts_before = served.metric("machgen_server_restarts_total")
    requests = Requests(served.grpc_url)
    assert requests.progressed.wait(timeout=60), "no request got going"
    killed_at = time.monotonic()
    assert served.kill_instances(model)

    def serves_right() -> bool:
        try:
            return np.array_equal(generate(served.grpc_url, SEEDS[0], on_progress=streamed), expected[SEEDS[0]])
        except GenerationError:
            return False

    try:
        wait_until(serves_right, timeout=SERVES_AGAIN_WITHIN_S, what=f"{model} serving again")
    except AssertionError:
        print(served.output()[-20000:])  # what the supervisor saw, shown with the failure
        raise
    requests.join()
    late = {seed: round(at - killed_at, 1) for seed, at in requests.first_answer.items()
            if at - killed_at > ANSWER_WITHIN_S}
    assert not late, f"answered more than {ANSWER_WITHIN_S:.0f} s after the kill: {late}"
    wrong = {seed: result for seed, result in requests.results.items()
             if not isinstance(result, np.ndarray) or not np.array_equal(result, expected[seed])}
    assert not wrong and len(requests.results) == len(SEEDS), wrong
    assert f"of model {model} died" in served.output()
    if served.metric("machgen_server_restarts_total") == restarts_before:
        assert served.metric(f'machgen_model_recoveries_total{{model="{model}"}}') == recovered_before + 1
    else:  # its load wedged: the documented way out
        assert f"loading model {model} again took over {LOAD_TIMEOUT_S:.0f} s" in served.output()
        assert served.metric("machgen_server_restarts_total") == restarts_before + 1


def test_a_dead_server_is_started_again(served, expected):
    restarts_before = served.metric("machgen_server_restarts_total")
    restarted_before = served.output().count("tritonserver serves again")  # a wedged load restarted it too
    served.tritonserver().kill()
    wait_for_serve(served, lambda: served.output().count("tritonserver serves again") > restarted_before,
                   timeout=240, what="the server restarted")
    assert np.array_equal(generate(served.grpc_url, SEEDS[1], retry=RetryPolicy()), expected[SEEDS[1]])
    assert served.metric("machgen_server_restarts_total") == restarts_before + 1


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


# ------------------------------------------------- machgen serve --replicas: HAProxy in front of two servers
# Here, not in a module of their own: a replica killed and restarted while another module's servers are killed
# and restarted on the same two cores made both miss their answer deadlines.
needs_haproxy = pytest.mark.skipif(shutil.which("haproxy") is None,
                                   reason="needs HAProxy (Debian: apt-get install haproxy; make system-tools installs it)")

REPLICA_STEPS = 12
REPLICA_SEEDS = (0, 1, 2)
# Each client thread sends its own kind of request: a plain gRPC one, a gRPC stream with progress
# (NAME_stream) and a plain HTTP one.
KINDS = ("grpc", "stream", "http")
# A client's pause between an answer and its next request: three clients keep requests in flight on both
# replicas without taking every core from the replicas' own restarts (and from the other test worker).
THINK_S = 0.3


@pytest.fixture(scope="module")
def replicas(built_repository, tiny_flux_dir, tmp_path_factory):
    # One instance per component and a slot per client thread (KINDS): a rolling restart starts each replica's
    # processes again under load.
    repository = lighter_repository(tiny_flux_dir, tmp_path_factory, "replicas-repository", in_flight=len(KINDS),
                                    component_instances=1)
    extra = ["--replicas", "2", "--drain-timeout", "30"]
    prometheus = shutil.which("prometheus") is not None
    if prometheus:
        extra += ["--prometheus-port", str(free_port())]
    served = ServeProcess(repository, *extra)
    served.repository = repository
    served.prometheus_port = int(extra[-1]) if prometheus else None
    try:
        yield served
    finally:
        served.stop()
    assert served.process.returncode == 0, served.output()


def wait_for_serve(served, condition, timeout: float, what: str) -> None:
    """wait_until, failing with what ``machgen serve`` said and the tails of its logs (a CI run keeps nothing else)."""
    try:
        wait_until(condition, timeout=timeout, what=what)
    except AssertionError as err:
        logs = next((line.split("logs: ", 1)[1].strip() for line in served.lines if line.startswith("logs: ")), None)
        tails = "".join(f"\n--- {log} ---\n{log.read_text(errors='replace')[-3000:]}"
                        for log in sorted(Path(logs).glob("**/*.log"))) if logs else ""
        raise AssertionError(f"{err}; machgen serve said:\n{served.output()[-6000:]}{tails}") from None


def replica_pids(served) -> dict[int, int]:
    """Replica -> the pid of its tritonserver, as machgen serve last reported it."""
    pids = {}
    for line in served.lines:
        if ": tritonserver pid " in line:
            pids[int(line.split()[1].rstrip(":"))] = int(line.split(" pid ")[1].split()[0])
    return pids


def one_request(served, kind: str, seed: int) -> np.ndarray:
    url = served.http_url if kind == "http" else served.grpc_url
    with MachgenClient(url, "http" if kind == "http" else "grpc") as client:
        progress = (lambda report: None) if kind == "stream" else None
        return client.generate(PIPELINE_NAME, "a red cat", seed=seed, num_inference_steps=REPLICA_STEPS,
                               on_progress=progress)


@pytest.fixture(scope="module")
def replica_expected(replicas):
    return {seed: one_request(replicas, "grpc", seed) for seed in REPLICA_SEEDS}


class Load:
    """Client threads sending requests (with the client's retries, as a user's) until ``stop``: every
    request's outcome, and whether its image is the one its seed makes."""

    def __init__(self, served, expected):
        self.served, self.expected = served, expected
        self.outcomes: list[tuple[str, int, str]] = []  # (kind, seed, "ok" | "wrong image" | the error)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(kind, index), daemon=True)
                         for index, kind in enumerate(KINDS)]
        for thread in self._threads:
            thread.start()

    def _client(self, kind: str, index: int) -> None:
        request = index
        while not self._stop.is_set():
            seed = REPLICA_SEEDS[request % len(REPLICA_SEEDS)]
            request += 1
            try:
                image = one_request(self.served, kind, seed)
                outcome = "ok" if np.array_equal(image, self.expected[seed]) else "wrong image"
            except Exception as err:  # noqa: BLE001 - a lost request is what the test counts
                outcome = f"{type(err).__name__}: {err}"
            self.outcomes.append((kind, seed, outcome))
            self._stop.wait(THINK_S)

    def stop(self) -> list[tuple[str, int, str]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        return self.outcomes

    def wait_for(self, count: int) -> None:
        wait_until(lambda: len(self.outcomes) >= count, timeout=120, what=f"{count} requests answered")


def assert_nothing_lost(outcomes) -> None:
    lost = [outcome for outcome in outcomes if outcome[2] != "ok"]
    assert not lost, f"{len(lost)} of {len(outcomes)} requests lost: {lost[:5]}"
    assert {kind for kind, _, _ in outcomes} == set(KINDS)


@needs_haproxy
def test_one_address_serves_both_protocols_and_prometheus_scrapes_every_replica(replicas, replica_expected):
    ready = next(line for line in replicas.lines if line.startswith("ready:"))
    assert f"gRPC 127.0.0.1:{replicas.grpc}" in ready and "2 replicas" in ready
    for kind in ("http", "stream"):
        assert np.array_equal(one_request(replicas, kind, REPLICA_SEEDS[0]), replica_expected[REPLICA_SEEDS[0]])
    with urllib.request.urlopen(f"http://127.0.0.1:{replicas.metrics}/metrics", timeout=5) as response:
        balancer = response.read().decode()
    assert 'haproxy_server_status{proxy="grpc_replicas",server="r1",state="UP"} 1' in balancer
    if replicas.prometheus_port is None:
        pytest.skip("Prometheus is not installed (Debian: apt-get install prometheus; make system-tools installs it): "
                    "its scrape is not checked")
    url = f"http://127.0.0.1:{replicas.prometheus_port}/api/v1"

    def targets() -> dict[str, list[str]]:
        with urllib.request.urlopen(f"{url}/targets", timeout=5) as response:
            active = json.load(response)["data"]["activeTargets"]
        found: dict[str, list[str]] = {}
        for target in active:
            found.setdefault(target["labels"]["job"], []).append(target["health"])
        return found

    wait_until(lambda: all(health == ["up"] * len(health) for health in targets().values()) and
               len(targets().get("triton", [])) == 2, timeout=30, what="every target scraped")
    assert set(targets()) == {"triton", "haproxy", "machgen-supervisor"}

    def per_replica_successes() -> dict[str, float]:
        query = urllib.parse.quote(f'sum by (replica) (nv_inference_request_success{{model="{PIPELINE_NAME}"}})')
        with urllib.request.urlopen(f"{url}/query?query={query}", timeout=5) as response:
            return {row["metric"]["replica"]: float(row["value"][1]) for row in json.load(response)["data"]["result"]}

    wait_until(lambda: sum(per_replica_successes().values()) >= 1, timeout=30, what="requests counted")


@needs_haproxy
def test_a_replica_killed_under_load_loses_no_request(replicas, replica_expected):
    before = replica_pids(replicas)
    load = Load(replicas, replica_expected)
    load.wait_for(6)
    os.kill(before[0], signal.SIGKILL)
    # Up to a start's own timeout (180 s): the other test worker may be exporting beside it.
    wait_for_serve(replicas, lambda: replica_pids(replicas)[0] != before[0] or
                   any("replica 0: supervisor: tritonserver serves again" in line for line in replicas.lines),
                   timeout=240, what="replica 0 started again")
    served_after = len(load.outcomes)
    load.wait_for(served_after + 6)
    outcomes = load.stop()
    assert any("replica 0: supervisor: tritonserver exited" in line for line in replicas.lines), replicas.output()
    assert_nothing_lost(outcomes)


FAILS_ONCE_MODEL = "machgen_fails_once"


def add_a_model_that_fails_to_start_once(repository: Path, marker: Path) -> None:
    """A Python model in ``repository`` whose first initialisation fails (leaving ``marker``) and every later
    one succeeds: the next tritonserver started on the repository fails to start ("a model failed to load"),
    as after a rebuild that broke a model, and the one after starts. Servers already running do not load it
    (explicit model control)."""
    model = repository / FAILS_ONCE_MODEL
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(f'name: "{FAILS_ONCE_MODEL}"\nbackend: "python"\nmax_batch_size: 0\n')
    (model / "1" / "model.py").write_text(textwrap.dedent(f"""\
        from pathlib import Path

        MARKER = Path({str(marker)!r})


        class TritonPythonModel:
            def initialize(self, args):
                if not MARKER.exists():
                    MARKER.touch()
                    raise RuntimeError("fails on its first start (tests/test_faults.py)")
        """))


def replica_status(served) -> list[dict]:
    with urllib.request.urlopen(f"http://127.0.0.1:{served.supervisor}/status", timeout=5) as response:
        return json.load(response)["replicas"]


def line_index(served, start: str) -> int:
    return next(index for index, line in enumerate(served.lines) if line.startswith(start))


@needs_haproxy
def test_a_rolling_restart_under_load_waits_out_a_replica_that_fails_to_start_and_loses_no_request(
        replicas, replica_expected, tmp_path):
    """SIGHUP under load, the repository holding a model that fails its first start: replica 0 does not come
    back at first. It is said down (/status, machgen_replica_up, the log), tried again after a backoff and
    back; replica 1 serves alone meanwhile, every kind of request answered, and is taken out only once
    replica 0 is back. Then both run new servers, and no request was lost."""
    before = replica_pids(replicas)
    add_a_model_that_fails_to_start_once(replicas.repository, tmp_path / "failed-once")
    load = Load(replicas, replica_expected)
    load.wait_for(6)
    hup_at = time.time()
    replicas.process.send_signal(signal.SIGHUP)
    failure = "replica 0: did not start (try 1): a model failed to load"
    wait_for_serve(replicas, lambda: any(line.startswith(failure) for line in replicas.lines), timeout=300,
                   what="replica 0's first start failing")
    answered_before = len(load.outcomes)
    assert replicas.metric('machgen_replica_up{replica="0"}') == 0
    assert replicas.metric('machgen_replica_start_failures_total{replica="0"}') == 1
    assert replicas.metric('machgen_replica_up{replica="1"}') == 1
    status = replica_status(replicas)
    assert status[0]["state"] in ("retrying", "restarting") and not status[0]["up"], status
    assert status[0]["start_failures"] == 1 and FAILS_ONCE_MODEL in status[0]["last_error"], status
    assert status[1]["state"] == "serving" and status[1]["pid"] == before[1], status
    with urllib.request.urlopen(f"http://127.0.0.1:{replicas.metrics}/metrics", timeout=5) as response:
        balancer = response.read().decode()
    for backend in ("grpc", "grpc_stream", "http"):
        assert f'haproxy_server_status{{proxy="{backend}_replicas",server="r0",state="MAINT"}} 1' in balancer
        assert f'haproxy_server_status{{proxy="{backend}_replicas",server="r1",state="UP"}} 1' in balancer

    wait_for_serve(replicas, lambda: any(line.startswith("replica 0: back in the balancer") for line in replicas.lines),
                   timeout=240, what="replica 0 back")
    back_at = time.time()
    answered_while_down = load.outcomes[answered_before:]
    assert {kind for kind, _, _ in answered_while_down} == set(KINDS), answered_while_down
    assert replicas.metric('machgen_replica_up{replica="0"}') == 1
    assert "started on try 2" in replicas.lines[line_index(replicas, "replica 0: back in the balancer")]
    wait_for_serve(replicas, lambda: any(line.startswith("rolling restart") for line in replicas.lines), timeout=240,
                   what="the rolling restart's end")
    # No other replica out while replica 0 was: replica 1's restart began once replica 0 was back (its first
    # line may come after the test saw replica 0 back, hence checked once the restart is over).
    assert line_index(replicas, "replica 1: restarting") > line_index(replicas, "replica 0: back in the balancer")
    load.wait_for(len(load.outcomes) + 6)
    outcomes = load.stop()
    assert any(line.startswith("rolling restart done") for line in replicas.lines), replicas.output()
    after = replica_pids(replicas)
    assert all(after[index] != before[index] for index in before), (before, after)
    assert [(entry["state"], entry["start_failures"]) for entry in replica_status(replicas)] == [
        ("serving", 1), ("serving", 0)]
    assert_nothing_lost(outcomes)
    if replicas.prometheus_port is None:
        pytest.skip("Prometheus is not installed (Debian: apt-get install prometheus): its view of replica 0 "
                    "is not checked")

    def query(expression: str, at: float) -> dict[str, float]:
        arguments = urllib.parse.urlencode({"query": expression, "time": f"{at:.3f}"})
        url = f"http://127.0.0.1:{replicas.prometheus_port}/api/v1/query?{arguments}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return {row["metric"]["replica"]: float(row["value"][1]) for row in json.load(response)["data"]["result"]}

    # What a scrape saw while replica 0 was out (the 5 s scrapes of the window since the SIGHUP), and after.
    window = f"{max(1, int(back_at - hup_at))}s"
    wait_until(lambda: query("machgen_replica_start_failures_total", time.time()) == {"0": 1, "1": 0} and
               query("machgen_replica_up", time.time()) == {"0": 1, "1": 1}, timeout=30,
               what="Prometheus scraping the failed start and both replicas up")
    assert query(f"min_over_time(machgen_replica_up[{window}])", back_at)["0"] == 0
