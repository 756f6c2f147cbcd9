"""What a policy could read in an episode sandbox at reset: searched from inside the sandbox.

One exec of a small Python script walks every readable file under the usual writable roots
(any name, hidden or not) and the environment variables, and reports where the author's secret
probes occur, which file names look like answers, where each gold answer occurs as a whole
token, and a few words of the work dir (candidates for hedging adversaries).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

SCAN_ROOTS = [".", "/tmp", "/var/tmp", "/home", "/root", "/srv", "/opt", "/mnt", "/data", "/workspace"]
# file names that look like answers or hidden tests; an env may override `leak_name_pattern`
LEAK_NAME_PATTERN = r"answer|solution|hidden|expected|oracle|gold|secret"

_SCAN = r"""
import json, os, re, sys
cfg = json.loads(sys.stdin.read())
probes = [p.encode() for p in cfg["probes"]]
golds = cfg["golds"]
gold_re = None
if golds:
    alt = b"|".join(re.escape(g.encode()) for g in sorted(golds, key=len, reverse=True))
    gold_re = re.compile(rb"(?<![\w.])(" + alt + rb")(?!\w)")
gold_index = {g.encode(): i for i, g in enumerate(golds)}
names = re.compile(cfg["names"], re.IGNORECASE) if cfg["names"] else None
hits, gold_hits, words, seen, budget = [], [], [], set(), 20000

def search(where, data):
    for i, p in enumerate(probes):
        if p in data:
            hits.append({"path": where, "probe": i})
    if gold_re is not None:
        found = {}
        for m in gold_re.finditer(data):
            found.setdefault(m.group(1), m.start())
        for g, pos in found.items():
            ctx = data[max(0, pos - 40): pos + len(g) + 20].decode("utf-8", "replace")
            gold_hits.append({"path": where, "gold": gold_index[g], "context": ctx})

for name, value in os.environ.items():
    search("$" + name, value.encode(errors="ignore"))
for root in cfg["roots"]:
    if not os.path.isdir(root):
        continue
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if os.path.join(d, x) not in ("/proc", "/sys", "/dev")]
        for f in files:
            path = os.path.realpath(os.path.join(d, f))
            if path in seen or budget <= 0:
                continue
            seen.add(path); budget -= 1
            if names is not None and names.search(f):
                hits.append({"path": path, "probe": -1})
            try:
                if os.path.getsize(path) > 2_000_000:
                    continue
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError:
                continue
            search(path, data)
            if root == "." and b"\0" not in data and len(words) < 60:
                for w in re.findall(rb"[\w.+/-]{1,24}", data[:20000]):
                    w = w.decode("utf-8", "replace")
                    if w not in words:
                        words.append(w)
print(json.dumps({"hits": hits, "gold_hits": gold_hits, "words": words[:60]}))
"""


@dataclass
class ScanResult:
    probe_hits: list[tuple[str, int]] = field(default_factory=list)  # (where, probe index; -1: answer-like name)
    gold_hits: list[tuple[str, int, str]] = field(default_factory=list)  # (where, gold index, context)
    words: list[str] = field(default_factory=list)
    error: str | None = None


def scan_sandbox(sandbox: Any, probes: list[str], golds: list[str], roots: list[str], names: str | None,
                 timeout: float = 60.0) -> ScanResult:
    r = sandbox.exec(["python3", "-c", _SCAN], stdin=json.dumps({"probes": probes, "golds": golds, "roots": roots,
                                                                 "names": names}), timeout=timeout)
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return ScanResult(error=(r.stderr or r.stdout or f"exit {r.exit_code}")[:200])
    return ScanResult(probe_hits=[(h["path"], h["probe"]) for h in out["hits"]],
                      gold_hits=[(h["path"], h["gold"], h["context"]) for h in out["gold_hits"]],
                      words=out["words"])
