"""Every documented example runs: each ```sh/bash/shell/console and ```python block of README.md and docs/*.md,
page by page, as a reader after `make install` runs it from the repository root (tests/doc_examples.py says
how: a scratch copy of the root, ports of the page's own, the servers a block leaves in the background kept
for the page's later blocks and stopped at its end). A block that needs a GPU, TensorRT, a container runtime
or a cluster is skipped, naming why; any other block that fails fails its page's test with the block, its
line and its output's tail. The last test reports how many ran and were skipped, and why."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import warnings
from pathlib import Path

import pytest
from conftest import free_port
from doc_examples import NEED_REASONS, Block, ExampleFailed, PageRun, PortMap, extract, prepared, scratch_root

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def page_name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def available_needs() -> set[str]:
    """The NEEDS this machine meets: a GPU where NVIDIA's driver is, TensorRT where it imports as well."""
    found = set()
    if os.path.exists("/dev/nvidiactl"):
        found.add("gpu")
        if importlib.util.find_spec("tensorrt") is not None:
            found.add("tensorrt")
    return found


RESULTS: dict = {}  # page -> its PageResult, for the report at the end
EXAMPLE_PAGES = [page for page in pages() if extract(page.read_text(), page_name(page))]


class DocumentedExamples(UserWarning):
    """The examples test's count, shown in pytest's warnings summary (also from an xdist worker)."""


@pytest.mark.parametrize("page", [pytest.param(page, id=page_name(page),
                                               marks=[pytest.mark.export, pytest.mark.integration])
                                  for page in EXAMPLE_PAGES])
def test_page_examples_run(page, tmp_path, session_export_cache):
    """``session_export_cache`` (conftest.py, in the environment the blocks inherit): a model that several pages
    build, or that the other tests built, is exported once in the session and copied from the cache after."""
    name = page_name(page)
    blocks = extract(page.read_text(), name)
    runs_make = any(re.search(r"^\s*make\b", block.code, re.M) for block in blocks)
    if runs_make and not (ROOT / ".venv" / ".installed").exists():
        pytest.fail("the page runs make, which would install into .venv: run `make install` first")
    root = scratch_root(ROOT, tmp_path / "root")
    with PageRun(name, root, tmp_path / "examples", PYTHON, free_port, available_needs()) as run:
        try:
            result = run.run(blocks)
        finally:
            RESULTS[name] = run.result
    shutil.rmtree(root, ignore_errors=True)  # a copy of the repository and what the page built; the logs stay
    print(f"{name}: {len(result.ran)} examples ran and {len(result.skipped)} skipped in {result.seconds:.0f} s "
          f"(the slowest: {', '.join(f'{where} {seconds:.0f} s' for where, seconds in slowest(result, 3))})")
    for where, why in result.skipped:
        print(f"  skipped {where}: {why}")
    for note in result.notes:
        print(f"  {note}")
    if not result.ran:
        pytest.skip(f"{name}: every example skipped: " + "; ".join(f"{w} {why}" for w, why in result.skipped))


def slowest(result, count: int) -> list[tuple[str, float]]:
    return sorted(result.block_seconds.items(), key=lambda item: -item[1])[:count]


# The fast tier: extraction, port substitution and the runner on a synthetic page (no export, no server of
# machgen's: a plain Python HTTP server plays one).

SYNTHETIC_PAGE = '''# A page

```sh
echo written > note.txt
export GREETING=hello
cd build
```

Some prose, then a transcript and a file layout that is not run:

```console
$ echo "$GREETING from $(basename "$PWD")" > seen.txt
this line is output
```

```text
.venv/bin/machgen serve model_repository
```

1. In a list:

   ```python
   import os
   assert open("seen.txt").read() == "hello from build\\n", open("seen.txt").read()
   assert os.environ["GREETING"] == "hello"
   ```

```sh
cat > serve.py <<'EOF'
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
http.server.ThreadingHTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler).serve_forever()
EOF
../.venv/bin/python serve.py --port 8080 &   # the page's later blocks find it serving
```

```python
import urllib.request
assert b"serve.py" in urllib.request.urlopen("http://127.0.0.1:8080/").read()
```

```sh
kubectl apply -f nowhere.yaml
```
'''


def synthetic_run(tmp_path: Path, page: str = "docs/synthetic.md") -> PageRun:
    root = tmp_path / "root"
    (root / "build").mkdir(parents=True)
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").symlink_to(sys.executable)
    return PageRun(page, root, tmp_path / "examples", Path(sys.executable), free_port)


def test_extraction_keeps_runnable_blocks_in_page_order_with_their_lines():
    blocks = extract(SYNTHETIC_PAGE, "docs/synthetic.md")
    assert [(block.kind, block.line) for block in blocks] == [
        ("sh", 4), ("sh", 12), ("python", 23), ("sh", 29), ("python", 38), ("sh", 43)]
    assert blocks[1].code.split("\n") == ['echo "$GREETING from $(basename "$PWD")" > seen.txt', ""]
    assert blocks[2].code.startswith("import os\nassert")  # dedented out of the list


def test_documented_ports_become_the_pages_own_and_defaults_are_spelled_out():
    taken = iter(range(20000, 20100))
    ports = PortMap(lambda: next(taken))
    block = Block("README.md", 1, "sh", (
        ".venv/bin/machgen serve model_repository &\n"
        ".venv/bin/machgen api --keys-file keys.txt \\\n    --webhook-secret s &\n"
        ".venv/bin/machgen generate --url 127.0.0.1:8001 --model shapes --steps 8000 --out x.png\n"
        "curl -s http://localhost:8080/v1/models\n"
        ".venv/bin/machgen-build train build/t --steps 8000 --vae-steps 3000\n"
        "make test   # everything\n"
        "kill -HUP <machgen serve's pid>; .venv/bin/machgen api-key keys.txt alice\n"))
    code, notes = prepared(block, ports)
    grpc, http, api = ports.port(8001), ports.port(8000), ports.port(8080)
    lines = code.splitlines()
    assert lines[0] == (f".venv/bin/machgen serve --http-port {http} --grpc-port {grpc} --metrics-port "
                        f"{ports.port(8002)} --supervisor-metrics-port {ports.port(8003)} model_repository &")
    assert lines[1] == f".venv/bin/machgen api --port {api} --triton 127.0.0.1:{grpc} --keys-file keys.txt \\"
    assert f"--url 127.0.0.1:{grpc} " in lines[3] and "--steps 8000" in lines[3]
    assert lines[4] == f"curl -s http://localhost:{api}/v1/models"
    assert lines[5] == ".venv/bin/machgen-build train build/t --steps 8000 --vae-steps 3000"
    assert lines[6] == ": not run here" and "make test" in notes[0]
    assert lines[7] == "kill -HUP <machgen serve's pid>; .venv/bin/machgen api-key keys.txt alice"
    assert ports.make_variables()["DEMO_GRPC"] == f"127.0.0.1:{grpc}"
    python = Block("docs/x.md", 1, "python", 'MachgenClient("127.0.0.1:8001")\nopenai.OpenAI(base_url='
                                            '"http://127.0.0.1:8080/v1")')
    assert prepared(python, ports)[0] == (f'MachgenClient("127.0.0.1:{grpc}")\n'
                                          f'openai.OpenAI(base_url="http://127.0.0.1:{api}/v1")')


def test_a_page_shares_files_variables_and_servers_and_leaves_no_process(tmp_path):
    with synthetic_run(tmp_path) as run:
        result = run.run(extract(SYNTHETIC_PAGE, run.page))
        server = run.ports.port(8080)
        assert len(run.processes()) == 1  # the background server, serving
    assert run.processes() == []
    assert result.ran == [f"docs/synthetic.md:{line}" for line in (4, 12, 23, 29, 38)]
    assert result.skipped == [("docs/synthetic.md:43", NEED_REASONS["cluster"])]
    import socket

    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", server)) != 0


def test_a_failing_block_fails_the_page_naming_its_line_and_output(tmp_path):
    page = "# Broken\n\n```sh\necho before\nsleep 300 &\nls no-such-file\necho after\n```\n\n```sh\necho never\n```\n"
    with synthetic_run(tmp_path, "docs/broken.md") as run:
        with pytest.raises(ExampleFailed) as failed:
            run.run(extract(page, run.page))
        assert run.processes()  # the background sleep, until the page ends
    assert run.processes() == []
    message = str(failed.value)
    assert "docs/broken.md:4 (sh) failed: exit status 2" in message
    assert "before" in message and "no-such-file" in message and "after\n" not in message.split("tail")[1]
    assert "example failed at line 6" in message
    assert run.result.ran == []


@pytest.mark.export
@pytest.mark.integration
def test_report_how_many_examples_ran():
    """Last in the module: the count of the pages run in this session (none when only this test was chosen),
    in pytest's warnings summary, which `make test` shows from its xdist workers too."""
    if not RESULTS:
        pytest.skip("no page of examples ran in this session")
    ran = sum(len(result.ran) for result in RESULTS.values())
    skipped = [(where, why) for result in RESULTS.values() for where, why in result.skipped]
    reasons: dict[str, list[str]] = {}
    for where, why in skipped:
        reasons.setdefault(why, []).append(where)
    report = "\n".join([
        f"documented examples: {ran} ran, {len(skipped)} skipped, in {len(RESULTS)} of {len(EXAMPLE_PAGES)} pages "
        f"({sum(result.seconds for result in RESULTS.values()):.0f} s)",
        *(f"  skipped, {why}: {', '.join(wheres)}" for why, wheres in reasons.items()),
        *(f"  {note}" for result in RESULTS.values() for note in result.notes)])
    print(report)
    warnings.warn(report, DocumentedExamples)
    assert ran > 0
