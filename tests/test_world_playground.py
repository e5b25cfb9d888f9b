"""The world playground (machgen/api/static/world.html, served by the API at /world) in headless Chromium, playing
the trained world model (models/shapes-world) through the realtime WebSocket.

A user's path through it: the API key, the model, a subject; Start; the arrow keys and the space bar steer the
session; Fork opens a second future, which the keys steer on its own. The frames the page drew on its canvases
are read back and each chunk's motion read by the world-shapes detector (machgen/datasets/world_shapes.py): it
must be the action the chunk was made under, as the page recorded from the server's answer to each key (the
chunk the key applies from), and the fork's chunks must go their own way. Skipped, naming what is missing,
without chromium, chromedriver or selenium, as tests/test_playground.py.
"""

from __future__ import annotations

import base64
import itertools
import time
from pathlib import Path

import numpy as np
import pytest
from browser_helpers import MISSING, browser, poll  # noqa: F401 (browser: a fixture)
from conftest import api_on, build_tiny_repository, serving

from machgen.datasets import world_shapes

pytestmark = [
    pytest.mark.export,
    pytest.mark.integration,
    pytest.mark.skipif(bool(MISSING), reason="the world playground's browser test needs " + ", ".join(MISSING)
                       + " (Debian: apt-get install chromium chromium-driver)"),
]

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "shapes-world"
MODEL = "shapes-world"
SUBJECT = world_shapes.Subject("red", "circle")
SEED = 3
# Each key pressed when the chunk the one before applies from arrives, so that it holds for a chunk (two when late):
# the shape stays within 16 px of the centre, a wall 21 px away (where_the_shape_goes accounts for one reached).
KEYS = (("RIGHT", "right"), ("UP", "up"), ("LEFT", "left"), ("DOWN", "down"), ("SPACE", "stop"))
# After the fork, each future steered its own way, each for this many chunks at least.
FORK_CHUNKS = 2

# A future's record as the page keeps it (window.worldRecord): its keys and its chunks, each chunk's frames as
# drawn on its canvas (RGBA, base64).
FUTURE_RECORD = """
const future = window.worldRecord.futures[arguments[0]];
if (!future) return null;
return {parent: future.parent, keys: future.keys, chunks: future.chunks.map((c) => {
  let text = "", width = 0, height = 0;
  for (const image of c.drawn) {
    width = image.width; height = image.height;
    for (let i = 0; i < image.data.length; i += 0x8000)
      text += String.fromCharCode.apply(null, image.data.subarray(i, i + 0x8000));
  }
  return {chunk: c.chunk, action: c.action, frames: c.frames, drawn: c.drawn.length, width, height,
          key_to_frame_ms: c.key_to_frame_ms === undefined ? null : c.key_to_frame_ms, rgba: btoa(text)};
})};
"""
# Without the pixels: what arrived and what was drawn, per chunk.
FUTURE_STATE = """
const future = window.worldRecord.futures[arguments[0]];
return future ? {keys: future.keys, chunks: future.chunks.map((c) => ({chunk: c.chunk, action: c.action,
                 frames: c.frames, drawn: c.drawn.length}))} : null;
"""


@pytest.fixture(scope="module")
def world_repository(tmp_path_factory):
    return build_tiny_repository(tmp_path_factory, MODEL_DIR, MODEL)


@pytest.fixture(scope="module")
def world_server(world_repository):
    with serving(world_repository) as server:
        yield server


@pytest.fixture(scope="module")
def world_api(world_server, api_keys, tmp_path_factory):
    with api_on(world_server.grpc_url, api_keys, tmp_path_factory, "world-api") as api:
        yield api


class Page:
    """The world playground in the browser: its futures' records, keys pressed as a person presses them."""

    def __init__(self, browser):
        self.browser = browser

    def error(self) -> str:
        from selenium.webdriver.common.by import By

        return self.browser.find_element(By.ID, "error").text

    def state(self, future: str) -> dict | None:
        error = self.error()
        assert not error, f"the page shows an error: {error}"
        return self.browser.execute_script(FUTURE_STATE, future)

    def received(self, future: str, chunk: int, drawn: bool = False) -> bool:
        state = self.state(future)
        return bool(state) and any(c["chunk"] >= chunk and (not drawn or c["drawn"] == c["frames"])
                                   for c in state["chunks"])

    def press(self, key: str, future: str) -> int:
        """Presses ``key`` (a name in Selenium's Keys) with ``future`` selected; the chunk it applies from, as the
        server answered it to the page."""
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        keys_before = len(self.state(future)["keys"])
        ActionChains(self.browser).send_keys(getattr(Keys, key)).perform()

        def answered():
            keys = self.state(future)["keys"]
            return keys if len(keys) > keys_before else None

        return poll(answered, 10, f"the server's answer to {key} on {future}")[-1]["applies_from"]

    def select(self, future: str) -> None:
        from selenium.webdriver.common.by import By

        self.browser.find_element(By.CSS_SELECTOR, f'.future[data-session="{future}"] canvas').click()
        poll(lambda: self.browser.execute_script(
            "return document.querySelector(`.future[data-session='${arguments[0]}']`).classList.contains('selected')",
            future), 5, f"{future} selected")

    def record(self, future: str) -> dict:
        return self.browser.execute_script(FUTURE_RECORD, future)


def drawn_frames(chunk: dict) -> np.ndarray:
    """A chunk's frames as the page drew them: uint8 [frames, height, width, 3]."""
    rgba = np.frombuffer(base64.b64decode(chunk["rgba"]), np.uint8)
    return rgba.reshape(chunk["drawn"], chunk["height"], chunk["width"], 4)[..., :3]


def readings(chunks: list[dict], before: np.ndarray | None) -> list[world_shapes.ChunkReading | None]:
    """The detector's reading of each of consecutive chunks; ``before``: the frame before the first (None: the
    session's first chunk)."""
    read = []
    for chunk in chunks:
        frames = drawn_frames(chunk)
        read.append(world_shapes.detect_chunk(frames, before))
        before = frames[-1]
    return read


def made_under(chunks: list[dict]) -> list[str]:
    """The action each chunk was made under, as the page recorded it (the bare subject stays still)."""
    return [chunk["action"] or "stop" for chunk in chunks]


def where_the_shape_goes(actions: list[str]) -> list[str | None]:
    """What each chunk of a session steered by ``actions`` (one a chunk) shows in the dataset's ground truth: the
    action, "stop" where a wall holds the shape the whole chunk, None where it holds it part of the chunk (not
    checked: the detector's slope then depends on when)."""
    centres = world_shapes.path(world_shapes.START, actions, world_shapes.START_SIZE)
    shown = []
    for index, (start, length) in enumerate(zip(world_shapes.chunk_starts(len(actions)),
                                                world_shapes.chunk_lengths(len(actions)))):
        moves = length - 1 if index == 0 else length
        moved = np.abs(centres[start + length - 1] - centres[max(start - 1, 0)]).max()
        full = actions[index] == "stop" or np.isclose(moved, moves * world_shapes.SPEED)
        shown.append(actions[index] if full else "stop" if np.isclose(moved, 0) else None)
    return shown


def test_the_keys_steer_the_world_and_a_fork_goes_its_own_way(world_api, browser):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    started = time.monotonic()
    browser.get(world_api.url + "/world")
    browser.find_element(By.ID, "api-key").send_keys(world_api.key)
    # The models load again with the key: only the realtime ones are offered.
    poll(lambda: browser.find_elements(By.CSS_SELECTOR, f'#model option[value="{MODEL}"]'), 10,
         f"the model list offering {MODEL!r}")
    offered = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#model option")]
    assert offered == [MODEL], offered
    Select(browser.find_element(By.ID, "model")).select_by_value(MODEL)
    browser.find_element(By.ID, "subject").send_keys(SUBJECT.phrase)
    browser.find_element(By.ID, "seed").send_keys(str(SEED))
    poll(lambda: browser.find_element(By.ID, "start").is_enabled(), 5, "the Start button enabling")
    browser.find_element(By.ID, "start").click()
    page = Page(browser)
    poll(lambda: page.received("f1", 0), 30, "the session's first chunk")

    # Each key pressed as soon as the chunk the one before applies from has arrived.
    for key, action in KEYS:
        applies_from = page.press(key, "f1")
        poll(lambda: page.received("f1", applies_from), 30, f"f1's chunk {applies_from} ({action})")

    browser.find_element(By.CSS_SELECTOR, '.future[data-session="f1"] button.fork').click()
    poll(lambda: page.state("f2"), 30, "the fork's future f2")
    # Away from the nearer wall: the fork vertically, f1 horizontally (the chunks to come until the keys land
    # stay still, as the last key says).
    x, y = world_shapes.path(world_shapes.START, made_under(page.state("f1")["chunks"]), world_shapes.START_SIZE)[-1]
    fork_way = "up" if y >= world_shapes.SIZE / 2 else "down"
    main_way = "right" if x <= world_shapes.SIZE / 2 else "left"
    # The fork is selected once it opens: the keys now steer it alone.
    fork_from = page.press(fork_way.upper(), "f2")
    page.select("f1")
    main_from = page.press(main_way.upper(), "f1")
    poll(lambda: page.received("f2", fork_from + FORK_CHUNKS - 1, drawn=True)
         and page.received("f1", main_from + FORK_CHUNKS - 1, drawn=True), 30,
         f"{FORK_CHUNKS} chunks of each future after its key, drawn")
    browser.find_element(By.ID, "stop").click()
    played_s = time.monotonic() - started

    main, fork = page.record("f1"), page.record("f2")
    assert fork["parent"] == "f1"
    # Only whole chunks (drawn in full); the last ones may still be playing when Stop came.
    main_chunks = [c for c in main["chunks"] if c["drawn"] == c["frames"]]
    fork_chunks = [c for c in fork["chunks"] if c["drawn"] == c["frames"]]
    assert [c["chunk"] for c in main_chunks] == list(range(len(main_chunks))), "f1 played every chunk from 0"
    forked_at = fork_chunks[0]["chunk"]
    assert [c["chunk"] for c in fork_chunks] == list(range(forked_at, forked_at + len(fork_chunks)))
    assert main_chunks[0]["frames"] == 5 and all(c["frames"] == 8 for c in main_chunks[1:] + fork_chunks)

    # The page's record: the first chunk is the bare subject (still), then each key from the chunk it applies from.
    main_actions = made_under(main_chunks)
    fork_actions = made_under(main_chunks[:forked_at]) + made_under(fork_chunks)
    assert [action for action, _ in itertools.groupby(main_actions)] == ["stop", *(a for _, a in KEYS),
                                                                        main_way], main_actions
    assert set(made_under(fork_chunks)) <= {KEYS[-1][1], fork_way}, fork_actions

    main_read = readings(main_chunks, None)
    fork_read = readings(fork_chunks, drawn_frames(main_chunks[forked_at - 1])[-1])
    checks = [("f1", c["chunk"], action, expected, reading) for c, action, expected, reading in
              zip(main_chunks, main_actions, where_the_shape_goes(main_actions), main_read)]
    checks += [("f2", c["chunk"], action, expected, reading) for c, action, expected, reading in
               zip(fork_chunks, fork_actions[forked_at:], where_the_shape_goes(fork_actions)[forked_at:], fork_read)]
    table = "\n".join(f"{name} chunk {chunk}: made under {action}, shows {expected}, read {reading}"
                      for name, chunk, action, expected, reading in checks)
    print(f"\nplayed in {played_s:.1f} s (page load to Stop)\n{table}")
    print("key to frame (ms):", [round(c["key_to_frame_ms"]) for c in main["chunks"] + fork["chunks"]
                                 if c["key_to_frame_ms"] is not None])

    checked = [check for check in checks if check[3] is not None]
    assert len(checked) >= len(checks) - 2, f"more than two chunks held partly at a wall:\n{table}"
    for name, chunk, action, expected, reading in checked:
        assert reading is not None, f"{name}: no shape read in chunk {chunk}:\n{table}"
        assert reading.action == expected, f"{name}'s chunk {chunk} shows {reading.action}, not {expected}:\n{table}"
        assert (reading.colour, reading.shape) == (SUBJECT.colour, SUBJECT.shape), f"{name}, {chunk}:\n{table}"

    # The fork's own future: over the same chunks after the keys the two go different ways (read so above), and
    # look different.
    shows = {(name, chunk): expected for name, chunk, _, expected, _ in checked}
    diverged = [chunk for chunk in range(max(fork_from, main_from), len(main_chunks))
                if shows.get(("f1", chunk)) == main_way and shows.get(("f2", chunk)) == fork_way]
    assert diverged, f"no chunk after both keys shows each future its own way:\n{table}"
    last = diverged[-1]
    difference = np.abs(drawn_frames(main_chunks[last]).astype(int)
                        - drawn_frames(next(c for c in fork_chunks if c["chunk"] == last)).astype(int)).max()
    assert difference > 100, f"the two canvases show nearly the same chunk {last} ({difference}/255 apart)"
