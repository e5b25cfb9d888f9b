"""The HTTP API in-process, on a stand-in for Triton that serves two models' cards (no export, no server): the
routes it serves against docs/http-api.md's table, the models' own inputs in /v1/models, and the malformed
requests OpenAI's published schemas refuse, refused naming the field in OpenAI's error shape."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from openai_schema import openai_schema, validate

ROOT = Path(__file__).resolve().parents[1]
IMAGE_MODEL, VIDEO_MODEL = "shapes", "shapes-video"
# FastAPI's own page beside /docs (Swagger UI's login redirect): no route of machgen's.
FRAMEWORK_ROUTES = {("GET", "/docs/oauth2-redirect")}


def served_model(name: str, kind: str, inputs: list[dict]):
    from machgen.api.triton import ServedModel
    from machgen.contract.api import published_inputs
    from machgen.contract.specs import ServedDefaults

    video = kind == "video"
    defaults = ServedDefaults(height=64, width=64, num_inference_steps=4, guidance_scale=3.5, max_height=256,
                              max_width=256, num_frames=17 if video else 1, max_frames=33 if video else 1,
                              fps=8 if video else 0)
    card = {"family": "wan_ti2v" if video else "flux", "kind": kind, "audio": False, "guidance_is_cfg": video,
            "tasks": ["text-to-video", "image-to-video"] if video else ["text-to-image", "image-to-image"],
            "size_multiple": 16, "frame_multiple": 4 if video else 1, "defaults": defaults.to_json(),
            "family_settings": {"experts": 1} if video else {}, "inputs": inputs}
    return ServedModel(name, card, published_inputs(inputs), frozenset())


class StandInTriton:
    """What the API asks of Triton before a job exists: the served models (their cards), and readiness."""

    def __init__(self):
        from machgen.families.wan.spec import GUIDANCE_SCALE_2

        self.published = [GUIDANCE_SCALE_2.published(None)]
        self.served = {IMAGE_MODEL: served_model(IMAGE_MODEL, "image", []),
                       VIDEO_MODEL: served_model(VIDEO_MODEL, "video", self.published)}

    async def models(self):
        return self.served

    async def ready(self) -> bool:
        return True

    async def close(self) -> None:
        pass


@pytest.fixture
def api(tmp_path):
    """A TestClient of the app, started (its store, jobs, keys: none needed) with the stand-in for Triton."""
    from fastapi.testclient import TestClient

    from machgen.api.app import create_app
    from machgen.api.settings import ApiSettings

    app = create_app(ApiSettings(data_dir=tmp_path / "api"))
    with TestClient(app) as client:
        client.app.state.machgen.triton = StandInTriton()
        yield client


def served_routes(routes) -> set[tuple[str, str]]:
    """(method, path) of every route, those of the routers the app includes too."""
    found = set()
    for route in routes:
        if hasattr(route, "original_router"):  # an included router (FastAPI keeps it whole)
            found |= served_routes(route.original_router.routes)
        elif hasattr(route, "routes"):
            found |= served_routes(route.routes)
        else:
            found |= {(method, route.path) for method in getattr(route, "methods", None) or () if method != "HEAD"}
    return found


def documented_routes() -> set[tuple[str, str]]:
    """(method, path) of each route named in docs/http-api.md's routes table (query strings left out)."""
    page = (ROOT / "docs" / "http-api.md").read_text()
    table = page.split("\n## Routes\n", 1)[1].split("\n## ", 1)[0]
    return {(method, path) for method, path in re.findall(r"`(GET|POST|DELETE|PUT|PATCH) (/[^`?\s]*)", table)}


def path_shape(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "{}", path)  # the docs say {id} where a route names it {video_id}


def test_every_route_the_app_serves_is_in_the_docs_routes_table(tmp_path):
    from machgen.api.app import create_app
    from machgen.api.settings import ApiSettings

    served = {(method, path_shape(path))
              for method, path in served_routes(create_app(ApiSettings(data_dir=tmp_path)).routes) - FRAMEWORK_ROUTES}
    documented = {(method, path_shape(path)) for method, path in documented_routes()}
    assert ("GET", "/v1/models/{}") in served and ("POST", "/v1/videos/{}/remix") in served
    assert not served - documented, f"routes the app serves that docs/http-api.md's table leaves out: " \
                                    f"{sorted(served - documented)}"
    assert not documented - served, f"routes in docs/http-api.md's table the app does not serve: " \
                                    f"{sorted(documented - served)}"


def test_a_models_own_inputs_come_back_as_it_publishes_them(api):
    listed = {entry["id"]: entry for entry in api.get("/v1/models").json()["data"]}
    assert set(listed) == {IMAGE_MODEL, VIDEO_MODEL}
    published = StandInTriton().published
    one = api.get(f"/v1/models/{VIDEO_MODEL}").json()
    assert one == listed[VIDEO_MODEL] and one["kind"] == "video"
    assert one["inputs"] == published
    (entry,) = one["inputs"]
    assert (entry["name"], entry["datatype"], entry["shape"], entry["flag"]) == (
        "guidance_scale_2", "FP32", [1], "--guidance-scale-2")
    assert "low-noise expert" in entry["doc"] and entry["default_doc"] == "`guidance_scale`"
    assert listed[IMAGE_MODEL]["inputs"] == []
    missing = api.get("/v1/models/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_the_lists_are_openais_list_objects_and_health_says_triton_is_ready(api):
    videos = api.get("/v1/videos?limit=5&order=asc")
    assert videos.status_code == 200
    validate(videos.json(), "VideoListResource")
    assert api.get("/v1/jobs?kind=image").json() == {"object": "list", "data": [], "first_id": None,
                                                     "last_id": None, "has_more": False}
    assert_refused(api.get("/v1/jobs?kind=audio"), "kind")
    assert api.get("/health").json() == {"status": "ok", "triton": True}


def assert_refused(response, param: str, code: str = "invalid_value") -> dict:
    assert response.status_code == 400, response.text
    body = response.json()
    validate(body, "ErrorResponse")
    assert (body["error"]["param"], body["error"]["code"]) == (param, code), body
    return body["error"]


def longest_prompt(schema: str) -> int:
    """OpenAI's longest prompt: its schema's maxLength (videos), or its description's words (images: for the
    GPT image models)."""
    prompt = openai_schema(schema)["properties"]["prompt"]
    if "maxLength" in prompt:
        return prompt["maxLength"]
    return int(re.search(r"(\d+) characters for (the )?GPT image models", prompt["description"]).group(1))


def test_an_integer_sent_as_a_string_in_json_is_refused_naming_it(api):
    """OpenAI's schemas type ``n`` an integer: JSON's "2" is refused; a form's text (edits are multipart) is
    read as the field's type."""
    for path, body in [("/v1/images/generations", {"model": IMAGE_MODEL}),
                       ("/v1/videos", {"model": VIDEO_MODEL})]:
        error = assert_refused(api.post(path, json={**body, "prompt": "a red circle", "n": "2"}), "n")
        assert "integer" in error["message"]
    assert_refused(api.post("/v1/images/generations", json={"model": IMAGE_MODEL, "prompt": "a red circle",
                                                            "seed": "7"}), "seed")
    assert_refused(api.post("/v1/images/generations", json={"model": IMAGE_MODEL, "prompt": "a red circle",
                                                            "stream": "true"}), "stream")
    # A form's "2" passes (the request then fails for want of its picture, not for its n).
    assert_refused(api.post("/v1/images/edits", data={"model": IMAGE_MODEL, "prompt": "x", "n": "2"},
                            files={"mask": ("m.png", b"", "image/png")}), "image")


@pytest.mark.parametrize("path, schema, model", [("/v1/images/generations", "CreateImageRequest", IMAGE_MODEL),
                                                 ("/v1/images/edits", "CreateImageEditRequest", IMAGE_MODEL),
                                                 ("/v1/videos", "CreateVideoJsonBody", VIDEO_MODEL)])
def test_a_prompt_over_openais_longest_is_refused_naming_it(api, path, schema, model):
    limit = longest_prompt(schema)
    assert limit == 32000

    def send(prompt: str, **fields):
        if path.endswith("edits"):  # multipart, as OpenAI's edits are
            return api.post(path, data={"model": model, "prompt": prompt, **fields},
                            files={"mask": ("m.png", b"", "image/png")})
        return api.post(path, json={"model": model, "prompt": prompt, **fields})

    error = assert_refused(send("a" * (limit + 1)), "prompt", "string_above_max_length")
    assert str(limit) in error["message"]
    # The longest is taken: the request goes on to its next field (n 0 here, out of OpenAI's bounds).
    assert_refused(send("a" * limit, n="0" if path.endswith("edits") else 0), "n")


def test_every_option_of_machgen_api_is_in_the_docs():
    """Each option `machgen api` takes, and those `machgen serve` passes to the API (--api-*), in the page."""
    import typer

    from machgen.cli import app

    commands = typer.main.get_command(app).commands
    options = {option for command, wanted in (("api", lambda name: True), ("serve", lambda name: "-api-" in name))
               for param in commands[command].params for option in param.opts
               if option.startswith("--") and option != "--help" and wanted(option)}
    assert {"--preview-interval", "--host", "--api-data-dir"} <= options
    page = (ROOT / "docs" / "http-api.md").read_text()
    missing = sorted(option for option in options if not re.search(rf"`{re.escape(option)}[` ]", page))
    assert not missing, f"options docs/http-api.md does not name: {missing}"
