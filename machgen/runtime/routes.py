"""Which way each of a sampler's component calls goes: a plain choice over
named facts (the component, the calling request's priority, the requests
running), so that it runs under unit tests without Triton's Python backend.

The sampler model (triton_models/sampler.py) runs every request on its own
thread; a call that is not a step (text encoders, VAE) goes to its
component's model, and a step (a denoiser call) passes the step gate
(runtime/scheduling.py) and runs on the sampler's own process or on the
denoiser's instances."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Container, Sequence

from machgen.contract.specs import is_denoiser
from machgen.runtime.scheduling import BATCH, INTERACTIVE


class Route(enum.Enum):
    # A request's stage (not a step) on its component's model.
    STAGE = "stage"
    # The stage of the only request running: marked so, the component's wider session may take the cores that
    # concurrent requests would otherwise use (OnnxComponentModel).
    STAGE_ALONE = "stage alone"
    # A step of the one interactive request among batch ones: on the sampler (its in-sampler component, or its
    # rows on the sampler's own sessions cut for every instance), whatever else runs (the batch calls' instances
    # are niced), charged to its owner but holding no slot of the gate that the batch requests' calls could use.
    UNSLOTTED = "unslotted"
    # A step through the gate on the sampler's process: an in-sampler component, or the only request's rows on
    # the sampler's own sessions.
    SAMPLER = "sampler"
    # A step through the gate, its rows spread over the denoiser's instances (runtime/spread.py).
    INSTANCES = "instances"


@dataclass(frozen=True)
class RequestTurn:
    """The request a sampler thread runs, as its calls present it at the step gate (StepGate.turn)."""

    owner: str
    priority: str
    is_cancelled: Callable[[], bool]
    # Each gated call's (seconds waiting at the gate, seconds running), appended as it ends.
    waited: list
    # Its place in the order of arrival (StepGate.request_order): it holds a slot from one call to the next.
    order: int


@dataclass(frozen=True)
class ComponentRoutes:
    """The route of every component call of one sampler."""

    # Components that run inside the sampler's process.
    in_sampler: Container[str]
    # Denoiser components the sampler has sessions of its own for (the only request's steps run there).
    lone_steps: Container[str]
    # The one interactive request among batch ones computes its steps on those sessions too, outside the gate's
    # slots (ServingOptions.denoiser_nice).
    interactive_steps_here: bool = False

    def choose(self, component: str, *, priority: str | None, running: Sequence[str | None]) -> Route:
        """The route of a call to ``component``. ``priority``: that of the request whose thread calls (None: the
        call is no request's, and passes no gate); ``running``: the priorities of the requests running, the
        caller's included (None for one whose inputs are not read yet)."""
        if not is_denoiser(component):
            return Route.STAGE_ALONE if len(running) == 1 else Route.STAGE
        in_sampler = component in self.in_sampler
        if (priority is not None and (in_sampler or component in self.lone_steps)
                and self.only_interactive(priority, running)):
            return Route.UNSLOTTED
        if in_sampler or (component in self.lone_steps and len(running) == 1):
            return Route.SAMPLER
        return Route.INSTANCES

    def only_interactive(self, priority: str, running: Sequence[str | None]) -> bool:
        """Whether the caller's request is interactive and every other one running is batch (one whose inputs
        are not read yet may be interactive)."""
        if not self.interactive_steps_here or priority != INTERACTIVE:
            return False
        return len(running) > 1 and sum(other != BATCH for other in running) == 1
