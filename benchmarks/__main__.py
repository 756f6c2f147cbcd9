"""Run a benchmark by name, or list them: the one way to run everything in benchmarks/.

    python -m benchmarks                       # every benchmark, with what it measures
    python -m benchmarks NAME [ARGS ...]       # run benchmarks/NAME.py with ARGS (NAME --help: its options)

A benchmark is a script of this folder with a `__main__` block; its description is its docstring's first
sentence (read from the file: listing imports nothing). Running one is exactly `python benchmarks/NAME.py
ARGS`: the process is replaced, so its output, exit code and signals are the script's own. Figures, with
the commands that measured them: benchmarks/RESULTS.md.
"""
from __future__ import annotations

import ast
import difflib
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def benchmarks() -> dict[str, Path]:
    """Name -> script, for every script here that runs as a program."""
    found = {}
    for path in sorted(HERE.glob("*.py")):
        if not path.stem.startswith("_") and re.search(r"^if __name__ == .__main__.:", path.read_text(), re.M):
            found[path.stem] = path
    return found


def summary(path: Path, width: int = 110) -> str:
    """The docstring's first sentence, on one line of at most `width` characters."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    match = re.match(r"(.+?)\.(\s|$)", paragraph)
    sentence = match.group(1) if match else paragraph.rstrip(".:")
    return sentence if len(sentence) <= width else sentence[: width - 3].rsplit(" ", 1)[0] + " ..."


def main(argv: list[str]) -> int:
    found = benchmarks()
    if not argv or argv[0] in ("-h", "--help", "list"):
        width = max(map(len, found))
        print("python -m benchmarks NAME [ARGS ...]   (NAME --help for its options)\n")
        for name, path in found.items():
            print(f"  {name:<{width}}  {summary(path)}")
        return 0
    name, args = argv[0], argv[1:]
    if name not in found:
        close = difflib.get_close_matches(name, found, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        print(f"no benchmark named {name!r}{hint} (`python -m benchmarks` lists them)", file=sys.stderr)
        return 2
    os.execv(sys.executable, [sys.executable, str(found[name]), *args])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
