"""Bad input from outside: a model's malformed tool calls, hostile or broken HTTP grade requests,
environment files that fail at import and a corrupt registry. Each becomes one clear line (an
observation, a 4xx answer, an error and exit code), never a traceback, a hang or a silent accept."""
from __future__ import annotations

import json
import socket
import time

import pytest
from typer.testing import CliRunner

import envs
from envs import registry
from envs.cli import env_app
from envs.grading import LocalGrader
from envs.grading_http import GradeServer
from envs.toolcall import CLOSE, OPEN, parse_turn

DEEP = "[" * 1000 + "]" * 1000
LONG_INT = "1" * 5000


# -- tool calls ------------------------------------------------------------------------------------
@pytest.mark.parametrize("body, problem", [
    (DEEP, "JSON nested deeper than 64 levels"),
    ('{"name": "search", "arguments": {"query": ' + DEEP + "}}", "JSON nested deeper than 64 levels"),
    ('{"name": "search", "arguments": {"query": ' + LONG_INT + "}}", "Exceeds the limit (4300 digits)"),
    ('{"name": "search", "arguments": "' + DEEP + '"}', "'arguments' string is not JSON: JSON nested deeper"),
    ('{"name": "search", "arguments": "' + LONG_INT + '"}', "'arguments' string is not JSON: invalid JSON (Exceeds"),
])
def test_a_deep_or_huge_tool_call_is_a_malformed_call_not_an_exception(body, problem):
    parsed = parse_turn("thinking " + OPEN + body + CLOSE)
    assert parsed.call is None and parsed.wants_tool and parsed.text == "thinking "
    assert parsed.error.startswith("malformed tool call: ") and problem in parsed.error
    assert "\n" not in parsed.error


@pytest.mark.parametrize("body", [DEEP, '{"name": "search", "arguments": {"query": ' + LONG_INT + "}}"])
def test_step_answers_a_deep_or_huge_tool_call_with_the_bad_tool_call_observation(body):
    env = envs.make("lookup")
    env.reset(seed=0)
    observation, reward, terminated, truncated, info = env.step(OPEN + body + CLOSE)
    assert observation.startswith("error: malformed tool call: ") and "\n" not in observation
    assert info["tool_error"] and reward == 0.0 and not env.done
    env.close()


def test_a_tool_call_nested_within_the_bound_still_parses():
    nested = {"a": [[[{"b": 1}]]]}
    parsed = parse_turn(OPEN + json.dumps({"name": "t", "arguments": nested}) + CLOSE)
    assert parsed.error is None and parsed.call.arguments == nested


# -- the grader's HTTP server ----------------------------------------------------------------------
@pytest.fixture
def server():
    srv = GradeServer(LocalGrader()).start()
    yield srv
    srv.stop()


@pytest.fixture
def impatient_server():
    srv = GradeServer(LocalGrader(), read_timeout_s=1.0).start()
    yield srv
    srv.stop()


def exchange(srv: GradeServer, raw: bytes, wait_s: float = 10.0) -> tuple[int, dict]:
    """Send raw bytes, read until the server closes: (status, JSON body)."""
    host, port = srv._httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=wait_s) as sock:
        sock.sendall(raw)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def post(srv: GradeServer, body: bytes, headers: bytes | None = None) -> tuple[int, dict]:
    headers = b"Content-Length: %d\r\n" % len(body) if headers is None else headers
    return exchange(srv, b"POST /grade HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n" + body)


GOOD = {"env": "math", "task_id": "t1", "payload": {"response": "The answer is 0.5", "gold": "1/2"}}


def assert_one_line_refusal(status: int, answer: dict, code: int, *phrases: str) -> None:
    assert status == code, answer
    assert set(answer) == {"error"} and "\n" not in answer["error"] and "Traceback" not in answer["error"]
    for phrase in phrases:
        assert phrase in answer["error"], answer


def test_http_a_good_request_is_graded(server):
    status, grade = post(server, json.dumps(GOOD).encode())
    assert status == 200 and grade["passed"] and grade["details"]["task_id"] == "t1"
    status, grade = post(server, json.dumps({**GOOD, "task_id": 7, "effort": "max", "use_cache": False}).encode())
    assert status == 200 and grade["details"]["task_id"] == "7"


def test_http_json_nested_1000_deep_is_a_400(server):
    assert_one_line_refusal(*post(server, DEEP.encode()), 400, "nested deeper than 64 levels")
    deep_payload = json.dumps({**GOOD, "payload": {"x": "@"}}).replace('"@"', DEEP).encode()
    assert_one_line_refusal(*post(server, deep_payload), 400, "nested deeper than 64 levels")


@pytest.mark.parametrize("length, code, phrase", [
    (b"abc", 400, "Content-Length must be a whole number of bytes, got 'abc'"),
    (b"-5", 400, "whole number"),
    (b"1_0", 400, "whole number"),
    (b"0", 400, "body size must be 1..16777216 bytes, got 0"),
    (b"99999999", 413, "body size must be 1..16777216 bytes, got 99999999"),
])
def test_http_a_bad_content_length_is_refused(server, length, code, phrase):
    assert_one_line_refusal(*post(server, b"{}", b"Content-Length: " + length + b"\r\n"), code, phrase)


def test_http_a_body_without_a_length_is_refused(server):
    assert_one_line_refusal(*post(server, b"{}", b""), 411, "Content-Length header is required")
    chunked = b"Transfer-Encoding: chunked\r\n"
    assert_one_line_refusal(*post(server, b"2\r\n{}\r\n0\r\n\r\n", chunked), 411, "no Transfer-Encoding")


def test_http_slow_clients_are_cut_off_and_the_server_keeps_serving(impatient_server):
    server = impatient_server
    host, port = server._httpd.server_address[:2]
    started = time.monotonic()
    half_sent = [b"POST /grade HTTP/1.1\r\nContent-Len", b"POST /grade HTTP/1.1\r\nContent-Length: 50\r\n\r\n{\"env\""]
    socks = []
    for i in range(40):
        sock = socket.create_connection((host, port), timeout=10)
        sock.sendall(half_sent[i % 2])
        socks.append(sock)
    assert_one_line_refusal(*post(server, b"[]"), 400, "the body must be a JSON object")  # still answering
    for sock in socks:
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.0 408 ") and b"did not arrive within 1 s" in answer
    assert time.monotonic() - started < 8  # all cut off after the 1 s timeout, not held open


def test_http_a_client_trickling_bytes_is_cut_off_at_the_deadline(impatient_server):
    server = impatient_server
    host, port = server._httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /grade HTTP/1.1\r\nContent-Length: 500\r\n\r\n")
        try:
            for _ in range(30):  # one byte every 0.2 s: each read is quick, the whole request is not
                sock.sendall(b" ")
                time.sleep(0.2)
        except OSError:
            pass  # the server stopped reading and closed
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.0 408 ") and time.monotonic() - started < 5


def test_http_a_payload_the_grader_raises_on_is_a_422_without_a_traceback(server):
    status, answer = post(server, json.dumps({**GOOD, "payload": {"response": "1"}}).encode())
    assert_one_line_refusal(status, answer, 422, "'math' grader cannot grade this payload", "KeyError: 'gold'")


@pytest.mark.parametrize("change, phrase", [
    ({"task_id": None}, "field 'task_id' must be a string or an integer, got null"),
    ({"task_id": {"a": 1}}, "field 'task_id' must be a string or an integer, got an object"),
    ({"task_id": [1]}, "field 'task_id' must be a string or an integer, got a list"),
    ({"task_id": True}, "field 'task_id' must be a string or an integer, got true"),
    ({"effort": "ultra"}, "field 'effort' must be one of low, medium, high, max, got \"ultra\""),
    ({"use_cache": "no"}, "field 'use_cache' must be true or false, got \"no\""),
    ({"env": ""}, "field 'env' must be a non-empty string"),
    ({"env": 3}, "field 'env' must be a non-empty string, got 3"),
    ({"payload": "x"}, "field 'payload' must be a JSON object"),
    ({"env_kwargs": [1]}, "field 'env_kwargs' must be a JSON object, got a list"),
    ({"colour": "red"}, "unknown field 'colour'"),
    ({"env": "nope"}, "unknown environment 'nope'"),
    ({"env_kwargs": {"bogus": 1}}, "cannot build environment 'math' from these env_kwargs: TypeError"),
])
def test_http_an_ill_typed_field_is_a_400_naming_it(server, change, phrase):
    assert_one_line_refusal(*post(server, json.dumps({**GOOD, **change}).encode()), 400, phrase)


def test_http_missing_fields_and_non_objects_are_400(server):
    assert_one_line_refusal(*post(server, b'{"env": "math"}'), 400, "missing field 'task_id'")
    assert_one_line_refusal(*post(server, b"[1, 2]"), 400, "the body must be a JSON object")
    assert_one_line_refusal(*post(server, b"\xff\xfe{"), 400, "not usable JSON")
    assert_one_line_refusal(*post(server, b'{"task_id": ' + LONG_INT.encode() + b"}"), 400, "4300 digits")


# -- environment files and the registry ------------------------------------------------------------
@pytest.mark.parametrize("source, phrase", [
    ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
    ("undefined_name\n", "NameError: name 'undefined_name' is not defined"),
    ("def f():\n    return f()\nf()\n", "RecursionError: maximum recursion depth exceeded"),
    ("import sys\nsys.exit(3)\n", "it called sys.exit(3)"),
    ("def (:\n", "SyntaxError: invalid syntax (line 1)"),
])
def test_register_a_file_failing_at_import_is_one_line_and_exit_2(tmp_path, source, phrase):
    path = tmp_path / "broken_env.py"
    path.write_text(source)
    result = CliRunner().invoke(env_app, ["register", f"{path}:Env"])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        f"error: cannot register {path}:Env: environment file {path} failed at import: {phrase}"]
    with pytest.raises(registry.EnvRegistryError, match=f"{path} failed at import"):
        envs.register_file(f"{path}:Env")


@pytest.mark.parametrize("content, phrase", [
    ('{"a": ', "Expecting value: line 1 column 7 (char 6); fix or delete it"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"mine": 5}', "the entry 'mine' has no \"target\""),
    ('{"mine": {"target": 7}}', "the entry 'mine' has no \"target\""),
    ("\udcff", "corrupt registry file"),
    ("[" * 5000 + "]" * 5000, "maximum recursion depth exceeded"),
])
def test_a_corrupt_registry_json_is_one_line_and_exit_2(isolated_registry, content, phrase):
    isolated_registry.mkdir(parents=True, exist_ok=True)
    path = isolated_registry / "registry.json"
    path.write_bytes(content.encode("utf-8", "surrogateescape"))
    for args in (["list"], ["unregister", "mine"]):
        result = CliRunner().invoke(env_app, args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: corrupt registry file {path}: ") and phrase in lines[0]
    with pytest.raises(registry.EnvRegistryError, match="corrupt registry file"):
        registry.check_names(["math"])
