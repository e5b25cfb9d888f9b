"""What the perf/ scripts share: free ports and recording tables into RESULTS.md."""

from __future__ import annotations

import re
import socket
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def record(path: Path, section: str, table: str, title: str) -> None:
    """Put ``table`` between the section's markers in ``path``, appending
    the section (titled ``title, <model>``) when it is not there yet."""
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    text = path.read_text() if path.exists() else "# Results\n"
    block = f"{begin}\n{table}\n{end}"
    if begin in text:
        text = text[:text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + f"\n\n## {title}, {section.split(':')[1]}\n\n{block}\n"
    path.write_text(text)


def public_instances(repository: Path, name: str) -> int:
    """Instances of the served model ``name``. Each one's first request pays
    first-call costs (torch, ONNX Runtime allocations), and Triton hands
    sequential requests to the instances in turn, so a benchmark warms up
    with a few rounds of this many requests."""
    config = (Path(repository) / name / "config.pbtxt").read_text()
    return int(re.search(r"count: (\d+)", config).group(1))
