"""Parse tool calls written in assistant text and check their arguments against a JSON schema.

Format: <|tool_call|>{"name": ..., "arguments": {...}}<|/tool_call|>
A turn may open with reasoning, <|think|> ... <|/think|>: it is set apart first, so a tool call or an
answer written inside it is never taken (reasoning cut off before its close tag is all reasoning).
Nothing here raises on bad model output: problems come back as an error string that the
environment shows to the model as an observation.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from envs.json_input import JsonInputError, parse_json

OPEN = "<|tool_call|>"
CLOSE = "<|/tool_call|>"
THINK = "<|think|>"
THINK_CLOSE = "<|/think|>"


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ParsedTurn:
    """An assistant turn split into its text and (at most one) tool call."""

    text: str  # the assistant text outside the reasoning and the tool call
    call: ToolCall | None = None
    error: str | None = None  # set when the turn tried to call a tool but the call is malformed
    reasoning: str = ""  # the turn's reasoning (never parsed for calls or answers)

    @property
    def wants_tool(self) -> bool:
        return self.call is not None or self.error is not None


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """The canonical text of a tool call (what reference actions use)."""
    return OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + CLOSE


def split_reasoning(text: str) -> tuple[str, str]:
    """(the turn's reasoning, the rest). The first <|think|> opens it and the next <|/think|> closes
    it; unclosed, it runs to the end. A close tag with no open tag ends reasoning the prompt opened."""
    start = text.find(THINK)
    if start < 0:
        end = text.find(THINK_CLOSE)
        if end < 0:
            return "", text
        return text[:end], text[end + len(THINK_CLOSE):]
    end = text.find(THINK_CLOSE, start + len(THINK))
    if end < 0:
        return text[start + len(THINK):], text[:start]
    return text[start + len(THINK):end], text[:start] + text[end + len(THINK_CLOSE):]


def parse_turn(text: str) -> ParsedTurn:
    """Find the first tool call in `text` outside its reasoning. Generation stops at the close tag,
    so only one is used."""
    reasoning, text = split_reasoning(text)
    parsed = _parse_action(text)
    parsed.reasoning = reasoning
    return parsed


def _parse_action(text: str) -> ParsedTurn:
    start = text.find(OPEN)
    if start < 0:
        if CLOSE in text:
            return ParsedTurn(text=text, error=f"malformed tool call: found {CLOSE} without {OPEN}")
        return ParsedTurn(text=text)
    before = text[:start]
    rest = text[start + len(OPEN):]
    end = rest.find(CLOSE)
    body = rest if end < 0 else rest[:end]  # a missing close tag is tolerated if the JSON is whole
    try:
        obj = parse_json(body)
    except JsonInputError as exc:
        return ParsedTurn(text=before, error=f"malformed tool call: {exc}")
    if not isinstance(obj, dict):
        return ParsedTurn(text=before, error="malformed tool call: expected a JSON object with 'name' and 'arguments'")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParsedTurn(text=before, error="malformed tool call: 'name' must be a non-empty string")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI sends arguments as a JSON string; accept both
        try:
            args = parse_json(args) if args.strip() else {}
        except JsonInputError as exc:
            return ParsedTurn(text=before, error=f"malformed tool call: 'arguments' string is not JSON: {exc}")
    if not isinstance(args, dict):
        return ParsedTurn(text=before, error="malformed tool call: 'arguments' must be a JSON object")
    return ParsedTurn(text=before, call=ToolCall(name=name, arguments=args))


_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
    "null": (type(None),),
}


def check_arguments(schema: dict[str, Any], args: dict[str, Any]) -> str | None:
    """Validate `args` against an object schema (required, types, enum, extra keys). None if valid."""
    props: dict[str, Any] = schema.get("properties", {})
    for key in schema.get("required", []):
        if key not in args:
            return f"missing required argument '{key}'"
    if schema.get("additionalProperties", False) is False:
        extra = sorted(set(args) - set(props))
        if extra:
            return f"unexpected argument(s) {extra}; allowed: {sorted(props)}"
    for key, value in args.items():
        spec = props.get(key, {})
        kind = spec.get("type")
        if kind is not None:
            types = _JSON_TYPES.get(kind, (object,))
            bad_bool = isinstance(value, bool) and kind in ("integer", "number")
            if not isinstance(value, types) or bad_bool:
                return f"argument '{key}' must be of type {kind}, got {type(value).__name__}"
        if "enum" in spec and value not in spec["enum"]:
            return f"argument '{key}' must be one of {spec['enum']}"
    return None
