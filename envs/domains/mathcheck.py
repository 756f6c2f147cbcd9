"""Math answer extraction and an equivalence check that accepts equal forms (17 = 17.0 = 34/2).

By default only number literals count as answers: an unevaluated expression such as "8 - 4"
would otherwise be "equivalent" and let a policy copy the question instead of solving it.
"""
from __future__ import annotations

import re
from fractions import Fraction

import sympy
from sympy.parsing.sympy_parser import parse_expr, standard_transformations, implicit_multiplication_application

_BOXED = re.compile(r"\\boxed\s*\{")
_MARKERS = re.compile(r"(?:final answer|answer)\s*(?:is|:|=)\s*(.+)", re.IGNORECASE)
_LATEX_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]+)\}\s*\{([^{}]+)\}")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_ALLOWED_NAMES = {"sqrt": sympy.sqrt, "pi": sympy.pi, "E": sympy.E, "log": sympy.log, "exp": sympy.exp}
_MAX_LEN = 80


def extract_answer(text: str | None) -> str | None:
    """The final answer in a response: \\boxed{..}, then 'answer is ..', then a bare short answer."""
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    found = _MARKERS.findall(text)
    if found:
        ans = found[-1].strip().splitlines()[0] if found[-1].strip() else ""
        return ans.strip().rstrip(".").strip() or None
    stripped = text.strip().rstrip(".")
    if stripped and "\n" not in stripped and len(stripped) <= _MAX_LEN:
        return stripped
    return None


def _last_boxed(text: str) -> str | None:
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    depth = 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def _clean(s: str) -> str:
    s = s.strip().strip("$").strip()
    s = s.replace("\\left", "").replace("\\right", "").replace("\\!", "").replace("\\,", "")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators: 1,000 -> 1000
    s = _LATEX_FRAC.sub(r"(\1)/(\2)", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("^", "**")
    s = re.sub(r"\\sqrt\s*\{([^{}]+)\}", r"sqrt(\1)", s)
    return s.rstrip(".").strip()


def parse_number(s: str | None) -> Fraction | None:
    """A number literal (integer, decimal, a/b, \\frac{a}{b}, with sign) as an exact Fraction."""
    if s is None:
        return None
    s = _clean(s)
    m = re.fullmatch(r"\(?\s*([+-]?[\d.eE+-]+)\s*\)?\s*/\s*\(?\s*([+-]?[\d.eE+-]+)\s*\)?", s)
    try:
        if m and _NUMBER.fullmatch(m.group(1)) and _NUMBER.fullmatch(m.group(2)):
            den = Fraction(m.group(2))
            return None if den == 0 else Fraction(m.group(1)) / den
        if _NUMBER.fullmatch(s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None
    return None


def parse_expression(s: str | None) -> sympy.Expr | None:
    """A symbolic answer (e.g. sqrt(2)/2). Only whitelisted names; never evaluates arbitrary code."""
    if s is None:
        return None
    s = _clean(s)
    if not s or len(s) > _MAX_LEN or not re.fullmatch(r"[0-9a-zA-Z+\-*/().\s]*", s):
        return None
    names = set(re.findall(r"[A-Za-z_]+", s))
    if not names <= set(_ALLOWED_NAMES) | {"e"}:
        return None
    # refuse huge powers (a grader DoS): at most one power, with a small literal exponent
    powers = re.findall(r"\*\*\s*([^\s]+)", s)
    if len(powers) > 1 or any(not re.fullmatch(r"\d{1,2}\)*", p) for p in powers):
        return None
    try:
        expr = parse_expr(
            s.replace("e", "E") if "e" in names else s,
            local_dict=dict(_ALLOWED_NAMES),
            global_dict={"__builtins__": {}, "Integer": sympy.Integer, "Float": sympy.Float,
                         "Rational": sympy.Rational, "Symbol": sympy.Symbol},
            transformations=standard_transformations + (implicit_multiplication_application,),
        )
    except Exception:  # noqa: BLE001 - unparsable answers are simply wrong
        return None
    return expr if isinstance(expr, sympy.Expr) and not expr.free_symbols else None


def equivalent(pred: str | None, gold: str, allow_expressions: bool = False) -> bool:
    """Whether a predicted answer equals the gold answer, in any accepted equivalent form."""
    p, g = parse_number(pred), parse_number(gold)
    if p is not None and g is not None:
        return p == g
    if not allow_expressions:
        return False
    pe, ge = parse_expression(pred), parse_expression(gold)
    if pe is None or ge is None:
        return False
    try:
        return bool(sympy.simplify(pe - ge) == 0)
    except Exception:  # noqa: BLE001
        return False
