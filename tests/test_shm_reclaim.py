"""Shared memory given back when a pipeline is idle (issue 61): Triton's Python backend grows a stub's region in
/dev/shm when a message does not fit and never shrinks it; `machgen serve`'s supervisor loads a model whose
regions grew past --shm-reclaim-mb again (fresh stubs, fresh regions) once its whole pipeline has been idle for
the build's idle release time, and never while a realtime session is open in its sampler."""

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import build_tiny_repository, machgen_serve, wait_until, write_tiny_streaming

from machgen.client import MachgenClient

pytestmark = [pytest.mark.export, pytest.mark.integration]

NAME = "tiny-stream"
RECLAIM_MB = 4
IDLE_RELEASE_S = 1.0
# A clip this size is 7 MB of frames (uint8), more in float32 from the VAE's decoders: every region it crosses
# grows past RECLAIM_MB, in a second or two of the tiny model's compute.
BIG = {"height": 192, "width": 192, "num_frames": 65, "num_inference_steps": 2}
MB = 2**20


@pytest.fixture(scope="module")
def repository(tmp_path_factory) -> Path:
    """The streaming tests' tiny Wan (it serves text-to-video and realtime sessions) with room for big clips, its
    memory given back after IDLE_RELEASE_S idle."""
    model = write_tiny_streaming(tmp_path_factory)
    card = json.loads((model / "machgen.json").read_text())
    card["serving"].update(max_height=BIG["height"], max_width=BIG["width"], max_frames=BIG["num_frames"])
    (model / "machgen.json").write_text(json.dumps(card))
    return build_tiny_repository(tmp_path_factory, model, NAME, idle_release_s=IDLE_RELEASE_S)


@pytest.fixture(scope="module")
def served(repository):
    with machgen_serve(repository, "--shm-reclaim-mb", str(RECLAIM_MB), "--drain-timeout", "10") as server:
        yield server


def regions(served) -> dict[int, tuple[str, int, int]]:
    """The server's stubs' regions, read as the supervisor reads them (runtime/processes.py Stub): stub pid ->
    (its model, the region's bytes when the stub started, its bytes in /dev/shm now)."""
    import psutil

    from machgen.runtime.processes import stub_of

    (triton,) = [child for child in psutil.Process(served.process.pid).children() if child.name() == "tritonserver"]
    stubs = [stub for stub in map(stub_of, triton.children()) if stub is not None and stub.region is not None]
    return {stub.pid: (stub.model, stub.region_start_bytes, stub.region_bytes()) for stub in stubs
            if stub.region.exists()}


def growth(found: dict[int, tuple[str, int, int]]) -> dict[str, int]:
    """Each model's regions' growth in bytes, over its stubs."""
    grown: dict[str, int] = {}
    for model, start, now in found.values():
        grown[model] = grown.get(model, 0) + now - start
    return grown


def running(pids: set[int]) -> set[int]:
    """Those of ``pids`` whose process still runs (a zombie does not)."""
    from machgen.runtime.processes import process_running

    return {pid for pid in pids if process_running(pid)}


def reloads(served) -> list[str]:
    return re.findall(r"supervisor: (\S+)'s shared memory grew .* loading it again", served.output())


def test_grown_shared_memory_is_given_back_once_idle_and_never_while_a_session_is_open(served):
    started = time.monotonic()
    with MachgenClient(served.grpc_url) as client:
        assert max(growth(regions(served)).values()) == 0  # a fresh server's regions are their start size
        session = client.open_session(NAME, prompt="a red circle", seed=3, height=48, width=32, chunks=1)
        assert len(list(session)) == 1 and session.info["state"] == "open"
        # Big clips, plain and streamed (NAME and NAME_stream relay them), while the session stays open.
        plain = client.generate(NAME, "a red circle", seed=1, **BIG)
        streamed = client.generate(NAME, "a blue square", seed=2, on_progress=lambda progress: None, **BIG)
        grown_at = time.monotonic()
        before = regions(served)
        grown = {model: grew for model, grew in growth(before).items() if grew > RECLAIM_MB * MB}
        assert {NAME, f"{NAME}_stream", f"{NAME}_sampler"} <= set(grown), growth(before)
        old_stubs = {pid for pid, (model, _, _) in before.items() if model in grown}

        # Idle well past the idle release time, a session open: nothing is loaded again.
        time.sleep(max(0.0, grown_at + 4 * IDLE_RELEASE_S - time.monotonic()))
        assert reloads(served) == [], served.output()[-3000:]
        assert {pid for pid, (model, _, _) in regions(served).items() if model in grown} == old_stubs
        assert session.stop()["sessions"] == 0
        closed_at = time.monotonic()

        # The session closed: every grown model is loaded again, one after another, its regions back to their start.
        def given_back() -> bool:
            return not running(old_stubs) and all(growth(regions(served)).get(model, 0) < MB for model in grown)

        wait_until(given_back, timeout=60, what="the grown models loaded again")
        reclaimed_in = time.monotonic() - closed_at
        assert sorted(reloads(served)) == sorted(grown), served.output()[-3000:]
        after = regions(served)
        for model in grown:
            assert served.metric(f'machgen_shm_reclaims_total{{model="{model}"}}') == 1
        # The same output from the fresh stubs.
        assert np.array_equal(client.generate(NAME, "a red circle", seed=1, **BIG), plain)
        assert np.array_equal(client.generate(NAME, "a blue square", seed=2, on_progress=lambda progress: None,
                                              **BIG), streamed)
    mb = {model: round(grew / MB, 1) for model, grew in grown.items()}
    print(f"grown over their start (MB): {mb}; /dev/shm of the stubs {sum(r[2] for r in before.values()) / MB:.0f} "
          f"-> {sum(r[2] for r in after.values()) / MB:.0f} MB; given back {reclaimed_in:.1f} s after the session "
          f"closed; test {time.monotonic() - started:.1f} s")
