"""perf/gpu_attention.py's check of the kernel on the trained model's
activations, run on the CPU under Triton's interpreter (conftest.py sets
it): what `perf/bench_attention.py --save-captured` writes (the step of
`perf/gpu_check.sh --prepare`) is what the GPU check reads."""

import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def test_captured_activations_reach_the_kernel_check(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "perf"))
    import gpu_attention

    path = tmp_path / "captured.pt"
    done = subprocess.run([sys.executable, str(ROOT / "perf" / "bench_attention.py"), "--save-captured", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    captured = torch.load(path)
    # shapes-flux at 128x128: 288 tokens, 32 of them text; 6 blocks x 2 passes (true CFG) in each of 3 steps
    assert captured["text_tokens"] == 32 and len(captured["calls"]) == 36
    assert all(x.shape == (1, 288, 4, 32) and x.dtype == torch.bfloat16 for call in captured["calls"] for x in call)

    # The interpreter rounds to float8 unlike the hardware (tests/test_tensorrt_plugin.py): fp32 only here.
    assert gpu_attention.captured_checks(path, device="cpu", precisions=("fp32",), limit=3) == []
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| shapes-flux")]
    assert len(rows) == 1 and "3 calls" in rows[0] and rows[0].endswith("| no |")
    assert gpu_attention.captured_checks(tmp_path / "absent.pt", device="cpu") == []
