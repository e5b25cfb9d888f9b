"""Headless Chromium for the playground tests (tests/test_playground.py, tests/test_world_playground.py): what
is missing to drive it, a browser fixture, and polling for what the page does."""

from __future__ import annotations

import shutil
import time

import pytest

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401
    SELENIUM = True
except ImportError:
    SELENIUM = False

MISSING = [what for what, there in (("chromium (on PATH)", CHROMIUM), ("chromedriver (on PATH)", CHROMEDRIVER),
                                    ("the selenium package", SELENIUM)) if not there]


@pytest.fixture
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    # The paths given: no Selenium Manager (it would download a driver).
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_script_timeout(10)
    try:
        yield driver
    finally:
        driver.quit()


def poll(condition, timeout: float, what: str):
    """``condition()``'s first truthy answer, polled every 20 ms."""
    deadline = time.monotonic() + timeout
    while True:
        answer = condition()
        if answer:
            return answer
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
        time.sleep(0.02)
