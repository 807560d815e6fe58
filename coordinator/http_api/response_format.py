"""What an OpenAI request asks its output to match, as an llguidance grammar
(coordinator/engine/constrained.py decodes with it): `response_format` json_object or
json_schema, and `tool_choice` required or a named function (a call in the model's own
tool-call markup whose JSON validates against the function's parameters, as vLLM does).
Problems are 400s naming the field."""

from __future__ import annotations

import json
from typing import Any

import llguidance

from common.errors import InvalidRequest
from common.tokenizer import ToolSyntax
from coordinator.engine.constrained import Grammars
from coordinator.http_api.api_errors import ApiError
from coordinator.http_api.tool_grammar import call_lark, marker_lark

# Compact JSON: a grammar that allows any whitespace lets a weak model pad forever.
JSON_OPTIONS = {"whitespace_flexible": False}


def _checked(grammars: Grammars | None, grammar: str, field: str) -> str:
    if grammars is None:
        raise ApiError(400, f"{field}: this model does not decode structured output", field)
    try:
        grammars.check(grammar)
    except InvalidRequest as e:
        raise ApiError(400, f"{field}: {e}", field) from None
    return grammar


def schema_grammar(schema: Any, grammars: Grammars | None, field: str) -> str:
    """The grammar of JSON that validates against `schema`."""
    if not isinstance(schema, dict):
        raise ApiError(400, f"{field}: the JSON schema must be an object", field)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except ValueError as e:
        raise ApiError(400, f"{field}: {e}", field) from None
    return _checked(grammars, grammar, field)


def response_format_grammar(rf: dict[str, Any] | None, grammars: Grammars | None) -> str | None:
    """OpenAI's `response_format` (None, text: free text)."""
    if not rf or rf.get("type") == "text":
        return None
    kind = rf.get("type")
    if kind == "json_object":
        return schema_grammar({"type": "object"}, grammars, "response_format")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(400, "response_format.json_schema.schema is required",
                           "response_format.json_schema.schema")  # fmt: skip
        return schema_grammar(spec["schema"], grammars, "response_format.json_schema.schema")
    raise ApiError(
        400,
        f"response_format.type must be text, json_object or json_schema, got {kind!r}",
        "response_format.type",
    )


def tool_choice_grammar(
    choice: Any, tools: list[dict[str, Any]], syntax: ToolSyntax, grammars: Grammars | None
) -> str | None:
    """`tool_choice` required (one call of any tool) or {"type": "function", "function":
    {"name": ...}} (one call of that one); None for auto and none."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        chosen = tools
    else:
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if not isinstance(name, str):
            shape = '{"type": "function", "function": {"name": ...}}'
            raise ApiError(400, f"tool_choice: 'none', 'auto', 'required' or {shape}",
                           "tool_choice")  # fmt: skip
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise ApiError(400, f"tool_choice: no tool named {name!r} in tools", "tool_choice")
    if not syntax.parse.__module__.endswith("json_tools"):  # the other formats
        stops = getattr(grammars, "_stop_ids", ())  # the model's stop tokens
        if (other := call_lark(chosen, syntax, stops)) is not None:
            return _checked(grammars, other, "tool_choice")
        raise ApiError(400, "tool_choice: required and named functions need a tool-call "
                       "format this server writes (json_tools, qwen3_coder, glm47, "
                       "minimax_m2, harmony); "
                       f"this model's is {syntax.format or 'another'}",
                       "tool_choice")  # fmt: skip
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema = {"anyOf": calls, "x-guidance": JSON_OPTIONS}
    lark = (
        f"start: {marker_lark(syntax.start + chr(10), syntax)} call "
        f"{marker_lark(chr(10) + syntax.end, syntax)}\n"
        f"call: %json {json.dumps(schema)}\n"
    )
    return _checked(grammars, llguidance.LLMatcher.grammar_from_lark(lark), "tool_choice")
