"""OpenAI's schemas (tests/openai_schemas/openai_api.json, vendored from its OpenAPI description) and
validation against them with jsonschema."""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path

SCHEMAS_FILE = Path(__file__).parent / "openai_schemas" / "openai_api.json"
# OpenAI's response schemas list the sizes its own models make; the served models make others, which its
# request schemas already allow as any WIDTHxHEIGHT string (gpt-image-2's "arbitrary resolutions").
ANY_SIZE = {"type": "string", "pattern": r"^([0-9]+x[0-9]+|auto)$"}


@functools.cache
def openai_spec() -> dict:
    return json.loads(SCHEMAS_FILE.read_text())


def openai_schema(name: str) -> dict:
    return openai_spec()["components"]["schemas"][name]


@functools.cache
def _document() -> dict:
    """The vendored document with every ``size`` taking any WIDTHxHEIGHT (ANY_SIZE), nothing else changed."""
    document = copy.deepcopy(openai_spec())
    schemas = document["components"]["schemas"]
    schemas["VideoSize"] = ANY_SIZE
    for schema in schemas.values():
        if "size" in schema.get("properties", {}) and "enum" in schema["properties"]["size"]:
            description = schema["properties"]["size"].get("description")
            schema["properties"]["size"] = {**ANY_SIZE, "description": description}
    return document


def validate(instance, name: str) -> None:
    """Raises jsonschema.ValidationError unless ``instance`` is a ``name`` (a component schema)."""
    import jsonschema

    document = _document()
    schema = {**document, "$ref": f"#/components/schemas/{name}"}
    jsonschema.validate(instance, schema, cls=jsonschema.Draft202012Validator)


def enum_values(property_schema: dict) -> list[str] | None:
    """The values OpenAI lists for a property (its enum, or that of a referenced or anyOf schema); None
    where any string goes (an anyOf with a plain string: model, size)."""
    if "$ref" in property_schema:
        return enum_values(openai_schema(property_schema["$ref"].rsplit("/", 1)[1]))
    if "enum" in property_schema:
        return list(property_schema["enum"])
    options = property_schema.get("anyOf", [])
    if any(option.get("type") == "string" and "enum" not in option for option in options):
        return None
    for option in options:
        found = enum_values(option)
        if found:
            return found
    return None


def integer_bounds(property_schema: dict) -> tuple[int | None, int | None] | None:
    """(minimum, maximum) OpenAI sets for an integer property (directly, referenced or in anyOf)."""
    if "$ref" in property_schema:
        return integer_bounds(openai_schema(property_schema["$ref"].rsplit("/", 1)[1]))
    if property_schema.get("type") == "integer":
        return property_schema.get("minimum"), property_schema.get("maximum")
    for option in property_schema.get("anyOf", []):
        bounds = integer_bounds(option)
        if bounds:
            return bounds
    return None
