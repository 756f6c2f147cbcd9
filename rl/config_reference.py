"""docs/config.md from the run config's schema: every key's dotted path, type, default and explanation.

    python -m rl.config_reference            # write docs/config.md
    python -m rl.config_reference --check    # exit 1 when docs/config.md differs from the schema

The explanations are the comments in rl/config.py: the comment lines directly above a field, and the
comment at the end of its lines; a section's docstring heads its part. A field without a comment of its
own that the field before it (no blank line between) explains by name points there. The schema is read
from the pydantic models (RunConfig and the sections it holds), so a key added, removed or re-typed
changes the page; tests/test_docs.py fails while the two differ.
"""
from __future__ import annotations

import ast
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from rl.config import RunConfig

REPO = Path(__file__).resolve().parents[1]
OUTPUT = REPO / "docs" / "config.md"
COMMAND = "python -m rl.config_reference"

HEADER = f"""# Run config reference

Generated from the schema in `rl/config.py` by `{COMMAND}`; `tests/test_docs.py` fails
when this page and the schema differ. Every key can be set in the YAML file or on the command line as a dotted override
(`rl train configs/demo.yaml train.lr=3e-4 rollout.group_size=4`); an unknown or ill-typed key stops the
run before anything starts, in one line naming the key. A mapping written in the file replaces its
default whole; an override into one the file leaves out edits the default (`effort.weights.max=2` keeps
the other levels at 1.0). Ranges are what the config accepts (the upper bounds only catch typos). `null`
is YAML's empty value.
"""


@dataclass
class Key:
    path: str
    type: str
    default: str
    text: str


def _comments(source: str) -> dict[int, str]:
    """Line number (1-based, within `source`) -> the text of the comment on that line."""
    found = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            found[tok.start[0]] = tok.string.lstrip("#").strip()
    return found


def _field_texts(cls: type[BaseModel]) -> dict[str, str]:
    """Each field of `cls` declared in its own body -> its comments, joined."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments = _comments(source)
    body = ast.parse(source).body[0].body
    texts: dict[str, str] = {}
    anchor: str | None = None  # the field whose comment the fields right after it may share
    last_end = 0  # the line the last field ends on
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            anchor = None
            continue
        name = node.target.id
        above = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        beside = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        text = " ".join(above + beside)
        if text:
            anchor = name
        elif anchor and last_end == node.lineno - 1 and re.search(rf"\b{name}\b", texts[anchor]):
            text = f"see `{anchor}`"  # a comment that explains a run of fields sits above the first
        else:
            anchor = None
        texts[name] = text
        last_end = node.end_lineno
    return texts


SIGNS = {annotated_types.Ge: ("ge", ">="), annotated_types.Gt: ("gt", ">"), annotated_types.Le: ("le", "<="),
         annotated_types.Lt: ("lt", "<")}


def _bounds(metadata: list[Any]) -> list[str]:
    out = []
    for item in metadata:
        if type(item) in SIGNS:
            attr, sign = SIGNS[type(item)]
            value = getattr(item, attr)
            out.append(f"{sign} {value:,}" if isinstance(value, int) else f"{sign} {value:g}")
        elif isinstance(item, annotated_types.MinLen) and item.min_length:
            out.append(f"at least {item.min_length:,} long")
        elif isinstance(item, annotated_types.MaxLen):
            out.append(f"at most {item.max_length:,} long")
    return out


def _type(annotation: Any, metadata: list[Any] = ()) -> str:
    """A reader's name for a type, with its bounds: `int, >= 1`, `float or null`, `one of a, b`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type(args[0], [*metadata, *args[1:], *getattr(args[1], "metadata", [])])
    bounds = _bounds(list(metadata))
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        name = " or ".join(_type(a) for a in rest) + (" or null" if len(rest) < len(args) else "")
    elif origin is Literal:
        name = "one of " + ", ".join(f"`{a}`" for a in args)
    elif origin is dict:
        value = args[1]
        name = ("mapping" if value is Any else
                "mapping of name to section" if _is_section(value) else f"mapping of name to {_type(value)}")
    elif origin is list:
        name = "list of sections" if _is_section(args[0]) else f"list of {_type(args[0])}"
    elif origin is tuple:
        name = "[" + ", ".join(_type(a) for a in args) + "]"
    elif isinstance(annotation, type):
        name = annotation.__name__
    else:
        name = str(annotation)
    return ", ".join([name, *bounds])


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _default(info: FieldInfo) -> str:
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return "`" + json.dumps(value, default=str) + "`"


def _walk(cls: type[BaseModel], prefix: str, parts: list[tuple[str, str, list[Key]]]) -> None:
    """Append (title, description, keys) for `cls` at `prefix`, then for the sections it holds."""
    texts = _field_texts(cls)
    doc = inspect.cleandoc(cls.__dict__["__doc__"]) if cls.__dict__.get("__doc__") else ""
    keys, nested = [], []
    for name, info in cls.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        annotation = info.annotation
        origin, args = typing.get_origin(annotation), typing.get_args(annotation)
        if _is_section(annotation):
            nested.append((annotation, path))
            continue
        if origin is list and _is_section(args[0]):
            nested.append((args[0], f"{path}[]"))
        elif origin is dict and _is_section(args[1]):
            nested.append((args[1], f"{path}.<name>"))
        text = texts.get(name, "")
        if text.startswith("see `"):
            text = f"see `{prefix + '.' if prefix else ''}{text[5:]}"
        elif not text and re.search(rf"\b{name}\b", doc):
            text = "see the section's description"
        keys.append(Key(path, _type(annotation, info.metadata), _default(info), text))
    if keys:
        parts.append((prefix or "top level", doc, keys))
    for sub, path in nested:
        _walk(sub, path, parts)


def render() -> str:
    parts: list[tuple[str, str, list[Key]]] = []
    _walk(RunConfig, "", parts)
    out = [HEADER, "Sections: " + ", ".join(f"[`{t}`](#{_anchor(t)})" for t, _, _ in parts) + ".\n"]
    for title, doc, keys in parts:
        out.append(f"## {title}\n")
        if doc:
            out.append(doc + "\n")
        for key in keys:
            head = f"- `{key.path}`: {key.type}; default {key.default}"
            out.append(head + ("" if not key.text else "\\\n" + textwrap.fill(
                key.text, 100, initial_indent="  ", subsequent_indent="  ", break_on_hyphens=False)))
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def _anchor(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def main(argv: list[str]) -> int:
    text = render()
    if argv == ["--check"]:
        if OUTPUT.read_text() != text:
            print(f"docs/config.md differs from the schema in rl/config.py: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if argv:
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
