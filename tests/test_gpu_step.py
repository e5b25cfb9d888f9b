"""perf/gpu_step.py, the full-size step timing of perf/gpu_check.sh, run on
tiny configs on the CPU: every path of it that needs no CUDA (the torch
target's tracing and runner, the cache-reuse arithmetic, Wan with the
SparseAttention op), so the script is ready when a GPU is at hand."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.export
def test_gpu_step_script_runs_on_tiny_configs(tmp_path):
    table = tmp_path / "step.md"
    done = subprocess.run([sys.executable, str(ROOT / "perf" / "gpu_step.py"), "--scale", "tiny", "--device", "cpu",
                           "--repeats", "1", "--out", str(table)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line for line in table.read_text().splitlines() if line.startswith("| flux") or line.startswith("| wan")]
    assert not [row for row in rows if "FAILED" in row]
    what = [row.split("|")[2].strip() for row in rows]
    assert "torch target (head + tail), eager" in what
    assert any(w.startswith("28 steps, 10 computed") for w in what)
    assert any("SparseAttention" in w for w in what)
    for row in rows:
        assert float(row.split("|")[3]) > 0  # a time was measured
