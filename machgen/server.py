"""Start the tritonserver that the nvidia-pytriton wheel bundles.

The bundled server needs three things prepared (checked on these machines):
its Python-backend stub must match this interpreter's version (the wheel
ships one per version; we copy the right one into a backend folder), the
interpreter's own libpython must come first on LD_LIBRARY_PATH, and this
environment's ``bin`` must lead PATH so that the stub's embedded Python picks
up this virtual environment (and the installed machgen package).

The server runs in explicit model-control mode with every model loaded, so
that one model can be reloaded without touching the others (a Python stub
that dies is not restarted by Triton itself); its model-repository,
shared-memory, logging and trace APIs (reading their settings too: Triton
restricts a category whole) answer only requests carrying
``CONTROL_KEY_HEADER`` with this server's own key, which only the process
that started it holds: a stranger who reaches the port can neither unload a
model nor switch verbose logging or tracing on.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from machgen.contract.manifest import STEP_LOG_ENV, STOP_FILE_ENV
from machgen.runtime.processes import STACKS_SIGNAL, Stub, stub_of

# The header that Triton's restricted APIs (RESTRICTED_APIS) ask for; gRPC clients send it as
# GRPC_CONTROL_KEY_HEADER (Triton prefixes a restricted protocol's header). Refused: HTTP 403, gRPC UNAVAILABLE
# (Triton 2.51's code for it), both "This API/protocol is restricted, expecting header '...'".
CONTROL_KEY_HEADER = "machgen-control-key"
GRPC_CONTROL_KEY_HEADER = f"triton-grpc-protocol-{CONTROL_KEY_HEADER}"
RESTRICTED_APIS = "model-repository,shared-memory,logging,trace"


class ServerError(RuntimeError):
    pass


class ServerTimeout(ServerError):
    """The server did not answer a call in time."""


class StartStalled(ServerError):
    """A start that made no progress: its log did not grow and its processes computed nothing (Triton 2.51 can
    wait forever on a Python-backend stub that has run its model's initialize: docs/faults.md)."""


class StartAborted(ServerError):
    """A start whose server was killed by a signal before it was ready (Triton 2.51's Python backend can abort
    at start-up with boost::interprocess::lock_exception on a loaded machine: docs/faults.md)."""


# A start is making progress while its log grows or its processes (the server, its stubs, their ranks) compute at
# least this many CPU seconds between two log lines: a wedged one idles (seen: 22 stubs, 0.1-0.2 s each in 150 s).
STARTING_CPU_S = 1.0
# How long a start may make no progress before it is taken as wedged (a healthy start logs or computes well
# within it; a model's load that reads weights from a slow disk still uses CPU).
START_STALL_S = 120.0
# Between two starts of one server (its ``attempts``), a pause this many seconds times the starts so far:
# lock_exception aborts come in bursts while the machine is loaded (three in 20 s seen).
START_RETRY_PAUSE_S = 3.0
# Starts `machgen serve` and each replica make of a server before giving up: with the pauses between them they
# outlast such a burst (a documented example's server aborted twice in a row while the other test worker ran).
START_ATTEMPTS = 4


def _pytriton_dir() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("nvidia-pytriton is not installed; it provides the tritonserver binary")
    return Path(list(spec.submodule_search_locations)[0])


def prepare_server_dir(work_dir: Path) -> Path:
    """Copy the bundled server into ``work_dir`` with this Python's backend stub."""
    source = _pytriton_dir() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = source / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"the bundled tritonserver has no Python backend stub for Python {version}")
    target = work_dir / "tritonserver"
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("python_backend_stubs"))
    shutil.copy2(stub, target / "backends" / "python" / "triton_python_backend_stub")
    return target


def _spawn_copied_binary(command: list[str], attempts: int = 50, **popen_args) -> subprocess.Popen:
    """Popen a binary this process has just copied, waiting out ETXTBSY, as a child that dies with this process
    (spawn_tied_child).

    While a thread copies a binary, a fork by any other thread (another replica's server starting) inherits
    the copy's write descriptor until that child execs; exec of the copied file fails with ETXTBSY meanwhile.
    """
    for _ in range(attempts - 1):
        try:
            return spawn_tied_child(command, **popen_args)
        except OSError as err:
            if err.errno != errno.ETXTBSY:
                raise
            time.sleep(0.1)
    return spawn_tied_child(command, **popen_args)


_SPAWNER: "concurrent.futures.ThreadPoolExecutor | None" = None
_SPAWNER_LOCK = threading.Lock()


def spawn_tied_child(command: list[str], **popen_args) -> subprocess.Popen:
    """Popen a child that dies with this process. A server (tritonserver, HAProxy, Prometheus) runs in a
    session of its own (a terminal's Ctrl-C must reach machgen serve alone, which drains it), so nothing would
    end it when this process is SIGKILLed: on Linux it is asked for SIGKILL when its parent dies
    (PR_SET_PDEATHSIG; Triton's Python stubs then follow it). The kernel sends that when the *thread* that
    forked it ends, so every such child is forked by one thread that lives as long as this process, not by the
    supervisor's or a replica's thread that happened to start it."""
    global _SPAWNER
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(command, **popen_args)
    import concurrent.futures

    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="server-spawner")
    return _SPAWNER.submit(subprocess.Popen, command, preexec_fn=_die_with_parent, **popen_args).result()


def _die_with_parent() -> None:
    # In the child between fork and exec: one C call (libc resolved before the fork, below).
    _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)


_PR_SET_PDEATHSIG = 1
_PRCTL = None
if sys.platform.startswith("linux"):
    import ctypes

    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl


def server_environment() -> dict[str, str]:
    env = dict(os.environ)
    libs = [sysconfig.get_config_var("LIBDIR") or "", os.fspath(_pytriton_dir().parent / "nvidia_pytriton.libs")]
    if env.get("LD_LIBRARY_PATH"):
        libs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = ":".join(p for p in libs if p)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    return env


@dataclass
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


class TritonServer:
    """A tritonserver process on a model repository; a context manager.

    ``start`` returns once the server reports ready and its metrics answer
    (or raises with the tail of its log); ``stop`` sends SIGTERM and waits
    for in-flight requests.
    """

    def __init__(self, model_repository: Path, ports: Ports = Ports(), host: str = "127.0.0.1",
                 log_file: Path | None = None, verbose: bool = False, exit_timeout_s: int = 30,
                 tritonserver: Path | None = None):
        self.model_repository = Path(model_repository).resolve()
        # An installed Triton's bin/tritonserver (NVIDIA's container: /opt/tritonserver/bin/tritonserver), its
        # backends beside it; else the one nvidia-pytriton bundles.
        self.tritonserver = Path(tritonserver) if tritonserver is not None else None
        self.ports = ports
        self.host = host
        self.verbose = verbose
        self.exit_timeout_s = exit_timeout_s
        self._work = tempfile.TemporaryDirectory(prefix="machgen-triton-")
        # The Python backend's shared-memory regions (/dev/shm) of this server alone start with this.
        self.shm_prefix = f"machgen_{os.getpid()}_{os.path.basename(self._work.name)}_"
        self.log_file = log_file or Path(self._work.name) / "tritonserver.log"
        self.stop_file = Path(self._work.name) / "stop-requests"
        self.control_key = secrets.token_urlsafe(24)
        self.process: subprocess.Popen | None = None
        self._server_dir: Path | None = None
        self._stubs_seen: dict[int, Stub] = {}

    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.ports.http}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.ports.grpc}"

    def command(self, server_dir: Path) -> list[str]:
        return [
            os.fspath(server_dir / "bin" / "tritonserver"),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={server_dir / 'backends'}",
            f"--cache-directory={server_dir / 'caches'}",
            f"--http-address={self.host}", f"--http-port={self.ports.http}",
            f"--grpc-address={self.host}", f"--grpc-port={self.ports.grpc}",
            f"--metrics-address={self.host}", f"--metrics-port={self.ports.metrics}",
            "--allow-gpu-metrics=false",
            f"--log-verbose={1 if self.verbose else 0}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            "--model-control-mode=explicit", "--load-model=*", "--strict-readiness=true",
            # Every config is written whole by machgen-build: without this the Python backend starts one more
            # stub per model to ask it to complete its config (measured: the three defaults ready in 11.5 s
            # instead of 17.8 on these 2 cores).
            "--disable-auto-complete-config",
            f"--http-restricted-api={RESTRICTED_APIS}:{CONTROL_KEY_HEADER}={self.control_key}",
            f"--grpc-restricted-protocol={RESTRICTED_APIS}:{CONTROL_KEY_HEADER}={self.control_key}",
        ]

    def environment(self) -> dict[str, str]:
        """The server's environment: what its stubs need, where machgen serve asks running requests to stop
        (STOP_FILE_ENV), and with ``verbose`` the sampler's log of every step (STEP_LOG_ENV)."""
        return {**server_environment(), STOP_FILE_ENV: os.fspath(self.stop_file),
                **({STEP_LOG_ENV: "1"} if self.verbose else {})}

    def start(self, timeout: float = 180.0, stall_timeout: float | None = START_STALL_S,
              attempts: int = 1) -> "TritonServer":
        """Start the server and wait until it and every model is ready, at most ``timeout`` s. Give up sooner
        on a start that hangs, one whose log did not grow and whose processes computed less than STARTING_CPU_S
        for ``stall_timeout`` s (None: never): StartStalled; one whose server a signal killed: StartAborted; each
        after ``attempts`` starts in all, a growing pause between them."""
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} does not exist")
        for attempt in range(1, attempts + 1):
            try:
                return self._start(timeout, stall_timeout)
            except (StartStalled, StartAborted):
                if attempt == attempts:
                    raise
            time.sleep(START_RETRY_PAUSE_S * attempt)

    def _start(self, timeout: float, stall_timeout: float | None) -> "TritonServer":
        restart = self._server_dir is not None
        if not restart:
            self._server_dir = (self.tritonserver.resolve().parent.parent if self.tritonserver is not None
                                else prepare_server_dir(Path(self._work.name)))
        self.stop_file.unlink(missing_ok=True)
        self.remove_shm_regions()  # a killed server's
        log = open(self.log_file, "ab" if restart else "wb")  # a restarted server's log goes on
        log_start = log.tell()
        self.process = _spawn_copied_binary(self.command(self._server_dir), stdout=log, stderr=subprocess.STDOUT,
                                            env=self.environment(), start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        logged, computed, progressed = 0, 0.0, time.monotonic()
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                if code < 0:
                    self.kill_process()  # its stubs
                    raise StartAborted(f"tritonserver was killed by {signal.Signals(-code).name} while it started:\n"
                                       f"{self.log_tail()}")
                raise ServerError(f"tritonserver exited with code {code}:\n{self.log_tail()}")
            size = self.log_file.stat().st_size if self.log_file.exists() else 0
            cpu = self._cpu_seconds() if stall_timeout is not None else 0.0
            if size != logged or cpu - computed >= STARTING_CPU_S:
                logged, computed, progressed = size, cpu, time.monotonic()
            elif stall_timeout is not None and time.monotonic() - progressed > stall_timeout:
                stalled = self._stalled_load(self.log_since(log_start))
                self.kill_process()
                raise StartStalled(f"tritonserver made no progress for {stall_timeout:.0f} s (its log unchanged, "
                                   f"its processes idle, not ready): {stalled}\n{self.log_tail()}")
            # The metrics service starts last: a server whose metrics port is taken reports ready, then exits.
            if self.ready() and self._answers(f"http://{self.host}:{self.ports.metrics}/metrics"):
                return self
            # In explicit mode a model that fails to load leaves the server up, and never ready.
            if b"failed to load '" in self.log_since(log_start):
                self.kill_process()
                raise ServerError(f"a model failed to load:\n{self.log_tail()}")
            time.sleep(0.25)
        self.kill_process()
        raise ServerError(f"tritonserver was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def _cpu_seconds(self) -> float:
        """CPU seconds the server and every process under it (stubs, their ranks) have used so far."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for process in processes:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def _stalled_load(self, log: bytes) -> str:
        """What a start that hangs waits for: the models whose load began and did not end, and the state of each
        stub process (its instance, whether it runs or sleeps, its CPU seconds so far). The stubs of the models
        it waits for are asked for their threads' Python stacks, which they write into the server log."""
        import re

        import psutil

        text = log.decode(errors="replace")
        begun = dict.fromkeys(re.findall(r'"loading: ([^:"]+):\d+"', text))
        ended = set(re.findall(r"(?:successfully loaded|failed to load) '([^']+)'", text))
        waiting = [name for name in begun if name not in ended]
        stubs = []
        for stub in self.stubs():
            try:
                process = psutil.Process(stub.pid)
                times = process.cpu_times()
                stubs.append(f"{stub.instance} (pid {stub.pid}) {process.status()}, "
                             f"{times.user + times.system:.1f} s CPU")
            except psutil.NoSuchProcess:
                continue
        asked = self.write_stacks(waiting)
        return (f"models not loaded: {', '.join(waiting) or 'none'}; "
                f"stub processes: {'; '.join(stubs) or 'none'}"
                + (f"; the Python stacks of {asked} of them are in the server log" if asked else ""))

    def write_stacks(self, models: list[str]) -> int:
        """Ask every live stub of ``models`` for its threads' Python stacks, which it writes into the server log
        (a second later); how many were asked."""
        asked = 0
        size = self.log_size()
        for stub in self.stubs():
            if stub.model in models:
                try:
                    os.kill(stub.pid, STACKS_SIGNAL)
                    asked += 1
                except ProcessLookupError:
                    continue
        # For the stacks to reach the log (before the server is killed, where it is): once it grew, until it
        # stops growing; at most five seconds (a loaded machine schedules the stubs late).
        deadline, started = time.monotonic() + 5.0, size
        while asked and time.monotonic() < deadline:
            time.sleep(0.25)
            previous, size = size, self.log_size()
            if size == previous and size != started:
                break
        return asked

    def log_size(self) -> int:
        try:
            return self.log_file.stat().st_size
        except OSError:
            return 0

    def log_since(self, offset: int) -> bytes:
        try:
            with open(self.log_file, "rb") as log:
                log.seek(offset)
                return log.read()
        except OSError:
            return b""

    def ready(self) -> bool:
        return self._answers(f"http://{self.http_url}/v2/health/ready")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def control_headers(self, protocol: str = "http") -> dict[str, str]:
        """The headers that open the restricted APIs to a tritonclient of ``protocol``."""
        return {CONTROL_KEY_HEADER if protocol == "http" else GRPC_CONTROL_KEY_HEADER: self.control_key}

    def control(self, path: str, body: dict | None = None, timeout: float = 300.0):
        """A call to the server's HTTP API with the control key (POST with
        ``body``, else GET): its decoded JSON answer (None when empty)."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://{self.http_url}{path}", data=data,
                                         method="GET" if body is None else "POST",
                                         headers={**self.control_headers(), "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                text = response.read()
        except urllib.error.HTTPError as err:
            raise ServerError(f"{path}: HTTP {err.code}: {err.read().decode(errors='replace')}") from None
        except (TimeoutError, urllib.error.URLError, OSError) as err:  # no answer in time, no connection
            timed_out = isinstance(err, TimeoutError) or isinstance(getattr(err, "reason", None), TimeoutError)
            raise (ServerTimeout if timed_out else ServerError)(f"{path}: {err}") from None
        return json.loads(text) if text else None

    def model_states(self) -> dict[str, str]:
        """Every model of the repository and its state (READY, UNLOADING, UNAVAILABLE, ...)."""
        return {entry["name"]: entry.get("state", "") for entry in self.control("/v2/repository/index", {})}

    def reload_model(self, model: str, generation: int, timeout: float = 300.0) -> None:
        """Load ``model`` again, new instances (stub processes) for all of
        its own, the others untouched. Triton skips a load whose config did
        not change, so the config carries ``generation`` as a parameter."""
        config = self.control(f"/v2/models/{model}/config")
        config.setdefault("parameters", {})["machgen_generation"] = {"string_value": str(generation)}
        self.control(f"/v2/repository/models/{model}/load", {"parameters": {"config": json.dumps(config)}},
                     timeout=timeout)

    def unload_model(self, model: str) -> None:
        """Unload ``model``: it takes no new request at once and goes once
        those in flight have their answers (this call does not wait)."""
        self.control(f"/v2/repository/models/{model}/unload", {})

    def stubs(self) -> list[Stub]:
        """The server's live Python-backend stub processes (not those that died and wait to be reaped)."""
        import psutil

        if not self.alive():
            return []
        try:
            children = psutil.Process(self.process.pid).children()
        except psutil.NoSuchProcess:
            return []
        live = []
        for child in children:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
                stub = self._stubs_seen.get(child.pid)  # a stub's command line is read once
                if stub is None or stub.started != child.create_time():  # (a pid can come back as another)
                    stub = stub_of(child)
            except psutil.NoSuchProcess:
                continue
            if stub is not None:  # (a child not yet exec'd is no stub yet: asked again next time)
                self._stubs_seen[child.pid] = stub
                live.append(stub)
        return live

    def last_inferences(self) -> dict[str, float]:
        """When each model last took a request (seconds since the epoch; its versions' latest; 0: never), from
        Triton's statistics."""
        latest: dict[str, float] = {}
        for entry in self.control("/v2/models/stats")["model_stats"]:
            latest[entry["name"]] = max(latest.get(entry["name"], 0.0), int(entry.get("last_inference", 0)) / 1000)
        return latest

    @staticmethod
    def _answers(url: str) -> bool:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 60.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        # Stubs outlive a server that aborted, or that exited before they did (seen: orphaned stubs of test
        # servers, alive an hour later): whatever is left of its group goes too.
        self.kill_process()
        self.remove_shm_regions()
        self._work.cleanup()

    def remove_shm_regions(self) -> None:
        """Remove what the server's instances left in /dev/shm (a stub that
        died, or a server that did not stop cleanly, leaves its regions)."""
        for region in self.shm_regions():
            region.unlink(missing_ok=True)

    def shm_regions(self) -> list[Path]:
        """This server's shared-memory regions that are there now."""
        return sorted(Path("/dev/shm").glob(f"{self.shm_prefix}*"))

    def kill(self) -> None:
        """Stop at once (SIGKILL to the server and its stubs), without
        Triton's second per model instance; its shared memory is removed."""
        self.kill_process()
        self.remove_shm_regions()
        self._work.cleanup()

    def kill_process(self) -> None:
        """SIGKILL to the server and its stubs (the work folder stays: it can start again)."""
        if self.process is not None:
            try:  # the whole group: stubs can outlive the server itself
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
