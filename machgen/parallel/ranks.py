"""The rank processes of a layout, each joining one process group and
serving calls with its ``RankMesh``. They are forked from a forkserver: a
clean interpreter spawned once per owning process (never the owner itself,
whose threads and CUDA state a forked child would inherit), which has
imported what every rank needs (torch, torch.distributed, the program
loader). A rank so starts in tens of milliseconds instead of the seconds
a fresh interpreter takes to import torch, which counts where a layout is
loaded again after a rank died. The forkserver ends with its owner, and a
rank with the forkserver.

The parent owns the rendezvous: a TCPStore it opens on a port the system
picks (port 0), so there is no free-port race to retry. A ``RankPool``'s
ranks are gone once it is stopped, and a rank that dies fails the call in
flight at once (the others, blocked in a collective with it, are killed).
Values come back as numpy arrays (torch tensors would travel through shared
memory that outlives a killed rank). What the parent and a rank say to each
other is typed: the parent sends its handler's messages and ``Stop``; a
rank answers ``Ready`` once, then ``Answer`` or ``Failed`` to each message.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import shutil
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

from machgen.contract.manifest import load_object
from machgen.parallel.layout import ParallelLayout

# How long a rank waits for the others at the rendezvous.
RENDEZVOUS_S = 120.0
# How long a collective waits for a peer: a slow step (a long video on CPU ranks) must not fail the others;
# a rank that died is found by the parent at once (its process sentinel), which stops them all.
COLLECTIVE_S = 1800.0
# What every rank imports, imported once by the forkserver the ranks are forked from (none of it starts a
# thread or touches CUDA). The program loader's serde module alone takes a second.
_RANK_IMPORTS = ("torch", "torch.distributed", "torch._export.serde.serialize", "machgen.parallel.mesh",
                 "machgen.parallel.rank_programs", "machgen.runtime.torch_runner")
# What a collective says when another rank has gone (gloo, NCCL).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "NCCL communicator was aborted")


class RankError(RuntimeError):
    """A rank process failed, died or did not answer in time."""


@dataclass(frozen=True)
class Stop:
    """The parent's last message: the rank leaves its group and ends."""


@dataclass(frozen=True)
class Ready:
    """A rank joined its group and made its handler."""


@dataclass(frozen=True)
class Answer:
    """What a rank's handler returned for a message (torch tensors as numpy arrays)."""

    value: Any


@dataclass(frozen=True)
class Failed:
    """A rank could not start, or its handler raised: the traceback."""

    report: str


@dataclass(frozen=True)
class Call:
    """``target(mesh, *args)`` ("module:function"), once (run_on_ranks)."""

    target: str
    args: tuple


def _portable(value: Any) -> Any:
    """``value`` with torch tensors as numpy arrays (in tuples, lists and dicts too)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(item) for item in value)
    if isinstance(value, dict):
        return {key: _portable(item) for key, item in value.items()}
    return value


def _end_with_parent() -> None:
    """SIGKILL this rank when the process that started it ends (Linux): a Triton stub killed or stopped
    without its finalize leaves no rank behind, whatever the rank is waiting in."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _rank_main(rank: int, layout: dict, store_port: int, backend: str, threads: int, target: str,
               args: Sequence[Any], connection) -> None:
    """A rank process: join the group, make the handler (``target(mesh, *args)``), answer each message."""
    import torch
    import torch.distributed as dist

    from machgen.parallel.mesh import RankMesh

    _end_with_parent()
    _name_process(f"machgen-rank-{rank}")
    torch.set_num_threads(threads)
    mesh_layout = ParallelLayout.from_json(layout)
    if backend == "nccl":  # NCCL's communicators use the current device: rank r's GPU is cuda:r
        torch.cuda.set_device(rank % torch.cuda.device_count())
    try:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=RENDEZVOUS_S))
        dist.init_process_group(backend, store=store, rank=rank, world_size=mesh_layout.world_size,
                                timeout=timedelta(seconds=COLLECTIVE_S))
        handler: Callable[[Any], Any] = load_object(target)(RankMesh(mesh_layout, rank), *args)
    except BaseException:  # noqa: BLE001 - the parent reports it
        connection.send(Failed(traceback.format_exc()))
        return
    connection.send(Ready())
    try:
        while not isinstance(message := connection.recv(), Stop):
            try:
                connection.send(Answer(_portable(handler(message))))
            except BaseException:  # noqa: BLE001 - the parent reports it
                connection.send(Failed(traceback.format_exc()))
    except EOFError:  # the parent has gone
        pass
    finally:
        dist.destroy_process_group()


def _name_process(name: str) -> None:
    """The process's name as ``ps`` and psutil show it (Linux; 15 characters): a rank is told from its
    forkserver, whose command line it shares."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15])  # PR_SET_NAME


def _rank_context():
    """The multiprocessing context ranks start in: the forkserver, started with this environment's Python
    and ``_RANK_IMPORTS`` (settings that only the first start in a process takes)."""
    context = multiprocessing.get_context("forkserver")
    context.set_executable(_python())
    context.set_forkserver_preload(list(_RANK_IMPORTS))
    return context


def _python() -> str:
    """The interpreter rank processes start with: this one, or inside Triton's Python backend stub (whose
    executable is the stub) the first python3 on PATH (machgen serve puts the environment's first)."""
    if Path(sys.executable or "").name.startswith("python"):
        return sys.executable
    found = shutil.which("python3") or shutil.which("python")
    if found is None:
        raise RankError(f"no python interpreter on PATH to start rank processes with ({sys.executable!r} is not)")
    return found


class RankPool:
    """The ranks of ``layout``, each running ``target(mesh, *args)`` (a
    "module:function" returning the handler of its messages) in its own
    process; ``call(message)`` gives every rank the message and returns
    their answers in rank order."""

    def __init__(self, layout: ParallelLayout, target: str, *args: Any, backend: str = "gloo", threads: int = 1,
                 start_timeout: float = 300.0):
        import torch.distributed as dist

        self.layout = layout
        # One call at a time: every rank must see the messages in one order, or their collectives mismatch.
        # Reentrant: a caller holds it around its call to keep what it prepared for the ranks in that order.
        self.calling = threading.RLock()
        context = _rank_context()
        self._store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=RENDEZVOUS_S))
        self._connections, self._processes = [], []
        for rank in range(layout.world_size):
            parent, child = context.Pipe()
            process = context.Process(target=_rank_main, name=f"machgen-rank-{rank}", daemon=True,
                                      args=(rank, layout.to_json(), self._store.port, backend, threads, target,
                                            args, child))
            self._connections.append(parent)
            self._processes.append(process)
        try:
            for process in self._processes:
                process.start()
            self._answers(Ready, start_timeout)
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def alive(self) -> bool:
        return bool(self._processes) and all(process.is_alive() for process in self._processes)

    def call(self, message: Any, timeout: float | None = None) -> list[Any]:
        """Every rank's answer to ``message``. A rank that fails or dies fails the call (RankError); one that
        died leaves the pool unusable (every rank stopped)."""
        with self.calling:
            if not self.alive():
                raise RankError(f"the ranks of {self.layout} are not running")
            for connection in self._connections:
                connection.send(message)
            return self._answers(Answer, timeout)

    def _answers(self, expected: type, timeout: float | None) -> list[Any]:
        """Every rank's reply (``expected``: Ready or Answer), its value in rank order."""
        deadline = None if timeout is None else time.monotonic() + timeout
        answers: dict[int, Any] = {}
        failed: dict[int, str] = {}
        waiting = dict(enumerate(self._connections))
        while waiting:
            left = None if deadline is None else max(deadline - time.monotonic(), 0)
            sentinels = {self._processes[rank].sentinel: rank for rank in waiting}
            ready = multiprocessing.connection.wait([*waiting.values(), *sentinels], timeout=left)
            if not ready:
                self.stop()
                raise RankError(f"ranks {sorted(waiting)} did not answer within {timeout:.0f} s")
            for item in ready:
                if item in sentinels:
                    rank = sentinels[item]
                    if waiting.get(rank) is not None and waiting[rank].poll():
                        continue  # its last answer is still to be read
                    self._died(rank, failed)
                rank = next(rank for rank, connection in waiting.items() if connection is item)
                try:
                    reply = item.recv()
                except (EOFError, OSError):  # its end of the pipe closed: it died (its sentinel can come later)
                    self._died(rank, failed)
                del waiting[rank]
                if isinstance(reply, Failed):
                    failed[rank] = reply.report
                    if expected is Ready:  # it will not serve: the others would wait for it forever
                        break
                else:
                    answers[rank] = reply.value if isinstance(reply, Answer) else None
            if failed and (expected is Ready or any(_is_cause(report) for report in failed.values())):
                self._collect(failed, waiting, grace=2.0)
                if waiting or expected is Ready:  # a rank still in a collective with the failed one: stuck
                    self.stop()
                raise RankError(_report(failed))
        if failed:
            raise RankError(_report(failed))
        return [answers[rank] for rank in range(len(self._connections))]

    def _died(self, rank: int, failed: dict[int, str]) -> None:
        """Raise RankError for ``rank``'s death, every rank stopped (those in a collective with it would wait
        for it until their timeout)."""
        self._processes[rank].join(timeout=1.0)
        code = self._processes[rank].exitcode
        self.stop()
        raise RankError(f"rank {rank} died (exit code {code})" + (f"; before it:\n{_report(failed)}" if failed else ""))

    def _collect(self, failed: dict[int, str], waiting: dict, grace: float) -> None:
        """The other ranks' answers within ``grace``, their failures into ``failed`` (a rank whose peer
        failed fails too); those that answered leave ``waiting``."""
        deadline = time.monotonic() + grace
        for rank, connection in list(waiting.items()):
            if connection.poll(max(deadline - time.monotonic(), 0)):
                reply = connection.recv()
                del waiting[rank]
                if isinstance(reply, Failed):
                    failed[rank] = reply.report

    def stop(self, grace: float = 5.0) -> None:
        """Every rank ended: asked to stop, then killed after ``grace``."""
        for connection in self._connections:
            try:
                connection.send(Stop())
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + grace
        for process in self._processes:
            if process.pid is not None:
                process.join(timeout=max(deadline - time.monotonic(), 0))
        for process in self._processes:
            if process.pid is not None and process.is_alive():
                process.kill()
                process.join()
        for connection in self._connections:
            connection.close()
        self._processes, self._connections = [], []

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _is_cause(report: str) -> bool:
    return not any(mark in report for mark in _PEER_LOST)


def _report(failed: dict[int, str]) -> str:
    """Every failed rank's report, the cause first: a rank whose peer failed fails too, in its next
    collective, and its report can come first."""
    ordered = sorted(failed.items(), key=lambda item: (not _is_cause(item[1]), item[0]))
    return "\n".join(f"rank {rank} failed:\n{report}" for rank, report in ordered)


def _calls(mesh) -> Callable[[Call], Any]:
    return lambda call: load_object(call.target)(mesh, *call.args)


def run_on_ranks(layout: ParallelLayout, target: str, *args: Any, backend: str = "gloo", threads: int = 1,
                 timeout: float = 300.0) -> list[Any]:
    """``target(mesh, *args)`` (a "module:function") once on each rank of
    ``layout``, each in its own process; the results in rank order.
    Every rank process is gone when it returns or raises."""
    with RankPool(layout, "machgen.parallel.ranks:_calls", backend=backend, threads=threads,
                  start_timeout=timeout) as pool:
        return pool.call(Call(target, args), timeout=timeout)
