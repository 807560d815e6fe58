"""A GenerateRequest's output_format (wire) → an llguidance grammar for the engine
(coordinator/engine/constrained.py), with INVALID_ARGUMENT-worthy messages naming the
field."""

from __future__ import annotations

import json

import llguidance

from common.errors import InvalidRequest
from common.proto_gen import wedlm_pb2 as pb
from coordinator.engine.constrained import Grammars

# Compact JSON, as the HTTP API asks (a grammar that allows any whitespace lets a weak
# model pad forever).
JSON_OPTIONS = {"whitespace_flexible": False}


def _schema_grammar(schema: object, field: str) -> str:
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{field}: the JSON schema must be an object")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise InvalidRequest(f"{field}: {e}") from None


def _grammar(fmt: pb.OutputFormat) -> str | None:
    which = fmt.WhichOneof("format")
    field = f"output_format.{which}"
    if which == "json_schema":
        try:
            schema = json.loads(fmt.json_schema)
        except ValueError as e:
            raise InvalidRequest(f"{field} is not JSON: {e}") from None
        return _schema_grammar(schema, field)
    if which == "json_object":
        return _schema_grammar({"type": "object"}, field) if fmt.json_object else None
    if which in ("regex", "lark"):
        source = getattr(fmt, which)
        if not source:
            raise InvalidRequest(f"{field} is empty")
        make = (
            llguidance.LLMatcher.grammar_from_regex
            if which == "regex"
            else (llguidance.LLMatcher.grammar_from_lark)
        )
        try:
            return make(source)
        except ValueError as e:
            raise InvalidRequest(f"{field}: {e}") from None
    return None


def grammar_from_request(req: pb.GenerateRequest, grammars: Grammars | None) -> str | None:
    """The grammar the request's output must match (None: free text)."""
    if not req.HasField("output_format"):
        return None
    grammar = _grammar(req.output_format)
    if grammar is None:
        return None
    which = req.output_format.WhichOneof("format")
    if grammars is None:
        raise InvalidRequest(f"output_format.{which}: this model does not decode structured output")
    try:
        grammars.check(grammar)
    except InvalidRequest as e:
        raise InvalidRequest(f"output_format.{which}: {e}") from None
    return grammar
