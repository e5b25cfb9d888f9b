"""An agent's loops as requests: explore (many variants run to a step, scored there, only the best continue)
and refine (a finished job's trajectory continued from a step with a new prompt or settings).

Both rest on the model API's trajectory inputs (docs/model-api.md): a variant explored runs with ``stop_step``
and ``trajectory_steps`` at the scoring step (its images are then the clean result that step points to), and a
winner continues with ``start_step`` and ``start_latents``: with its own prompt and settings that continuation
is the variant's full run, step for step, so a pruned explore pays N x p + k x (N - p) steps for what k full
runs give. A refine is such a continuation of a stored trajectory.

Scorers: a built-in one reads an image back with the trained default models' detector (``shapes``); a callback
URL gets the early images, signed as webhooks are, and answers their scores within a timeout (without an
answer nothing is pruned: every variant continues).
"""

from __future__ import annotations

import asyncio
import io
import json
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np

from machgen.api.media import data_url
from machgen.api.schemas import ApiError, invalid, typed

DEFAULT_SCORER_TIMEOUT_S = 10.0
MAX_SCORER_TIMEOUT_S = 120.0
LATENTS_FILE = "latents-{index}.npz"
EARLY_FILE = "early-{index}.{extension}"  # png (an image job) or mp4 (a video job)


# The image request's fields for agents (docs/http-api.md): besides OpenAI's.
AGENT_FIELDS = ("explore", "prompts", "keep_latents", "parent", "parent_index", "step")


def kept_latents(value: Any, start_step: int, steps: int) -> list[int]:
    """The steps whose latents a job keeps for refines: ``keep_latents`` true (every step it runs but the last)
    or a list of steps; 400 naming the field."""
    if value is None or value is False:
        return []
    if value is True:
        return list(range(start_step + 1, steps))
    if not isinstance(value, list) or not all(isinstance(step, int) and not isinstance(step, bool) for step in value):
        raise invalid("keep_latents", "'keep_latents' is true or a list of steps")
    outside = [step for step in value if not start_step < step < steps]
    if outside:
        raise invalid("keep_latents", f"steps {outside} are outside [{start_step + 1}, {steps - 1}]: a refine "
                                      f"goes on from a step before the last")
    return sorted(set(value))


def prompt_variants(value: Any, prompt: str, n: int) -> list[str]:
    """Each variant's prompt: ``prompts`` in turn (variant i takes prompts[i % len]), else the prompt."""
    if value is None:
        return [prompt] * n
    if not isinstance(value, list) or not value or not all(isinstance(p, str) and p for p in value):
        raise invalid("prompts", "'prompts' is a list of non-empty strings, the variants' prompts in turn")
    return [value[index % len(value)] for index in range(n)]


@dataclass(frozen=True)
class ExploreSettings:
    """An explore job's plan: score every variant after ``at_step`` steps, continue the best ``keep``."""

    keep: int
    at_step: int
    scorer: str  # a built-in scorer's name, or an http(s) URL
    timeout_s: float = DEFAULT_SCORER_TIMEOUT_S

    @property
    def by_callback(self) -> bool:
        return self.scorer.startswith(("http://", "https://"))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def explore_settings(value: Any, n: int, steps: int) -> ExploreSettings:
    """The request's ``explore`` object checked against its ``n`` variants and ``steps``; 400 naming the field."""
    if not isinstance(value, dict):
        raise invalid("explore", "'explore' must be an object: {\"keep\": k, \"at_step\": s, \"scorer\": ...}")
    unknown = sorted(set(value) - {"keep", "at_step", "scorer", "timeout_s"})
    if unknown:
        raise invalid(f"explore.{unknown[0]}", f"unknown parameter 'explore.{unknown[0]}'", code="unknown_parameter")
    if n < 2:
        raise invalid("n", "an explore job runs several variants: 'n' of 2 or more")
    keep = typed("explore.keep", value.get("keep", 1), int)
    if not 1 <= keep < n:
        raise invalid("explore.keep", f"'explore.keep' must be in [1, {n - 1}] (fewer than the {n} variants)")
    at_step = typed("explore.at_step", value.get("at_step", max(steps // 4, 1)), int)
    if not 1 <= at_step < steps:
        raise invalid("explore.at_step", f"'explore.at_step' must be in [1, {steps - 1}]: a step of the {steps} "
                                         f"before the last")
    scorer = value.get("scorer")
    if not isinstance(scorer, str) or not (scorer in BUILTIN or scorer.startswith(("http://", "https://"))):
        raise invalid("explore.scorer", f"'explore.scorer' must be a built-in scorer ({', '.join(BUILTIN)}) "
                                        f"or an http(s) URL that answers scores")
    timeout = float(typed("explore.timeout_s", value.get("timeout_s", DEFAULT_SCORER_TIMEOUT_S), float))
    if not 0 < timeout <= MAX_SCORER_TIMEOUT_S:
        raise invalid("explore.timeout_s", f"'explore.timeout_s' must be in (0, {MAX_SCORER_TIMEOUT_S:g}]")
    return ExploreSettings(keep, at_step, scorer, timeout)


def shapes_score(media: np.ndarray, prompt: str) -> float:
    """The share of what the prompt says that the trained default models' detectors read in ``media``: of a
    picture [H, W, 3] its colour, shape and place (datasets/shapes.py), of a clip [F, H, W, 3] its colour, shape
    and direction (datasets/moving_shapes.py); of those the prompt names, 0 where no shape is found."""
    from machgen.datasets import moving_shapes, shapes

    text = f" {prompt.lower().rstrip('.')} "
    media = np.asarray(media)[..., :3]
    wanted = {"colour": next((c for c in shapes.PALETTE if f" {c} " in text), None),
              "shape": next((s for s in shapes.SHAPES if f" {s} " in text or f" {s}." in text), None)}
    if media.ndim == 4:
        wanted["direction"] = next((direction for direction, phrase in moving_shapes.DIRECTION_PHRASES.items()
                                    if f" {phrase} " in text), None)
        found = moving_shapes.detect(media)
        read = None if found is None else {"colour": found.colour, "shape": found.shape,
                                           "direction": found.direction}
    else:
        wanted["position"] = next((p for p in sorted(shapes.POSITIONS, key=len, reverse=True) if p in text), None)
        found = shapes.detect(media)
        read = None if found is None else {"colour": found.colour, "shape": found.shape,
                                           "position": found.position}
    named = {name: value for name, value in wanted.items() if value is not None}
    if read is None or not named:
        return 0.0
    return sum(read[name] == value for name, value in named.items()) / len(named)


# The scorers built in: name -> score(picture uint8 [H, W, 3] or clip [F, H, W, 3], prompt) in [0, 1].
BUILTIN: dict[str, Callable[[np.ndarray, str], float]] = {"shapes": shapes_score}


async def check_scorer(url: str, destinations, secret: str | None, timeout_s: float) -> None:
    """At submission: the scorer URL is an allowed destination and answers a signed check; else 400 naming it."""
    from machgen.api.destinations import RefusedDestination

    if secret is None:
        raise invalid("explore.scorer", "a scorer URL gets signed requests: this API was started without a "
                                        "webhook secret", code="webhooks_disabled")
    try:
        await post_signed(url, {"type": "explore.check", "data": {}}, destinations, secret, min(timeout_s, 10.0))
    except RefusedDestination as err:
        raise invalid("explore.scorer", f"'explore.scorer' is refused: {err}", code="callback_refused") from None
    except ScorerFailed as err:
        raise invalid("explore.scorer", f"'explore.scorer' did not answer a check: {err}",
                      code="scorer_unreachable") from None


class ScorerFailed(Exception):
    """The scorer did not answer in time, or not as asked."""


async def post_signed(url: str, payload: dict[str, Any], destinations, secret: str, timeout_s: float) -> Any:
    """POST ``payload`` signed as a webhook to the checked address of ``url``: its JSON answer."""
    import httpx

    from machgen.api.webhooks import signed_headers

    destination = await asyncio.to_thread(destinations.check, url)
    body = json.dumps(payload).encode()
    headers = signed_headers(secret, f"msg_{uuid.uuid4().hex}", int(time.time()), body)
    headers["host"] = destination.host_header
    try:
        async with httpx.AsyncClient(timeout=timeout_s) as client:
            response = await asyncio.wait_for(
                client.post(destination.connect_url, content=body, headers=headers,
                            extensions={"sni_hostname": destination.host}), timeout_s)
    except (httpx.HTTPError, asyncio.TimeoutError) as err:
        raise ScorerFailed(f"{type(err).__name__}: {err}".rstrip(": ")) from None
    if not 200 <= response.status_code < 300:
        raise ScorerFailed(f"HTTP {response.status_code}")
    try:
        return response.json() if response.content else None
    except ValueError as err:
        raise ScorerFailed(f"its answer is not JSON: {err}") from None


async def score(settings: ExploreSettings, job_id: str, media: list[np.ndarray], files: list[bytes],
                prompts: list[str], seeds: list[int], destinations,
                secret: str | None) -> tuple[list[float] | None, str | None]:
    """Each variant's score (higher: better), or None and why when the scorer gave none. ``media``: each
    variant's early picture [H, W, 3] or clip [F, H, W, 3]; ``files``: the same as a PNG or an MP4, which a
    scorer URL gets as a data URL (``image`` or ``video``)."""
    if not settings.by_callback:
        scorer = BUILTIN[settings.scorer]
        return await asyncio.to_thread(lambda: [float(scorer(early, prompt)) for early, prompt in
                                                zip(media, prompts)]), None
    field = "video" if media and np.asarray(media[0]).ndim == 4 else "image"
    media_type = "video/mp4" if field == "video" else "image/png"
    variants = [{"index": index, "prompt": prompt, "seed": seed, field: data_url(file, media_type)}
                for index, (file, prompt, seed) in enumerate(zip(files, prompts, seeds))]
    payload = {"type": "explore.score", "data": {"job_id": job_id, "step": settings.at_step, "variants": variants}}
    try:
        answer = await post_signed(settings.scorer, payload, destinations, secret or "", settings.timeout_s)
    except Exception as err:  # noqa: BLE001 - refused, timed out, not JSON: nothing is pruned
        return None, f"{type(err).__name__}: {err}"
    scores = answer.get("scores") if isinstance(answer, dict) else None
    if (not isinstance(scores, list) or len(scores) != len(media)
            or not all(isinstance(s, (int, float)) and np.isfinite(s) for s in scores)):
        return None, f"the scorer's answer has no 'scores' list of {len(media)} finite numbers"
    return [float(s) for s in scores], None


def ranking(scores: list[float] | None, keep: int, count: int) -> tuple[list[int], set[int]]:
    """The ``count`` variants best first (ties in their order), and those that continue: the best ``keep``, or
    every one where there are no scores."""
    if scores is None:
        order = list(range(count))
        return order, set(order)
    order = sorted(range(len(scores)), key=lambda index: (-scores[index], index))
    return order, set(order[:keep])


def latents_file(trajectory: np.ndarray, steps: list[int], limit_bytes: int) -> tuple[bytes, list[int]]:
    """A variant's kept latents as an npz (``steps``, ``latents`` [steps, values] float32) within
    ``limit_bytes``: evenly spaced steps where all of them would not fit (the last always kept)."""
    row = trajectory[0].nbytes if len(trajectory) else 1
    fits = max(int(limit_bytes // max(row, 1)), 0)
    chosen = list(range(len(steps)))
    if fits < len(chosen):
        chosen = sorted({round(i * (len(steps) - 1) / max(fits - 1, 1)) for i in range(fits)}) if fits > 1 else (
            [len(steps) - 1] if fits == 1 else [])
    buffer = io.BytesIO()
    np.savez(buffer, steps=np.asarray([steps[i] for i in chosen], np.int32),
             latents=np.asarray(trajectory[chosen], np.float32))
    return buffer.getvalue(), [steps[i] for i in chosen]


def read_latents(data: bytes) -> tuple[list[int], np.ndarray]:
    with np.load(io.BytesIO(data)) as kept:
        return [int(s) for s in kept["steps"]], kept["latents"]


def refine_step(fields: dict[str, Any], steps: int) -> int:
    """A refine's start: ``step`` (1 to steps - 1), or ``strength`` (the share of the steps run again, as
    image-to-image's: the parent's first steps - int(steps x strength) kept); 400 naming the field."""
    if fields.get("step") is not None and fields.get("strength") is not None:
        raise invalid("strength", "a refine takes 'step' or 'strength', not both")
    if fields.get("strength") is not None:
        strength = float(typed("strength", fields["strength"], float))
        step = steps - int(steps * strength) if 0 < strength < 1 else 0
        if not 1 <= step < steps:
            raise invalid("strength", f"'strength' {strength:g} keeps none of the parent's {steps} steps, or all of "
                                      f"them: it must leave between 1 and {steps - 1} steps to the parent")
        return step
    if fields.get("step") is None:
        raise invalid("step", "a refine needs 'step' (the parent's step to go on from) or 'strength'")
    step = typed("step", fields["step"], int)
    if not 1 <= step < steps:
        raise invalid("step", f"'step' must be in [1, {steps - 1}]: a step of the parent's {steps} before its last")
    return step


def no_parent(parent_id: Any) -> ApiError:
    return ApiError(404, f"no job with id '{parent_id}' to refine (it must be one of yours)", param="parent",
                    code="parent_not_found")
