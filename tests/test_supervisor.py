"""The supervisor's decisions where a server dies at an awkward moment, on a stand-in for Triton whose process is
a real child process that really dies (tests/test_faults.py kills a real server, at whatever moment it lands)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from machgen.server import ServerError
from machgen.supervisor import Supervisor, SupervisorSettings


class ServerDyingMidCheck:
    """A server whose process is SIGKILLed while the supervisor asks for its models (between its look at the
    process and its look at the stubs): the control API then refuses the connection, as Triton's does."""

    def __init__(self, repository):
        self.model_repository = repository
        self.stop_file = repository / "stop"
        self.starts = 0
        self.process = self._process()

    @staticmethod
    def _process():
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])

    def alive(self) -> bool:
        return self.process.poll() is None

    def model_states(self) -> dict[str, str]:
        if self.starts == 0:
            self.process.kill()
            raise ServerError("/v2/repository/index: <urlopen error [Errno 111] Connection refused>")
        return {}

    def stubs(self) -> list:
        return []

    def log_tail(self, lines: int = 10) -> str:
        return ""

    def kill_process(self) -> None:
        self.process.kill()
        self.process.wait()

    kill = kill_process

    def start(self, attempts: int = 1) -> None:
        self.starts += 1
        self.process = self._process()


def test_a_server_that_dies_between_the_supervisors_looks_is_started_again(tmp_path):
    """Seen in a full run: the SIGKILL landed after the supervisor saw the process alive and before it asked for
    the models; the refused connection made it give up, and machgen serve exited with nothing serving."""
    server = ServerDyingMidCheck(tmp_path)
    lines: list[str] = []
    supervisor = Supervisor(server, SupervisorSettings(poll_interval_s=0.05), log=lines.append).start()
    try:
        deadline = time.monotonic() + 30
        while supervisor.server_restarts == 0 and supervisor.exit_code is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert supervisor.server_restarts == 1 and supervisor.exit_code is None, lines
        assert server.starts == 1 and server.alive()
        assert any("starting tritonserver again" in line for line in lines), lines
    finally:
        supervisor.drain(timeout_s=1)
    assert supervisor.wait() == 0 and not server.alive()


@pytest.mark.integration
def test_a_killed_machgen_serve_takes_its_tritonserver_and_stubs_with_it(built_repository):
    """machgen serve SIGKILLed (no drain can run): its tritonserver, in a session of its own, is killed by the
    kernel as its parent dies, and the Python stubs follow it; nothing of the server is left running."""
    import os
    import signal

    import psutil

    from conftest import ServeProcess, wait_until

    pytest.importorskip("tritonclient")
    served = ServeProcess(built_repository[0])
    try:
        (server,) = [child for child in psutil.Process(served.process.pid).children() if child.name() == "tritonserver"]
        left = [server, *server.children(recursive=True)]
        assert len(left) > 1, "no stub under the server"
        os.kill(served.process.pid, signal.SIGKILL)
        served.process.wait()
        wait_until(lambda: not any(process.is_running() and process.status() != psutil.STATUS_ZOMBIE
                                   for process in left), timeout=20, what="the server and its stubs gone")
    finally:
        served.stop()


def test_an_opening_session_is_published_first_and_refused_by_a_sampler_being_replaced(tmp_path, monkeypatch):
    """machgen serve loads an idle sampler again only when no sessions file is there, after writing the replacing
    file that names the old version's processes: an opening session publishes its file before it reads that one,
    so it is either seen by the supervisor or refused here (never opened on a version about to go)."""
    from machgen.contract.manifest import STOP_FILE_ENV, replacing_file, sessions_file
    from machgen.runtime.streaming.engine import SessionRefused
    from machgen.runtime.triton_models.sessions_open import SessionsOpen

    stop_file = tmp_path / "stop"
    monkeypatch.setenv(STOP_FILE_ENV, str(stop_file))
    published = Path(sessions_file(str(stop_file), "world", os.getpid()))
    sessions = SessionsOpen("world")
    seen_while_opening = []
    with sessions.opening(lambda: 1):
        seen_while_opening.append(published.exists())
    assert seen_while_opening == [True] and published.exists()  # one session open
    sessions.update(lambda: 0)
    assert not published.exists()
    replacing = Path(replacing_file(str(stop_file), "world_sampler"))
    replacing.write_text(f"{os.getpid() + 1}")  # another version's process: this one opens
    with sessions.opening(lambda: 1):
        pass
    sessions.update(lambda: 0)
    replacing.write_text(f"{os.getpid() - 1} {os.getpid()}")
    with pytest.raises(SessionRefused, match="being loaded again"):
        with sessions.opening(lambda: 0):
            pytest.fail("opened on a version being replaced")
    assert not published.exists()  # the refused opening leaves no sessions file
