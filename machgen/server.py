"""Start the tritonserver that the nvidia-pytriton wheel bundles.

The bundled server needs three things prepared (checked on these machines):
its Python-backend stub must match this interpreter's version (the wheel
ships one per version; we copy the right one into a backend folder), the
interpreter's own libpython must come first on LD_LIBRARY_PATH, and this
environment's ``bin`` must lead PATH so that the stub's embedded Python picks
up this virtual environment (and the installed machgen package).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


class ServerError(RuntimeError):
    pass


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
                 log_file: Path | None = None, verbose: bool = False):
        self.model_repository = Path(model_repository).resolve()
        self.ports = ports
        self.host = host
        self.verbose = verbose
        self._work = tempfile.TemporaryDirectory(prefix="machgen-triton-")
        # The Python backend's shared-memory regions (/dev/shm) of this server alone start with this.
        self.shm_prefix = f"machgen_{os.getpid()}_{os.path.basename(self._work.name)}_"
        self.log_file = log_file or Path(self._work.name) / "tritonserver.log"
        self.process: subprocess.Popen | None = None

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
            "--exit-timeout-secs=30",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]

    def start(self, timeout: float = 180.0) -> "TritonServer":
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} does not exist")
        server_dir = prepare_server_dir(Path(self._work.name))
        log = open(self.log_file, "wb")
        self.process = subprocess.Popen(self.command(server_dir), stdout=log, stderr=subprocess.STDOUT,
                                        env=server_environment(), start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"tritonserver exited with code {self.process.returncode}:\n{self.log_tail()}")
            # The metrics service starts last: a server whose metrics port is taken reports ready, then exits.
            if self.ready() and self._answers(f"http://{self.host}:{self.ports.metrics}/metrics"):
                return self
            time.sleep(0.25)
        self.stop()
        raise ServerError(f"tritonserver was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def ready(self) -> bool:
        return self._answers(f"http://{self.http_url}/v2/health/ready")

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

    def wait(self) -> int:
        assert self.process is not None
        return self.process.wait()

    def stop(self, timeout: float = 60.0) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._work.cleanup()

    def shm_regions(self) -> list[Path]:
        """This server's shared-memory regions that are there now."""
        return sorted(Path("/dev/shm").glob(f"{self.shm_prefix}*"))

    def kill(self) -> None:
        """Stop at once (SIGKILL to the server and its stubs), without
        Triton's second per model instance; its shared memory is removed."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        for region in self.shm_regions():
            region.unlink(missing_ok=True)
        self._work.cleanup()

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
