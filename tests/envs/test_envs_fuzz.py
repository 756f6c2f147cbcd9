"""Property-based fuzzing (hypothesis) of what reaches the environments from outside: the model's
tool calls, raw bytes sent to the grader's HTTP server, registry.json and environment files.
Properties: no traceback, no hang, and no silent accept (what is malformed is refused, in one line;
what is well formed is taken as it is)."""
from __future__ import annotations

import functools
import json
import os
import socket
import string
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import envs
from envs import registry
from envs.grading import LocalGrader
from envs.grading_http import GradeServer
from envs.json_input import MAX_DEPTH
from envs.toolcall import CLOSE, OPEN, THINK, THINK_CLOSE, check_arguments, format_tool_call, parse_turn

FUZZ = settings(deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=20)


def nested(depth: int, kind: str) -> str:
    return ("[" * depth + "]" * depth) if kind == "list" else ('{"a": ' * depth + "1" + "}" * depth)


# -- tool calls ------------------------------------------------------------------------------------
def assert_well_formed(text: str, parsed) -> None:
    """Whatever the text: at most one of call / error, the error one line, the text before the call."""
    assert not (parsed.call is not None and parsed.error is not None)
    if parsed.error is not None:
        assert parsed.error.startswith("malformed tool call: ") and "\n" not in parsed.error
    if parsed.call is not None:
        assert isinstance(parsed.call.name, str) and parsed.call.name and isinstance(parsed.call.arguments, dict)
    assert text.startswith(parsed.text)


@FUZZ
@given(st.lists(st.text(max_size=20) | st.sampled_from([OPEN, CLOSE, "{", "}", "[", '"', ":", '"name"']),
                max_size=15).map("".join))
def test_parse_turn_never_raises_on_any_text(text):
    assert_well_formed(text, parse_turn(text))


@FUZZ
@given(st.text(min_size=1, max_size=20), st.dictionaries(st.text(max_size=10), json_values, max_size=4),
       st.text(max_size=30))
def test_a_well_formed_tool_call_is_taken_as_written(name, arguments, before):
    # a marker in the text is the format's own (Hypothesis draws the module's constants: before='<|think|>'
    # opens reasoning, which hides the call, as it should)
    written = before + name + json.dumps(arguments, ensure_ascii=False)
    assume(not any(marker in written for marker in (OPEN, CLOSE, THINK, THINK_CLOSE)))
    parsed = parse_turn(before + format_tool_call(name, arguments))
    assert parsed.error is None and parsed.text == before
    assert (parsed.call.name, parsed.call.arguments) == (name, json.loads(json.dumps(arguments)))


@FUZZ
@given(st.text(min_size=1, max_size=20), st.dictionaries(st.text(max_size=10), json_values, max_size=4),
       st.data())
def test_a_tool_call_cut_short_is_refused_not_accepted(name, arguments, data):
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    cut = data.draw(st.integers(0, len(body) - 1))
    parsed = parse_turn(OPEN + body[:cut] + CLOSE)
    assert parsed.call is None and parsed.error is not None


@FUZZ
@given(st.integers(1, 200), st.sampled_from(["list", "dict"]), st.booleans())
def test_tool_call_nesting_is_bounded(depth, kind, as_a_string):
    value = nested(depth, kind)
    arguments = '{"q": ' + value + "}"
    if as_a_string:  # OpenAI's form: the arguments object as a JSON string, parsed on its own
        arguments = json.dumps(arguments)
    parsed = parse_turn(OPEN + '{"name": "search", "arguments": ' + arguments + "}" + CLOSE)
    assert_well_formed("", parsed)
    levels = depth + (1 if as_a_string else 2)  # {"q": ...}, and the call's object around it
    if levels > MAX_DEPTH:
        assert parsed.error is not None and "nested deeper than 64 levels" in parsed.error
    else:
        assert parsed.error is None and parsed.call.arguments == {"q": json.loads(value)}


@FUZZ
@given(st.integers(1, 6000))
def test_tool_call_integers_are_bounded(digits):
    parsed = parse_turn(OPEN + '{"name": "search", "arguments": {"q": ' + "7" * digits + "}}" + CLOSE)
    if digits > 4300:
        assert "Exceeds the limit (4300 digits)" in parsed.error
    else:
        assert parsed.error is None and parsed.call.arguments["q"] == int("7" * digits)


@functools.lru_cache(maxsize=1)
def lookup_env():
    return envs.make("lookup")


tool_texts = st.one_of(
    st.text(max_size=200),
    st.builds(lambda body: OPEN + body + CLOSE, st.text(max_size=200)),
    st.builds(lambda v: OPEN + json.dumps(v) + CLOSE, json_values),
    st.builds(lambda v: OPEN + json.dumps({"name": "search", "arguments": v}) + CLOSE, json_values),
    st.builds(lambda d, k: OPEN + nested(d, k) + CLOSE, st.integers(1, 1500) | st.sampled_from([1000, 5000]),
              st.sampled_from(["list", "dict"])),
    st.builds(lambda n: OPEN + '{"name": "search", "arguments": {"query": ' + "9" * n + "}}" + CLOSE,
              st.integers(1, 6000) | st.just(4301)),
)


@FUZZ
@given(st.lists(tool_texts, min_size=1, max_size=4))
def test_step_never_raises_and_a_malformed_call_is_the_bad_call_observation(turns):
    env = lookup_env()
    env.reset(seed=0)
    for text in turns:
        if env.done:
            break
        parsed = parse_turn(text)
        observation, _, terminated, truncated, info = env.step(text)
        if not parsed.wants_tool:
            assert terminated and observation is None and env.final_answer == parsed.text
        elif truncated:
            assert observation is None
        else:
            assert isinstance(observation, str) and info["tool_error"] == observation.startswith("error:")
            if parsed.error is not None:
                assert observation == f"error: {parsed.error}"


@FUZZ
@given(st.dictionaries(st.text(max_size=8), json_values, max_size=4))
def test_check_arguments_never_raises(arguments):
    schema = lookup_env().tools[0]["function"]["parameters"]
    problem = check_arguments(schema, arguments)
    assert problem is None or "\n" not in problem
    assert (problem is None) == (set(arguments) == {"query"} and isinstance(arguments["query"], str))


# -- the grader's HTTP server: raw bytes -----------------------------------------------------------
READ_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def server():
    srv = GradeServer(LocalGrader(), read_timeout_s=READ_TIMEOUT_S, max_body=4096).start()
    yield srv
    srv.stop()


def exchange(srv: GradeServer, raw: bytes) -> bytes:
    host, port = srv._httpd.server_address[:2]
    with socket.create_connection((host, port), timeout=10) as sock:
        try:
            sock.sendall(raw)
        except OSError:  # the server answered and closed before taking all of it
            pass
        answer = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:  # closed with bytes of ours unread: what came first still counts
                break
            if not chunk:
                break
            answer += chunk
    return answer


def parse_answer(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = head.split(b"\r\n")[0].split(b" ")
    assert status[0] == b"HTTP/1.0", answer[:200]
    return int(status[1]), json.loads(body)


VALID = {"env": "math", "task_id": "t", "payload": {"response": "The answer is 3", "gold": "3"}}
wrong_values = {
    "env": st.sampled_from([None, 3, "", [], {}, True]),
    "task_id": st.sampled_from([None, 1.5, [], {}, True, False]),
    "payload": st.sampled_from([None, 3, "x", [], True]),
    "env_kwargs": st.sampled_from([None, 3, "x", [], True]),
    "effort": st.sampled_from([None, 3, "ultra", "", [], "LOW"]),
    "use_cache": st.sampled_from([None, 0, 1, "no", "true", []]),
}


def post(body: bytes, length: bytes | None = None) -> bytes:
    length = str(len(body)).encode() if length is None else length
    return b"POST /grade HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\n" + body


@settings(FUZZ, max_examples=60)
@given(st.data())
def test_http_a_request_is_answered_200_only_when_every_field_is_right(server, data):
    body = dict(VALID)
    for key, options in {"effort": st.sampled_from(["low", "medium", "high", "max"]), "use_cache": st.booleans(),
                         "env_kwargs": st.just({}), "task_id": st.integers() | st.text(max_size=10)}.items():
        if data.draw(st.booleans()):
            body[key] = data.draw(options)
    mutation = data.draw(st.sampled_from(["none", "drop", "wrong", "extra"]))
    if mutation == "drop":
        del body[data.draw(st.sampled_from(["env", "task_id", "payload"]))]
    elif mutation == "wrong":
        key = data.draw(st.sampled_from(sorted(wrong_values)))
        body[key] = data.draw(wrong_values[key])
    elif mutation == "extra":
        body[data.draw(st.text(min_size=1, max_size=8).filter(lambda k: k not in wrong_values))] = 1
    status, answer = parse_answer(exchange(server, post(json.dumps(body).encode())))
    if mutation == "none":
        assert status == 200 and answer["passed"] and answer["details"]["task_id"] == str(body["task_id"])
    else:
        assert status == 400 and set(answer) == {"error"} and "\n" not in answer["error"]


# repeated entries weigh the draw toward requests that get as far as the body and the grader
methods = st.sampled_from([b"POST"] * 12 + [b"GET", b"PUT", b"post", b"", b"\x00", b"POST POST"])
paths = st.sampled_from([b"/grade"] * 12 + [b"/health", b"/", b"/grade?x=1", b"", b"/" + b"a" * 70000])
lengths = st.sampled_from(["right"] * 12 + ["absent", "number", "abc", "", "1e3", "0x10", " 12 ", "\xff", "9" * 20])
bodies = st.one_of(st.binary(max_size=300), json_values.map(lambda v: json.dumps(v).encode()),
                   st.integers(1, 2000).map(lambda d: nested(d, "list").encode()),
                   st.builds(lambda v: json.dumps({**VALID, "payload": v}).encode(), json_values),
                   st.builds(lambda gold: json.dumps({**VALID, "payload": {"response": "3", "gold": gold}}).encode(),
                             json_scalars))


def content_length(kind: str, body: bytes, data) -> bytes | None:
    if kind == "right":
        return str(len(body)).encode()
    if kind == "number":
        return str(data.draw(st.integers(-5, 10_000))).encode()
    return None if kind == "absent" else kind.encode("latin-1")


junk_headers = st.one_of(st.just([]), st.just([]), st.lists(st.binary(max_size=40), min_size=1, max_size=3))


@settings(FUZZ, max_examples=150)
@given(methods, paths, lengths, junk_headers, bodies,
       st.sampled_from(["whole"] * 4 + ["short", "cut"]), st.data())
def test_http_raw_bytes_get_a_json_answer_or_a_timely_close(server, method, path, length_kind, junk, body,
                                                            shape, data):
    length = content_length(length_kind, body, data)
    headers = b"".join(b"X-" + h.replace(b"\r", b"").replace(b"\n", b"") + b": v\r\n" for h in junk)
    if length is not None:
        headers += b"Content-Length: " + length + b"\r\n"
    raw = method + b" " + path + b" HTTP/1.1\r\n" + headers + b"\r\n" + body
    if shape == "cut":
        raw = raw[: len(raw) // 2]
    elif shape == "short" and len(body) > 1:
        raw = raw[:-1]
    started = time.monotonic()
    answer = exchange(server, raw)
    assert time.monotonic() - started < READ_TIMEOUT_S + 5  # cut off at the deadline, never held open
    status, reply = parse_answer(answer)
    event(f"answered {status}")  # --hypothesis-show-statistics: which refusals the examples reached
    if status == 200:
        if path == b"/health":
            assert reply == {"ok": True}
        else:  # graded: the body was a whole, well-formed request
            sent = json.loads(body)
            assert method == b"POST" and path == b"/grade" and int(length) == len(body) and shape == "whole"
            assert set(sent) >= {"env", "task_id", "payload"} and reply["grader_version"]
    else:
        assert 400 <= status < 600 and set(reply) == {"error"} and "\n" not in reply["error"]
    status, reply = parse_answer(exchange(server, b"GET /health HTTP/1.1\r\n\r\n"))
    assert status == 200 and reply == {"ok": True}  # still serving


# -- registry files --------------------------------------------------------------------------------
@contextmanager
def registry_home() -> Iterator[Path]:
    """A registry dir of its own for one example (the autouse fixture's lasts a whole test)."""
    saved = os.environ.get("RL_ENVS_HOME")
    with tempfile.TemporaryDirectory() as home:
        os.environ["RL_ENVS_HOME"] = home
        try:
            yield Path(home)
        finally:
            if saved is None:
                os.environ.pop("RL_ENVS_HOME", None)
            else:
                os.environ["RL_ENVS_HOME"] = saved


registry_contents = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.text(min_size=1, max_size=8), json_values, max_size=3).map(lambda v: json.dumps(v).encode()),
    st.integers(0, 3000).map(lambda d: nested(d, "dict").encode()),
)


@settings(FUZZ, max_examples=100)
@given(registry_contents)
def test_any_registry_json_is_read_or_refused_in_one_line(content):
    with registry_home() as home:
        (home / "registry.json").write_bytes(content)
        try:
            names = registry.env_names()
        except registry.EnvRegistryError as exc:
            message = str(exc)
            assert "\n" not in message and str(home / "registry.json") in message
            return
        # accepted: it is an object whose every entry names a file and class, and every entry is listed
        data = json.loads(content)
        assert isinstance(data, dict)
        for name, rec in data.items():
            assert isinstance(rec, dict) and isinstance(rec.get("target"), str) and ":" in rec["target"]
            assert name in names
        assert "math" in names


SAFE_JUNK = string.digits + " +-/%()[]{}:,.='\""  # no names, no `*` or `<<`: junk that cannot run for long
fragments = st.sampled_from([
    "raise RuntimeError('boom')", "undefined_name", "import sys\nsys.exit(3)", "raise SystemExit('bye')",
    "def f():\n    return f()\nf()", "1/0", "import no_such_module_xyz", "raise BaseException('odd')",
    "def (:", "\x00", "class Env:\n    pass",
    "from envs.domains.math import MathEnv\nclass Env(MathEnv):\n    name = 'fuzz-env'",
]) | st.text(alphabet=SAFE_JUNK, max_size=30)


@settings(FUZZ, max_examples=60)
@given(st.lists(fragments, min_size=1, max_size=3))
def test_any_environment_file_registers_or_is_refused_in_one_line(parts):
    with registry_home() as home:
        path = home / "fuzz_env.py"
        source = "\n".join(parts) + "\n"
        path.write_text(source, errors="surrogateescape")
        try:
            name = envs.register_file(f"{path}:Env")
        except (ValueError, TypeError, AttributeError) as exc:  # EnvRegistryError is a ValueError
            assert "\n" not in str(exc) and str(path) in str(exc)
            return
        # accepted: the file defined an Environment subclass Env and nothing after it failed
        assert name == "fuzz-env" and "class Env(MathEnv)" in source
        assert registry.get_entry(name).target == f"{path}:Env"
        registry.unregister(name)
