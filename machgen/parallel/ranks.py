"""The rank processes of a layout: spawned (never forked: a forked child
inherits the parent's threads and CUDA state), each joining one process
group and running a function with its ``RankMesh``.

The parent owns the rendezvous: a TCPStore it opens on a port the system
picks (port 0), so there is no free-port race to retry. Every rank process
is gone when ``run_on_ranks`` returns or raises: the ones still running
after a failure or the timeout are killed. Results come back as numpy
arrays (torch tensors would travel through shared memory that outlives a
killed rank).
"""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
from datetime import timedelta
from typing import Any, Sequence

from machgen.contract.manifest import load_object
from machgen.parallel.layout import ParallelLayout

# How long a rank waits for the others at the rendezvous and in a collective.
RENDEZVOUS_S = 120.0


# What a collective says when another rank has gone (gloo, NCCL).
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "NCCL communicator was aborted")


class RankError(RuntimeError):
    """A rank process failed, died or did not finish in time."""


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


def _rank_main(rank: int, layout: dict, store_port: int, backend: str, threads: int, target: str,
               args: Sequence[Any], results) -> None:
    import torch
    import torch.distributed as dist

    from machgen.parallel.mesh import RankMesh

    torch.set_num_threads(threads)
    mesh_layout = ParallelLayout.from_json(layout)
    try:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=RENDEZVOUS_S))
        dist.init_process_group(backend, store=store, rank=rank, world_size=mesh_layout.world_size,
                                timeout=timedelta(seconds=RENDEZVOUS_S))
        try:
            value = load_object(target)(RankMesh(mesh_layout, rank), *args)
            results.put((rank, "ok", _portable(value)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        results.put((rank, "error", traceback.format_exc()))


def run_on_ranks(layout: ParallelLayout, target: str, *args: Any, backend: str = "gloo", threads: int = 1,
                 timeout: float = 300.0) -> list[Any]:
    """``target(mesh, *args)`` (a "module:function") on each rank of
    ``layout``, in its own spawned process; the results in rank order."""
    import torch.distributed as dist

    context = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, world_size=None, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=RENDEZVOUS_S))
    results = context.Queue()
    processes = [context.Process(target=_rank_main, name=f"machgen-rank-{rank}", daemon=True,
                                 args=(rank, layout.to_json(), store.port, backend, threads, target, args, results))
                 for rank in range(layout.world_size)]
    values: dict[int, Any] = {}
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        while len(values) < len(processes):
            try:
                rank, outcome, value = results.get(timeout=0.2)
            except queue.Empty:
                dead = [p for index, p in enumerate(processes) if index not in values and p.exitcode not in
                        (None, 0)]
                if dead:
                    raise RankError(f"rank process {dead[0].name} died (exit code {dead[0].exitcode})") from None
                if time.monotonic() > deadline:
                    raise RankError(f"the ranks did not finish within {timeout:.0f} s") from None
                continue
            if outcome == "error":
                raise RankError(_failures(results, {rank: value}))
            values[rank] = value
        return [values[rank] for rank in range(len(processes))]
    finally:
        _stop(processes)
        results.close()
        del store


def _failures(results, failed: dict[int, str], grace: float = 2.0) -> str:
    """Every rank's failure reported within ``grace`` of the first, the cause first: a rank whose peer
    failed fails too, in its next collective, and its report can come first."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            rank, outcome, value = results.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            break
        if outcome == "error":
            failed[rank] = value
    ordered = sorted(failed.items(), key=lambda item: (any(mark in item[1] for mark in _PEER_LOST), item[0]))
    return "\n".join(f"rank {rank} failed:\n{report}" for rank, report in ordered)


def _stop(processes, grace: float = 5.0) -> None:
    """Every process ended: joined when it ends by itself, else killed."""
    deadline = time.monotonic() + grace
    for process in processes:
        if process.pid is not None:
            process.join(timeout=max(deadline - time.monotonic(), 0))
    for process in processes:
        if process.pid is not None and process.is_alive():
            process.kill()
            process.join()
