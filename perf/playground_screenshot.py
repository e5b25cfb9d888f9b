"""docs/playground.png: the playground page showing the trained default model's picture.

Runs what a user runs: ``machgen-build build`` of models/shapes-flux (unless --repository names a built one),
``machgen serve`` on it, ``machgen api`` beside it with a key, then headless Chromium (Debian's ``chromium`` and
``chromium-driver``, driven by selenium from the ``test`` extra, as tests/test_playground.py drives it) types the
key and the prompt, presses Generate, waits for the picture and saves the page. The browser test's own screenshot
(MACHGEN_SCREENSHOT) is of the tiny random-weight model, whose picture is noise; this one shows the page in use.

    python perf/playground_screenshot.py                          # builds models/shapes-flux into a temporary folder
    python perf/playground_screenshot.py --repository model_repository --out docs/playground.png
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def wait_for(condition, timeout: float, what: str, process: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what}: the process exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        answer = condition()
        if answer:
            return answer
        time.sleep(0.2)
    raise SystemExit(f"{what} did not happen within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def stop(process: subprocess.Popen, timeout: float = 90.0) -> None:
    """SIGTERM (machgen serve drains), killed after ``timeout``."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def screenshot(api_url: str, key: str, model: str, prompt: str, seed: int, out: Path) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and chromedriver):
        raise SystemExit("needs chromium and chromedriver on PATH (Debian: apt-get install chromium chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    # The paths given: no Selenium Manager (it would download a driver).
    driver = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        driver.get(api_url + "/")
        driver.find_element(By.ID, "api-key").send_keys(key)
        deadline = time.monotonic() + 20
        while not driver.find_elements(By.CSS_SELECTOR, f'#model option[value="{model}"]'):
            if time.monotonic() > deadline:
                raise SystemExit(f"the page never offered the model {model!r}")
            time.sleep(0.1)
        Select(driver.find_element(By.ID, "model")).select_by_value(model)
        driver.find_element(By.ID, "prompt").send_keys(prompt)
        seed_box = driver.find_element(By.ID, "seed")
        seed_box.clear()
        seed_box.send_keys(str(seed))
        # Steps and size stay the model's defaults, as the page filled them in.
        driver.find_element(By.ID, "generate").click()
        deadline = time.monotonic() + 120
        while True:
            state = driver.execute_script(
                "const r = document.getElementById('result');"
                "return {error: document.getElementById('error').textContent,"
                "        loaded: !r.hidden && r.complete && r.naturalWidth > 0,"
                "        listed: !!document.querySelector(\"#jobs li[data-status='completed']\")};")
            if state["error"]:
                raise SystemExit(f"the page shows an error: {state['error']}")
            if state["loaded"] and state["listed"]:
                break
            if time.monotonic() > deadline:
                raise SystemExit("the picture did not show within 120 s")
            time.sleep(0.1)
        out.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(out))
    finally:
        driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repository", type=Path, help="a built repository serving --name (default: build one)")
    parser.add_argument("--model-dir", type=Path, default=ROOT / "models" / "shapes-flux")
    parser.add_argument("--name", default="shapes")
    parser.add_argument("--prompt", default="a red circle at the top left")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "playground.png")
    args = parser.parse_args()

    from machgen.api.keys import add_key

    with tempfile.TemporaryDirectory(prefix="machgen-playground-") as scratch:
        scratch = Path(scratch)
        repository = args.repository
        if repository is None:
            repository = scratch / "repository"
            print(f"building {args.model_dir} into {repository} ...", flush=True)
            subprocess.run([str(BIN / "machgen-build"), "build", str(args.model_dir), "--name", args.name,
                            "--target", "onnxruntime", "--out", str(repository)], check=True)
        ports = {"--http-port": free_port(), "--grpc-port": free_port(), "--metrics-port": free_port(),
                 "--supervisor-metrics-port": free_port()}
        serve_log, api_log = scratch / "serve.log", scratch / "api.log"
        serve = subprocess.Popen([str(BIN / "machgen"), "serve", str(repository),
                                  *(str(part) for item in ports.items() for part in item)],
                                 stdout=serve_log.open("w"), stderr=subprocess.STDOUT)
        api = None
        try:
            wait_for(lambda: any(line.startswith("ready") for line in serve_log.read_text().splitlines()), 300,
                     "machgen serve ready", serve, serve_log)
            keys_file = scratch / "keys.txt"
            key = add_key(keys_file, "docs")
            api_port = free_port()
            api = subprocess.Popen([str(BIN / "machgen"), "api", "--triton", f"127.0.0.1:{ports['--grpc-port']}",
                                    "--port", str(api_port), "--data-dir", str(scratch / "api-data"),
                                    "--keys-file", str(keys_file)], stdout=api_log.open("w"), stderr=subprocess.STDOUT)
            api_url = f"http://127.0.0.1:{api_port}"
            wait_for(lambda: answers(api_url + "/health"), 60, "machgen api ready", api, api_log)
            screenshot(api_url, key, args.name, args.prompt, args.seed, args.out)
            print(f"wrote {args.out}")
        finally:
            if api is not None:
                stop(api, 30)
            stop(serve)


if __name__ == "__main__":
    main()
