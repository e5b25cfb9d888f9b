"""A soak: many mixed requests at a steady concurrency against a served model,
supervised as ``machgen serve`` supervises it, with stub processes killed
at random on the way (``--chaos``).

    .venv/bin/python perf/soak.py                      # the tiny random-weight Flux, built here
    .venv/bin/python perf/soak.py --chaos 10           # a random stub SIGKILLed every 10 s
    .venv/bin/python perf/soak.py --repository model_repository --model shapes

The mix: sizes, step counts, cache policies, true CFG, image-to-image, and
10 % invalid requests. Every valid request's output is compared with the same
request run alone on the idle server first (within 2/255); each invalid one
must be answered INVALID_ARGUMENT. Reports requests lost, outputs that
differ, invalid requests misanswered, p50/p99 latency, the server's resident
memory after warm-up (the first tenth of the mix) and at the end, and the
/dev/shm regions left once the server stopped.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAX_PIXEL_DIFF = 2


@dataclass(frozen=True)
class Spec:
    """One request of the mix; ``invalid``: the field the server must refuse."""

    options: tuple
    invalid: str | None = None

    def kwargs(self) -> dict:
        return dict(self.options)


def picture(size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 255, (size, size, 3), dtype=np.uint8)


def make_specs(rng: random.Random, count: int, sizes: list[int], max_steps: int) -> list[Spec]:
    """``count`` distinct valid requests and the invalid ones the mix draws from."""
    specs = []
    for index in range(count):
        size = rng.choice(sizes)
        options = {"prompt": rng.choice(["a red circle", "a blue square", "a green cat", "two yellow stars"]),
                   "seed": rng.randrange(2**31), "height": size, "width": rng.choice(sizes),
                   "num_inference_steps": rng.randint(2, max_steps),
                   "cache_policy": rng.choice(["none", "fbcache"])}
        kind = index % 4
        if kind == 1:
            options.update(negative_prompt="blurry", true_cfg_scale=rng.choice([2.0, 4.0]))
        elif kind == 2:
            options.update(image=("picture", size, index), strength=rng.choice([0.5, 0.8]))
            options["width"] = size
        specs.append(Spec(tuple(sorted(options.items()))))
    invalid = [Spec((("prompt", "x"), ("height", 66)), "height"),
               Spec((("prompt", "x"), ("num_inference_steps", 0)), "num_inference_steps"),
               Spec((("prompt", "x"), ("guidance_scale", float("nan"))), "guidance_scale"),
               Spec((("prompt", "x"), ("cache_policy", "bogus")), "cache_policy"),
               Spec((("prompt", "x"), ("strength", 0.5)), "strength"),
               Spec((("prompt", "x"), ("width", 100_000)), "width")]
    return specs + invalid


def inputs_of(spec: Spec) -> dict:
    options = spec.kwargs()
    if "image" in options:
        _, size, seed = options["image"]
        options["image"] = picture(size, seed)
    return options


@dataclass
class Outcome:
    spec: Spec
    seconds: float
    images: np.ndarray | None = None
    status: str | None = None
    message: str = ""
    retries: int = 0


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_one(url: str, model: str, spec: Spec, retry) -> Outcome:
    from machgen.client import GenerationError, MachgenClient

    retries = []
    started = time.perf_counter()
    options = inputs_of(spec)
    prompt = options.pop("prompt")
    try:
        with MachgenClient(url, retry=retry, on_retry=lambda *args: retries.append(args)) as client:
            images = client.generate(model, prompt, **options)
        return Outcome(spec, time.perf_counter() - started, images=images, retries=len(retries))
    except GenerationError as err:
        return Outcome(spec, time.perf_counter() - started, status=err.status, message=str(err),
                       retries=len(retries))


def resident_mb(server) -> float:
    import psutil

    try:
        root = psutil.Process(server.process.pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20
    except psutil.NoSuchProcess:
        return float("nan")


def chaos(server, every_s: float, stop: threading.Event, rng: random.Random, log: list[str]) -> None:
    """A random stub SIGKILLed every ``every_s`` (models being loaded again included; not while the whole
    server starts again: a start that keeps failing is given up after a few)."""
    while not stop.wait(every_s):
        live = server.stubs() if server.ready() else []
        if not live:
            continue
        victim = rng.choice(live)
        try:
            os.kill(victim.pid, signal.SIGKILL)
            log.append(victim.instance)
        except ProcessLookupError:
            pass


def build_tiny(work: Path) -> tuple[Path, str]:
    from machgen.builder.build import build_repository
    from machgen.builder.model_folder import write_tiny_model
    from machgen.builder.repository import ServingOptions
    from machgen.families.registry import get_family

    model_dir = write_tiny_model(get_family("flux"), work / "tiny-flux")
    repository = work / "repository"
    print("building the tiny Flux repository ...", flush=True)
    build_repository(model_dir, "flux", repository, options=ServingOptions(in_flight=16), log=lambda line: None,
                     preview=False)
    return repository, "flux"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repository", type=Path, help="a built model repository (default: build the tiny Flux)")
    parser.add_argument("--model", default=None, help="its public model (default: flux)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--distinct", type=int, default=48, help="distinct valid requests the mix draws from")
    parser.add_argument("--sizes", default="32,48,64", help="image sides (multiples of the model's factor)")
    parser.add_argument("--max-steps", type=int, default=6)
    parser.add_argument("--chaos", type=float, default=0.0, help="SIGKILL a random stub every this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from machgen.client import NO_RETRY, RetryPolicy
    from machgen.server import Ports, TritonServer
    from machgen.supervisor import Supervisor, SupervisorSettings

    from common import free_port

    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="machgen-soak-"))
    repository, model = (args.repository, args.model) if args.repository else build_tiny(work)
    model = model or "flux"
    server = TritonServer(repository, Ports(free_port(), free_port(), free_port()), log_file=work / "server.log")
    server.start()
    supervisor_log: list[str] = []
    # Chaos kills stubs while models load too: a load wedged by one gets 20 s before the server is restarted.
    # The soak's requests last seconds: a replaced version's stubs that Triton keeps go after 20.
    supervisor = Supervisor(server, SupervisorSettings(load_timeout_s=20.0, retired_grace_s=20.0),
                            log=supervisor_log.append).start()
    url = server.grpc_url
    specs = make_specs(rng, args.distinct, [int(s) for s in args.sizes.split(",")], args.max_steps)
    valid = [spec for spec in specs if spec.invalid is None]
    invalid = [spec for spec in specs if spec.invalid is not None]
    try:
        print(f"solo runs of {len(valid)} distinct requests ...", flush=True)
        solo = {spec: run_one(url, model, spec, NO_RETRY) for spec in valid}
        failed = [outcome.message for outcome in solo.values() if outcome.images is None]
        assert not failed, failed
        mix = [rng.choice(invalid) if rng.random() < 0.1 else rng.choice(valid) for _ in range(args.requests)]
        stop_chaos = threading.Event()
        killed: list[str] = []
        if args.chaos:
            threading.Thread(target=chaos, args=(server, args.chaos, stop_chaos, rng, killed), daemon=True).start()
        # Ten tries span about a minute: a model's load wedged by a kill costs the load timeout and a restart.
        retry = RetryPolicy(attempts=10, first_delay_s=0.5, max_delay_s=8.0)
        print(f"{args.requests} requests at concurrency {args.concurrency}"
              + (f", a stub killed every {args.chaos:g} s" if args.chaos else "") + " ...", flush=True)
        warm = {"done": 0, "resident": float("nan")}
        warm_lock = threading.Lock()

        def run_counted(spec: Spec) -> Outcome:
            outcome = run_one(url, model, spec, retry)
            with warm_lock:
                warm["done"] += 1
                if warm["done"] == max(len(mix) // 10, 1):  # warmed up: a tenth of the mix served
                    warm["resident"] = resident_mb(server)
            return outcome

        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            outcomes = list(pool.map(run_counted, mix))
        wall = time.perf_counter() - started
        stop_chaos.set()
        resident_warm, resident_end = warm["resident"], resident_mb(server)
    finally:
        supervisor.drain(timeout_s=30)
    left = list(Path("/dev/shm").glob(f"{server.shm_prefix}*"))

    lost = [o for o in outcomes if o.spec.invalid is None and o.images is None]
    differing = [o for o in outcomes if o.images is not None and (
        o.images.shape != solo[o.spec].images.shape
        or np.abs(o.images.astype(int) - solo[o.spec].images.astype(int)).max() > MAX_PIXEL_DIFF)]
    misanswered = [o for o in outcomes if o.spec.invalid is not None and not (
        o.status in ("StatusCode.INVALID_ARGUMENT", "400") and f"'{o.spec.invalid}'" in o.message)]
    latencies = np.array([o.seconds for o in outcomes if o.spec.invalid is None])
    print()
    print("| requests | invalid | chaos kills | model reloads | server restarts | lost | differing "
          "| invalid misanswered | retried | p50 s | p99 s | req/s | RSS warm MB | RSS end MB | growth "
          "| /dev/shm left |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print(f"| {len(outcomes)} | {sum(o.spec.invalid is not None for o in outcomes)} | {len(killed)} "
          f"| {sum(supervisor.recoveries.values())} | {supervisor.server_restarts} | {len(lost)} | {len(differing)} | {len(misanswered)} "
          f"| {sum(o.retries > 0 for o in outcomes)} | {np.percentile(latencies, 50):.2f} "
          f"| {np.percentile(latencies, 99):.2f} | {len(outcomes) / wall:.1f} | {resident_warm:.0f} "
          f"| {resident_end:.0f} | {100 * (resident_end / resident_warm - 1):+.1f} % | {len(left)} |")
    for outcome in (lost + misanswered)[:10]:
        print(f"  {outcome.spec.invalid or 'valid'}: {outcome.status} {outcome.message[:200]}")
    for outcome in differing[:10]:
        solo_images = solo[outcome.spec].images
        difference = (np.abs(outcome.images.astype(int) - solo_images.astype(int)).max()
                      if outcome.images.shape == solo_images.shape else outcome.images.shape)
        print(f"  differs by {difference} (retried {outcome.retries}x): {dict(outcome.spec.options)}")
    if killed:
        print(f"killed: {', '.join(killed)}")
    for line in supervisor_log:
        if any(word in line for word in ("died", "giving up", "stopped", "failed", "tritonserver")):
            print(f"  {line}")
    return 1 if lost or differing or misanswered or left else 0


if __name__ == "__main__":
    sys.exit(main())
