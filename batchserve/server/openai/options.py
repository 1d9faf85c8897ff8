"""The OpenAI API's option objects inside a request body: batchserve's `lookahead`, `stream_options`,
`prediction` (predicted outputs) and `response_format` (structured output)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from batchserve.request import MAX_INT32, Constraint
from batchserve.server.openai.errors import ApiError

# JSON levels a client's schema may nest (OpenAI allows 10 levels of objects, about 25 of JSON):
# strict_schema, json.dumps and the grammar compiler all recurse through it.
MAX_SCHEMA_DEPTH = 64


def too_deep(value: Any, limit: int) -> bool:
    """Whether parsed JSON `value` nests objects and arrays more than `limit` deep (measured
    without recursion, so that any depth a body parser let through is answered)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def count_field() -> Any:
    """An optional count with SamplingParams' bounds, so that a bad value is a 400 naming its field."""
    return Field(default=None, ge=1, le=MAX_INT32)


class LookaheadOptions(BaseModel):
    """batchserve's speculation options (an extra field, as vLLM takes its own extras)."""

    model_config = ConfigDict(extra="forbid")
    enable: bool | None = None
    decoding_length: int | None = Field(default=None, ge=0, le=MAX_INT32)
    layout: str | None = None
    jacobi_window: int | None = count_field()
    jacobi_ngram: int | None = Field(default=None, ge=2, le=MAX_INT32)
    jacobi_guesses: int | None = Field(default=None, ge=0, le=MAX_INT32)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    # OpenAI pads its chunks against length side channels. None is added here, so asking for it
    # is refused rather than ignored: a client must not believe its stream is padded.
    include_obfuscation: bool | None = None


OBFUSCATION_REFUSED = (
    "no padding is added to stream events here (their count and sizes show the output's pace): send false or omit it"
)


class Prediction(BaseModel):
    """OpenAI's predicted output: text the completion is expected to repeat (a code edit's file).
    It drafts, privately to the request; it never changes the output."""

    model_config = ConfigDict(extra="forbid")
    type: str
    content: str | list[dict[str, Any]]

    def text(self) -> str:
        """The predicted text; 400 for another type or a part that is not text."""
        if self.type != "content":
            raise ApiError(400, f"prediction.type: only 'content' is supported, got {self.type!r}", "prediction.type")
        if isinstance(self.content, str):
            return self.content
        parts = []
        for i, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                param = f"prediction.content[{i}]"
                raise ApiError(400, f"{param}: only text parts are supported", param)
            parts.append(part["text"])
        return "".join(parts)


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema under `schema`, with its name."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None  # the output always matches the schema: strict or not


class ResponseFormat(BaseModel):
    """OpenAI's `response_format` (text, json_object, json_schema), plus two batchserve extras:
    `{"type": "regex", "regex": ...}` and `{"type": "grammar", "grammar": <Lark>}`."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema", "regex", "grammar"]
    json_schema: JsonSchemaFormat | None = None
    regex: str | None = None
    grammar: str | None = None

    def constraint(self) -> Constraint | None:
        """The constraint it asks for (None for text); 400 naming the field that is missing."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return Constraint("json_object")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise ApiError(400, "response_format.json_schema is required for type json_schema", "response_format")
            schema = self.json_schema.json_schema
            if too_deep(schema, MAX_SCHEMA_DEPTH):  # before anything recurses through it
                param = "response_format.json_schema.schema"
                raise ApiError(400, f"{param}: nested deeper than {MAX_SCHEMA_DEPTH} (MAX_SCHEMA_DEPTH)", param)
            return Constraint("json_schema", json.dumps(strict_schema(schema) if self.json_schema.strict else schema))
        text = getattr(self, self.type)
        if not text:
            raise ApiError(400, f"response_format.{self.type} is required for type {self.type}", "response_format")
        return Constraint(self.type, text)


# Where a schema holds subschemas (JSON Schema 2020-12 and draft 7's keywords).
_ONE = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "unevaluatedProperties")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any) -> Any:
    """`schema` with every object subschema that leaves `additionalProperties` out closed (false):
    OpenAI's strict mode, where an object holds the keys it declares and no others. Without it the
    grammar may write keys the schema never named (JSON Schema allows them by default)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(s) for name, s in out[key].items()}
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or "properties" in out
    if is_object and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out
