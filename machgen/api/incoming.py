"""What a route reads of its request: who calls (the key, the owner a gateway names), its fields (JSON or a
form, with its uploaded files) and its query."""

from __future__ import annotations

import base64
import json
from typing import Any

from machgen.api.schemas import ApiError, TextValue, bounded, invalid, typed
from machgen.api.state import ApiState

ANONYMOUS = "anonymous"


def bearer(request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def caller(state: ApiState, request) -> tuple[str, int]:
    """(the key's name, its limit of jobs in flight); 401 without a valid key where keys are needed."""
    if not state.keys.required:
        return ANONYMOUS, state.settings.max_jobs_per_key
    key = state.keys.find(bearer(request))
    if key is None:
        problem = "no API key given" if bearer(request) is None else "the API key is not valid"
        raise ApiError(401, f"{problem}: send 'Authorization: Bearer KEY'", code="invalid_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    return key.name, key.max_jobs or state.settings.max_jobs_per_key


def owner_of(state: ApiState, request) -> str:
    """Whose request it is, for fair shares: the tenant a trusted gateway names (--tenant-header), else the key's
    name."""
    owner, _ = caller(state, request)
    header = state.settings.tenant_header
    tenant = request.headers.get(header, "").strip() if header else ""
    return f"{owner}/{tenant}" if tenant else owner


async def read_fields(state: ApiState, request, form: bool, json_body: bool) -> tuple[dict[str, Any],
                                                                                      dict[str, list[bytes]]]:
    """The request's fields and uploaded files, from JSON or a multipart/urlencoded form (whose values are
    TextValue: text that each field's type reads, where JSON's values have their own types)."""
    limit = state.settings.max_upload_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body is {int(length)} bytes; this API takes at most {limit}",
                       code="request_too_large")
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if json_body and content_type in ("application/json", ""):
        body = await request.body()
        if len(body) > limit:
            raise ApiError(413, f"the request body is over {limit} bytes", code="request_too_large")
        try:
            fields = json.loads(body or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ApiError(400, f"the body is not valid JSON: {err}", code="invalid_json") from None
        if not isinstance(fields, dict):
            raise ApiError(400, "the body must be a JSON object", code="invalid_json")
        return fields, {}
    if form and content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            parsed = await request.form(max_files=16, max_fields=64, max_part_size=limit)
        except Exception as err:  # noqa: BLE001 - starlette's parse errors, a part over the limit
            raise ApiError(400, f"the form could not be read: {err}", code="invalid_form") from None
        fields: dict[str, Any] = {}
        files: dict[str, list[bytes]] = {}
        total = 0
        for name, value in parsed.multi_items():
            name = name.removesuffix("[]")
            if hasattr(value, "read"):
                data = await value.read()
                total += len(data)
                if total > limit:
                    raise ApiError(413, f"the uploaded files are over {limit} bytes", code="request_too_large")
                files.setdefault(name, []).append(data)
            else:
                fields[name] = TextValue(value)
        return fields, files
    accepted = " or ".join(kind for kind, ok in (("application/json", json_body), ("multipart/form-data", form))
                           if ok)
    raise ApiError(415, f"content type {content_type or '(none)'} is not accepted here; send {accepted}",
                   code="unsupported_media_type")


def query(request, allowed: dict[str, type]) -> dict[str, Any]:
    """The query's parameters, typed; one the route does not take is refused by name (as a body's are)."""
    for name in request.query_params:
        if name not in allowed:
            raise invalid(name, f"unknown query parameter '{name}'; this route takes "
                                f"{', '.join(allowed) or 'none'}", code="unknown_parameter")
    return {name: typed(name, TextValue(request.query_params[name]), kind) for name, kind in allowed.items()
            if name in request.query_params}


def page(request, extra: dict[str, type] | None = None) -> tuple[int, str | None, bool, dict[str, Any]]:
    """OpenAI's list parameters: (``limit`` 0-100, default 20; ``after``; ascending, from ``order`` asc or
    desc, default desc; the query, ``extra`` included)."""
    found = query(request, {"limit": int, "after": str, "order": str, **(extra or {})})
    limit = bounded("limit", found.get("limit", 20), 0, 100)
    order = found.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", f"'order' must be asc or desc, not {order!r}")
    return limit, found.get("after"), order == "asc", found


def data_url_bytes(name: str, value: Any) -> bytes:
    """An image given in JSON: a data URL or {"image_url": data URL} (no fetching of remote URLs)."""
    if isinstance(value, dict):
        value = value.get("image_url")
    if not isinstance(value, str) or not value.startswith("data:") or ";base64," not in value:
        raise invalid(name, f"'{name}' in JSON must be a base64 data URL (or upload it as a file with "
                            f"multipart/form-data)")
    try:
        return base64.b64decode(value.split(";base64,", 1)[1], validate=True)
    except ValueError:
        raise invalid(name, f"'{name}' is not valid base64") from None
