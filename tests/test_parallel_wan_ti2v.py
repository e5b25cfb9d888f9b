"""test_parallel_wan.py's tests on Wan 2.2 TI2V (a timestep, so a modulation, per token; image-to-video keeps the
picture's latents in the first latent frame): every layout against one rank, in process and through Triton."""

import pytest

from test_parallel_wan import *  # noqa: F401,F403 - the same tests and fixtures, on another family


@pytest.fixture(scope="module")
def family():
    return "wan-ti2v"
