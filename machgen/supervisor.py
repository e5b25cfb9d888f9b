"""What ``machgen serve`` does around the tritonserver it starts: bring back
models whose stub died, restart a server that died, and drain before a stop.

Triton (2.51, and since 24.06) does not restart a Python-backend stub that
dies (out of memory, a crash in a native library, the OOM killer): every
later request to its model fails with "Stub process is not healthy", and the
model still reports ready. The supervisor counts the server's live stub
processes instead: a model with fewer than its instances is seen within
``poll_interval_s``, and it alone is loaded again through the model-control
API (the server runs in explicit mode; see machgen/server.py), the other
models untouched.

Measured with Triton 2.51: a request that reaches a dead stub keeps that
model's old version from ever unloading, so after a recovery the server's
stop waits out its exit timeout and the old version's regions stay in
/dev/shm until ``TritonServer.stop`` removes them.

Triton's Python backend gives each stub a shared-memory region in /dev/shm
that grows when a message does not fit and never shrinks (perf/RESULTS.md,
the realtime soak: 87 -> 256 MB). A model whose stubs' regions grew past
``shm_reclaim_mb`` is loaded again the same way, fresh stubs with fresh
regions, once its whole pipeline has been idle for the build's idle release
time: no public instance holding a request, no realtime session open.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

from machgen.contract.manifest import (BUSY_PREFIX, IDLE_RELEASE_PARAMETER, MANIFEST_FILE, SAMPLER, SESSIONS_PREFIX,
                                      STREAM, PipelineManifest, drained_file, model_name, replacing_file)
from machgen.runtime.processes import Stub, process_running
from machgen.server import START_ATTEMPTS, ServerError, ServerTimeout, TritonServer

# A drain takes a public model that Triton still unloads for drained once none of its instances has held a
# request for this long: longer than Triton takes to send an answer its instance returned, which the busy
# file no longer shows.
IDLE_SETTLE_S = 2.0


@dataclass(frozen=True)
class SupervisorSettings:
    poll_interval_s: float = 0.25
    """How often the server's processes are looked at."""
    max_restarts: int = 3
    """Server restarts allowed within ``restart_window_s``; one more and the supervisor gives up (exit code 1)."""
    restart_window_s: float = 60.0
    retired_grace_s: float = 300.0
    """After a model is loaded again, its old version's stubs that still run this much later are stopped
    (SIGKILL): Triton never unloads a version a dead stub held, and its live stubs would stay forever.
    Longer than the longest request, which may still finish on the old version."""
    load_timeout_s: float = 180.0
    """A model's load again that takes longer is wedged (Triton 2.51 can wait forever on a stub that died
    while it started): the server is started again. (A load that fails is tried three times first.)"""
    drain_timeout_s: float = 60.0
    """On a stop, how long requests in flight get to finish; then they are stopped at their next step
    (answering UNAVAILABLE, so that a client sends them again elsewhere)."""
    shm_reclaim_mb: float = 16.0
    """A Python-backend model whose stubs' shared-memory regions together grew by more than this since those
    stubs started is loaded again (fresh stubs, fresh regions) once its pipeline is idle; 0: never."""
    shm_reclaim_idle_s: float = 10.0
    """How long a pipeline must be idle first where its build recorded no idle release time (a torch or
    TensorRT build); else the build's (machgen-build --idle-release-s; 0: never)."""


def pipeline_models(repository: Path) -> tuple[dict[str, set[str]], dict[str, int]]:
    """Each pipeline of a repository machgen-build wrote, and its Triton models: the public model and its
    streaming twin, the sampler, and the components' own models; and each component model's weight bytes (a
    load of it holds them twice while the old version goes)."""
    pipelines, weights = {}, {}
    for path in sorted(Path(repository).glob(f"*_{SAMPLER}/1/{MANIFEST_FILE}")):
        manifest = PipelineManifest.read(path.parent)
        name = manifest.name
        components = {component: entry.model for component, entry in manifest.components.items()
                      if entry.model is not None}
        pipelines[name] = {name, model_name(name, STREAM), model_name(name, SAMPLER), *components.values()}
        for component, model in components.items():
            recorded = (manifest.weight_bytes or {}).get(component)
            weights[model] = recorded if recorded is not None else sum(
                file.stat().st_size for file in (Path(repository) / model / "1").rglob("*") if file.is_file())
    return pipelines, weights


def public_models(repository: Path) -> list[str]:
    """The models clients call (each pipeline's NAME and NAME_stream), in a repository machgen-build wrote."""
    names = []
    for path in sorted(Path(repository).glob(f"*_{SAMPLER}/1/{MANIFEST_FILE}")):
        name = PipelineManifest.read(path.parent).name
        names += [name, model_name(name, STREAM)]
    return names


class Supervisor:
    """Watches ``server`` on a thread of its own (``start``) until ``drain``
    stops the server without dropping a request in flight, or until it gives
    up (``wait`` returns the exit code then)."""

    def __init__(self, server: TritonServer, settings: SupervisorSettings = SupervisorSettings(),
                 log: Callable[[str], None] = print):
        self.server = server
        self.settings = settings
        self.log = log
        self.recoveries: Counter[str] = Counter()
        self.reclaims: Counter[str] = Counter()  # loaded again, idle, for the shared memory their stubs grew
        self.server_restarts = 0
        self.exit_code: int | None = None
        self._instances: dict[str, int] | None = None  # stub processes each Python-backend model runs
        self._idle_release: dict[str, float] = {}  # each model's idle release time, where its config has one
        self._pipelines: dict[str, set[str]] | None = None
        self._weights: dict[str, int] = {}  # each component model's weight bytes
        self._on_gpu: set[str] = set()  # models with an instance on a GPU: never loaded again for shared memory
        # Of each pipeline with a model past shm_reclaim_mb: when it was last seen busy (monotonic).
        self._active_at: dict[str, float] = {}
        self._region_bytes: dict[int, int] = {}  # each stub's region's bytes at the last look, by pid
        self._reclaim_failed: set[str] = set()  # not tried again (until the model or the server is started anew)
        # Stubs of versions since replaced (some linger: see above): pid -> when its version was replaced.
        self._retired: dict[int, float] = {}
        self._restarts: deque[float] = deque()
        self._generation = 0
        self._stopping = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()  # one of the watch and a drain acts on the server at a time
        self._thread: threading.Thread | None = None

    def start(self) -> "Supervisor":
        self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def wait(self) -> int:
        """Block until the supervisor stops; its exit code (0 after ``drain``)."""
        self._done.wait()
        return self.exit_code or 0

    def _watch(self) -> None:
        try:
            while not self._stopping.wait(self.settings.poll_interval_s):
                with self._lock:
                    if self._stopping.is_set():
                        break
                    if not self.server.alive():
                        self._restart_server()
                        continue
                    try:
                        live = self._check_stubs()
                        if live is not None and self.settings.shm_reclaim_mb > 0:
                            self._reclaim_shared_memory(live)
                    except (OSError, ServerError):  # refused: the server died after the check above (a SIGKILL
                        if not self._exits_within(5.0):  # between them; its control API says so as ServerError)
                            raise
                        self._restart_server()
        except Exception as err:  # noqa: BLE001 - an orchestrator must see the supervisor gone
            self.log(f"supervisor: {err}; giving up")
            self.exit_code = 1
        finally:
            self._done.set()

    def _instance_counts(self) -> dict[str, int]:
        """The stub processes each Python-backend model of the server runs (its instance groups' counts); and
        its idle release time into ``_idle_release``, where its config has one."""
        counts = {}
        self._idle_release = {}
        for model in self.server.model_states():
            config = self.server.control(f"/v2/models/{model}/config")
            if config.get("backend") == "python":
                counts[model] = sum(int(group.get("count", 1)) for group in config.get("instance_group", []))
            if any(group.get("kind") == "KIND_GPU" for group in config.get("instance_group", [])):
                self._on_gpu.add(model)
            idle = config.get("parameters", {}).get(IDLE_RELEASE_PARAMETER, {}).get("string_value")
            if idle is not None:
                self._idle_release[model] = float(idle)
        return counts

    def _check_stubs(self) -> list[Stub] | None:
        """Every model has as many live stubs of its current version as it has instances, or is loaded again.
        (Counted, not followed by pid: a stub may die before a look at it, during a load say.) The live stubs
        when none was missing."""
        if self._instances is None:
            self._instances = self._instance_counts()
        live = self._stop_lingering(self.server.stubs())
        current = Counter(stub.model for stub in live if stub.pid not in self._retired)
        short = {model: count - current[model] for model, count in self._instances.items() if current[model] < count}
        if not short:
            return live
        states = self.server.model_states()
        for model, missing in short.items():
            if states.get(model) == "READY":  # not a model on its way out (an unload of ours)
                self._recover(model, missing, live)
            if self._instances is None:  # the server was started again instead: all is new
                return None
        return None

    def _stop_lingering(self, live: list[Stub]) -> list[Stub]:
        """``live`` less the stubs of replaced versions past their grace, which are stopped."""
        now = time.monotonic()
        lingering = [stub for stub in live if now - self._retired.get(stub.pid, now) > self.settings.retired_grace_s]
        for stub in lingering:
            try:
                os.kill(stub.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if lingering:
            self.log(f"supervisor: stopped {len(lingering)} stubs of replaced versions that Triton kept "
                     f"({', '.join(sorted(stub.instance for stub in lingering))})")
        live = [stub for stub in live if stub not in lingering]
        alive = {stub.pid for stub in live}
        self._retired = {pid: at for pid, at in self._retired.items() if pid in alive}
        return live

    def _recover(self, model: str, missing: int, live: list[Stub]) -> None:
        started = time.monotonic()
        self.log(f"supervisor: {missing} of {self._instances[model]} stubs of model {model} died; "
                 f"loading {model} again")
        for attempt in range(1, 4):
            # Its stubs now are of the version being replaced, whether or not they go away.
            self._retired.update({stub.pid: time.monotonic() for stub in live
                                  if stub.model == model and stub.pid not in self._retired})
            self._generation += 1
            try:
                self.server.reload_model(model, self._generation, timeout=self.settings.load_timeout_s)
                break
            except ServerTimeout:  # a load wedged (on a stub that died while it started): others would wait on it
                self._restart_server(f"loading model {model} again took over {self.settings.load_timeout_s:.0f} s")
                return
            except ServerError as err:  # a stub of the new version died while it started, say
                self.log(f"supervisor: loading {model} again failed (try {attempt} of 3): {err}")
                if attempt == 3:
                    self._restart_server(f"model {model} could not be loaded again")
                    return
                time.sleep(attempt)
                live = self.server.stubs()
        self.recoveries[model] += 1
        self._reclaim_failed.discard(model)
        self.log(f"supervisor: model {model} serves again ({time.monotonic() - started:.1f} s)")

    def _reclaim_shared_memory(self, live: list[Stub]) -> None:
        """Load again the model whose stubs' shared memory grew most past ``shm_reclaim_mb`` once its whole
        pipeline has been idle for the pipeline's idle release time: no public instance holding a request, no
        realtime session open in its sampler (a reload of the sampler would lose them), no region of it grown,
        no request taken (Triton's statistics: one between two looks moves no busy file). One model a look."""
        sizes, growing = self._shared_memory([stub for stub in live if stub.pid not in self._retired])
        threshold = self.settings.shm_reclaim_mb * 2**20
        if self._pipelines is None:
            self._pipelines, self._weights = pipeline_models(self.server.model_repository)
        # A component's load holds its weights twice until the old version goes: worth it only for more shared
        # memory than that, and never on a GPU (its weights there, the regions in host memory).
        grown = {model for model, (start, now) in sizes.items()
                 if now - start > max(threshold, self._weights.get(model, 0)) and model not in self._on_gpu
                 and model not in self._reclaim_failed}
        if not grown:
            self._active_at.clear()
            return
        now = time.monotonic()
        due = []
        for pipeline, models in self._pipelines.items():
            if not models & grown:
                self._active_at.pop(pipeline, None)
                continue
            if models & growing or self._pipeline_busy(pipeline):
                self._active_at[pipeline] = now
            idle_s = self._pipeline_idle_s(models)
            if idle_s > 0 and now - self._active_at.setdefault(pipeline, now) >= idle_s:
                due.append((pipeline, idle_s))
        if not due:
            return
        taken = self.server.last_inferences()
        epoch_ahead = time.time() - now  # a time since the epoch less this: the monotonic clock's
        for pipeline, idle_s in due:
            last = max(taken.get(model, 0.0) for model in self._pipelines[pipeline])
            self._active_at[pipeline] = max(self._active_at[pipeline], last - epoch_ahead)
            idle_for = now - self._active_at[pipeline]
            if idle_for >= idle_s:
                model = max(self._pipelines[pipeline] & grown, key=lambda name: sizes[name][1] - sizes[name][0])
                self._reclaim(pipeline, model, *sizes[model], idle_for)
                return

    def _shared_memory(self, current: list[Stub]) -> tuple[dict[str, tuple[int, int]], set[str]]:
        """Each model's stubs' regions' bytes together, when those stubs started and now; and the models one of
        whose regions grew since the last look."""
        sizes: dict[str, tuple[int, int]] = {}
        growing = set()
        looked = {}
        for stub in current:
            if stub.region is None:
                continue
            size = looked[stub.pid] = stub.region_bytes()
            if size > self._region_bytes.get(stub.pid, size):
                growing.add(stub.model)
            start, now = sizes.get(stub.model, (0, 0))
            sizes[stub.model] = (start + stub.region_start_bytes, now + size)
        self._region_bytes = looked
        return sizes, growing

    def _pipeline_idle_s(self, models: set[str]) -> float:
        """How long ``models``' pipeline must be idle before one is loaded again: its build's idle release time
        (its models' configs carry it), else ``shm_reclaim_idle_s``."""
        recorded = [self._idle_release[model] for model in models if model in self._idle_release]
        return max(recorded) if recorded else self.settings.shm_reclaim_idle_s

    def _pipeline_busy(self, pipeline: str) -> bool:
        """Whether a public instance of ``pipeline`` holds a request or its sampler has a realtime session open."""
        return (self._requests_held(pipeline) or self._requests_held(model_name(pipeline, STREAM))
                or bool(self._marked(SESSIONS_PREFIX, pipeline)))

    def _reclaim(self, pipeline: str, model: str, start: int, grown: int, idle_for: float) -> None:
        """Load ``model`` again, its old stubs retired; a load that fails is logged and not tried again."""
        if self._stopping.is_set() or self.server.model_states().get(model) != "READY":  # a drain, an unload
            return
        old = {stub.pid for stub in self.server.stubs() if stub.model == model and stub.pid not in self._retired}
        # A sampler's old version refuses sessions from now on (it would lose them): written before the last look
        # at the sessions files, so a session opening meanwhile is either seen here or refused there.
        replacing = Path(replacing_file(os.fspath(self.server.stop_file), model))
        if model == model_name(pipeline, SAMPLER):
            replacing.write_text(" ".join(str(pid) for pid in sorted(old)))
        try:
            if self._marked(SESSIONS_PREFIX, pipeline):
                self.log(f"supervisor: a realtime session opened on {pipeline}; {model} is not loaded again")
                self._active_at[pipeline] = time.monotonic()
                return
            self.log(f"supervisor: {model}'s shared memory grew {start / 2**20:.0f} -> {grown / 2**20:.0f} MB; "
                     f"idle {idle_for:.0f} s: loading it again")
            started = time.monotonic()
            self._generation += 1
            try:
                self.server.reload_model(model, self._generation, timeout=self.settings.load_timeout_s)
            except ServerTimeout:  # a load wedged: others would wait on it
                self._restart_server(f"loading model {model} again took over {self.settings.load_timeout_s:.0f} s")
                return
            except ServerError as err:  # Triton keeps the version that serves
                self._reclaim_failed.add(model)
                self.log(f"supervisor: loading {model} again failed: {err}; its shared memory stays (not tried "
                         "again)")
                return
        finally:
            replacing.unlink(missing_ok=True)
        self._retired.update({pid: time.monotonic() for pid in old})
        self.reclaims[model] += 1
        self.log(f"supervisor: model {model} loaded again ({time.monotonic() - started:.1f} s)")

    def _exits_within(self, seconds: float) -> bool:
        """Whether the server process has ended, or ends within ``seconds``."""
        import subprocess

        try:
            self.server.process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _restart_server(self, reason: str | None = None) -> None:
        """Start the server again (killing what is left of it), unless it was started again too often."""
        if reason is None:
            code = self.server.process.returncode if self.server.process is not None else None
            reason = f"tritonserver exited with code {code}\n{self.server.log_tail(10)}"
        while True:
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > self.settings.restart_window_s:
                self._restarts.popleft()
            if len(self._restarts) >= self.settings.max_restarts:
                self.log(f"supervisor: {reason}; {len(self._restarts)} restarts within "
                         f"{self.settings.restart_window_s:.0f} s already: giving up")
                self.exit_code = 1
                self._stopping.set()
                return
            self._restarts.append(now)
            self.log(f"supervisor: {reason}; starting tritonserver again")
            self.server.kill_process()  # what is left of it: stubs that outlived it, a server wedged in a load
            self._retired.clear()
            self._instances = None
            self._pipelines = None
            self._on_gpu.clear()
            self._active_at.clear()
            self._reclaim_failed.clear()
            try:
                # A start Triton aborts (lock_exception) or wedges is made again after a pause, not counted as a
                # restart: such aborts come in bursts on a loaded machine, which restarts back to back used up.
                self.server.start(attempts=START_ATTEMPTS)
                break
            except ServerError as err:
                reason = f"tritonserver did not start again: {err}"
        self.server_restarts += 1
        self.log("supervisor: tritonserver serves again")

    def drain(self, timeout_s: float | None = None) -> None:
        """Stop the server without dropping a request: its public models take
        no new request, those in flight get ``timeout_s`` to finish, then are
        stopped at their next step (each answered UNAVAILABLE), then the
        server stops. (Triton's own SIGTERM fails every request in flight at
        its next component call: "Server not ready".)"""
        timeout_s = self.settings.drain_timeout_s if timeout_s is None else timeout_s
        self._stopping.set()
        with self._lock:
            if self.server.alive():
                self._drain(timeout_s)
            # Nothing is in flight now: what Triton's own stop would still do is unload every instance, a
            # second each, one after another (and wait out its exit timeout for a version a dead stub kept).
            self.server.kill()
        if self._thread is not None:
            self._thread.join()

    def _drain(self, timeout_s: float) -> None:
        models = public_models(self.server.model_repository)
        for model in models:  # left by versions replaced earlier
            Path(drained_file(os.fspath(self.server.stop_file), model)).unlink(missing_ok=True)
        try:
            for model in models:
                self.server.unload_model(model)
            # Said once it is true: a client that reads it and sends a request is refused.
            self.log(f"supervisor: draining: {', '.join(models)} take no new request")
            holding = self._models_holding_requests(models, timeout_s)
            if holding:
                self.log(f"supervisor: requests still in flight after {timeout_s:.0f} s in {', '.join(holding)}; "
                         "stopping them at their next step")
                self._log_stacks(holding)
                self.server.stop_file.touch()
                holding = self._models_holding_requests(holding, 30.0)
                if holding:
                    self.log(f"supervisor: {', '.join(holding)} still not unloaded after 30 s more; killing the "
                             "server")
        except ServerError as err:
            self.log(f"supervisor: drain: {err}")

    def _log_stacks(self, models: list[str]) -> None:
        """The Python stacks of ``models``' stubs, from the server log into this log: where a request is held
        (the server log goes with the server's folder when machgen serve stops)."""
        offset = self.server.log_size()
        if self.server.write_stacks(models):
            text = self.server.log_since(offset).decode(errors="replace").strip()
            self.log(f"supervisor: where {', '.join(models)} hold their requests (each thread's stack):\n{text}")

    def _models_holding_requests(self, models: list[str], timeout_s: float) -> list[str]:
        """Those of ``models`` that still hold a request after ``timeout_s`` (none once each answered all its
        requests: unloaded, finalizing (runtime/triton_models/backend.py mark_drained), or, while Triton
        still unloads it, none of its instances holding a request for IDLE_SETTLE_S)."""
        deadline = time.monotonic() + timeout_s
        idle_since: dict[str, float] = {}
        while True:
            states = self.server.model_states()
            now = time.monotonic()
            for model in models:
                if self._requests_held(model):
                    idle_since.pop(model, None)
                else:
                    idle_since.setdefault(model, now)
            holding = [model for model in models if states.get(model) in ("READY", "UNLOADING")
                       and not os.path.exists(drained_file(os.fspath(self.server.stop_file), model))
                       and now - idle_since.get(model, now) < IDLE_SETTLE_S]
            if not holding or now > deadline:
                return holding
            time.sleep(0.25)

    def _requests_held(self, model: str) -> bool:
        """Whether a live instance of public ``model`` holds a request (contract/manifest.py busy_file)."""
        return bool(self._marked(BUSY_PREFIX, model))

    def _marked(self, kind: str, name: str) -> list[int]:
        """The live processes that have a ``kind`` file of ``name`` beside the stop file (contract/manifest.py
        busy_file, sessions_file)."""
        prefix = f"{kind}{name}-"
        folder = Path(self.server.stop_file).parent
        pids = [int(text) for text in (path.name[len(prefix):] for path in folder.glob(f"{prefix}*"))
                if text.isdigit()]
        return [pid for pid in pids if process_running(pid)]

    def metrics_text(self) -> str:
        """The supervisor's counters in Prometheus' text format."""
        return metrics_text({(): self})

    def serve_metrics(self, host: str, port: int) -> ThreadingHTTPServer:
        """``metrics_text`` at http://HOST:PORT/metrics, on a thread; ``shutdown()`` the result to stop it."""
        return serve_metrics(host, port, self.metrics_text)


def metrics_text(supervisors: "dict[tuple[tuple[str, str], ...], Supervisor]") -> str:
    """The counters of ``supervisors`` (each keyed by the labels that tell it from the others, as
    (name, value) pairs: ``(("replica", "0"),)``) in Prometheus' text format, one family each."""
    def series(name: str, labels: tuple[tuple[str, str], ...], value: int) -> str:
        text = ",".join(f'{key}="{label}"' for key, label in labels)
        return f"{name}{{{text}}} {value}" if text else f"{name} {value}"

    lines = ["# HELP machgen_model_recoveries_total Models loaded again after a stub of theirs died.",
             "# TYPE machgen_model_recoveries_total counter"]
    for labels, supervisor in supervisors.items():
        lines += [series("machgen_model_recoveries_total", (*labels, ("model", model)), count)
                  for model, count in sorted(supervisor.recoveries.items())]
    lines += ["# HELP machgen_shm_reclaims_total Models loaded again, idle, to give back the shared memory their "
              "stubs' regions grew.",
              "# TYPE machgen_shm_reclaims_total counter"]
    for labels, supervisor in supervisors.items():
        lines += [series("machgen_shm_reclaims_total", (*labels, ("model", model)), count)
                  for model, count in sorted(supervisor.reclaims.items())]
    lines += ["# HELP machgen_server_restarts_total Times tritonserver was started again after it died.",
              "# TYPE machgen_server_restarts_total counter"]
    lines += [series("machgen_server_restarts_total", labels, supervisor.server_restarts)
              for labels, supervisor in supervisors.items()]
    return "\n".join(lines) + "\n"


def serve_metrics(host: str, port: int, text: Callable[[], str],
                  status: Callable[[], str] | None = None) -> ThreadingHTTPServer:
    """``text()`` (Prometheus' text format) at http://HOST:PORT/metrics and, given, ``status()`` (JSON) at
    /status, on a thread; ``shutdown()`` the result to stop it."""
    routes = {"/metrics": (text, "text/plain; version=0.0.4"),
              **({"/status": (status, "application/json")} if status is not None else {})}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            route = routes.get(self.path.split("?")[0])
            if route is None:
                self.send_error(404)
                return
            answer, content_type = route
            body = answer().encode()
            self.send_response(200)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # no line per scrape
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, name="supervisor-metrics", daemon=True).start()
    return httpd
