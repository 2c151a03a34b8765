"""A small JSON Schema validator for the kernel generator protocol's schema
(`generator_schema.json`): the keywords that schema uses (type, enum, properties, required,
additionalProperties, items, minItems, maxItems, minLength, minimum, maximum, local `$ref`),
so that the protocol is checked in both directions without a dependency. The schema itself
is standard draft 2020-12: generator authors can check against it with any validator."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).with_name("generator_schema.json")

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


@functools.lru_cache(maxsize=1)
def protocol_schema() -> dict[str, Any]:
    """The protocol's schema (shipped beside this module)."""
    return json.loads(SCHEMA_FILE.read_text())


def _is(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[kind])


def errors(value: Any, schema: dict[str, Any], root: dict[str, Any], where: str = "$") -> list[str]:
    """What is wrong with `value` against `schema` (whose `$ref`s point into `root`), each
    as "where: what"; empty when it conforms."""
    if "$ref" in schema:
        node = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        return errors(value, node, root, where)
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_is(value, kind) for kind in kinds):
            return [f"{where}: expected {' or '.join(kinds)}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} is not one of {schema['enum']}"]
    found = []
    if isinstance(value, dict):
        found += [f"{where}: lacks '{name}'" for name in schema.get("required", []) if name not in value]
        properties = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for name, item in value.items():
            if name in properties:
                found += errors(item, properties[name], root, f"{where}.{name}")
            elif extra is False:
                found.append(f"{where}: unexpected '{name}'")
            elif isinstance(extra, dict):
                found += errors(item, extra, root, f"{where}.{name}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            found.append(f"{where}: fewer than {schema['minItems']} items")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            found.append(f"{where}: more than {schema['maxItems']} items")
        if "items" in schema:
            for index, item in enumerate(value):
                found += errors(item, schema["items"], root, f"{where}[{index}]")
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        found.append(f"{where}: shorter than {schema['minLength']} characters")
    if _is(value, "number") and "minimum" in schema and value < schema["minimum"]:
        found.append(f"{where}: {value} < {schema['minimum']}")
    if _is(value, "number") and "maximum" in schema and value > schema["maximum"]:
        found.append(f"{where}: {value} > {schema['maximum']}")
    return found


def protocol_errors(value: Any, definition: str) -> list[str]:
    """What is wrong with `value` as the protocol's `definition` ("task" or "candidates")."""
    root = protocol_schema()
    return errors(value, root["$defs"][definition], root)
