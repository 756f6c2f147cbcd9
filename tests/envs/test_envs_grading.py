"""Grader service: Ray pool and local grading; cache, versions, timeouts, crashes; HTTP both ways."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import envs
from envs.grades import GradeRequest
from envs.grading import GraderPool, LocalGrader
from envs.grading_http import GradeServer, HttpGrader
import graders_testutil
from graders_testutil import CountingGrader, CrashingGrader, ExitingGrader, RaisingGrader, SleepyGrader


def _req(grader, **payload):
    return GradeRequest(env="test", task_id="t0", grader=grader, payload=payload)


@pytest.fixture(scope="module")
def pool(ray_session):
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(graders_testutil)  # Ray workers cannot import tests/envs
    p = GraderPool(num_actors=2, retries=1)
    yield p
    p.close()


def test_pool_grades_caches_and_records_version(pool):
    g = pool.grade(_req(CountingGrader(), x=2))
    assert g.passed and g.reward == 1.0 and g.error is None
    assert g.grader_version.endswith("graders_testutil.CountingGrader@count-1")
    again = pool.grade(_req(CountingGrader(), x=2))
    assert again.details.get("cached") is True and again.passed
    fresh = pool.grade(_req(CountingGrader(), x=2), use_cache=False)
    assert "cached" not in fresh.details
    other = pool.grade(_req(CountingGrader(), x=3))
    assert not other.passed and "cached" not in other.details


def test_cache_key_changes_with_grader_version():
    a, b = CountingGrader(), CountingGrader()
    b.version = "count-2"
    assert _req(a, x=1).cache_key() != _req(b, x=1).cache_key()
    assert _req(a, x=1).cache_key() != _req(a, x=2).cache_key()


def test_pool_hung_grader_times_out_with_a_clear_error_and_pool_recovers(pool):
    t0 = time.monotonic()
    g = pool.grade(_req(SleepyGrader()), use_cache=False)
    took = time.monotonic() - t0
    assert not g.passed and g.reward == 0.0 and g.error is not None
    assert g.error.startswith("grader timed out") and "attempt 2 timed out after 1s" in g.error
    assert g.grader_version.endswith("SleepyGrader@sleepy-1")
    assert took < 20
    assert pool.grade(_req(CountingGrader(), x=4), use_cache=False).passed  # replacement actors work


def test_pool_crashing_grader_gives_failed_grade_and_pool_recovers(pool):
    g = pool.grade(_req(CrashingGrader()), use_cache=False)
    assert not g.passed and g.error.startswith("grader crashed") and "attempt 2" in g.error
    assert pool.grade(_req(CountingGrader(), x=6), use_cache=False).passed


def test_pool_raising_grader_is_a_failed_grade_not_an_exception(pool):
    g = pool.grade(_req(RaisingGrader()))
    assert not g.passed and g.error == "grader raised ValueError: the grader has a bug"
    assert pool.grade(_req(RaisingGrader())).details.get("cached") is None  # failures are not cached


def test_pool_grade_many_runs_on_several_actors(pool):
    grades = pool.grade_many([_req(CountingGrader(), x=i) for i in range(8)], use_cache=False)
    assert [g.passed for g in grades] == [i % 2 == 0 for i in range(8)]


def test_pool_grade_many_batches_and_a_bad_request_gets_its_own_error(pool):
    """Requests go to the actors in chunks; a chunk with a hung (or crashed) grader is graded again
    one request at a time, so only the bad request fails."""
    counting = CountingGrader()
    counting.timeout_s = 2.0  # a chunk waits for its slowest grader's timeout before it is split up
    reqs = [_req(counting, x=i) for i in range(5)] + [_req(SleepyGrader())] + [_req(counting, x=i) for i in range(5, 9)]
    grades = pool.grade_many(reqs, use_cache=False)
    assert [g.passed for g in grades[:5] + grades[6:]] == [i % 2 == 0 for i in range(9)]
    assert all(g.error is None for g in grades[:5] + grades[6:])
    assert grades[5].error.startswith("grader timed out") and "attempt 2" in grades[5].error


def _stops(grades):
    skipped = [g for g in grades if g.details.get("skipped")]
    assert skipped and all(g.error == "not graded: an earlier grade timed out" and not g.passed for g in skipped)
    return skipped


def test_local_grade_many_can_stop_after_a_timeout():
    reqs = [_req(SleepyGrader())] + [_req(CountingGrader(), x=2 * i) for i in range(10)]
    grades = LocalGrader(timeout_s=0.5, parallelism=1).grade_many(reqs, use_cache=False, stop_on_timeout=True)
    # one worker: it sees the timeout before it would take the next request, so none of the rest starts
    assert grades[0].error.startswith("grader timed out") and len(_stops(grades)) == 10
    assert all(g.passed for g in LocalGrader().grade_many(reqs[1:], use_cache=False, stop_on_timeout=True))


def test_pool_grade_many_can_stop_after_a_timeout(pool):
    """40 hanging requests cost a few timeouts, not 40."""
    t0 = time.monotonic()
    grades = pool.grade_many([_req(SleepyGrader(), n=i) for i in range(40)], use_cache=False, stop_on_timeout=True)
    assert time.monotonic() - t0 < 120  # each timeout also restarts an actor
    assert len(_stops(grades)) >= 30 and all(g.error.startswith("grader timed out") for g in grades if not g.details.get("skipped"))


def test_pool_grades_env_requests(pool):
    env = envs.make("lookup")
    _, info = env.reset(seed=0)
    for action in env.reference_actions(info["task_id"]):
        env.step(action)
    assert pool.grade(env.grade_request()).passed


def test_local_grader_timeout_and_errors():
    local = LocalGrader(timeout_s=0.5)
    t0 = time.monotonic()
    g = local.grade(_req(SleepyGrader()))
    assert time.monotonic() - t0 < 5
    assert g.error == "grader timed out after 0.5s (1 attempt(s))" and not g.passed
    assert local.grade(_req(RaisingGrader())).error.startswith("grader raised ValueError")
    assert local.grade(_req(CountingGrader(), x=0)).passed
    assert local.grade(_req(ExitingGrader())).error == "grader crashed: SystemExit: 3"


def test_pool_needs_ray_running():
    import subprocess
    import sys

    code = "from envs.grading import GraderPool\nGraderPool()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "GraderPool needs a running Ray session" in r.stderr


def test_pool_grades_envs_registered_from_a_file(pool, tmp_path):
    from test_envs_registry import _write_env

    envs.register_file(f"{_write_env(tmp_path)}:SayWord")
    env = envs.make("say-word")
    _, info = env.reset(seed=0)
    env.step(env.reference_actions(info["task_id"])[0])
    g = pool.grade(env.grade_request())
    assert g.passed and g.error is None, g


def _post(url, body):
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_grade_server():
    server = GradeServer(LocalGrader()).start()
    try:
        with urllib.request.urlopen(server.url + "/health", timeout=5) as resp:
            assert json.loads(resp.read()) == {"ok": True}
        code, grade = _post(server.url + "/grade", {"env": "math", "task_id": "x",
                                                    "payload": {"response": "The answer is 0.5", "gold": "1/2"}})
        assert code == 200 and grade["passed"] and grade["grader_version"].endswith("MathGrader@1")
        code, grade = _post(server.url + "/grade", {"env": "math", "task_id": "x",
                                                    "payload": {"response": "The answer is 3", "gold": "1/2"}})
        assert code == 200 and not grade["passed"]
        code, err = _post(server.url + "/grade", {"env": "math"})
        assert code == 400 and "missing field 'task_id'" in err["error"]
        code, err = _post(server.url + "/grade", {"env": "nope", "task_id": "x", "payload": {}})
        assert code == 400 and "unknown environment" in err["error"]
    finally:
        server.stop()


class _ExternalGrader(BaseHTTPRequestHandler):
    """Stands in for a grader written in another language: answers JSON over HTTP."""

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body["payload"].get("broken"):
            self.send_response(500)
            self.end_headers()
            return
        ok = body["payload"]["answer"] == "42"
        data = json.dumps({"reward": float(ok), "passed": ok, "details": {"lang": "other"}}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_http_grader_calls_an_external_service():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ExternalGrader)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/score"
    try:
        grader = HttpGrader(url, version="ext-7")
        g = grader({"answer": "42"})
        assert g.passed and g.details["lang"] == "other" and g.grader_version.endswith("HttpGrader@ext-7")
        assert not grader({"answer": "41"}).passed
        assert grader({"broken": True}).error == f"remote grader at {url} answered HTTP 500"
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert "unreachable" in HttpGrader(url, timeout_s=2)({"answer": "42"}).error
