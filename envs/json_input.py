"""JSON that comes from outside the process (a model's tool call, an HTTP request body), parsed
within bounds: whatever the text, the outcome is a value or one `JsonInputError` line, never a
RecursionError or an integer-conversion ValueError escaping to the caller."""
from __future__ import annotations

import json
from typing import Any

# Deep enough for any real tool call or grade request; far below the interpreter's recursion limit,
# so code that later walks the value (json.dumps, repr, equality) cannot hit it either.
MAX_DEPTH = 64


class JsonInputError(ValueError):
    """Input that is not JSON or is outside the bounds; the message is one line."""


def parse_json(text: str | bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The value of `text`; raises JsonInputError saying what is wrong with it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise JsonInputError(f"invalid JSON ({exc.msg} at char {exc.pos})") from None
    except UnicodeDecodeError:
        raise JsonInputError("invalid JSON (the bytes are not UTF-8 text)") from None
    except RecursionError:
        raise JsonInputError(f"JSON nested deeper than {max_depth} levels") from None
    except ValueError as exc:  # an integer literal longer than sys.get_int_max_str_digits()
        raise JsonInputError(f"invalid JSON ({str(exc).split(':')[0]})") from None
    if nesting_depth(value, max_depth) > max_depth:
        raise JsonInputError(f"JSON nested deeper than {max_depth} levels")
    return value


def nesting_depth(value: Any, stop_after: int) -> int:
    """How deeply lists and dicts nest in `value` (a scalar is 0), counted without recursion;
    the count stops once it passes `stop_after`."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > stop_after:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest
