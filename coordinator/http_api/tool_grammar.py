"""`tool_choice` required / a named function as a grammar in the model's own tool-call
markup, for the formats whose arguments are not one JSON object between markers
(response_format.py does Qwen's JSON `<tool_call>`): Qwen3-Coder's XML parameters,
GLM-4.5/4.7's `<arg_key>`/`<arg_value>` pairs, MiniMax-M2's `<invoke>` and harmony's
commentary message. A string
parameter is free text without markup (its `enum`, when it has one, chosen from), any
other is JSON of its schema; what mlx-lm's parser of that format reads back."""

from __future__ import annotations

import json
from typing import Any

from common.tokenizer import ToolSyntax

# Compact JSON, as response_format.py's (a grammar that allows any whitespace lets a weak
# model pad forever); a free string stops at markup and is kept short.
_JSON_OPTIONS = {"whitespace_flexible": False}
_FREE_TEXT = r"/[^<\n]{1,80}/"
FORMATS = ("qwen3_coder", "glm47", "minimax_m2", "harmony")


def marker_lark(text: str, syntax: ToolSyntax) -> str:
    """A marker in lark: an added token by its id (llguidance does not match an added
    token's text), other text quoted."""
    special = dict(syntax.added_tokens)
    pieces, rest = [], text
    while rest:
        hit = min(((rest.find(m), m) for m in special if m in rest), default=None)
        if hit is None:
            pieces.append(json.dumps(rest))
            break
        at, marker = hit
        if at:
            pieces.append(json.dumps(rest[:at]))
        pieces.append(f"<[{special[marker]}]>")
        rest = rest[at + len(marker) :]
    return " ".join(pieces)


def _value(schema: Any, syntax: ToolSyntax) -> str:
    """A parameter's value: free text for a string (one of its enum when given), JSON
    of its schema otherwise."""
    schema = schema if isinstance(schema, dict) else {}
    if schema.get("type") == "string" or (
        "type" not in schema and all(isinstance(v, str) for v in schema.get("enum") or [1])
    ):
        if schema.get("enum"):
            return "(" + " | ".join(marker_lark(str(v), syntax) for v in schema["enum"]) + ")"
        return _FREE_TEXT
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})


def _parameters(tool: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """(name, schema, required) of a function's parameters, in their order."""
    params = tool["function"].get("parameters") or {}
    required = set(params.get("required") or ())
    return [(k, v, k in required) for k, v in (params.get("properties") or {}).items()]


def _call_rule(tool: dict[str, Any], syntax: ToolSyntax, i: int) -> list[str]:
    """The lark rules of one function's call (rule `call{i}` and its parameters)."""
    name = tool["function"]["name"]
    rules, parts = [], []
    for j, (key, schema, required) in enumerate(_parameters(tool)):
        if syntax.format == "qwen3_coder":
            opening, closing = f"<parameter={key}>\n", "\n</parameter>\n"
        elif syntax.format == "minimax_m2":
            opening, closing = f'<parameter name="{key}">', "</parameter>\n"
        else:  # glm47
            opening, closing = f"<arg_key>{key}</arg_key><arg_value>", "</arg_value>"
        body = f"{marker_lark(opening, syntax)} v{i}_{j} {marker_lark(closing, syntax)}"
        rules += [f"p{i}_{j}: {body}", f"v{i}_{j}: {_value(schema, syntax)}"]
        parts.append(f"p{i}_{j}" + ("" if required else "?"))
    if syntax.format == "qwen3_coder":
        head = marker_lark(f"\n<function={name}>\n", syntax)
        tail = marker_lark("</function>\n", syntax)
    elif syntax.format == "minimax_m2":
        head = marker_lark(f'\n<invoke name="{name}">\n', syntax)
        tail = marker_lark("</invoke>\n", syntax)
    else:
        head, tail = marker_lark(name, syntax), ""
    rules.append(f"call{i}: {head} {' '.join(parts)} {tail}".rstrip())
    return rules


def call_lark(
    chosen: list[dict[str, Any]], syntax: ToolSyntax, stop_ids: tuple[int, ...]
) -> str | None:
    """The lark grammar of one call of one of `chosen` in `syntax`'s format, or None for a
    format this module does not write. `stop_ids`: a closing marker that is a stop token
    (gpt-oss's <|call|>) is left to the stop (the reply's parser reads a call cut there)."""
    if syntax.format == "harmony":
        stop = dict(syntax.added_tokens).get(syntax.end) in stop_ids
        calls = []
        for i, tool in enumerate(chosen):
            params = tool["function"].get("parameters") or {"type": "object"}
            head = f"<|channel|>commentary to=functions.{tool['function']['name']} " \
                   "<|constrain|>json<|message|>"  # fmt: skip
            end = "" if stop else " " + marker_lark(syntax.end, syntax)
            calls.append(f"call{i}: {marker_lark(head, syntax)} args{i}{end}")
            calls.append(f"args{i}: %json {json.dumps({**params, 'x-guidance': _JSON_OPTIONS})}")
        alternatives = " | ".join(f"call{i}" for i in range(len(chosen)))
        return "\n".join([f"start: {alternatives}", *calls]) + "\n"
    if syntax.format not in FORMATS:
        return None
    rules = [r for i, tool in enumerate(chosen) for r in _call_rule(tool, syntax, i)]
    alternatives = " | ".join(f"call{i}" for i in range(len(chosen)))
    opening, closing = marker_lark(syntax.start, syntax), marker_lark(syntax.end, syntax)
    start = f"start: {opening} ({alternatives}) {closing}"
    return "\n".join([start, *rules]) + "\n"
