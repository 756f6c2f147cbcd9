"""HTTP for graders outside Python, both ways.

- `GradeServer`: serves the grader service over HTTP, so a non-Python rollout system can
  ask for grades. POST /grade {"env", "env_kwargs", "task_id", "payload", "use_cache"}
  -> Grade as JSON; GET /health -> {"ok": true}.
- `HttpGrader`: a Grader whose scoring lives in an external HTTP service (any language).
  It POSTs {"payload": ...} and expects {"reward": float, "passed": bool, "details": {...}}.
"""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from envs.grades import Grade, Grader, GradeRequest

MAX_BODY = 16 << 20


class HttpGrader(Grader):
    """Delegates scoring to an HTTP endpoint. Set `version` to the remote grader's version."""

    def __init__(self, url: str, version: str = "1", timeout_s: float = 30.0) -> None:
        self.url = url
        self.version = version
        self.timeout_s = timeout_s

    def score(self, payload: dict[str, Any]) -> Grade:
        body = json.dumps({"payload": payload}).encode()
        req = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                data = json.loads(resp.read(MAX_BODY))
        except urllib.error.HTTPError as exc:
            return Grade.failed("", f"remote grader at {self.url} answered HTTP {exc.code}")
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            return Grade.failed("", f"remote grader at {self.url} unreachable: {exc}")
        except json.JSONDecodeError:
            return Grade.failed("", f"remote grader at {self.url} returned invalid JSON")
        if not isinstance(data, dict) or "reward" not in data or "passed" not in data:
            return Grade.failed("", f"remote grader at {self.url} must return an object with 'reward' and 'passed'")
        return Grade(reward=float(data["reward"]), passed=bool(data["passed"]), grader_version="",
                     details=dict(data.get("details") or {}))


class GradeServer:
    """An HTTP front for a grading service (GraderPool or LocalGrader). Runs in a background thread."""

    def __init__(self, service: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.service = service
        self._graders: dict[str, Grader] = {}
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((host, port), self._handler())
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> "GradeServer":
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True, name="grade-server")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def grade_json(self, body: dict[str, Any]) -> dict[str, Any]:
        """Grade one JSON request (the body of POST /grade)."""
        for key in ("env", "task_id", "payload"):
            if key not in body:
                raise ValueError(f"missing field {key!r}")
        kwargs = body.get("env_kwargs") or {}
        grader = self._grader_for(body["env"], kwargs)
        req = GradeRequest(env=body["env"], task_id=str(body["task_id"]), grader=grader, payload=body["payload"],
                           effort=body.get("effort", "medium"))
        return self.service.grade(req, use_cache=bool(body.get("use_cache", True))).to_dict()

    def _grader_for(self, env: str, kwargs: dict[str, Any]) -> Grader:
        key = json.dumps([env, kwargs], sort_keys=True)
        with self._lock:
            if key not in self._graders:
                from envs.registry import make

                instance = make(env, **kwargs)
                self._graders[key] = instance.grader
                instance.close()
            return self._graders[key]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, obj: dict[str, Any]) -> None:
                data = json.dumps(obj, default=str).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802 - http.server naming
                if self.path == "/health":
                    self._send(200, {"ok": True})
                else:
                    self._send(404, {"error": f"no route {self.path}"})

            def do_POST(self) -> None:  # noqa: N802
                if self.path != "/grade":
                    self._send(404, {"error": f"no route {self.path}"})
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length <= 0 or length > MAX_BODY:
                    self._send(400, {"error": f"body size must be 1..{MAX_BODY} bytes"})
                    return
                try:
                    body = json.loads(self.rfile.read(length))
                    if not isinstance(body, dict):
                        raise ValueError("the body must be a JSON object")
                    self._send(200, server.grade_json(body))
                except (ValueError, KeyError, TypeError) as exc:
                    self._send(400, {"error": f"{type(exc).__name__}: {exc}"})

            def log_message(self, *args: Any) -> None:  # keep test and driver output quiet
                pass

        return Handler
