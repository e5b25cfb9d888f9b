"""perf/soak_realtime.py, the realtime sessions' soak (issue 61), in its short run on the streaming tests' tiny
model under `machgen serve`: four sessions opened, steered, forked and closed at random for 24 s, the sampler
SIGKILLed in the middle. The script's own invariants hold: no call hangs, every session alive at the kill is
told (an error, not silence), the caches and sessions back to 0, the server's memory back to its baseline, no
restart but the kill's, and every process it started gone."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_repository, write_tiny_streaming

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.export
@pytest.mark.integration
def test_a_short_soak_with_the_sampler_killed_keeps_every_invariant(tmp_path_factory, tmp_path):
    # Its components and sampler give back what their runs grew after 1 s idle (after its last session), within
    # the soak's settle of memory: the memory check below is of the released server.
    repository = build_tiny_repository(tmp_path_factory, write_tiny_streaming(tmp_path_factory), "tiny-stream",
                                       idle_release_s=1.0)
    out = tmp_path / "soak.json"
    done = subprocess.run([sys.executable, str(ROOT / "perf" / "soak_realtime.py"), "--repository", str(repository),
                           "--name", "tiny-stream", "--minutes", "0.4", "--sessions", "4", "--mean-life-s", "6",
                           "--seed", "0", "--settle-s", "5", "--out", str(out)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"})
    printed = done.stdout[-6000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed and done.returncode == 0, f"{failed}\n{printed}"
    # What the checks stand on: the soak did what it says.
    assert result["kill"]["target"] == "sampler" and result["kill"]["pids"], printed
    assert result["hangs"] == [] and result["lost"] == 0, printed
    assert len(result["kill"]["alive"]) >= 1 and result["told"] == len(result["kill"]["alive"]), printed
    assert set(result["told_statuses"]) <= {"StatusCode.UNAVAILABLE"}, result["told_messages"]
    assert result["recoveries"] == {"tiny-stream_sampler": 1.0}, printed
    assert result["chunks"] > 0 and result["sessions_opened"] > 4 and result["sessions_forked"] >= 1, printed
    assert result["key_presses"] >= 1
    memory = result["memory"]
    assert memory["peak"]["cache_bytes"] > 0 and memory["after"]["cache_bytes"] == 0
    assert memory["after"]["sessions"] == 0
    assert 0 < memory["after"]["rss_mb"] <= memory["baseline"]["rss_mb"] * (1 + memory["tolerance_percent"] / 100)
    assert result["processes_left"] == [] and result["shm_left"] == []
