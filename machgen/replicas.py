"""Several replicas of one model repository on one host, behind one address.

``machgen serve REPO --replicas N`` starts N tritonservers on loopback ports
of their own, each watched by its own Supervisor (machgen/supervisor.py),
and HAProxy in front of them on the ports a single server would take, so a
client sees one gRPC and one HTTP address (checked with HAProxy 2.6):

- gRPC is HTTP/2 cleartext end to end (``proto h2``); replicas are checked on
  Triton's HTTP readiness (``check-proto h1``: HTTP/2 checks time out).
- A replica that dies with requests in flight: a request whose answer had
  not begun (Triton answers only once a generation is done) is sent again to
  another replica (``retry-on``, ``option redispatch``); a stream that had
  begun fails UNAVAILABLE and the client retries it (machgen/client).
- A replica leaves the balancer before it stops: put in maintenance through
  HAProxy's runtime API (no new request), drained (those in flight finish),
  stopped. On SIGTERM Triton's gRPC side answers "Server is stopping" and
  NOT_FOUND inside HTTP 200 responses that no balancer retries; measured: 106
  failed requests through HAProxy without this order, 0 with it.
- ``rolling_restart`` does that to each replica in turn, starting it again
  and waiting until the balancer sees it ready before the next. It takes a
  replica out only while every other one serves: a replica that does not come
  back (its tritonserver fails to start: a rebuilt repository with a model
  that does not load, a port taken) is tried again with exponential backoff
  (``ReplicaSettings.retry_first_s`` doubling up to ``retry_max_s``, for as
  long as it takes), and the restart goes on to the next replica only once it
  is back in the balancer. The others serve meanwhile, still the version they
  ran: a restart that rolls out a broken build stops at its first replica.
  The replica's state is in ``status()`` (served at /status beside /metrics),
  ``machgen_replica_up`` and ``machgen_replica_start_failures_total``, and
  the log.

The balancer's configuration is rendered from deploy/haproxy/haproxy.cfg.template.
With ``prometheus_port`` a Prometheus scrapes the balancer, every replica and
the supervisors, with the rules of deploy/prometheus/rules.yaml.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import shutil
import socket
import string
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from machgen.server import START_ATTEMPTS, Ports, ServerError, TritonServer, spawn_tied_child
from machgen.supervisor import Supervisor, SupervisorSettings, metrics_text, serve_metrics

# deploy/ of the checkout, linked into the package (machgen/deploy) so that an installed machgen has it too.
DEPLOY_DIR = Path(__file__).resolve().parent / "deploy"
HAPROXY_TEMPLATE = DEPLOY_DIR / "haproxy" / "haproxy.cfg.template"
PROMETHEUS_RULES = DEPLOY_DIR / "prometheus" / "rules.yaml"
BACKENDS = ("grpc", "grpc_stream", "http")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free now: each socket is held until all are bound (one bound and closed at a
    time, the system can give the same port twice: seen, a replica's HTTP and metrics ports the same, and
    that tritonserver exited)."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in sockets]


def _tool(name: str, package: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise ServerError(f"{name} is not installed (Debian: apt-get install {package})")
    return found


def _wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise ServerError(f"{what} not within {timeout:.0f} s")
        time.sleep(interval)


def _terminate(process: subprocess.Popen | None) -> None:
    """SIGTERM, then SIGKILL after 10 s."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _answers(url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class Balancer:
    """An haproxy process on ``ports`` in front of replicas on ``replica_ports``."""

    def __init__(self, work_dir: Path, host: str, ports: Ports, replica_ports: list[Ports],
                 check_interval_ms: int = 500):
        self.work_dir = work_dir
        self.host = host
        self.ports = ports
        self.replica_ports = replica_ports
        self.check_interval_ms = check_interval_ms
        self.socket_path = work_dir / "haproxy.sock"
        self.config_file = work_dir / "haproxy.cfg"
        self.log_file = work_dir / "haproxy.log"
        self.process: subprocess.Popen | None = None

    def render(self) -> str:
        """The configuration: deploy/haproxy/haproxy.cfg.template with this balancer's settings."""
        text = string.Template(HAPROXY_TEMPLATE.read_text()).substitute(
            runtime_socket=self.socket_path, host=self.host, grpc_port=self.ports.grpc,
            http_port=self.ports.http, metrics_port=self.ports.metrics, check_interval_ms=self.check_interval_ms)
        grpc = [f"    server r{index} 127.0.0.1:{ports.grpc} proto h2 check port {ports.http} check-proto h1"
                for index, ports in enumerate(self.replica_ports)]
        servers = {"grpc": grpc, "grpc_stream": grpc,
                   "http": [f"    server r{index} 127.0.0.1:{ports.http} check"
                            for index, ports in enumerate(self.replica_ports)]}
        for backend, lines in servers.items():
            text = text.replace(f"@SERVERS:{backend}@", "\n".join(lines))
        return text

    def start(self, timeout: float = 30.0) -> "Balancer":
        binary = _tool("haproxy", "haproxy")
        self.config_file.write_text(self.render())
        checked = subprocess.run([binary, "-c", "-f", os.fspath(self.config_file)], capture_output=True,
                                 text=True)
        if checked.returncode != 0:
            raise ServerError(f"haproxy refused its configuration:\n{checked.stdout}{checked.stderr}")
        with open(self.log_file, "wb") as log:
            # -db: in the foreground, its messages on stderr; -W would fork a master.
            self.process = spawn_tied_child([binary, "-db", "-f", os.fspath(self.config_file)], stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        _wait_until(lambda: self.process.poll() is not None or self.socket_path.exists(), timeout, "haproxy up")
        if self.process.poll() is not None:
            raise ServerError(f"haproxy exited:\n{self.log_file.read_text(errors='replace')[-2000:]}")
        return self

    def command(self, line: str) -> str:
        """One command of HAProxy's runtime API, its answer."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(os.fspath(self.socket_path))
            sock.sendall(line.encode() + b"\n")
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode()

    def set_state(self, index: int, state: str) -> None:
        """Replica ``index`` in every backend to ``state``: "maint" (no new request) or "ready"."""
        for backend in BACKENDS:
            answer = self.command(f"set server {backend}_replicas/r{index} state {state}").strip()
            if answer:
                raise ServerError(f"haproxy: set server {backend}_replicas/r{index} state {state}: {answer}")

    def statuses(self) -> dict[tuple[str, int], str]:
        """(backend, replica) -> HAProxy's status of it: UP, DOWN, MAINT, ..."""
        table = self.command("show stat").lstrip("# ")
        statuses = {}
        for row in csv.DictReader(io.StringIO(table)):
            backend, server = row.get("pxname", ""), row.get("svname", "")
            if backend.endswith("_replicas") and server.startswith("r"):
                statuses[(backend.removesuffix("_replicas"), int(server[1:]))] = row["status"].split(" ")[0]
        return statuses

    def wait_up(self, index: int, timeout: float = 60.0) -> None:
        _wait_until(lambda: all(self.statuses().get((backend, index)) == "UP" for backend in BACKENDS), timeout,
                    f"replica {index} up in the balancer", interval=0.2)

    def stop(self) -> None:
        _terminate(self.process)


class PrometheusProcess:
    """A Prometheus on ``port`` scraping ``targets`` (job -> [(address, labels)]) every ``interval_s``."""

    def __init__(self, work_dir: Path, host: str, port: int, targets: dict[str, list[tuple[str, dict]]],
                 interval_s: float = 5.0):
        self.work_dir = work_dir
        self.url = f"http://{host}:{port}"
        self.host, self.port = host, port
        self.targets = targets
        self.interval_s = interval_s
        self.config_file = work_dir / "prometheus.yml"
        self.log_file = work_dir / "prometheus.log"
        self.process: subprocess.Popen | None = None

    def render(self) -> str:
        # YAML is a superset of JSON: the configuration needs no YAML writer.
        scrape_configs = [{"job_name": job, "scrape_interval": f"{self.interval_s:g}s",
                           "static_configs": [{"targets": [address], "labels": labels} for address, labels in found]}
                          for job, found in self.targets.items() if found]
        return json.dumps({"global": {"evaluation_interval": f"{self.interval_s:g}s"},
                           "rule_files": [os.fspath(PROMETHEUS_RULES)], "scrape_configs": scrape_configs}, indent=1)

    def start(self, timeout: float = 30.0) -> "PrometheusProcess":
        binary = _tool("prometheus", "prometheus")
        self.config_file.write_text(self.render())
        with open(self.log_file, "wb") as log:
            self.process = spawn_tied_child(
                [binary, f"--config.file={self.config_file}", f"--storage.tsdb.path={self.work_dir / 'data'}",
                 f"--web.listen-address={self.host}:{self.port}", "--storage.tsdb.retention.time=1d"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        _wait_until(lambda: self.process.poll() is not None or _answers(f"{self.url}/-/ready"), timeout,
                    "prometheus ready", interval=0.2)
        if self.process.poll() is not None:
            raise ServerError(f"prometheus exited:\n{self.log_file.read_text(errors='replace')[-2000:]}")
        return self

    def stop(self) -> None:
        _terminate(self.process)


@dataclass
class Replica:
    index: int
    ports: Ports
    server: TritonServer
    supervisor: Supervisor


STARTING, SERVING, RESTARTING, RETRYING = "starting", "serving", "restarting", "retrying"


@dataclass
class ReplicaStatus:
    """What machgen serve knows of one replica, kept across its restarts (a Replica is new at each)."""

    state: str = STARTING
    """starting; serving (in the balancer); restarting (a rolling restart took it out: drained, started
    again); retrying (its start failed: tried again at ``retry_at``)."""
    start_failures: int = 0
    """Starts that failed, in rolling restarts, since machgen serve started."""
    last_error: str = ""
    retry_at: float | None = None
    """time.monotonic() of the next try while retrying."""
    changed_at: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class ReplicaSettings:
    count: int = 2
    """Replicas (tritonservers) behind the balancer."""
    host: str = "127.0.0.1"
    """Where the balancer (and Prometheus) listen; the replicas listen on loopback only."""
    verbose: bool = False
    tritonserver: Path | None = None
    """An installed Triton's bin/tritonserver instead of the bundled one (machgen/server.py)."""
    check_interval_ms: int = 500
    """How often the balancer asks each replica whether it is ready."""
    retry_first_s: float = 1.0
    """A replica that failed to start in a rolling restart is tried again after this long, then after
    twice as long after each failure, up to ``retry_max_s``: a failure that passes (a port freed, a
    repository fixed) is over soon, one that lasts costs a start a minute, not a loop."""
    retry_max_s: float = 60.0


class ReplicaSet:
    """``settings.count`` supervised tritonservers on ``repository`` behind HAProxy on ``ports``."""

    def __init__(self, repository: Path, ports: Ports, settings: ReplicaSettings = ReplicaSettings(),
                 supervision: SupervisorSettings = SupervisorSettings(), log: Callable[[str], None] = print):
        self.repository = Path(repository)
        self.ports = ports
        self.settings = settings
        self.supervision = supervision
        self.log = log
        self._work = tempfile.TemporaryDirectory(prefix="machgen-replicas-")
        self.work_dir = Path(self._work.name)
        self.replicas: list[Replica] = []
        picked = iter(free_ports(3 * settings.count))
        replica_ports = [Ports(next(picked), next(picked), next(picked)) for _ in range(settings.count)]
        self.balancer = Balancer(self.work_dir, settings.host, ports, replica_ports, settings.check_interval_ms)
        self.prometheus: PrometheusProcess | None = None
        self.statuses = [ReplicaStatus() for _ in range(settings.count)]
        self.restarting: int | None = None  # the replica a rolling restart is at
        self._given_up = threading.Event()
        self._stopping = threading.Event()  # a drain began: a rolling restart leaves off
        self._lock = threading.Lock()  # one rolling restart at a time, never beside a drain

    def _new_replica(self, index: int, ports: Ports) -> Replica:
        # Triton must not give up on requests in flight before the drain does.
        server = TritonServer(self.repository, ports, verbose=self.settings.verbose,
                              exit_timeout_s=int(self.supervision.drain_timeout_s) + 60,
                              log_file=self.work_dir / f"replica-{index}.log",
                              tritonserver=self.settings.tritonserver)
        supervisor = Supervisor(server, self.supervision, log=lambda line: self.log(f"replica {index}: {line}"))
        return Replica(index, ports, server, supervisor)

    def _start_replica(self, replica: Replica) -> None:
        replica.server.start(attempts=START_ATTEMPTS)  # a start that wedges or aborts is made again
        self._supervise(replica)

    def _supervise(self, replica: Replica) -> None:
        replica.supervisor.start()
        threading.Thread(target=self._watch_given_up, args=(replica.supervisor,), daemon=True).start()
        self.log(f"replica {replica.index}: tritonserver pid {replica.server.process.pid} ready "
                 f"(HTTP {replica.server.http_url}, gRPC {replica.server.grpc_url})")

    def _set_state(self, index: int, state: str, **changes) -> None:
        status = self.statuses[index]
        status.state, status.changed_at = state, time.monotonic()
        for name, value in changes.items():
            setattr(status, name, value)

    def _watch_given_up(self, supervisor: Supervisor) -> None:
        if supervisor.wait():  # 0 after a drain of ours
            self._given_up.set()

    def start(self, prometheus_port: int | None = None, supervisor_metrics_port: int | None = None) -> "ReplicaSet":
        """Every replica (started side by side), then the balancer, which waits until it sees them ready."""
        self.replicas = [self._new_replica(index, ports)
                         for index, ports in enumerate(self.balancer.replica_ports)]
        errors: list[BaseException] = []

        def start(replica: Replica) -> None:
            try:
                self._start_replica(replica)
            except BaseException as err:  # noqa: BLE001 - reported below, after every start ended
                errors.append(err)

        threads = [threading.Thread(target=start, args=(replica,)) for replica in self.replicas]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        self.balancer.start()
        for replica in self.replicas:
            self.balancer.wait_up(replica.index)
            self._set_state(replica.index, SERVING)
        if prometheus_port:
            self.prometheus = PrometheusProcess(self.work_dir / "prometheus", self.settings.host, prometheus_port,
                                                self.scrape_targets(supervisor_metrics_port))
            self.prometheus.work_dir.mkdir()
            self.prometheus.start()
        return self

    def scrape_targets(self, supervisor_metrics_port: int | None) -> dict[str, list[tuple[str, dict]]]:
        """What Prometheus scrapes: each replica's Triton metrics (labelled by replica and, as the chart's
        ServiceMonitor labels them, machgen_role="triton"), the balancer's and the supervisors'."""
        host = self.settings.host if self.settings.host != "0.0.0.0" else "127.0.0.1"
        targets = {
            "triton": [(f"127.0.0.1:{replica.ports.metrics}",
                        {"replica": str(replica.index), "pod": f"replica-{replica.index}", "machgen_role": "triton"})
                       for replica in self.replicas],
            "haproxy": [(f"{host}:{self.ports.metrics}", {"machgen_role": "balancer"})],
        }
        if supervisor_metrics_port:
            targets["machgen-supervisor"] = [(f"{host}:{supervisor_metrics_port}", {"machgen_role": "supervisor"})]
        return targets

    def is_up(self, index: int) -> bool:
        """Replica ``index`` serves: in the balancer (not out for a restart, nor failing to start) and its
        tritonserver runs."""
        return (self.statuses[index].state == SERVING and index < len(self.replicas)
                and self.replicas[index].server.alive())

    def metrics_text(self) -> str:
        """The supervisors' counters and each replica's state, labelled by replica."""
        lines = ["# HELP machgen_replica_up 1 while the replica serves behind the balancer; 0 while it is out: "
                 "restarting, or failing to start and being tried again.",
                 "# TYPE machgen_replica_up gauge"]
        lines += [f'machgen_replica_up{{replica="{index}"}} {int(self.is_up(index))}'
                  for index in range(len(self.statuses))]
        lines += ["# HELP machgen_replica_start_failures_total Starts of the replica's tritonserver that failed in "
                  "rolling restarts (each is tried again, with backoff).",
                  "# TYPE machgen_replica_start_failures_total counter"]
        lines += [f'machgen_replica_start_failures_total{{replica="{index}"}} {status.start_failures}'
                  for index, status in enumerate(self.statuses)]
        supervisors = {(("replica", str(replica.index)),): replica.supervisor for replica in self.replicas}
        return metrics_text(supervisors) + "\n".join(lines) + "\n"

    def status(self) -> dict:
        """Each replica's state, as /status serves it (JSON)."""
        now = time.monotonic()
        replicas = []
        for index, status in enumerate(self.statuses):
            replica = self.replicas[index] if index < len(self.replicas) else None
            replicas.append({
                "replica": index, "state": status.state, "up": self.is_up(index),
                "since_s": round(now - status.changed_at, 1),
                "pid": replica.server.process.pid if replica and replica.server.alive() else None,
                "start_failures": status.start_failures, "last_error": status.last_error or None,
                "next_try_in_s": (round(max(0.0, status.retry_at - now), 1)
                                  if status.state == RETRYING and status.retry_at is not None else None)})
        return {"replicas": replicas, "rolling_restart": None if self.restarting is None
                else {"replica": self.restarting, "of": len(self.statuses)}}

    def serve_metrics(self, host: str, port: int):
        """/metrics (``metrics_text``) and /status (``status``, JSON) at http://HOST:PORT."""
        return serve_metrics(host, port, self.metrics_text, status=lambda: json.dumps(self.status(), indent=1))

    def wait(self) -> int:
        """Block until a replica's supervisor gives up (then 1): a replica that cannot be kept up is for the
        orchestrator to see, as with one server."""
        self._given_up.wait()
        return 1

    def rolling_restart(self) -> None:
        """Each replica in turn, once every other one serves: out of the balancer, drained (requests in flight
        finish), stopped, started again on the same ports (tried again with backoff until it starts), and back
        in the balancer once it answers ready there. Raises ServerError when a drain cut it short."""
        with self._lock:
            try:
                for index in range(len(self.replicas)):
                    self.restarting = index
                    self._wait_for_the_others(index)
                    self._restart(index)
            finally:
                self.restarting = None

    def _wait_for_the_others(self, index: int) -> None:
        """Until every replica but ``index`` is up in the balancer: one more out could leave none serving."""
        waiting_on = None
        while True:
            statuses = self.balancer.statuses()
            down = [other for other in range(len(self.replicas)) if other != index
                    and not all(statuses.get((backend, other)) == "UP" for backend in BACKENDS)]
            if not down:
                return
            if down != waiting_on:
                waiting_on = down
                self.log(f"replica {index}: the rolling restart waits: replica {', '.join(map(str, down))} "
                         "does not serve, and no replica is taken out while another is down")
            if self._stopping.wait(1.0):
                raise ServerError(f"stopping: the rolling restart left off before replica {index}")

    def _restart(self, index: int) -> None:
        replica = self.replicas[index]
        started = time.monotonic()
        self.log(f"replica {index}: restarting (rolling): out of the balancer, draining")
        self._set_state(index, RESTARTING)
        self.balancer.set_state(index, "maint")
        replica.supervisor.drain()
        fresh = self._new_replica(index, replica.ports)
        # In place before it starts: a drain meanwhile stops this one, not the old.
        self.replicas[index] = fresh
        delay, failed = self.settings.retry_first_s, 0
        while True:
            try:
                fresh.server.start()
                self.balancer.set_state(index, "ready")
                self.balancer.wait_up(index)
                break
            except ServerError as err:
                fresh.server.kill_process()  # what a start that failed late leaves (stubs, a server not ready)
                self.balancer.set_state(index, "maint")  # back in only once a start succeeded
                failed += 1
                self._set_state(index, RETRYING, start_failures=self.statuses[index].start_failures + 1,
                                last_error=str(err), retry_at=time.monotonic() + delay)
                self.log(f"replica {index}: did not start (try {failed}): {err}\n"
                         f"replica {index}: out of the balancer, trying again in {delay:.0f} s; the other replicas "
                         f"serve, and the rolling restart goes on only once replica {index} is back")
                if self._stopping.wait(delay):
                    raise ServerError(f"stopping: replica {index} had not started again") from None
                self._set_state(index, RESTARTING, retry_at=None)
                delay = min(delay * 2, self.settings.retry_max_s)
        self._supervise(fresh)
        self._set_state(index, SERVING, last_error="")
        self.log(f"replica {index}: back in the balancer ({time.monotonic() - started:.1f} s"
                 + (f", started on try {failed + 1}" if failed else "") + ")")

    def drain(self) -> None:
        """Stop: every replica out of the balancer and drained side by side, then the balancer."""
        self._stopping.set()  # a rolling restart waiting to try a replica again leaves off (and the lock)
        with self._lock:
            for replica in self.replicas:
                try:
                    self.balancer.set_state(replica.index, "maint")
                except (OSError, ServerError):  # a balancer that is gone takes no request anyway
                    pass
            threads = [threading.Thread(target=replica.supervisor.drain) for replica in self.replicas]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            self.balancer.stop()
            if self.prometheus is not None:
                self.prometheus.stop()
            self._work.cleanup()
