"""perf/bench_realtime.py, the realtime sessions' benchmark (issue 60), in its
short run on the streaming tests' tiny model: every part runs and records its
tables, and its comparisons compare like with like (the cached chunk equals
diffusers' SkyReels-V2 recompute of the prefix, a fork's chunk the replay's)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in text.splitlines()
            if re.match(rf"\| {first_cell} \|", line)]


@pytest.mark.export
def test_bench_realtime_quick_run_records_every_part(tmp_path):
    results = tmp_path / "RESULTS.md"
    done = subprocess.run([sys.executable, str(ROOT / "perf" / "bench_realtime.py"), "--quick", "--random", "tiny",
                           "--record", str(results)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    text = results.read_text()
    assert "## Realtime sessions (perf/bench_realtime.py), random Wan, tiny size" in text
    assert "<!-- bench_realtime:random Wan, tiny size:begin -->" in text
    alone = table_rows(text, r"[\d.]+ \([\d.]+\)")
    assert len(alone) == 1 and float(alone[0][3]) > 0  # frames/s
    for sessions in ("1", "2"):
        modes = {row[1]: row for row in table_rows(text, sessions) if row[1] in ("batched", "separate")}
        assert set(modes) == {"batched", "separate"}
        assert float(modes["batched"][2]) > 0 and float(modes["separate"][2]) > 0
        assert float(modes["batched"][4]) == float(sessions)  # rows per denoiser call
        assert float(modes["separate"][4]) == 1.0
    (prefix,) = table_rows(text, "3")
    eager, onnx = (float(value) for value in prefix[-1].split(","))
    assert eager <= 1e-5 and onnx <= 1e-5  # the cached chunk against SkyReels-V2's recompute
    forks = table_rows(text, "(seed 99|action left)")
    assert [row[0] for row in forks] == ["seed 99", "action left"]
    for row in forks:
        assert float(row[-1]) == 0.0  # the fork's chunk against the replay's
        assert int(row[4].replace(",", "")) < int(row[5].replace(",", ""))  # the fork adds less memory
