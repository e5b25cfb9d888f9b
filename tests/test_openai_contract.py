"""The HTTP API held to OpenAI's contract for the Images API: its answers validated against the schemas of
OpenAI's OpenAPI description (tests/openai_schemas, vendored), each field OpenAI defines honoured or
refused by name, errors in OpenAI's shape; called with httpx and with the official ``openai`` package.
The Videos API's part is in test_wan_ti2v.py (the suite's video model)."""

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from conftest import PIPELINE_NAME, picture
from openai_schema import enum_values, integer_bounds, openai_schema, validate

pytestmark = [pytest.mark.integration,
              pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

# Each value OpenAI lists for an enumerated image field that machgen honours; the others it refuses
# (unsupported_value), naming the field. Read against OpenAI's own lists below, so a value OpenAI adds fails.
HONOURED = {
    "response_format": {"url", "b64_json"}, "output_format": {"png", "jpeg", "webp"},
    "background": {"opaque", "auto"}, "quality": {"auto"}, "moderation": set(), "style": set(),
    "input_fidelity": set(),
}
FAST = {"num_inference_steps": 2, "seed": 7}


def auth(api) -> dict:
    return {"Authorization": f"Bearer {api.key}"}


def openai_client(api):
    import openai

    return openai.OpenAI(base_url=f"{api.url}/v1", api_key=api.key, max_retries=0)


def pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(int)


def generate(api, **fields) -> httpx.Response:
    return httpx.post(f"{api.url}/v1/images/generations", headers=auth(api), timeout=120,
                      json={"model": PIPELINE_NAME, "prompt": "a red cat", **FAST, **fields})


def edit(api, fields: dict, stream: bool = False):
    start = io.BytesIO()
    Image.fromarray(picture(64, 64, seed=4)).save(start, format="PNG")
    request = dict(url=f"{api.url}/v1/images/edits", headers=auth(api), timeout=120,
                   files={"image": ("start.png", start.getvalue(), "image/png")},
                   data={"model": PIPELINE_NAME, "prompt": "a blue square", "num_inference_steps": "4",
                         "seed": "3", **{k: str(v).lower() if isinstance(v, bool) else str(v)
                                         for k, v in fields.items()}})
    return httpx.stream("POST", **request) if stream else httpx.post(**request)


def server_sent_events(lines) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: "):])))
    return events


def assert_openai_error(response: httpx.Response, status: int, param: str | None, code: str | None = None):
    assert response.status_code == status, response.text
    body = response.json()
    validate(body, "ErrorResponse")
    assert body["error"]["param"] == param, body
    if code is not None:
        assert body["error"]["code"] == code, body


def test_output_format_and_compression_are_honoured_and_the_answer_is_openais(api_server):
    png = generate(api_server, quality="auto", background="auto", user="user-1")
    jpeg_fine = generate(api_server, output_format="jpeg", output_compression=95, background="opaque")
    jpeg_coarse = generate(api_server, output_format="jpeg", output_compression=5)
    webp = openai_client(api_server).images.generate(model=PIPELINE_NAME, prompt="a red cat", output_format="webp",
                                                     extra_body=FAST)
    for response in (png, jpeg_fine, jpeg_coarse):
        assert response.status_code == 200, response.text
        validate(response.json(), "ImagesResponse")
        usage = response.json()["usage"]
        assert usage["output_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert png.json()["output_format"] == "png" and jpeg_fine.json()["output_format"] == "jpeg"
    assert webp.output_format == "webp" and webp.usage.output_tokens == png.json()["usage"]["output_tokens"]
    png_bytes, fine, coarse = (base64.b64decode(response.json()["data"][0]["b64_json"])
                               for response in (png, jpeg_fine, jpeg_coarse))
    webp_bytes = base64.b64decode(webp.data[0].b64_json)
    assert png_bytes[:8] == b"\x89PNG\r\n\x1a\n" and fine[:3] == coarse[:3] == b"\xff\xd8\xff"
    assert webp_bytes[:4] == b"RIFF" and webp_bytes[8:12] == b"WEBP"
    reference = pixels(png_bytes)  # one seed: the same picture, as each format keeps it
    assert np.array_equal(pixels(webp_bytes), reference)  # output_compression 100 (its default): lossless
    assert np.abs(pixels(fine) - reference).mean() < 20  # JPEG's chroma subsampling, on a random model's noise
    assert len(coarse) < len(fine) and np.abs(pixels(coarse) - reference).mean() > np.abs(pixels(fine) - reference).mean()


def test_a_result_url_downloads_with_a_plain_get_and_a_changed_one_is_refused(api_server):
    answer = generate(api_server, response_format="url", output_format="webp").json()
    validate(answer, "ImagesResponse")
    url = answer["data"][0]["url"]
    downloaded = httpx.get(url, timeout=30)  # no key: the URL's signature stands for it
    assert downloaded.status_code == 200 and downloaded.headers["content-type"] == "image/webp"
    assert downloaded.content[8:12] == b"WEBP"
    assert_openai_error(httpx.get(url.replace("index=0", "index=1")), 403, "signature", "invalid_signature")
    expires = url.split("expires=")[1].split("&")[0]
    assert_openai_error(httpx.get(url.replace(f"expires={expires}", f"expires={int(expires) + 10**6}")), 403,
                        "signature", "invalid_signature")
    unsigned = url.split("&expires=")[0]
    assert_openai_error(httpx.get(unsigned), 401, None, "invalid_api_key")


def test_a_streamed_generation_sends_openais_events_partial_images_numbered_per_image(api_server):
    with generate_stream(api_server, n=2, partial_images=2, num_inference_steps=6, output_format="jpeg") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        job_id = response.headers["x-machgen-job-id"]
        events = server_sent_events(response.iter_lines())
    assert {name for name, _ in events} == {"image_generation.partial_image", "image_generation.completed"}
    for name, data in events:
        validate(data, "ImageGenStreamEvent")
        validate(data, {"image_generation.partial_image": "ImageGenPartialImageEvent",
                        "image_generation.completed": "ImageGenCompletedEvent"}[name])
        assert data["type"] == name and data["output_format"] == "jpeg" and data["size"] == "64x64"
        assert base64.b64decode(data["b64_json"])[:3] == b"\xff\xd8\xff"
        assert data["machgen"]["job_id"] == job_id
    for index in (0, 1):
        partials = [data["partial_image_index"] for name, data in events
                    if name.endswith("partial_image") and data["machgen"]["index"] == index]
        assert partials == [0, 1]
    assert [name for name, _ in events][-2:] == ["image_generation.completed"] * 2
    import openai

    stream = openai_client(api_server).images.generate(model=PIPELINE_NAME, prompt="a red cat", stream=True,
                                                       partial_images=1, extra_body={**FAST, "num_inference_steps": 4})
    types = [event.type for event in stream]
    assert types == ["image_generation.partial_image", "image_generation.completed"]
    with generate_stream(api_server) as response:  # partial_images 0, OpenAI's default: the image alone
        assert [name for name, _ in server_sent_events(response.iter_lines())] == ["image_generation.completed"]
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(api_server).images.generate(model=PIPELINE_NAME, prompt="a cat", partial_images=2)
    assert refused.value.param == "partial_images"  # partial images are streamed


def generate_stream(api, **fields):
    return httpx.stream("POST", f"{api.url}/v1/images/generations", headers=auth(api), timeout=120,
                        json={"model": PIPELINE_NAME, "prompt": "a red cat", **FAST, "stream": True, **fields})


def test_a_streamed_edit_sends_image_edit_events(api_server):
    with edit(api_server, {"stream": True, "partial_images": 1, "output_format": "webp"}, stream=True) as response:
        events = server_sent_events(response.iter_lines())
    assert [name for name, _ in events] == ["image_edit.partial_image", "image_edit.completed"]
    for name, data in events:
        validate(data, "ImageEditStreamEvent")
        validate(data, {"image_edit.partial_image": "ImageEditPartialImageEvent",
                        "image_edit.completed": "ImageEditCompletedEvent"}[name])
    usage = events[-1][1]["usage"]
    assert usage["input_tokens_details"]["image_tokens"] > 0  # the picture edited is input
    start = io.BytesIO()
    Image.fromarray(picture(64, 64, seed=4)).save(start, format="PNG")
    answer = openai_client(api_server).images.edit(model=PIPELINE_NAME, image=("s.png", start.getvalue(), "image/png"),
                                                   prompt="a blue square", output_format="jpeg",
                                                   extra_body={"num_inference_steps": 4, "seed": 3})
    assert answer.output_format == "jpeg" and base64.b64decode(answer.data[0].b64_json)[:3] == b"\xff\xd8\xff"
    assert answer.usage.input_tokens_details.image_tokens == usage["input_tokens_details"]["image_tokens"]


@pytest.mark.parametrize("request_schema", ["CreateImageRequest", "CreateImageEditRequest"])
def test_each_field_openai_defines_is_refused_by_name_outside_openais_values(api_server, request_schema):
    """From OpenAI's request schema: an enumerated field's value outside its list, an integer outside its
    bounds: 400 naming the field. A value OpenAI lists that is not honoured here: 400, unsupported_value."""
    send = (lambda fields: generate(api_server, **fields)) if request_schema == "CreateImageRequest" \
        else (lambda fields: edit(api_server, fields))
    properties = openai_schema(request_schema)["properties"]
    checked = set()
    for name, schema in properties.items():
        values = enum_values(schema)
        if values is not None:
            assert set(HONOURED[name]) <= set(values), name
            for value in ["not-" + values[0], 3]:
                assert_openai_error(send({name: value}), 400, name, "invalid_value")
            for value in sorted(set(values) - HONOURED[name]):
                assert_openai_error(send({name: value}), 400, name, "unsupported_value")
            checked.add(name)
        bounds = integer_bounds(schema)
        if bounds is not None:
            # output_compression gives its bounds in words: "The compression level (0-100%)".
            low, high = bounds if bounds != (None, None) else (0, 100)
            assert name != "output_compression" or "(0-100%)" in schema["description"]
            for value in (low - 1, high + 1, "many"):
                fields = {name: value, "stream": True} if name == "partial_images" else {name: value}
                assert_openai_error(send({**fields, "output_format": "webp"}), 400, name, "invalid_value")
            checked.add(name)
    expected = {"quality", "response_format", "output_format", "background", "n", "output_compression",
                "partial_images", *(("input_fidelity",) if "Edit" in request_schema else ("moderation", "style"))}
    assert checked == expected
    # A field OpenAI defines for the other route is unknown here, as any other.
    other = "style" if "Edit" in request_schema else "input_fidelity"
    assert_openai_error(send({other: "low"}), 400, other, "unknown_parameter")
    assert_openai_error(send({"background": True}), 400, "background", "invalid_value")  # machgen's is 'async'
    assert_openai_error(send({"output_compression": 50}), 400, "output_compression")  # png is lossless


def test_what_openais_schemas_refuse_is_refused_naming_the_field(api_server):
    """OpenAI's schemas type ``n`` an integer (JSON's "2" is refused; a multipart edit's text is read as one)
    and allow prompts of at most 32,000 characters. Videos' prompt: test_api_routes.py (no video model here)."""
    assert_openai_error(generate(api_server, n="2"), 400, "n", "invalid_value")
    assert_openai_error(generate(api_server, prompt="a" * 32001), 400, "prompt", "string_above_max_length")
    assert_openai_error(edit(api_server, {"prompt": "a" * 32001}), 400, "prompt", "string_above_max_length")
    assert_openai_error(edit(api_server, {"n": "2", "output_compression": 50}), 400, "output_compression")  # n read


def test_every_error_is_openais_error_object(api_server):
    import openai

    url = api_server.url
    cases = [
        (httpx.get(f"{url}/v1/jobs?limit=abc", headers=auth(api_server)), 400, "limit"),  # mistyped
        (httpx.get(f"{url}/v1/jobs?limit=101", headers=auth(api_server)), 400, "limit"),  # out of range
        (httpx.get(f"{url}/v1/videos?limit=-1", headers=auth(api_server)), 400, "limit"),
        (httpx.get(f"{url}/v1/videos?order=sideways", headers=auth(api_server)), 400, "order"),
        (httpx.get(f"{url}/v1/videos?limt=5", headers=auth(api_server)), 400, "limt"),  # misspelt
        (httpx.get(f"{url}/v1/videos/video_nope", headers=auth(api_server)), 404, "id"),
        (httpx.get(f"{url}/v1/videos/video_nope/content?variant=poster", headers=auth(api_server)), 400, "variant"),
        (httpx.get(f"{url}/v1/jobs/img_nope/content?index=x", headers=auth(api_server)), 400, "index"),
        (httpx.get(f"{url}/v1/nowhere", headers=auth(api_server)), 404, None),
        (httpx.post(f"{url}/v1/models", headers=auth(api_server)), 405, None),
        (httpx.post(f"{url}/v1/images/generations", content=b"{", headers={**auth(api_server),
                                                                            "content-type": "application/json"}),
         400, None),
        (httpx.get(f"{url}/v1/models"), 401, None),
    ]
    for response, status, param in cases:
        assert_openai_error(response, status, param)
    empty = httpx.get(f"{url}/v1/videos?limit=0&order=asc", headers=auth(api_server))
    assert empty.status_code == 200
    validate(empty.json(), "VideoListResource")
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client(api_server).videos.list(limit=101)
    assert refused.value.param == "limit"
