"""A structured-output constraint: what the output must match, as data that travels in
SamplingParams.

The gateway (OpenAI's `response_format`, vLLM's `structured_outputs` and `guided_*`, tool calling)
and the SDK build one; the engine compiles it with xgrammar (engine/structured.py) and masks the
sampler with it. Nothing here imports xgrammar or torch: the gateway must not, and checking the
*meaning* of a schema, regex or grammar is the compiler's job, whose message comes back as a 400
(docs/structured_output.md). This module checks only the shape: a known kind, a string value of
bounded size, JSON where JSON is due.

kinds and their `value`:
  json            a JSON schema, as JSON text (OpenAI json_schema, vLLM json / guided_json)
  json_object     any JSON object; value ""
  regex           a regular expression the whole output matches
  choice          one of a list of strings, the list as JSON text (vLLM choice / guided_choice)
  grammar         an EBNF grammar (xgrammar's dialect, GBNF-like: `root ::= ...`)
  structural_tag  an xgrammar structural tag, as JSON text (tool calls: tags around JSON arguments)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequest

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# a schema or grammar larger than this is refused (the wire has a size limit)
MAX_CONSTRAINT_CHARS = 100_000
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """InvalidRequest naming what is wrong with the shape; the compiler judges the content
        later."""
        if self.kind not in KINDS:
            raise InvalidRequest(f"constraint kind must be one of {list(KINDS)}, got "
                                 f"{self.kind!r}"[:300], param="constraint")
        if not isinstance(self.value, str):
            raise InvalidRequest("constraint value must be a string, got "
                                 f"{type(self.value).__name__}", param="constraint")
        if len(self.value) > MAX_CONSTRAINT_CHARS:
            raise InvalidRequest(f"the {self.kind} constraint has {len(self.value)} characters; at "
                                 f"most {MAX_CONSTRAINT_CHARS} are accepted", param="constraint")
        if self.kind == "json_object":
            if self.value:
                raise InvalidRequest("a json_object constraint takes no value", param="constraint")
            return
        if not self.value:
            raise InvalidRequest(f"the {self.kind} constraint is empty", param="constraint")
        if self.kind in ("json", "structural_tag"):
            if not isinstance(_loads(self.value, self.kind), dict):
                raise InvalidRequest(f"the {self.kind} constraint must be a JSON object",
                                     param="constraint")
        elif self.kind == "choice":
            choices = _loads(self.value, "choice")
            if not (isinstance(choices, list) and 0 < len(choices) <= MAX_CHOICES
                    and all(isinstance(c, str) and c for c in choices)):
                raise InvalidRequest(f"choice must be a list of 1 to {MAX_CHOICES} non-empty "
                                     "strings", param="constraint")

    @property
    def choices(self) -> list[str]:
        assert self.kind == "choice"
        out: list[str] = json.loads(self.value)
        return out

    @classmethod
    def from_wire(cls, value: object) -> Constraint | None:
        """None, a Constraint, or its dict (SamplingParams.to_dict / the wire) -> a Constraint."""
        if value is None or isinstance(value, Constraint):
            return value
        if not isinstance(value, dict) or set(value) - {"kind", "value"} or "kind" not in value:
            raise InvalidRequest("constraint must be an object {kind, value}", param="constraint")
        return cls(value["kind"], value.get("value", ""))


def json_schema(schema: dict[str, Any]) -> Constraint:
    """A JSON schema given as a Python object (a client's dict) -> its constraint."""
    if not isinstance(schema, dict):
        raise InvalidRequest("a JSON schema must be an object", param="schema")
    return Constraint("json", json.dumps(schema, separators=(",", ":")))


def choice(options: list[str]) -> Constraint:
    if not isinstance(options, list):
        raise InvalidRequest("choice must be a list of strings", param="choice")
    return Constraint("choice", json.dumps(options))


def _loads(text: str, kind: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidRequest(f"the {kind} constraint is not valid JSON: {e}"[:300],
                             param="constraint") from None
