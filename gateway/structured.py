"""Structured-output fields of a request body -> one Constraint (shared/constraints.py), or None.

Spellings accepted, at most one per request:
- OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema": {"name",
  "schema", "strict", "description"}}, on chat and completions alike (as vLLM); `{"type":
  "json_object", "schema": {...}}` (several hosted APIs' spelling) is that schema, an object at the
  top;
- vLLM's current extra: `structured_outputs` {"json" | "regex" | "choice" | "grammar" |
  "json_object"};
- vLLM's older extras: `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
Only the shape is checked here; whether a schema, regex or grammar compiles is the engine's
compiler's to say (an ERROR 400 with its message, before the request is queued:
docs/structured_output.md).
"""
from __future__ import annotations

import json
from typing import Any

from shared import constraints
from shared.constraints import Constraint
from shared.errors import InvalidRequest

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
          "guided_grammar")
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def constraint_of(body: dict[str, Any]) -> Constraint | None:
    """The request's constraint; InvalidRequest naming the field for a malformed or doubled one."""
    found: list[tuple[str, Constraint]] = []
    for name in FIELDS:
        value = body.get(name)
        if value is None:
            continue
        c = _PARSERS[name](value)
        if c is not None:
            found.append((name, c))
    if len(found) > 1:
        raise InvalidRequest(f"give one structured-output constraint, not {len(found)} ("
                             f"{', '.join(n for n, _ in found)})", param=found[1][0])
    return found[0][1] if found else None


def _response_format(value: Any) -> Constraint | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequest("response_format must be an object with a string 'type'",
                             param="response_format")
    kind = value["type"]
    for key, owner in (("schema", "json_object"), ("json_schema", "json_schema")):  # per type
        if value.get(key) is not None and kind != owner:
            why = f"response_format.{key} belongs to type {owner!r}, not {kind!r}"[:300]
            raise InvalidRequest(why, param=f"response_format.{key}")
    if kind == "text":
        return None
    if kind == "json_object":  # with `schema`: several hosted APIs' spelling of a JSON schema
        schema = value.get("schema")
        if schema is None:
            return Constraint("json_object")
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format.schema must be a JSON schema object",
                                 param="response_format.schema")
        return constraints.json_schema(schema if "type" in schema else {"type": "object", **schema})
    if kind != "json_schema":
        raise InvalidRequest("response_format type must be 'text', 'json_object' or "
                             f"'json_schema', got {kind!r}"[:300], param="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequest("response_format json_schema must be an object {name, schema, strict}",
                             param="response_format")
    if not isinstance(spec.get("name"), str):
        raise InvalidRequest("response_format json_schema.name must be a string",
                             param="response_format")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: a missing schema is any object
    if not isinstance(schema, dict):
        raise InvalidRequest("response_format json_schema.schema must be an object",
                             param="response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise InvalidRequest("response_format json_schema.strict must be true or false",
                             param="response_format")
    return constraints.json_schema(schema)


def _structured_outputs(value: Any) -> Constraint | None:
    if not isinstance(value, dict):
        raise InvalidRequest("structured_outputs must be an object", param="structured_outputs")
    # unknown keys were refused by request_fields.check_keys
    given = [k for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)]
    if len(given) != 1:
        raise InvalidRequest("structured_outputs must set exactly one of "
                             f"{', '.join(_STRUCTURED_KEYS)}", param="structured_outputs")
    key = given[0]
    if key == "json_object":
        if value[key] is not True:
            raise InvalidRequest("structured_outputs.json_object must be true",
                                 param="structured_outputs")
        return Constraint("json_object")
    parsed: Constraint = _PARSERS[f"guided_{key}"](value[key], "structured_outputs")
    return parsed


def _json(value: Any, param: str = "guided_json") -> Constraint:
    """A schema as an object, or as JSON text (vLLM accepts both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequest(f"{param}: the JSON schema is not valid JSON: {e}"[:300],
                                 param=param) from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param}: the JSON schema must be an object", param=param)
    return constraints.json_schema(value)


def _text(kind: str) -> Any:
    def parse(value: Any, param: str = f"guided_{kind}") -> Constraint:
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"{param}: the {kind} must be a non-empty string", param=param)
        return Constraint(kind, value)
    return parse


def _choice(value: Any, param: str = "guided_choice") -> Constraint:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise InvalidRequest(f"{param}: choice must be a non-empty list of non-empty strings",
                             param=param)
    return constraints.choice(value)


_PARSERS: dict[str, Any] = {"response_format": _response_format,
                            "structured_outputs": _structured_outputs, "guided_json": _json,
                            "guided_regex": _text("regex"), "guided_choice": _choice,
                            "guided_grammar": _text("grammar")}
