"""HTTP for graders outside Python, both ways.

- `GradeServer`: serves the grader service over HTTP, so a non-Python rollout system can
  ask for grades. POST /grade {"env", "task_id", "payload", and optionally "env_kwargs",
  "effort", "use_cache"} -> Grade as JSON; GET /health -> {"ok": true}. A request that is
  malformed, too large, too slow to arrive, or that makes the grader raise is answered 4xx with
  {"error": one line}.
- `HttpGrader`: a Grader whose scoring lives in an external HTTP service (any language).
  It POSTs {"payload": ...} and expects {"reward": float, "passed": bool, "details": {...}}.
"""
from __future__ import annotations

import json
import re
import socket
import threading
import urllib.error
import urllib.request
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from envs.grades import Grade, Grader, GradeRequest
from envs.json_input import JsonInputError, parse_json
from kimi_vocab.effort import EFFORT_LEVELS

MAX_BODY = 16 << 20
READ_TIMEOUT_S = 10.0  # a client has this long to send its whole request (headers and body)


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


class RequestError(ValueError):
    """A request the server refuses: the HTTP status and a one-line reason."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


def _is_task_id(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


# field -> (check, what it must be); env, task_id and payload are required, the rest optional
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "env": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "task_id": (_is_task_id, "a string or an integer"),
    "payload": (lambda v: isinstance(v, dict), "a JSON object"),
    "env_kwargs": (lambda v: isinstance(v, dict), "a JSON object"),
    "effort": (lambda v: isinstance(v, str) and v in EFFORT_LEVELS, "one of " + ", ".join(EFFORT_LEVELS)),
    "use_cache": (lambda v: isinstance(v, bool), "true or false"),
}
_REQUIRED = ("env", "task_id", "payload")


def _shown(value: Any) -> str:
    """A value for an error line: containers by kind, scalars as JSON, never long."""
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_grade_request(body: Any) -> dict[str, Any]:
    """The body of POST /grade with its optional fields filled in; RequestError(400) names the
    first field that is missing, unknown or ill-typed."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    unknown = sorted(set(body) - set(_FIELDS))
    if unknown:
        raise RequestError(400, f"unknown field {unknown[0]!r}; expected {', '.join(_FIELDS)}")
    for key in _REQUIRED:
        if key not in body:
            raise RequestError(400, f"missing field {key!r}")
    for key, value in body.items():
        check, expected = _FIELDS[key]
        if not check(value):
            raise RequestError(400, f"field {key!r} must be {expected}, got {_shown(value)}")
    return {"env_kwargs": {}, "effort": "medium", "use_cache": True, **body}


class GradeServer:
    """An HTTP front for a grading service (GraderPool or LocalGrader). Runs in a background thread.
    A client has `read_timeout_s` to send a request of at most `max_body` bytes of body."""

    def __init__(self, service: Any, host: str = "127.0.0.1", port: int = 0, max_body: int = MAX_BODY,
                 read_timeout_s: float = READ_TIMEOUT_S) -> None:
        self.service = service
        self.max_body = max_body
        self.read_timeout_s = read_timeout_s
        self._graders: dict[str, Grader] = {}
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer((host, port), self._handler())
        self._httpd.daemon_threads = True
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

    def grade_json(self, body: Any) -> dict[str, Any]:
        """Grade one JSON request (the body of POST /grade); RequestError says why it cannot be."""
        fields = check_grade_request(body)
        grader = self._grader_for(fields["env"], fields["env_kwargs"])
        req = GradeRequest(env=fields["env"], task_id=str(fields["task_id"]), grader=grader,
                           payload=fields["payload"], effort=fields["effort"])
        grade = self.service.grade(req, use_cache=fields["use_cache"])
        if grade.error is not None and "traceback" in grade.details:  # score() raised on this payload
            raise RequestError(422, f"the {fields['env']!r} grader cannot grade this payload: {grade.error}")
        return grade.to_dict()

    def _grader_for(self, env: str, kwargs: dict[str, Any]) -> Grader:
        key = json.dumps([env, kwargs], sort_keys=True)
        with self._lock:
            if key not in self._graders:
                self._graders[key] = self._build_grader(env, kwargs)
            return self._graders[key]

    @staticmethod
    def _build_grader(env: str, kwargs: dict[str, Any]) -> Grader:
        from envs.registry import make

        try:
            instance = make(env, **kwargs)
        except KeyError as exc:  # an unknown name
            raise RequestError(400, str(exc.args[0])) from None
        except Exception as exc:  # noqa: BLE001 - whatever the constructor makes of the kwargs
            raise RequestError(400, f"cannot build environment {env!r} from these env_kwargs: "
                                    f"{type(exc).__name__}: {_first_line(exc)}") from None
        instance.close()
        return instance.grader

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            timeout = 2 * server.read_timeout_s  # a backstop for writes: the watchdog below ends reads
            default_request_version = "HTTP/1.0"  # a garbled request line is still answered with a status line

            def setup(self) -> None:
                super().setup()
                # one deadline for the whole request, headers and body, so a client trickling a byte
                # at a time is cut off too: the read side is shut, reads see the end of the stream
                self._late = threading.Event()
                self._watchdog = threading.Timer(server.read_timeout_s, self._cut_off)
                self._watchdog.daemon = True
                self._watchdog.start()

            def _cut_off(self) -> None:
                self._late.set()
                try:
                    self.connection.shutdown(socket.SHUT_RD)
                except OSError:  # already closed
                    pass

            def finish(self) -> None:
                self._watchdog.cancel()
                super().finish()

            def parse_request(self) -> bool:
                """The request line and headers; 408 when the watchdog cut them off."""
                ok = super().parse_request()
                if ok and self._late.is_set():
                    self.send_error(408)
                    return False
                return ok

            def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
                """http.server's own refusals (a garbled request line, an unknown method) as JSON too."""
                if self._late.is_set():  # whatever looked wrong, the request was cut off unfinished
                    code, message = 408, f"the request did not arrive within {server.read_timeout_s:g} s"
                self.close_connection = True
                self._send(code, {"error": message or HTTPStatus(code).phrase})

            def _send(self, code: int, obj: dict[str, Any]) -> None:
                data = json.dumps(obj, default=str).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client went away (or stopped reading) before its answer
                    self.close_connection = True

            def do_GET(self) -> None:  # noqa: N802 - http.server naming
                if self.path == "/health":
                    self._send(200, {"ok": True})
                else:
                    self._send(404, {"error": f"no route {self.path}"})

            def do_POST(self) -> None:  # noqa: N802
                try:
                    if self.path != "/grade":
                        raise RequestError(404, f"no route {self.path}")
                    body = parse_json(self._read_body())
                    self._watchdog.cancel()  # grading may take as long as the grader's own timeout
                    self._send(200, server.grade_json(body))
                except RequestError as exc:
                    self._send(exc.status, {"error": str(exc)})
                except JsonInputError as exc:
                    self._send(400, {"error": f"the body is not usable JSON: {exc}"})
                except Exception as exc:  # noqa: BLE001 - the grading service failed: say so, in one line
                    self._send(500, {"error": f"grading failed: {type(exc).__name__}: {_first_line(exc)}"})

            def _read_body(self) -> bytes:
                if self.headers.get("Transfer-Encoding"):
                    raise RequestError(411, "send the body with a Content-Length (no Transfer-Encoding)")
                length = self.headers.get("Content-Length")
                if length is None:
                    raise RequestError(411, "a Content-Length header is required")
                if not re.fullmatch(r"[0-9]{1,18}", length.strip()):
                    raise RequestError(400, f"Content-Length must be a whole number of bytes, got {length[:40]!r}")
                size = int(length)
                if not 1 <= size <= server.max_body:
                    raise RequestError(413 if size else 400,
                                       f"body size must be 1..{server.max_body} bytes, got {size}")
                try:
                    data = self.rfile.read(size)
                except TimeoutError:  # a pause longer than the socket's timeout
                    self._late.set()
                    data = b""
                if len(data) < size:
                    self.close_connection = True
                    if self._late.is_set():
                        raise RequestError(408, f"the request did not arrive within {server.read_timeout_s:g} s "
                                                f"({len(data)} of {size} body bytes)")
                    raise RequestError(400, f"the body ended after {len(data)} of its {size} bytes")
                return data

            def log_message(self, *args: Any) -> None:  # keep test and driver output quiet
                pass

        return Handler


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
