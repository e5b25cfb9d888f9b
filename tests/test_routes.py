"""The sampler's choice of route for each component call (runtime/routes.py), without Triton."""

import pytest

from machgen.runtime.routes import ComponentRoutes, Route

INTERACTIVE, BATCH = "interactive", "batch"
# A served sampler: the reuse part runs in its process, and it has sessions of its own for the denoiser.
ROUTES = ComponentRoutes(in_sampler={"denoiser_reuse"}, lone_steps={"denoiser", "denoiser_tail"},
                         interactive_steps_here=True)


@pytest.mark.parametrize("running, route", [
    ([INTERACTIVE], Route.STAGE_ALONE),  # the only request: its component's wider session may take the call
    ([INTERACTIVE, BATCH], Route.STAGE),
    ([INTERACTIVE, None], Route.STAGE),  # one whose inputs are not read yet runs too
])
def test_a_stage_goes_to_its_model_marked_alone_only_for_the_only_request(running, route):
    for component in ("text_encoder", "text_encoder_2", "vae_decoder", "vae_encoder"):
        assert ROUTES.choose(component, priority=INTERACTIVE, running=running) is route
        assert ROUTES.choose(component, priority=None, running=running) is route  # no request: the same


def test_the_only_requests_steps_run_on_the_samplers_sessions():
    assert ROUTES.choose("denoiser", priority=INTERACTIVE, running=[INTERACTIVE]) is Route.SAMPLER
    assert ROUTES.choose("denoiser_tail", priority=BATCH, running=[BATCH]) is Route.SAMPLER
    # A part the sampler has no session for goes to the instances, alone or not.
    assert ROUTES.choose("denoiser_head", priority=INTERACTIVE, running=[INTERACTIVE]) is Route.INSTANCES


def test_steps_beside_other_requests_spread_over_the_instances():
    for running in ([INTERACTIVE, INTERACTIVE], [BATCH, BATCH], [BATCH, INTERACTIVE, INTERACTIVE]):
        assert ROUTES.choose("denoiser", priority=running[-1], running=running) is Route.INSTANCES


def test_an_in_sampler_part_runs_in_the_sampler_whoever_runs():
    for running in ([INTERACTIVE], [INTERACTIVE, INTERACTIVE], [BATCH, BATCH]):
        assert ROUTES.choose("denoiser_reuse", priority=running[0], running=running) is Route.SAMPLER
    assert ROUTES.choose("denoiser_reuse", priority=None, running=[]) is Route.SAMPLER


@pytest.mark.parametrize("component", ["denoiser", "denoiser_tail", "denoiser_reuse"])
def test_the_one_interactive_request_among_batch_ones_holds_no_slot(component):
    for running in ([INTERACTIVE, BATCH], [BATCH, INTERACTIVE, BATCH]):
        assert ROUTES.choose(component, priority=INTERACTIVE, running=running) is Route.UNSLOTTED
    # The batch requests' own steps go through the gate.
    batch_route = ROUTES.choose(component, priority=BATCH, running=[INTERACTIVE, BATCH])
    assert batch_route is (Route.SAMPLER if component == "denoiser_reuse" else Route.INSTANCES)


def test_holding_no_slot_needs_one_interactive_request_among_batch_ones_and_the_option():
    # Two interactive requests, or one whose inputs are not read yet (it may be interactive): the gate decides.
    assert ROUTES.choose("denoiser", priority=INTERACTIVE, running=[INTERACTIVE, INTERACTIVE]) is Route.INSTANCES
    assert ROUTES.choose("denoiser", priority=INTERACTIVE, running=[INTERACTIVE, None, BATCH]) is Route.INSTANCES
    # Alone it is the only request, not one among batch ones.
    assert ROUTES.choose("denoiser", priority=INTERACTIVE, running=[INTERACTIVE]) is Route.SAMPLER
    # A part the sampler has no session for, or a call that is no request's: through the gate.
    assert ROUTES.choose("denoiser_head", priority=INTERACTIVE, running=[INTERACTIVE, BATCH]) is Route.INSTANCES
    assert ROUTES.choose("denoiser", priority=None, running=[INTERACTIVE, BATCH]) is Route.INSTANCES
    # Without the option (a build without denoiser_nice) it waits for its turn as the others do.
    plain = ComponentRoutes(in_sampler=ROUTES.in_sampler, lone_steps=ROUTES.lone_steps)
    assert plain.choose("denoiser", priority=INTERACTIVE, running=[INTERACTIVE, BATCH]) is Route.INSTANCES
    assert plain.choose("denoiser_reuse", priority=INTERACTIVE, running=[INTERACTIVE, BATCH]) is Route.SAMPLER


def test_only_interactive_counts_every_request_but_batch_ones():
    assert ROUTES.only_interactive(INTERACTIVE, [INTERACTIVE, BATCH, BATCH])
    assert not ROUTES.only_interactive(BATCH, [INTERACTIVE, BATCH])
    assert not ROUTES.only_interactive(INTERACTIVE, [INTERACTIVE])
    assert not ROUTES.only_interactive(INTERACTIVE, [None, INTERACTIVE, BATCH])


def test_a_second_denoisers_parts_route_as_the_first_ones():
    """Wan 2.2's low-noise expert (denoiser_2_*) is a denoiser too: its calls are steps."""
    routes = ComponentRoutes(in_sampler=set(), lone_steps={"denoiser_2"})
    assert routes.choose("denoiser_2", priority=INTERACTIVE, running=[INTERACTIVE]) is Route.SAMPLER
    assert routes.choose("denoiser_2_head", priority=INTERACTIVE, running=[INTERACTIVE]) is Route.INSTANCES
