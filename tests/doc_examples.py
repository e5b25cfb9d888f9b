"""The documented examples as a reader runs them: every ```sh (bash, shell, console) and ```python block of a
Markdown page, in page order, in a scratch copy of the repository, on ports of their own.

A page's blocks share what a reader's terminal shares: files, the current folder, shell variables (exported
ones reach the Python blocks) and the servers a block started in the background (``... &``), which the next
block finds ready. Every process a page started is stopped when the page ends (see ``PageRun``).
Used by tests/test_examples.py."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import textwrap
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

RUN_TAGS = {"sh": "sh", "bash": "sh", "shell": "sh", "console": "sh", "python": "python"}
FENCE = re.compile(r"^[ \t]*(?P<fence>`{3,}|~{3,})[ \t]*(?P<tag>[^\s`{]*)")
# The addresses the docs use (README, docs/): loopback, Triton's 8000 HTTP, 8001 gRPC, 8002 metrics, 8003 the
# supervisor's metrics, 8080 the API. A port number in one of these places is the page's, and gets a free one.
PORT = re.compile(r"(?:\b(?:127\.0\.0\.1|localhost|0\.0\.0\.0):|://[\w.-]+:|--[\w-]*port[ =])(?P<port>\d{4,5})\b")
# Options a command listens or calls on when the page does not give them: their documented defaults, spelled
# out so that they get the page's ports too (a reader's shell has nothing else on them).
DEFAULT_ADDRESSES = {
    "serve": {"--http-port": "8000", "--grpc-port": "8001", "--metrics-port": "8002",
              "--supervisor-metrics-port": "8003"},
    "api": {"--port": "8080", "--triton": "127.0.0.1:8001"},
    "generate": {"--url": "127.0.0.1:8001"},
    "inputs": {"--url": "127.0.0.1:8001"},
}


def machgen_command(subcommand: str) -> re.Pattern:
    """``machgen SUBCOMMAND`` where a command starts (``.venv/bin/machgen serve``; not ``<machgen serve's pid>``)."""
    return re.compile(rf"(?:^|(?<=[\s;&|(/]))machgen[ \t]+{subcommand}(?=[ \t]|$)", re.M)


# `make demo`'s addresses are make variables (Makefile: DEMO_PORTS, DEMO_GRPC), set from the environment.
MAKE_DEMO_PORTS = "--http-port 8000 --grpc-port 8001 --metrics-port 8002 --supervisor-metrics-port 8003"
MAKE_DEMO_GRPC = "127.0.0.1:8001"
# What a block needs that this machine may lack: (pattern over its code, what it needs). Checked in order.
NEEDS = (
    (re.compile(r"\bdocker[ \t]+(?:run|build)\b|--gpus\b"), "docker"),
    (re.compile(r"\b(?:kubectl|helm)[ \t]+\w"), "cluster"),
    (re.compile(r"--target[ =]tensorrt\b|\bimport tensorrt\b"), "tensorrt"),
    (re.compile(r"--device[ =]cuda\b|\bperf/gpu_|\bnvidia-smi\b|[\"']cuda(?::\d+)?[\"']"), "gpu"),
)
NEED_REASONS = {
    "docker": "builds or runs a container image (Docker with NVIDIA's runtime): containers cannot run here",
    "cluster": "talks to a Kubernetes cluster (kubectl, helm): none here",
    "tensorrt": "needs TensorRT and an NVIDIA GPU",
    "gpu": "needs an NVIDIA GPU (CUDA)",
}
# Commands not run inside a block: the suite this test belongs to would run itself.
NOT_RUN = ((re.compile(r"^([ \t]*)make[ \t]+test(?:-fast)?\b.*$", re.M),
            "runs the test suite that this test is part of"),)
BLOCK_TIMEOUT_S = float(os.environ.get("MACHGEN_EXAMPLE_TIMEOUT_S", 900))
SERVER_READY_S = 420.0
STOP_GRACE_S = 60.0
# Marks every process a page starts (it reaches those that start sessions of their own: tritonserver, HAProxy).
MARK_ENV = "MACHGEN_EXAMPLES_PAGE"
# The test run's own settings that a reader's shell does not have.
NOT_A_READERS = ("PYTEST_CURRENT_TEST", "PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT",
                 "PYTEST_XDIST_TESTRUNUID", "TRITON_INTERPRET", "MACHGEN_TEST_TIER")


@dataclass
class Block:
    page: str
    line: int  # of its first code line in the page (1-based)
    kind: str  # "sh" or "python"
    code: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def extract(text: str, page: str) -> list[Block]:
    """The runnable fenced blocks of a Markdown page, in page order (an indented fence, in a list, dedented)."""
    blocks, lines, index = [], text.splitlines(), 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        index += 1
        if not opening:
            continue
        fence, body, first = opening["fence"], [], index
        while index < len(lines) and not (lines[index].strip().startswith(fence)
                                          and set(lines[index].strip()) == {fence[0]}
                                          and len(lines[index].strip()) >= len(fence)):
            body.append(lines[index])
            index += 1
        index += 1  # the closing fence
        tag = opening["tag"].lower()
        if tag in RUN_TAGS:
            code = textwrap.dedent("\n".join(body))
            if tag == "console":
                code = console_commands(code)
            blocks.append(Block(page, first + 1, RUN_TAGS[tag], code))
    return blocks


def console_commands(code: str) -> str:
    """A console transcript's commands (``$ `` lines and their continuations), its output lines blanked
    (kept as empty lines, so that line numbers stay the page's); a block without prompts is all commands."""
    lines = code.splitlines()
    if not any(line.startswith("$ ") for line in lines):
        return code
    kept, continued = [], False
    for line in lines:
        if line.startswith("$ ") or continued:
            kept.append(line[2:] if line.startswith("$ ") and not continued else line)
            continued = line.endswith("\\")
        else:
            kept.append("")
    return "\n".join(kept)


def without_comments(code: str) -> str:
    """Shell or Python code without its ``#`` comments (roughly: a ``#`` at a line's start or after a blank)."""
    return re.sub(r"(^|[ \t])#.*$", r"\1", code, flags=re.M)


def needs(block: Block) -> str | None:
    """What of NEEDS the block uses, or None."""
    code = without_comments(block.code)
    return next((need for pattern, need in NEEDS if pattern.search(code)), None)


def command_end(code: str, start: int) -> int:
    """Where the shell command at ``start`` ends: its line's end, continuation lines included."""
    end = start
    while True:
        newline = code.find("\n", end)
        if newline == -1:
            return len(code)
        if code[newline - 1] != "\\":
            return newline
        end = newline + 1


def with_default_addresses(code: str) -> str:
    """Each machgen command that listens or calls with an address the block leaves at its default gets that
    default written out (DEFAULT_ADDRESSES), so that the page's port substitution reaches it."""
    for subcommand, defaults in DEFAULT_ADDRESSES.items():
        pieces, done = [], 0
        for found in machgen_command(subcommand).finditer(code):
            command = code[found.start():command_end(code, found.start())]
            added = "".join(f" {option} {value}" for option, value in defaults.items()
                            if not re.search(rf"{re.escape(option)}[ =]", command))
            pieces += [code[done:found.end()], added]
            done = found.end()
        code = "".join(pieces) + code[done:]
    return code


class PortMap:
    """A page's documented ports -> free ports of its own, the same one for each mention on the page."""

    def __init__(self, free_port):
        self.free_port, self.ports = free_port, {}

    def port(self, documented: str | int) -> int:
        if int(documented) not in self.ports:
            self.ports[int(documented)] = self.free_port()
        return self.ports[int(documented)]

    def substitute(self, code: str) -> str:
        return PORT.sub(lambda found: found[0][:found.start("port") - found.start()] + str(self.port(found["port"])),
                        code)

    def make_variables(self) -> dict[str, str]:
        """The Makefile's demo addresses (DEMO_PORTS, DEMO_GRPC) on the page's ports."""
        return {"DEMO_PORTS": self.substitute(MAKE_DEMO_PORTS), "DEMO_GRPC": self.substitute(MAKE_DEMO_GRPC)}


def prepared(block: Block, ports: PortMap) -> tuple[str, list[str]]:
    """The block's code as it runs here (defaults spelled out, the page's ports, NOT_RUN commands left out),
    and a note for each command left out."""
    code, notes = block.code, []
    if block.kind == "sh":
        code = with_default_addresses(code)
        for pattern, why in NOT_RUN:
            for found in pattern.finditer(code):
                notes.append(f"{block.where}: `{found[0].strip()}` not run: {why}")
            code = pattern.sub(lambda found: f"{found[1]}: not run here", code)
    return ports.substitute(code), notes


def background_commands(code: str) -> list[str]:
    """The commands a shell block leaves running (``... &``), continuation lines joined."""
    commands, start = [], 0
    while start < len(code):
        end = command_end(code, start)
        command = without_comments(code[start:end]).replace("\\\n", " ").strip()
        if re.search(r"(?<![&|>])&$", command):
            commands.append(command[:-1].strip())
        start = end + 1
    return commands


def readiness_checks(command: str) -> list[str]:
    """What shows that a background command serves: Triton's ready URL, the API's health URL, else each port
    it names accepting connections ("tcp:PORT")."""
    def option(name):
        found = re.search(rf"{name}[ =](\d+)", command)
        return found[1] if found else None

    if machgen_command("serve").search(command):
        checks = [f"http://127.0.0.1:{option('--http-port')}/v2/health/ready"]
        return checks + ([f"http://127.0.0.1:{option('--api-port')}/health"] if option("--api-port") else [])
    if machgen_command("api").search(command):
        return [f"http://127.0.0.1:{option('--port')}/health"]
    return [f"tcp:{port}" for port in PORT.findall(command)]


def answers(check: str) -> bool:
    if check.startswith("tcp:"):
        with socket.socket() as sock:
            sock.settimeout(2)
            return sock.connect_ex(("127.0.0.1", int(check[4:]))) == 0
    try:
        with urllib.request.urlopen(check, timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


# Runs one block in bash: the page's shell state (variables, folder) read before and, for a shell block,
# written after; `set -e`; the failing line named (block files are padded so that their lines are the page's).
RUNNER = r"""
__state=$1 __kind=$2 __block=$3 __python=$4
set --
declare -A __initial
for __name in $(compgen -v); do __initial[$__name]=$(declare -p "$__name" 2>/dev/null); done
if [ -f "$__state" ]; then source "$__state"; fi
__save_state() {
    local __name __declared
    for __name in $(compgen -v); do
        case $__name in
            __*|BASH*|FUNCNAME|LINENO|RANDOM|SRANDOM|SECONDS|EPOCH*|PIPESTATUS|_|SHLVL) continue;;
            PWD|OLDPWD|PPID|UID|EUID|GROUPS|HISTCMD|SHELLOPTS|COLUMNS|LINES|DIRSTACK|OPTIND|OPTARG|COMP_*) continue;;
        esac
        __declared=$(declare -p "$__name" 2>/dev/null) || continue
        [[ "${__initial[$__name]-}" == "$__declared" ]] || printf '%s\n' "$__declared"
    done > "$__state.new"
    printf 'cd %q\n' "$PWD" >> "$__state.new"
    mv "$__state.new" "$__state"
}
if [ "$__kind" = python ]; then
    set -e
    "$__python" - < "$__block"  # as typed into python at the folder: it is on sys.path
else
    trap __save_state EXIT
    trap 'echo "example failed at line $LINENO (exit status $?)" >&2' ERR
    set -e
    source "$__block"
fi
"""


class ExampleFailed(AssertionError):
    pass


@dataclass
class PageResult:
    page: str
    ran: list[str] = field(default_factory=list)  # where each block that ran is
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (where, why)
    notes: list[str] = field(default_factory=list)  # commands left out of blocks that ran
    seconds: float = 0.0
    block_seconds: dict[str, float] = field(default_factory=dict)  # where -> seconds, of each block that ran


def tail(path: Path, lines: int = 60) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class PageRun:
    """Runs a page's blocks one after another in ``root`` (a folder that looks like the repository's root),
    with its files (blocks, logs, shell state) in ``work``; a context manager: on exit every process the page
    started is stopped, SIGTERM first (a server drains), SIGKILL after STOP_GRACE_S."""

    def __init__(self, page: str, root: Path, work: Path, python: Path, free_port, available=()):
        self.page, self.root, self.work, self.python = page, root, work, python
        self.available = set(available)  # the NEEDS this machine meets
        self.ports = PortMap(free_port)
        self.mark = uuid.uuid4().hex
        self.result = PageResult(page)
        work.mkdir(parents=True, exist_ok=True)
        (work / "runner.sh").write_text(RUNNER)
        self.state = work / "state.sh"

    def environment(self) -> dict[str, str]:
        env = {name: value for name, value in os.environ.items() if name not in NOT_A_READERS}
        return {**env, **self.ports.make_variables(), MARK_ENV: self.mark, "PYTHONUNBUFFERED": "1"}

    def run(self, blocks: list[Block]) -> PageResult:
        started = time.monotonic()
        try:
            for block in blocks:
                need = needs(block)
                if need is not None and need not in self.available:
                    self.result.skipped.append((block.where, NEED_REASONS[need]))
                    continue
                block_started = time.monotonic()
                self.run_block(block)
                self.result.ran.append(block.where)
                self.result.block_seconds[block.where] = time.monotonic() - block_started
        finally:
            self.result.seconds = time.monotonic() - started
        return self.result

    def run_block(self, block: Block) -> None:
        code, notes = prepared(block, self.ports)
        self.result.notes += notes
        name = f"{Path(block.page).name}.L{block.line}"
        script = self.work / f"{name}.{'py' if block.kind == 'python' else 'sh'}"
        script.write_text("\n" * (block.line - 1) + code + "\n")  # its line numbers are the page's
        log = self.work / f"{name}.log"
        with open(log, "wb") as output:
            process = subprocess.Popen(
                ["bash", "--noprofile", "--norc", str(self.work / "runner.sh"), str(self.state), block.kind,
                 str(script), str(self.python)],
                cwd=self.root, env=self.environment(), stdin=subprocess.DEVNULL, stdout=output,
                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            status = process.wait(timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ExampleFailed(self.failure(block, code, log, f"still running after {BLOCK_TIMEOUT_S:.0f} s (a "
                                                              "server left in the foreground? end its line with &)"))
        if status != 0:
            raise ExampleFailed(self.failure(block, code, log, f"exit status {status}"))
        for command in background_commands(code):
            self.wait_ready(block, code, command, process.pid, log)

    def wait_ready(self, block: Block, code: str, command: str, group: int, log: Path) -> None:
        checks = readiness_checks(command)
        deadline = time.monotonic() + SERVER_READY_S
        while checks:
            checks = [check for check in checks if not answers(check)]
            if not checks:
                return
            if not group_alive(group):
                raise ExampleFailed(self.failure(block, code, log, f"`{command}` exited before it served"))
            if time.monotonic() > deadline:
                raise ExampleFailed(self.failure(block, code, log, f"`{command}` not ready after "
                                                                  f"{SERVER_READY_S:.0f} s: {', '.join(checks)}"))
            time.sleep(0.5)

    def failure(self, block: Block, code: str, log: Path, what: str) -> str:
        return (f"the example at {block.where} ({block.kind}) failed: {what}\n"
                f"--- the block as run (this page's ports) ---\n{code}\n"
                f"--- its output's tail ({log}) ---\n{tail(log)}")

    def __enter__(self) -> "PageRun":
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def processes(self) -> list:
        """The live processes this page started (they carry its mark, those in sessions of their own too)."""
        import psutil

        found = []
        for process in psutil.process_iter():
            try:
                if process.environ().get(MARK_ENV) == self.mark and process.status() != psutil.STATUS_ZOMBIE:
                    found.append(process)
            except psutil.Error:
                continue
        return found

    def stop_all(self) -> None:
        """SIGTERM to the page's processes that no process of the page started (a server's supervisor stops
        its own server and drains), then SIGKILL to any left after STOP_GRACE_S."""
        import psutil

        terminated: set[int] = set()
        deadline = time.monotonic() + STOP_GRACE_S
        while (left := self.processes()) and time.monotonic() < deadline:
            pids = {process.pid for process in left}
            for process in left:  # again as their parents go: a block's bash leaves its children orphans
                if process.pid not in terminated and _parent(process) not in pids:
                    _suppressed(process.terminate)
                    terminated.add(process.pid)
            time.sleep(0.2)
        for process in left:
            _suppressed(process.kill)
        psutil.wait_procs(left, timeout=10)


def _parent(process) -> int | None:
    import psutil

    try:
        return process.ppid()
    except psutil.Error:
        return None


def _suppressed(call) -> None:
    import psutil

    try:
        call()
    except psutil.Error:
        pass


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# The repository root as a reader's checkout after `make install`, in a folder of the page's own: what examples
# read is copied (a page may rewrite it: a calibration into models/*/machgen.json, perf/RESULTS.md, a screenshot
# into docs/), the package and the tests are linked, and build/, out/ and model_repository/ start empty.
LINKED = (".venv", "machgen", "tests")
LEFT_OUT = {".git", ".pytest_cache", ".benchmarks", "build", "out", "model_repository", "__pycache__"}


def scratch_root(repo: Path, into: Path) -> Path:
    into.mkdir(parents=True)
    ignored = shutil.ignore_patterns("__pycache__", "*.egg-info", "results")
    for entry in repo.iterdir():
        if entry.name in LEFT_OUT or entry.name.endswith(".egg-info"):
            continue
        if entry.name in LINKED:
            (into / entry.name).symlink_to(entry)
        elif entry.is_dir():
            shutil.copytree(entry, into / entry.name, ignore=ignored, symlinks=True)
        else:
            shutil.copy2(entry, into / entry.name)
    (into / "model_repository").mkdir()
    if (repo / "model_repository" / "README.md").exists():
        shutil.copy2(repo / "model_repository" / "README.md", into / "model_repository" / "README.md")
    (into / "build").mkdir()
    (into / "out").mkdir()
    # `make` reinstalls when pyproject.toml is newer than the install's stamp; here that would point the shared
    # .venv's editable install at this copy: the copy is never newer.
    stamp = repo / ".venv" / ".installed"
    if stamp.exists() and (into / "pyproject.toml").exists():
        older = stamp.stat().st_mtime - 1
        os.utime(into / "pyproject.toml", (older, older))
    return into
