"""The playground page (machgen/api/static/playground.html, served by the API at /) in headless Chromium.

A user's path through it: the API key, a prompt, steps and a seed, Generate; the progress bar moves, the result
shows, the recent-jobs list has the job as completed. The picture shown is the API's own answer to the same
request. Skipped, naming what is missing, without chromium, chromedriver or selenium (`make system-tools`, which `make test` runs, installs them).
"""

from __future__ import annotations

import base64
import io
import json
import os
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from browser_helpers import MISSING, browser, poll  # noqa: F401 (browser: a fixture)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(bool(MISSING), reason="the playground's browser test needs " + ", ".join(MISSING)
                       + " (Debian: apt-get install chromium chromium-driver)"),
]

PROMPT = "a red circle at the top left"
# The tiny Flux runs a step in ~8 ms: at 12 steps the whole job (~0.1 s) sometimes reached the page as one burst
# and the 20 ms samples saw no intermediate value; 40 steps (~0.35 s) give the bar a dozen or more.
STEPS = 40
SEED = 1234

# Samples #progress every 20 ms, as a user would see it, until stopped.
# Every value the page gives the progress bar, as it gives it (a timer sampling the bar misses the values a
# loaded browser sets between two of its ticks: events read from the stream in one chunk).
RECORD_PROGRESS = """
window.__progress = [];
const bar = document.getElementById("progress");
const native = Object.getOwnPropertyDescriptor(HTMLProgressElement.prototype, "value");
Object.defineProperty(bar, "value", {configurable: true, get() { return native.get.call(this); },
  set(value) { native.set.call(this, value); window.__progress.push(native.get.call(this)); }});
"""
STOP_RECORDING = """
const bar = document.getElementById("progress");
delete bar.value;
window.__progress.push(bar.value);
return window.__progress;
"""
STATE = """
const result = document.getElementById("result");
return {error: document.getElementById("error").textContent, status: document.getElementById("status").textContent,
        loaded: !result.hidden && result.complete && result.naturalWidth > 0, job: result.dataset.jobId || null};
"""
# The shown result's pixels: drawn on a canvas at its own size, RGBA bytes as base64.
RESULT_PIXELS = """
const img = document.getElementById("result");
const canvas = document.createElement("canvas");
canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
const ctx = canvas.getContext("2d");
ctx.drawImage(img, 0, 0);
const data = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
let text = "";
for (let i = 0; i < data.length; i += 0x8000) text += String.fromCharCode.apply(null, data.subarray(i, i + 0x8000));
return {width: canvas.width, height: canvas.height, rgba: btoa(text)};
"""


def reference_image(api, prompt: str, size: str, seed: int, steps: int) -> np.ndarray:
    """The API's own answer to the same request (waited for, b64_json), as RGBA levels."""
    from PIL import Image

    body = {"model": api.model, "prompt": prompt, "n": 1, "size": size, "seed": seed, "num_inference_steps": steps,
            "response_format": "b64_json"}
    request = urllib.request.Request(f"{api.url}/v1/images/generations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {api.key}"})
    with urllib.request.urlopen(request, timeout=60) as response:
        answer = json.load(response)
    png = base64.b64decode(answer["data"][0]["b64_json"])
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"))


def open_playground(browser, api_server) -> None:
    """The page with the API key given and the session's model chosen, ready to generate."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    browser.get(api_server.url + "/")
    browser.find_element(By.ID, "api-key").send_keys(api_server.key)
    # The models load again with the key (the page debounces the key field's input).
    poll(lambda: browser.find_elements(By.CSS_SELECTOR, f'#model option[value="{api_server.model}"]'), 10,
         f"the model list offering {api_server.model!r}")
    Select(browser.find_element(By.ID, "model")).select_by_value(api_server.model)
    poll(lambda: browser.find_element(By.ID, "generate").is_enabled(), 5, "the Generate button enabling")


def test_generate_in_the_playground(api_server, browser, tmp_path):
    from selenium.webdriver.common.by import By

    open_playground(browser, api_server)

    browser.find_element(By.ID, "prompt").send_keys(PROMPT)
    for field, value in (("steps", STEPS), ("seed", SEED)):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(str(value))
    # The size is the model's default, as the page filled it in.
    width = int(browser.find_element(By.ID, "width").get_attribute("value"))
    height = int(browser.find_element(By.ID, "height").get_attribute("value"))

    browser.execute_script(RECORD_PROGRESS)
    browser.find_element(By.ID, "generate").click()

    def done():
        state = browser.execute_script(STATE)
        assert not state["error"], f"the page shows an error: {state['error']} (status: {state['status']})"
        return state if state["loaded"] else None

    state = poll(done, 60, "the result showing")
    seen = browser.execute_script(STOP_RECORDING)
    intermediate = sorted({value for value in seen if 0 < value < 100})
    assert len(intermediate) >= 2, f"the progress bar showed {intermediate} between 0 and 100 (samples: {seen})"
    assert seen[-1] == 100, seen
    assert browser.find_element(By.ID, "status").text.startswith("completed")

    shown = browser.execute_script(RESULT_PIXELS)
    pixels = np.frombuffer(base64.b64decode(shown["rgba"]), np.uint8).reshape(shown["height"], shown["width"], 4)
    expected = reference_image(api_server, PROMPT, f"{width}x{height}", SEED, STEPS)
    assert pixels.shape == expected.shape
    difference = np.abs(pixels.astype(np.int16) - expected.astype(np.int16)).max()
    assert difference <= 2, f"the page shows another picture than the API's: max difference {difference}/255"

    job = state["job"]
    listed = poll(lambda: browser.execute_script(
        "const li = document.querySelector(`#jobs li[data-job-id='${arguments[0]}']`);"
        "return li && li.dataset.status === 'completed' ? li.querySelector('.job-status').textContent : null;", job),
        10, f"the recent-jobs list showing {job} as completed")
    assert listed == "completed"
    assert browser.find_elements(By.CSS_SELECTOR, f'#jobs li[data-job-id="{job}"] .output-link')

    browser.save_screenshot(str(tmp_path / "playground.png"))
    # The tiny model's page, on request; docs/playground.png shows the trained model (perf/playground_screenshot.py).
    if os.environ.get("MACHGEN_SCREENSHOT"):
        target = Path(os.environ["MACHGEN_SCREENSHOT"])
        target.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(target))


def test_explore_then_refine_a_winner_in_the_playground(api_server, browser):
    """An explore of three variants shows each one's early image and score, ranked when done; a person picks the
    winner's Refine, writes a new prompt and generates: the job made is a refine of that explore."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    open_playground(browser, api_server)
    browser.find_element(By.ID, "prompt").send_keys(PROMPT)
    browser.find_element(By.CSS_SELECTOR, "#agents summary").click()
    for field, value in (("steps", 8), ("seed", 50), ("explore-n", 3), ("explore-step", 2)):
        box = browser.find_element(By.ID, field)
        box.clear()
        box.send_keys(str(value))
    browser.find_element(By.ID, "generate").click()

    def ranked():
        state = browser.execute_script(STATE)
        assert not state["error"], f"the page shows an error: {state['error']} (status: {state['status']})"
        cells = browser.execute_script(
            "return [...document.querySelectorAll('#variants .variant')].map((c) => ({text: c.textContent, "
            "loaded: c.querySelector('img').naturalWidth > 0, status: c.className}));")
        done = state["loaded"] and len(cells) == 3 and all(c["loaded"] and "rank" in c["text"] for c in cells)
        return (state, cells) if done else None

    state, cells = poll(ranked, 60, "the explored variants ranked with their early images")
    assert sum("continued" in cell["status"] for cell in cells) == 1
    assert all("score" in cell["text"] for cell in cells)
    explore_job = state["job"]

    browser.find_element(By.CSS_SELECTOR, "#variants .variant.continued button.refine").click()
    poll(lambda: browser.find_element(By.ID, "refine-bar").is_displayed(), 5, "the refine bar showing")
    Select(browser.find_element(By.ID, "refine-step")).select_by_value("4")
    prompt = browser.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys("a blue circle at the top left")
    browser.find_element(By.ID, "generate").click()

    def refined():
        state = browser.execute_script(STATE)
        assert not state["error"], f"the page shows an error: {state['error']} (status: {state['status']})"
        return state if state["loaded"] and state["job"] not in (None, explore_job) else None

    refine_job = poll(refined, 60, "the refined result showing")["job"]
    request = urllib.request.Request(f"{api_server.url}/v1/jobs/{refine_job}",
                                     headers={"Authorization": f"Bearer {api_server.key}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        record = json.load(response)
    assert record["refines"] == {"parent": explore_job, "parent_index": 0, "step": 4}
    assert record["prompt"] == "a blue circle at the top left" and record["stats"][0]["steps"] == 4
