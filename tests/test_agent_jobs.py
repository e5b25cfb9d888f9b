"""An agent's loops through the HTTP API on the tiny Flux: a job that keeps its latents, a refine that goes on
from them, and an explore whose variants are scored at a step (built in, or by the agent's own scorer) with
only the best continued."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from conftest import PIPELINE_NAME, agent_scorer

pytestmark = [pytest.mark.integration]

STEPS = 4


def auth(api, key: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key or api.key}"}


def generate(api, key: str | None = None, **fields) -> httpx.Response:
    body = {"model": PIPELINE_NAME, "prompt": "a red circle", "seed": 5, "num_inference_steps": STEPS,
            "cache_policy": "none", **fields}
    return httpx.post(f"{api.url}/v1/images/generations", headers=auth(api, key), timeout=120, json=body)


def pictures(answer: dict) -> list[np.ndarray]:
    return [np.asarray(Image.open(io.BytesIO(base64.b64decode(entry["b64_json"]))).convert("RGB"))
            for entry in answer["data"]]


def job(api, job_id: str) -> dict:
    return httpx.get(f"{api.url}/v1/jobs/{job_id}", headers=auth(api), timeout=30).json()


def difference(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


@pytest.fixture(scope="module")
def parent(api_server):
    answer = generate(api_server, keep_latents=True)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_job_lists_the_latents_it_kept(api_server, parent):
    listed = job(api_server, parent["machgen"]["job_id"])["latents"]
    assert [entry["steps"] for entry in listed] == [[1, 2, 3]] and listed[0]["bytes"] > 0


def test_a_refine_with_the_parents_prompt_gives_its_image_and_a_new_prompt_a_continuation(api_server, parent,
                                                                                        triton_server):
    from machgen.client import MachgenClient

    parent_id = parent["machgen"]["job_id"]
    (original,) = pictures(parent)
    again = generate(api_server, parent=parent_id, step=2)
    assert again.status_code == 200, again.text
    assert difference(pictures(again.json())[0], original) <= 1
    assert again.json()["machgen"]["stats"][0]["steps"] == STEPS - 2

    # A new prompt from the parent's latents at half its steps (strength 0.5): what the model gives for that
    # prompt from those latents, asked directly.
    refined = generate(api_server, prompt="a blue square", parent=parent_id, strength=0.5)
    assert refined.status_code == 200, refined.text
    record = job(api_server, refined.json()["machgen"]["job_id"])
    assert record["refines"] == {"parent": parent_id, "parent_index": 0, "step": 2}
    with MachgenClient(triton_server.grpc_url) as client:
        trajectory = client.generate_all(PIPELINE_NAME, "a red circle", seed=5, num_inference_steps=STEPS,
                                         cache_policy="none", trajectory_steps=[2]).trajectory
        expected = client.generate(PIPELINE_NAME, "a blue square", seed=5, num_inference_steps=STEPS,
                                   cache_policy="none", start_step=2, start_latents=trajectory[0])[0]
    assert difference(pictures(refined.json())[0], expected) <= 1


@pytest.mark.parametrize("fields, status, param", [
    ({"parent": "img_nothere", "step": 1}, 404, "parent"),
    ({"step": 0}, 400, "step"),
    ({"step": STEPS}, 400, "step"),
    ({"strength": 1.0}, 400, "strength"),
    ({"step": 1, "strength": 0.5}, 400, "strength"),
    ({}, 400, "step"),
    ({"step": 1, "parent_index": 3}, 400, "parent_index"),
    ({"step": 1, "n": 2}, 400, "n"),
    ({"step": 1, "size": "32x32"}, 400, "size"),
    ({"step": 1, "num_inference_steps": 6}, 400, "num_inference_steps"),
    ({"step": 1, "explore": {"keep": 1, "scorer": "shapes"}}, 400, "explore"),
])
def test_a_bad_refine_is_refused_naming_the_field(api_server, parent, fields, status, param):
    fields = {"parent": parent["machgen"]["job_id"], **fields}
    refused = generate(api_server, **fields)
    assert refused.status_code == status and refused.json()["error"]["param"] == param, refused.text


def test_a_parent_is_only_its_owners_and_must_have_kept_latents(api_server, api_keys, parent):
    _, _, other_key = api_keys
    refused = generate(api_server, key=other_key, parent=parent["machgen"]["job_id"], step=1)
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "parent"
    plain = generate(api_server).json()["machgen"]["job_id"]
    refused = generate(api_server, parent=plain, step=1)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "parent_without_latents"
    for fields, param in (({"keep_latents": [STEPS]}, "keep_latents"), ({"keep_latents": "yes"}, "keep_latents"),
                          ({"prompts": ["a cat"]}, "prompts"), ({"priority": "urgent"}, "priority")):
        refused = generate(api_server, **fields)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text


@pytest.fixture(scope="module")
def scorer():
    with agent_scorer() as handler:
        yield handler


def full_runs(triton_server, seeds) -> dict[int, np.ndarray]:
    from machgen.client import MachgenClient

    with MachgenClient(triton_server.grpc_url) as client:
        return {seed: client.generate(PIPELINE_NAME, "a red circle", seed=seed, num_inference_steps=STEPS,
                                      cache_policy="none")[0] for seed in seeds}


def test_an_explore_scored_by_the_agent_continues_only_the_best_as_their_full_runs(api_server, scorer,
                                                                                   triton_server):
    from standardwebhooks import Webhook

    scorer.scores, scorer.delay, scorer.asked = [0.1, 0.9, 0.5, 0.2], 0.0, []
    answer = generate(api_server, n=4, seed=20, explore={"keep": 2, "at_step": 1, "scorer": scorer.url})
    assert answer.status_code == 200, answer.text
    explored = job(api_server, answer.json()["machgen"]["job_id"])["explored"]
    ranked = [(v["index"], v["status"], v["steps"]) for v in explored["variants"]]
    assert ranked == [(1, "continued", STEPS), (2, "continued", STEPS), (3, "pruned", 1), (0, "pruned", 1)]
    assert [v["score"] for v in explored["variants"]] == [0.9, 0.5, 0.2, 0.1] and explored["problem"] is None
    # The winners are their seeds' full runs, best first.
    expected = full_runs(triton_server, (21, 22))
    images = pictures(answer.json())
    assert difference(images[0], expected[21]) <= 1 and difference(images[1], expected[22]) <= 1
    # The scorer saw each variant's early image, signed as webhooks are.
    headers, body = next((h, b) for h, b in scorer.asked if json.loads(b)["type"] == "explore.score")
    Webhook(api_server.webhook_secret).verify(body, {k.lower(): v for k, v in headers.items()})
    sent = json.loads(body)["data"]
    assert sent["step"] == 1 and [v["seed"] for v in sent["variants"]] == [20, 21, 22, 23]
    early = httpx.get(f"{api_server.url}/v1/jobs/{answer.json()['machgen']['job_id']}/content",
                      params={"early": 3}, headers=auth(api_server), timeout=30)
    assert early.status_code == 200 and early.content.startswith(b"\x89PNG")


def test_a_scorer_that_does_not_answer_in_time_prunes_nothing(api_server, scorer):
    scorer.scores, scorer.delay = [1.0, 0.0, 0.5], 3.0
    answer = generate(api_server, n=3, seed=30, explore={"keep": 1, "at_step": 2, "scorer": scorer.url,
                                                         "timeout_s": 0.5})
    assert answer.status_code == 200, answer.text
    explored = job(api_server, answer.json()["machgen"]["job_id"])["explored"]
    assert [v["status"] for v in explored["variants"]] == ["continued"] * 3 and "Timeout" in explored["problem"]
    assert len(answer.json()["data"]) == 3


def test_an_explore_scored_by_the_built_in_detector_lists_every_variant(api_server):
    answer = generate(api_server, n=3, seed=40, prompts=["a red circle at the top left", "a blue square"],
                      explore={"keep": 1, "scorer": "shapes"})
    assert answer.status_code == 200, answer.text
    explored = job(api_server, answer.json()["machgen"]["job_id"])["explored"]
    assert explored["step"] == 1 and sorted(v["index"] for v in explored["variants"]) == [0, 1, 2]
    assert [v["prompt"] for v in sorted(explored["variants"], key=lambda v: v["index"])] == [
        "a red circle at the top left", "a blue square", "a red circle at the top left"]
    assert all(0.0 <= v["score"] <= 1.0 for v in explored["variants"]) and len(answer.json()["data"]) == 1


@pytest.mark.parametrize("explore, param", [
    ({"keep": 3, "scorer": "shapes"}, "explore.keep"),
    ({"keep": 1, "at_step": STEPS, "scorer": "shapes"}, "explore.at_step"),
    ({"keep": 1, "scorer": "clip"}, "explore.scorer"),
    ({"keep": 1, "scorer": "shapes", "after": 2}, "explore.after"),
    ({"keep": 1, "scorer": "http://127.0.0.1:9/score"}, "explore.scorer"),  # nothing answers there
])
def test_a_bad_explore_is_refused_naming_the_field(api_server, explore, param):
    refused = generate(api_server, n=3, explore=explore)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
