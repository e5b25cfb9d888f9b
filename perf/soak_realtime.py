"""A soak of realtime sessions (issue 61): sessions of a served streaming
model steered by random key presses for ``--minutes``, opened, closed and
forked at random, with the process that holds them SIGKILLed in the middle,
under ``machgen serve`` (which loads a killed sampler again, docs/faults.md).

    python perf/soak_realtime.py --model models/shapes-world     # built here, served, 10 minutes, 8 sessions
    python perf/soak_realtime.py --repository REPO --name NAME   # a built repository, served here
    python perf/soak_realtime.py --url 127.0.0.1:8001 --metrics-url 127.0.0.1:8002 --name NAME
    python perf/soak_realtime.py ... --minutes 0.4 --sessions 4 --out soak.json --record perf/RESULTS.md

Each of ``--sessions`` slots holds one session at a time and plays it chunk by
chunk; after each chunk it presses a random action key (the model card's
actions) or closes the session at random, and an empty slot opens a new
session or forks a live one of another slot (through the client's fork, a
random action or seed). Every slot draws from its own RNG seeded from
``--seed``; what the server's timing decides (which chunk a key lands on)
varies from run to run.

What is killed (``--kill``, default ``sampler``): the Python-backend stub of
NAME_sampler. The sessions live there: it holds every session's keys and
values and runs the streaming denoiser and the VAE decoder (ONNX Runtime's
native code), so its memory grows with the sessions (the OOM killer's pick)
and a crash of that native code ends it alone; that is the death a user of
sessions meets. ``tritonserver`` kills the server itself instead (every
model goes; machgen serve starts it again).

What it checks (exit 1 when one fails):
- no hang: every client call (an open, a fork, a chunk read, a key press, a
  stop, a stream's close) returns or raises within ``--call-bound`` s
  (30); a watchdog counts the ones that do not, and a slot that does not
  finish at the end;
- told, not lost: each session alive at the kill ends with an error
  (GenerationError: its status and message) within the bound; lost: one
  that ended without one, or not at all;
- memory: the resident memory of tritonserver and its stubs (/proc) and the
  sampler's accounted cache bytes (Triton's machgen_realtime_* metrics) at
  the baseline (after one warm-up session, none open), at the peak and once
  every session is closed: the cache bytes and sessions back to 0, the
  resident memory within ``--memory-tolerance`` of the baseline (both read
  SETTLE_S after the last session closed: an idle model's sessions give back
  what their runs grew);
- no restart but the planned one: machgen serve's supervisor loaded the
  sampler again once (or restarted the server once) and did nothing else (a
  process that died by itself on the way fails the soak);
- every process: the served processes (machgen serve, tritonserver, stubs,
  those started again included) gone once it stopped, and its /dev/shm
  regions removed.
It also reports chunks made, deadline misses (the chunks' own stats),
first-chunk and chunk latencies, the resident memory by model, and the
errors sessions met by kind (a session that plays to the model's last
position, its streaming max_frames, is closed with INVALID_ARGUMENT naming
it: the slot opens another).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import free_port, record  # noqa: E402

SECTION = "soak_realtime"
# A session's subjects: the shapes models' colours and shapes (a world model's actions fill {prompt} with one).
COLOURS = ("red", "green", "blue", "yellow", "magenta", "cyan", "white")
SHAPES = ("circle", "square", "triangle")
SAMPLE_S = 0.5  # the monitor's period: memory, metrics, processes, the calls in flight
SERVER_READY_S = 900.0


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    import numpy as np

    if not values:
        return {"count": 0, "p50": None, "p90": None, "p99": None, "max": None}
    array = np.asarray(values, dtype=float)
    return {"count": len(values), **{f"p{q}": round(float(np.percentile(array, q)), 4) for q in (50, 90, 99)},
            "max": round(float(array.max()), 4)}


# The server and its processes


class Served:
    """The server under test: ``machgen serve REPOSITORY`` started here (``start``), or a running one at ``url``
    (``attach``: its processes found by the port it listens on, when it runs on this machine)."""

    def __init__(self, url: str, metrics_url: str, process: subprocess.Popen | None = None,
                 log_file: Path | None = None, triton_pid: int | None = None, supervisor_url: str | None = None):
        self.url, self.metrics_url, self.supervisor_url = url, metrics_url, supervisor_url
        self.process = process
        self.log_file = log_file
        self._triton_pid = triton_pid
        self.seen: dict[tuple[int, float], str] = {}  # (pid, start time): name, of every process seen under it
        self._seen_lock = threading.Lock()

    @classmethod
    def start(cls, repository: Path, work: Path) -> "Served":
        ports = {name: free_port() for name in ("http", "grpc", "metrics", "supervisor")}
        log_file = work / "serve.log"
        process = subprocess.Popen(
            [sys.executable, "-m", "machgen.cli", "serve", str(repository), "--http-port", str(ports["http"]),
             "--grpc-port", str(ports["grpc"]), "--metrics-port", str(ports["metrics"]),
             "--supervisor-metrics-port", str(ports["supervisor"])],
            stdout=log_file.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        served = cls(f"127.0.0.1:{ports['grpc']}", f"127.0.0.1:{ports['metrics']}", process, log_file,
                     supervisor_url=f"127.0.0.1:{ports['supervisor']}")
        deadline = time.monotonic() + SERVER_READY_S
        while "ready:" not in served.log():
            if process.poll() is not None or time.monotonic() > deadline:
                served.stop()
                raise RuntimeError(f"machgen serve did not become ready:\n{served.log()[-4000:]}")
            time.sleep(1)
        served.observe()
        return served

    @classmethod
    def attach(cls, url: str, metrics_url: str) -> "Served":
        import psutil

        port = int(url.rsplit(":", 1)[1])
        listening = [c.pid for c in psutil.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid]
        triton = next((pid for pid in listening if psutil.Process(pid).name() == "tritonserver"), None)
        return cls(url, metrics_url, triton_pid=triton)

    def log(self) -> str:
        return self.log_file.read_text(errors="replace") if self.log_file else ""

    def wait_for_reclaims(self, quiet_s: float = 3.0, timeout_s: float = 120.0) -> None:
        """Until machgen serve's supervisor has loaded again every model whose shared memory grew (each load it
        began ended) and began none for ``quiet_s``: it loads them one after another once the pipeline is idle
        (machgen serve --shm-reclaim-mb). Nothing to wait for on a server this did not start (no log)."""
        deadline, last, quiet_since = time.monotonic() + timeout_s, None, time.monotonic()
        while self.log_file is not None and time.monotonic() < deadline:
            log = self.log()
            state = (log.count("loading it again"), log.count(" loaded again ("), log.count("its shared memory stays"))
            if state != last:
                last, quiet_since = state, time.monotonic()
            elif state[0] == state[1] + state[2] and time.monotonic() - quiet_since >= quiet_s:
                return
            time.sleep(0.25)

    def tritonservers(self) -> list:
        import psutil

        try:
            if self.process is not None:
                return [p for p in psutil.Process(self.process.pid).children(recursive=True)
                        if p.name() == "tritonserver"]
            return [psutil.Process(self._triton_pid)] if self._triton_pid else []
        except psutil.NoSuchProcess:
            return []

    def server_processes(self) -> list:
        """tritonserver and every process under it (its Python-backend stubs)."""
        import psutil

        found = []
        for triton in self.tritonservers():
            try:
                found += [triton, *triton.children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return found

    def observe(self) -> tuple[float, float]:
        """(resident MB of tritonserver and its stubs, resident MB of the sampler's stubs); every process
        under the server remembered (to check at the end that each is gone)."""
        by_model = self.resident_by_model()
        return sum(by_model.values()), sum(mb for name, mb in by_model.items() if name.endswith("_sampler"))

    def resident_by_model(self) -> dict[str, float]:
        """Resident MB of tritonserver and of each model's stubs (all its instances together)."""
        import psutil

        from machgen.runtime.processes import stub_of

        processes = self.server_processes()
        if self.process is not None and self.process.poll() is None:
            processes.append(psutil.Process(self.process.pid))
        by_model: dict[str, float] = collections.defaultdict(float)
        for process in processes:
            try:
                with self._seen_lock:
                    self.seen[(process.pid, process.create_time())] = process.name()
                if self.process is not None and process.pid == self.process.pid:
                    continue  # machgen serve itself: the supervisor, not the server
                stub = stub_of(process)
                by_model[stub.model if stub is not None else process.name()] += process.memory_info().rss / 2**20
            except psutil.NoSuchProcess:
                pass
        return dict(by_model)

    def proportional_mb(self) -> tuple[float, float]:
        """(PSS MB of tritonserver and its stubs: the Python backend's shared-memory pools, mapped by the server
        and by a stub, counted once rather than in each RSS; MB the server's /dev/shm regions hold)."""
        import psutil

        pss = 0.0
        for process in self.server_processes():
            try:
                pss += process.memory_full_info().pss / 2**20
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return pss, sum(region.stat().st_blocks * 512 for region in self.shm_regions()) / 2**20

    def shm_regions(self) -> list[Path]:
        """The Python backend's regions of this server (named after the machgen serve that started it)."""
        import psutil

        if self.process is not None:
            owner = self.process.pid
        else:
            try:
                owner = psutil.Process(self._triton_pid).ppid() if self._triton_pid else None
            except psutil.NoSuchProcess:
                owner = None
        return list(Path("/dev/shm").glob(f"machgen_{owner}_*")) if owner else []

    def sampler_stubs(self, model: str) -> list:
        from machgen.runtime.processes import instances_of, stub_of

        stubs = [stub for stub in map(stub_of, self.server_processes()) if stub is not None]
        return instances_of(f"{model}_sampler", stubs)

    def metrics(self, model: str) -> dict[str, float]:
        """The machgen_realtime_* series of ``model`` on Triton's /metrics, summed by name."""
        with urllib.request.urlopen(f"http://{self.metrics_url}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        values: dict[str, float] = collections.defaultdict(float)
        for line in lines:
            if line.startswith("machgen_realtime_") and f'model="{model}"' in line and "_bucket{" not in line:
                values[line.split("{", 1)[0]] += float(line.rsplit(" ", 1)[1])
        return dict(values)

    def recoveries(self) -> dict[str, float] | None:
        """What machgen serve's supervisor counted: models loaded again (by model) and server restarts; None
        for a server not started here."""
        if self.supervisor_url is None:
            return None
        with urllib.request.urlopen(f"http://{self.supervisor_url}/metrics", timeout=10) as response:
            lines = response.read().decode().splitlines()
        counts: dict[str, float] = {}
        for line in lines:
            if line.startswith("machgen_model_recoveries_total{"):
                counts[line.split('model="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
            elif line.startswith("machgen_server_restarts_total"):
                counts["tritonserver"] = float(line.rsplit(" ", 1)[1])
        return {name: count for name, count in counts.items() if count}

    def kill(self, target: str, model: str) -> list[int]:
        """SIGKILLs the sampler's stubs or tritonserver; their pids."""
        pids = ([stub.pid for stub in self.sampler_stubs(model)] if target == "sampler"
                else [p.pid for p in self.tritonservers()])
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return pids

    def keep_triton_log(self, to: Path) -> Path | None:
        """A copy of the Triton log (machgen serve removes it when it stops): what a crash left there."""
        named = [line.split(":", 1)[1].strip() for line in self.log().splitlines() if line.startswith("server log:")]
        if not named or not Path(named[0]).exists():
            return None
        shutil.copyfile(named[0], to)
        return to

    def stop(self, timeout_s: float = 180.0) -> None:
        """SIGTERM to machgen serve (its drain), then SIGKILL to its process group after ``timeout_s``."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def left_running(self, wait_s: float = 15.0) -> list[str]:
        """The processes seen under the server that still run (zombies count as gone)."""
        import psutil

        deadline = time.monotonic() + wait_s
        while True:
            left = []
            for (pid, started), name in list(self.seen.items()):
                try:
                    process = psutil.Process(pid)
                    if process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE:
                        left.append(f"{name} {pid}")
                except psutil.NoSuchProcess:
                    pass
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.5)

    def shm_left(self) -> list[str]:
        return sorted(map(str, self.shm_regions())) if self.process is not None else []


# The sessions


@dataclass
class SessionRecord:
    """One session's life as its slot saw it (seconds since the soak began)."""

    session: str
    slot: int
    kind: str  # open or fork
    parent: str | None
    opened_s: float
    first_chunk_s: float | None = None  # from the open (or fork) call to its first chunk
    chunks: int = 0
    presses: int = 0
    ended_s: float | None = None
    outcome: str | None = None  # stopped (by its slot), soak-end (stopped at the end), error, ended (by the server)
    status: str | None = None
    message: str | None = None
    alive_at_kill: bool = False


@dataclass
class Live:
    record: SessionRecord
    session: object  # machgen.client.sessions.RealtimeSession
    chunks: object  # its chunk iterator
    opened: float  # time.monotonic() of the open or fork call
    last_chunk: float | None = None


@dataclass
class Tally:
    """What the slots measured, under ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    records: list[SessionRecord] = field(default_factory=list)
    calls: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    hangs: list[dict] = field(default_factory=list)
    refused: collections.Counter = field(default_factory=collections.Counter)  # (op, status, message head)
    first_chunk_s: list[float] = field(default_factory=list)
    fork_first_chunk_s: list[float] = field(default_factory=list)
    chunk_interval_s: list[float] = field(default_factory=list)
    server_wait_ms: list[float] = field(default_factory=list)
    make_ms: list[float] = field(default_factory=list)
    late_ms: list[float] = field(default_factory=list)
    chunks: int = 0
    deadline_misses: int = 0
    crashes: list[str] = field(default_factory=list)


class Soak:
    def __init__(self, args, served: Served, model: str, actions: list[str], height: int, width: int,
                 chunk_s: float):
        self.args, self.served, self.model, self.actions = args, served, model, actions
        self.height, self.width = height, width
        self.chunk_s = chunk_s  # a chunk's play time (after the first)
        self.tally = Tally()
        self.live: dict[str, Live] = {}  # by session id, under tally.lock
        self.ending = threading.Event()
        self.began = time.monotonic()
        self.kill: dict = {}
        self.slots: list[Slot] = []
        # Per chunk: a key press, a close (mean life --mean-life-s); an empty slot forks rather than opens.
        self.p_key = 1 - math.exp(-chunk_s / args.mean_key_s)
        self.p_close = 1 - math.exp(-chunk_s / args.mean_life_s)

    def now(self) -> float:
        return round(time.monotonic() - self.began, 3)

    def register(self, live: Live) -> None:
        with self.tally.lock:
            self.live[live.record.session] = live
            self.tally.records.append(live.record)

    def unregister(self, live: Live) -> None:
        with self.tally.lock:
            self.live.pop(live.record.session, None)

    def fork_parent(self, slot: "Slot") -> Live | None:
        with self.tally.lock:
            playing = [live for live in self.live.values() if live.record.slot != slot.index and live.record.chunks]
        return slot.rng.choice(playing) if playing else None

    def call_done(self, op: str, seconds: float) -> None:
        with self.tally.lock:
            self.tally.calls[op].append(seconds)

    def refuse(self, op: str, error) -> None:
        with self.tally.lock:
            self.tally.refused[(op, error.status, str(error)[:160])] += 1

    def chunk(self, live: Live, chunk, arrived: float) -> None:
        stats = chunk.stats
        with self.tally.lock:
            record = live.record
            if record.chunks == 0:
                record.first_chunk_s = round(arrived - live.opened, 3)
                (self.tally.first_chunk_s if record.kind == "open" else self.tally.fork_first_chunk_s).append(
                    arrived - live.opened)
            elif live.last_chunk is not None:
                self.tally.chunk_interval_s.append(arrived - live.last_chunk)
            record.chunks += 1
            live.last_chunk = arrived
            self.tally.chunks += 1
            self.tally.deadline_misses += int(bool(stats.get("deadline_missed")))
            self.tally.server_wait_ms.append(float(stats.get("wait_ms", 0.0)))
            self.tally.make_ms.append(float(stats.get("denoise_ms", 0.0)) + float(stats.get("decode_ms", 0.0)))
            if stats.get("deadline_missed"):
                self.tally.late_ms.append(float(stats.get("late_ms", 0.0)))

    def watch(self, stop: threading.Event, timeline: list, peaks: dict) -> None:
        """Every SAMPLE_S: memory, metrics and processes (their peaks), and the calls in flight past the bound
        (a hang: counted once, its session's stream ended to free the slot)."""
        last_point = -1e9
        while not stop.wait(SAMPLE_S):
            try:
                rss, sampler_rss = self.served.observe()
                metrics = self.served.metrics(self.model)
            except Exception:  # noqa: BLE001 - a server between deaths answers nothing: the next sample
                rss, sampler_rss, metrics = None, None, {}
            cache = metrics.get("machgen_realtime_cache_bytes")
            sessions = metrics.get("machgen_realtime_sessions")
            if rss is not None and rss > peaks.get("rss_mb", 0):
                peaks["rss_mb_by_model"] = {name: round(mb, 1)
                                            for name, mb in sorted(self.served.resident_by_model().items())}
            for name, value in (("rss_mb", rss), ("sampler_rss_mb", sampler_rss), ("cache_bytes", cache),
                                ("sessions", sessions)):
                if value is not None:
                    peaks[name] = max(peaks.get(name, 0), value)
            if time.monotonic() - last_point >= 5:
                last_point = time.monotonic()
                pss, shm = self.served.proportional_mb()
                for name, value in (("pss_mb", pss), ("shm_mb", shm)):
                    peaks[name] = max(peaks.get(name, 0), value)
                timeline.append({"t_s": self.now(), "rss_mb": rss and round(rss, 1), "pss_mb": round(pss, 1),
                                 "shm_mb": round(shm, 1), "cache_bytes": cache, "sessions": sessions,
                                 "open_here": len(self.live)})
            for slot in self.slots:
                call, live = slot.call, slot.live
                if call is not None and time.monotonic() - call[1] > self.args.call_bound and not call[2]:
                    call[2] = True
                    with self.tally.lock:
                        self.tally.hangs.append({"slot": slot.index, "op": call[0], "at_s": self.now(),
                                                 "session": live.record.session if live else None})
                    if live is not None:  # unblocks a chunk read: its stream ends
                        threading.Thread(target=live.session.close, daemon=True).start()


class Slot(threading.Thread):
    """One session at a time, played chunk by chunk, steered, closed and replaced at random."""

    def __init__(self, soak: Soak, index: int):
        from machgen.client import MachgenClient

        super().__init__(name=f"slot-{index}", daemon=True)
        self.soak, self.index = soak, index
        self.rng = random.Random(f"{soak.args.seed}:{index}")
        self.client = MachgenClient(soak.served.url)
        self.call: list | None = None  # [op, started, flagged as a hang]
        self.live: Live | None = None
        self.opened = 0

    def timed(self, op: str, function, *args, **kwargs):
        started = time.monotonic()
        self.call = [op, started, False]
        try:
            return function(*args, **kwargs)
        finally:
            self.call = None
            self.soak.call_done(op, time.monotonic() - started)

    def run(self) -> None:
        try:
            while not self.soak.ending.is_set():
                if self.live is None:
                    self.begin()
                else:
                    self.play_one()
            if self.live is not None:
                self.stop(self.live, "soak-end")
        except Exception:  # noqa: BLE001 - reported: a slot that crashed is a soak that failed
            with self.soak.tally.lock:
                self.soak.tally.crashes.append(f"slot {self.index}: {traceback.format_exc()}")

    def begin(self) -> None:
        from machgen.client import GenerationError

        soak, rng = self.soak, self.rng
        parent = soak.fork_parent(self) if rng.random() < soak.args.fork_share else None
        self.opened += 1
        session_id = f"soak-{self.index}-{self.opened}"
        seed = rng.randrange(2**31)
        started = time.monotonic()
        try:
            if parent is not None:
                change = {"action": rng.choice(soak.actions)} if rng.random() < 0.5 else {"seed": seed}
                session = self.timed("fork", parent.session.fork, session_id, **change)
            else:
                subject = f"a {rng.choice(COLOURS)} {rng.choice(SHAPES)}"
                session = self.timed("open", self.client.open_session, soak.model, prompt=subject, seed=seed,
                                     height=soak.height, width=soak.width, session_id=session_id)
        except GenerationError as error:
            soak.refuse("fork" if parent is not None else "open", error)
            time.sleep(rng.uniform(0.5, 2.0))
            return
        record = SessionRecord(session_id, self.index, "fork" if parent else "open",
                               parent.record.session if parent else None, soak.now())
        self.live = Live(record, session, iter(session), started)
        soak.register(self.live)

    def play_one(self) -> None:
        from machgen.client import GenerationError

        soak, live = self.soak, self.live
        try:
            chunk = self.timed("chunk", next, live.chunks)
        except StopIteration:
            self.end(live, "ended", message=json.dumps(live.session.info))
            return
        except GenerationError as error:
            self.end(live, "error", error)
            return
        soak.chunk(live, chunk, time.monotonic())
        if soak.ending.is_set():
            return
        if self.rng.random() < soak.p_key:
            try:
                self.timed("interact", live.session.interact, action=self.rng.choice(soak.actions))
                live.record.presses += 1
            except GenerationError as error:
                self.end(live, "error", error)
                return
        if self.rng.random() < soak.p_close:
            self.stop(live, "stopped")

    def stop(self, live: Live, outcome: str) -> None:
        from machgen.client import GenerationError

        try:
            info = self.timed("stop", live.session.stop)
        except GenerationError as error:
            self.end(live, "error", error)
            return
        self.end(live, outcome if info.get("state") == "closed" else "error", message=json.dumps(info))

    def end(self, live: Live, outcome: str, error=None, message: str | None = None) -> None:
        record = live.record
        record.ended_s, record.outcome = self.soak.now(), outcome
        if error is not None:
            record.status, record.message = error.status, str(error)
        elif message is not None:
            record.message = message
        self.soak.unregister(live)
        self.live = None
        self.timed("close", live.session.close)
        if error is not None:
            time.sleep(self.rng.uniform(0.5, 2.0))  # as a player would before opening again


# The run


def build(model_dir: Path, name: str, work: Path) -> Path:
    repository = work / "repository"
    print(f"building {model_dir} as {name} ...", flush=True)
    done = subprocess.run([sys.executable, "-m", "machgen.builder.cli", "build", str(model_dir), "--name", name,
                           "--out", str(repository), "--no-preview"], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the build failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return repository


def streaming_model(repository: Path) -> str:
    names = [p.name[:-len("_stream")] for p in repository.iterdir() if p.name.endswith("_stream")
             and (repository / p.name[:-len("_stream")] / "config.pbtxt").exists()
             and '\\"streaming\\": {' in (repository / p.name[:-len("_stream")] / "config.pbtxt").read_text()]
    if len(names) != 1:
        raise SystemExit(f"--name: the repository serves these streaming models: {names}; name one")
    return names[0]


def warm_up(served: Served, model: str, actions: list[str], height: int, width: int) -> None:
    """One session through every operation (open, chunks, a key, a fork, stops): what the first of each
    allocates belongs to the baseline, not to the sessions."""
    from machgen.client import MachgenClient

    with MachgenClient(served.url) as client:
        session = client.open_session(model, prompt="a red circle", seed=1, height=height, width=width, chunks=3)
        list(session)
        session.interact(action=actions[0])
        child = session.fork("soak-warm-child", seed=2, chunks=2)
        list(session.play(chunks=2))
        list(child)
        child.stop(), child.close()
        session.stop(), session.close()


# How long memory is given to settle once no session is open before it is read: past the idle release of the
# build's components and sampler (machgen-build build --idle-release-s, 10 s by default), which give back what
# their runs grew, and then until machgen serve has loaded again the models whose shared memory grew (its
# --shm-reclaim-mb, after the same idle time): what a server idle that long holds.
SETTLE_S = 15.0


def settled(served: Served, model: str, timeout_s: float = 60.0, settle_s: float = SETTLE_S) -> dict:
    """The sampler's realtime gauges once they read no session (or after ``timeout_s``: what they read then,
    None if the server did not answer), then memory after ``settle_s`` (the median of three samples)."""
    deadline = time.monotonic() + timeout_s
    metrics: dict = {}
    while True:
        try:
            metrics = served.metrics(model)
        except Exception:  # noqa: BLE001 - a server starting again answers nothing yet
            metrics = {}
        if metrics.get("machgen_realtime_sessions") == 0 and metrics.get("machgen_realtime_cache_bytes") == 0:
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    time.sleep(settle_s)
    served.wait_for_reclaims()
    samples = []
    for _ in range(3):
        samples.append(served.observe())
        time.sleep(1)
    samples.sort()
    pss, shm = served.proportional_mb()
    return {"rss_mb": round(samples[1][0], 1), "sampler_rss_mb": round(samples[1][1], 1),
            "pss_mb": round(pss, 1), "shm_mb": round(shm, 1),
            "cache_bytes": metrics.get("machgen_realtime_cache_bytes"),
            "sessions": metrics.get("machgen_realtime_sessions"),
            "rss_mb_by_model": {name: round(mb, 1) for name, mb in sorted(served.resident_by_model().items())}}


def killer(soak: Soak, at_s: float) -> None:
    if soak.ending.wait(at_s):
        return
    # Only a live target: while the server starts again (a crash of its own) there is none yet.
    while not soak.served.sampler_stubs(soak.model) and not soak.ending.wait(0.5):
        pass
    with soak.tally.lock:
        alive = list(soak.live.values())
        for live in alive:
            live.record.alive_at_kill = True
        killed_at = time.monotonic()
        pids = soak.served.kill(soak.args.kill, soak.model)
    soak.kill = {"target": soak.args.kill, "pids": pids, "at_s": round(killed_at - soak.began, 3),
                 "alive": [live.record.session for live in alive]}
    print(f"{soak.now():.1f} s: SIGKILL {soak.args.kill} {pids}, {len(alive)} sessions alive", flush=True)
    # Back: a sampler stub of another pid (or a new tritonserver), then a session's first chunk after it.
    deadline = time.monotonic() + 600
    while not soak.ending.is_set() and time.monotonic() < deadline:
        stubs = soak.served.sampler_stubs(soak.model)
        if stubs and not {stub.pid for stub in stubs} & set(pids):
            soak.kill["sampler_back_s"] = round(time.monotonic() - killed_at, 2)
            break
        time.sleep(0.25)
    while not soak.ending.is_set() and time.monotonic() < deadline:
        with soak.tally.lock:
            after = [r for r in soak.tally.records if r.first_chunk_s is not None
                     and r.opened_s > soak.kill["at_s"]]
        if after:
            first = min(after, key=lambda r: r.opened_s + r.first_chunk_s)
            soak.kill["first_chunk_after_s"] = round(first.opened_s + first.first_chunk_s - soak.kill["at_s"], 2)
            break
        time.sleep(0.25)


def told_and_lost(soak: Soak) -> tuple[list[SessionRecord], list[SessionRecord]]:
    """Of the sessions alive at the kill: those that ended with an error after it within the bound (told),
    and the others, bar those stopped cleanly before it died (lost)."""
    told, lost = [], []
    kill_at = soak.kill.get("at_s")
    for record in soak.tally.records:
        if not record.alive_at_kill:
            continue
        if record.outcome == "error" and record.ended_s is not None and record.ended_s >= kill_at:
            (told if record.ended_s - kill_at <= soak.args.call_bound else lost).append(record)
        elif record.outcome in ("stopped", "soak-end") and record.ended_s is not None and record.ended_s <= kill_at + 1:
            continue  # its stop was answered before the sampler died
        else:
            lost.append(record)
    return told, lost


def planned_recoveries(soak: Soak) -> dict[str, float]:
    """What the soak's own kill should make machgen serve do: load the sampler again, or restart the server."""
    if not soak.kill.get("pids"):
        return {}
    return {f"{soak.model}_sampler": 1.0} if soak.args.kill == "sampler" else {"tritonserver": 1.0}


def summary(soak: Soak, baseline: dict, cold: dict, peaks: dict, after: dict, recoveries: dict | None,
            left: list[str], shm: list[str], timeline: list, wall_s: float, load: tuple[float, ...],
            model_dir: str | None) -> dict:
    tally, args = soak.tally, soak.args
    told, lost = told_and_lost(soak)
    planned = planned_recoveries(soak)
    crashes = [line.strip() for line in soak.served.log().splitlines() if "tritonserver exited with code" in line
               or ("stubs of model" in line and "died" in line)]
    outcomes = collections.Counter(r.outcome for r in tally.records)
    errors = collections.Counter(f"{r.status}: {(r.message or '')[:140]}" for r in tally.records
                                 if r.outcome == "error")
    rss_growth = (after["rss_mb"] / baseline["rss_mb"] - 1) * 100 if baseline["rss_mb"] else None
    checks = {
        "hangs == 0": not tally.hangs,
        "the kill landed": args.kill == "none" or bool(soak.kill.get("pids")),
        "lost == 0": not lost,
        "told == alive at kill": len(told) == len(soak.kill.get("alive", [])),
        "cache bytes back to 0": after["cache_bytes"] == 0,
        "sessions back to 0": after["sessions"] == 0,
        f"server RSS within {args.memory_tolerance:g} % of baseline": bool(after["rss_mb"])
        and rss_growth is not None and rss_growth <= args.memory_tolerance,
        "no restart but the planned one": recoveries is None or recoveries == planned,
        "every process gone": not left,
        "no /dev/shm left": not shm,
        "no slot crashed": not tally.crashes,
    }
    return {
        "model": soak.model, "model_dir": model_dir, "sessions": args.sessions, "minutes": args.minutes,
        "seed": args.seed, "wall_s": round(wall_s, 1), "call_bound_s": args.call_bound,
        "machine": {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "load_average_start_end": load},
        "kill": soak.kill,
        "recoveries": recoveries, "planned_recoveries": planned, "supervisor_log": crashes,
        "sessions_opened": sum(r.kind == "open" for r in tally.records),
        "sessions_forked": sum(r.kind == "fork" for r in tally.records),
        "refused": [{"op": op, "status": status, "message": message, "count": count}
                    for (op, status, message), count in tally.refused.most_common()],
        "outcomes": dict(outcomes), "errors": dict(errors.most_common()),
        "key_presses": sum(r.presses for r in tally.records),
        "hangs": tally.hangs, "told": len(told), "lost": len(lost),
        "lost_sessions": [asdict(r) for r in lost],
        "told_statuses": dict(collections.Counter(r.status for r in told)),
        "told_within_s": max([r.ended_s - soak.kill["at_s"] for r in told], default=None),
        "told_messages": sorted({(r.message or "")[:200] for r in told}),
        "chunks": tally.chunks, "deadline_misses": tally.deadline_misses,
        "first_chunk_s": percentiles(tally.first_chunk_s),
        "fork_first_chunk_s": percentiles(tally.fork_first_chunk_s),
        "chunk_interval_s": percentiles(tally.chunk_interval_s),
        "server_wait_ms": percentiles(tally.server_wait_ms),
        "make_ms": percentiles(tally.make_ms),
        "late_ms": percentiles(tally.late_ms),
        "calls_s": {op: percentiles(values) for op, values in sorted(tally.calls.items())},
        "memory": {"cold": cold, "baseline": baseline,
                   "peak": {key: (round(value, 1) if key.endswith("_mb") else value)
                            for key, value in peaks.items()},
                   "after": after, "rss_growth_percent": rss_growth and round(rss_growth, 2),
                   "tolerance_percent": args.memory_tolerance},
        "processes_left": left, "shm_left": shm, "crashes": tally.crashes,
        "checks": checks, "passed": all(checks.values()),
        "timeline": timeline, "records": [asdict(r) for r in tally.records],
    }


def growth_by_model(memory: dict) -> list[tuple[str, float, float, float]]:
    """(model, baseline, peak, after MB) for the processes of each model, the most grown first."""
    baseline, after = memory["baseline"].get("rss_mb_by_model", {}), memory["after"].get("rss_mb_by_model", {})
    peak = memory["peak"].get("rss_mb_by_model", {})
    rows = [(name, baseline.get(name, 0.0), peak.get(name, 0.0), after.get(name, 0.0))
            for name in sorted(set(baseline) | set(after))]
    return sorted(rows, key=lambda row: row[1] - row[3])


def table(result: dict) -> str:
    def pct(name: str, scale: float = 1.0, digits: int = 2) -> str:
        p = result[name]
        if not p["count"]:
            return "-"
        return " / ".join(f"{p[key] * scale:.{digits}f}" for key in ("p50", "p90", "p99", "max"))

    memory = result["memory"]
    kill = result["kill"]
    rows = [
        ("sessions (slots) / minutes", f"{result['sessions']} / {result['minutes']:g} ({result['wall_s']:.0f} s)"),
        ("opened / forked / key presses", f"{result['sessions_opened']} / {result['sessions_forked']} / "
                                          f"{result['key_presses']}"),
        ("refused (open, fork)", str(sum(entry["count"] for entry in result["refused"]))),
        ("kill", f"{kill.get('target', 'none')} at {kill.get('at_s', 0):.0f} s, "
                 f"{len(kill.get('alive', []))} sessions alive; sampler back after {kill.get('sampler_back_s')} s, "
                 f"first chunk after {kill.get('first_chunk_after_s')} s"),
        ("restarts by machgen serve (planned: the kill's)", "n/a (not started here)" if result["recoveries"] is None
         else f"{', '.join(f'{name} {count:g}' for name, count in result['recoveries'].items()) or 'none'} "
              f"(planned: {', '.join(result['planned_recoveries']) or 'none'})"),
        ("**hangs** (calls over the bound)", f"**{len(result['hangs'])}** (bound {result['call_bound_s']:g} s)"),
        ("**told / lost** (of those alive at the kill)", f"**{result['told']} / {result['lost']}** "
                                                         f"(told within {result['told_within_s'] or 0:.1f} s: "
                                                         f"{', '.join(result['told_statuses']) or '-'})"),
        ("chunks / deadline misses", f"{result['chunks']} / {result['deadline_misses']}"),
        ("first chunk s (p50 / p90 / p99 / max)", pct("first_chunk_s")),
        ("a fork's first chunk s", pct("fork_first_chunk_s")),
        ("chunk interval s (client)", pct("chunk_interval_s")),
        ("chunk wait ms (server: request to frames)", pct("server_wait_ms", digits=0)),
        ("chunk make ms (denoise + decode)", pct("make_ms", digits=0)),
        ("late ms (missed chunks)", pct("late_ms", digits=0)),
        ("server RSS MB: cold / baseline / peak / after", f"{memory['cold']['rss_mb']:.0f} / "
         f"{memory['baseline']['rss_mb']:.0f} / {memory['peak'].get('rss_mb', 0):.0f} / "
         f"{memory['after']['rss_mb']:.0f} ({memory['rss_growth_percent']:+.1f} %, tolerance "
         f"{memory['tolerance_percent']:g} %)"),
        ("server PSS MB (shared memory once): baseline / peak / after", f"{memory['baseline']['pss_mb']:.0f} / "
         f"{memory['peak'].get('pss_mb', 0):.0f} / {memory['after']['pss_mb']:.0f}"),
        ("its /dev/shm pools MB: baseline / peak / after", f"{memory['baseline']['shm_mb']:.0f} / "
         f"{memory['peak'].get('shm_mb', 0):.0f} / {memory['after']['shm_mb']:.0f}"),
        ("grew most, MB (baseline → peak → after)", "; ".join(
            f"{name} {before:.0f} → {peak:.0f} → {after:.0f}"
            for name, before, peak, after in growth_by_model(memory)[:3]) or "-"),
        ("sampler stub RSS MB: baseline / peak / after", f"{memory['baseline']['sampler_rss_mb']:.0f} / "
         f"{memory['peak'].get('sampler_rss_mb', 0):.0f} / {memory['after']['sampler_rss_mb']:.0f}"),
        ("cache bytes: baseline / peak / after", f"{memory['baseline']['cache_bytes']:,.0f} / "
         f"{memory['peak'].get('cache_bytes', 0):,.0f} / **{memory['after']['cache_bytes'] or 0:,.0f}**"),
        ("sessions open (metric): peak / after", f"{memory['peak'].get('sessions', 0):.0f} / "
                                                 f"{memory['after']['sessions']}"),
        ("processes left / /dev/shm left", f"**{len(result['processes_left'])} / {len(result['shm_left'])}**"),
    ]
    lines = ["| | |", "| --- | --- |"] + [f"| {name} | {value} |" for name, value in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", type=Path, help="a diffusers folder with a streaming mode: built and served here")
    where.add_argument("--repository", type=Path, help="a built repository: served here")
    where.add_argument("--url", help="a running server's gRPC host:port (then --metrics-url)")
    parser.add_argument("--metrics-url", default=None, help="with --url: Triton's metrics host:port")
    parser.add_argument("--name", help="the served model (default: the folder's name, or the repository's one)")
    parser.add_argument("--sessions", type=int, default=8, help="slots: sessions played at once")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill", choices=("sampler", "tritonserver", "none"), default="sampler")
    parser.add_argument("--kill-at", type=float, default=0.5, help="when, as a share of the soak")
    parser.add_argument("--mean-life-s", type=float, default=60.0, help="a session's mean life before a close")
    parser.add_argument("--mean-key-s", type=float, default=3.0, help="mean seconds between a session's keys")
    parser.add_argument("--fork-share", type=float, default=0.4, help="share of new sessions that are forks")
    parser.add_argument("--call-bound", type=float, default=30.0, help="seconds within which a call must end")
    parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                        help="seconds memory settles, once no session is open, before it is read (past the build's "
                             "--idle-release-s)")
    parser.add_argument("--memory-tolerance", type=float, default=10.0,
                        help="percent over the baseline the server's RSS may stay after all are closed")
    parser.add_argument("--out", type=Path, help="the result as JSON")
    parser.add_argument("--record", type=Path, help="write the table into this RESULTS.md")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="machgen-soak-realtime-"))
    load_start = os.getloadavg()
    if args.url:
        served = Served.attach(args.url, args.metrics_url or f"{args.url.rsplit(':', 1)[0]}:8002")
        model = args.name or parser.error("--url needs --name")
    else:
        repository = args.repository or build(args.model, args.name or args.model.name, work)
        model = args.name or (args.model.name if args.model else streaming_model(repository))
        print(f"serving {repository} with machgen serve ...", flush=True)
        served = Served.start(repository, work)
    try:
        from machgen.client import MachgenClient

        with MachgenClient(served.url) as client:
            card = client.model_card(model) or {}
        streaming = card.get("family_settings", {}).get("streaming")
        if not streaming:
            raise SystemExit(f"--name: {model} has no streaming mode (realtime sessions)")
        defaults = card["defaults"]
        actions = sorted(streaming["actions"]) or ["stay"]
        fps = streaming.get("fps") or defaults["fps"]
        chunk_s = streaming["chunk_frames"] * card.get("family_settings", {}).get("temporal_factor", 4) / fps
        height, width = defaults["height"], defaults["width"]
        cold = settled(served, model, timeout_s=0, settle_s=3.0)  # before any session: the gauges are not there yet
        print("warm-up session ...", flush=True)
        warm_up(served, model, actions, height, width)
        baseline = settled(served, model, settle_s=args.settle_s)
        soak = Soak(args, served, model, actions, height, width, chunk_s)
        peaks: dict = {}
        timeline: list = []
        stop_watch = threading.Event()
        watcher = threading.Thread(target=soak.watch, args=(stop_watch, timeline, peaks), daemon=True)
        duration = args.minutes * 60
        print(f"{args.sessions} sessions of {model} for {duration:.0f} s, actions {', '.join(actions)}, "
              f"{args.kill} killed at {args.kill_at * duration:.0f} s ...", flush=True)
        soak.slots = [Slot(soak, index) for index in range(args.sessions)]
        soak.began = time.monotonic()
        watcher.start()
        if args.kill != "none":
            threading.Thread(target=killer, args=(soak, args.kill_at * duration), daemon=True).start()
        for slot in soak.slots:
            slot.start()
        soak.ending.wait(duration)
        soak.ending.set()
        joined_by = time.monotonic() + 2 * args.call_bound  # the last chunk read and the stop, each bounded
        for slot in soak.slots:
            slot.join(timeout=max(0.0, joined_by - time.monotonic()))
            if slot.is_alive():
                soak.tally.hangs.append({"slot": slot.index, "op": "slot did not finish", "at_s": soak.now(),
                                         "session": slot.live.record.session if slot.live else None})
        wall = time.monotonic() - soak.began
        stop_watch.set()
        watcher.join()
        for slot in soak.slots:
            slot.client.close()
        after = settled(served, model, settle_s=args.settle_s)
        recoveries = served.recoveries()
    finally:
        triton_log = served.keep_triton_log(work / "tritonserver.log")
        served.stop()
    if args.model:  # the repository built here (the logs stay beside it)
        shutil.rmtree(work / "repository", ignore_errors=True)
    print(f"logs: {served.log_file}" + (f", {triton_log}" if triton_log else ""), flush=True)
    # A server at --url is not this run's to stop: its processes stay.
    left = served.left_running() if served.process is not None else []
    shm = served.shm_left()
    result = summary(soak, baseline, cold, peaks, after, recoveries, left, shm, timeline, wall,
                     (round(load_start[0], 2), round(os.getloadavg()[0], 2)), str(args.model) if args.model else None)
    text = table(result)
    print()
    print(text)
    print()
    for name, ok in result["checks"].items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    grown = growth_by_model(result["memory"])
    if grown:
        print("  resident MB by model, baseline -> peak -> after: " + "; ".join(
            f"{name} {before:.0f} -> {peak:.0f} -> {after:.0f}" for name, before, peak, after in grown[:6]))
    for message in result["told_messages"][:5]:
        print(f"  told: {message}")
    for error, count in list(result["errors"].items())[:8]:
        print(f"  {count} x {error}")
    for line in result["supervisor_log"][:10]:
        print(f"  {line}")
    for crash in result["crashes"]:
        print(crash)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1, default=str))
    if args.record:
        when = time.strftime("%Y-%m-%d %H:%M")
        intro = (f"`perf/soak_realtime.py --model {args.model or model} --sessions {args.sessions} --minutes "
                 f"{args.minutes:g}`, {when}: {os.cpu_count()} CPU cores, load average {load_start[0]:.2f} at the "
                 f"start and {os.getloadavg()[0]:.2f} at the end.")
        record(args.record, f"{SECTION}:{model}", f"{intro}\n\n{text}", "Realtime soak (perf/soak_realtime.py)")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
