"""test_parallel_wan.py's in-process tests on Wan 2.2 TI2V (a timestep, so a modulation, per token; image-to-video
keeps the picture's latents in the first latent frame): every layout against one rank, text- and image-to-video.
Its Triton path is Wan's (the same component model and runtime), served in test_parallel_wan.py."""

import pytest

from test_parallel_wan import *  # noqa: F401,F403 - the same tests and fixtures, on another family

del test_served_by_triton_every_frame_equals_the_single_rank_video  # noqa: F821 - served there, for Wan 2.2
del test_image_to_video_and_vace_tails_split_over_the_ranks_give_the_whole_tails_outputs  # noqa: F821 - not TI2V's


@pytest.fixture(scope="module")
def family():
    return "wan-ti2v"
