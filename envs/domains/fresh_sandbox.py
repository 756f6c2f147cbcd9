"""Run one command in a fresh, grader-owned sandbox (never the policy's), retrying infrastructure errors."""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence


def run_in_fresh_sandbox(backend: str, files: Mapping[str, str], argv: Sequence[str], stdin: str = "",
                         timeout: float = 10.0, attempts: int = 3) -> Any:
    """Write `files`, run `argv`, return its ExecResult. A sandbox that fails to start or dies
    is retried (up to `attempts`); a command that runs and fails is a result, not a retry."""
    from sandbox import open_sandbox

    last: Exception | None = None
    for attempt in range(attempts):
        try:
            with open_sandbox(backend=backend, labels={"role": "grader"}) as sb:
                for path, text in files.items():
                    sb.write_file(path, text)
                return sb.exec(list(argv), stdin=stdin, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - sandbox start/transport failures are transient
            last = exc
            time.sleep(0.05 * (attempt + 1))
    raise RuntimeError(f"grading sandbox failed {attempts} times: {type(last).__name__}: {last}")
