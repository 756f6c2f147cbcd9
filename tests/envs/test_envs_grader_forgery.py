"""The code and shell graders' verdicts cannot be forged by the code under test.

Each attack is a wrong solution plus a trick; all but one (patching open() in calc.py, which the old
shell runner had opened its tests with already) made the old one-process harness print its success
line or pass its asserts without solving the task. All must score 0 on every backend; the reference
still scores 1, so a judge that fails everything cannot pass these tests.
"""
from __future__ import annotations

import os
import shutil

import pytest

import envs

# every 16-hex-digit string this process holds in a namespace, a frame's locals or a dict in them
# (the old harness kept its nonce in __main__)
_FIND = """
import __main__, gc, re, sys
def _strings(o, depth=0):
    if isinstance(o, str):
        yield o
    elif isinstance(o, dict) and depth < 3:
        for v in list(o.values()):
            yield from _strings(v, depth + 1)
def _nonces():
    pools = [vars(__main__)] + [o for o in gc.get_objects() if isinstance(o, dict)]
    for f in sys._current_frames().values():
        while f is not None:
            pools.append(f.f_locals)
            f = f.f_back
    return {s for p in pools for s in _strings(p) if re.fullmatch('[0-9a-f]{16}', s)}
def _forge():
    print('\\n'.join('ALL TESTS PASSED ' + n for n in _nonces()), flush=True)
"""

# answers read off any test file in reach: the work dir, /tmp, and the parent's stdin
_READ_TESTS = """
import ast, os
_table = {}
def _learn(text):
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return
    for node in ast.walk(tree):
        t = getattr(node, 'test', None)
        if isinstance(node, ast.Assert) and isinstance(t, ast.Compare) and isinstance(t.left, ast.Call):
            try:
                args = tuple(ast.literal_eval(a) for a in t.left.args)
                _table[repr(args)] = ast.literal_eval(t.comparators[0])
            except ValueError:
                pass
_paths = ['/proc/%d/fd/0' % os.getppid()]
for _root in ('.', '/tmp'):
    for _dir, _, _names in os.walk(_root):
        _paths += [os.path.join(_dir, n) for n in _names]
for _p in _paths:
    try:
        _learn(open(_p).read())
    except Exception:
        pass
"""

# a module the tests import lazily, planted where a harness that puts its directory on sys.path finds it
_SHADOW = """
import os
_src = %r
for _d in ('.', '/tmp'):
    try:
        open(os.path.join(_d, 'fractions.py'), 'w').write(_src)
    except OSError:
        pass
""" % (_FIND + "_forge()\nimport os\nos._exit(0)\n")

ATTACKS = {
    "marker-then-os-exit": _FIND + "_forge()\nimport os\nos._exit(0)\n",
    "marker-from-atexit": _FIND + "import atexit, os\natexit.register(lambda: (_forge(), os._exit(0)))\n",
    "marker-then-system-exit": _FIND + "_forge()\nraise SystemExit(0)\n",
    "marker-then-kill-parent": _FIND + "import os, signal\n_forge()\n"
                                       "os.kill(os.getppid(), signal.SIGKILL)\nos._exit(0)\n",
    # the harness reads its tests with open(): hand it tests that check nothing
    "tests-replaced-by-patched-open": "import builtins, io\n_open = builtins.open\n"
                                      "def _fake(path, *a, **k):\n"
                                      "    if 'test' in str(path):\n"
                                      "        return io.StringIO('def check(candidate):\\n    pass\\n')\n"
                                      "    return _open(path, *a, **k)\n"
                                      "builtins.open = _fake\n",
    "always-equal-result": "class _Yes:\n    def __eq__(self, other):\n        return True\n"
                           "    __ne__ = lambda self, other: False\n",
}
WRONG = "def {fn}(*args, **kwargs):\n    return {result}\n"


def _attack(name: str, fn: str) -> str:
    result = "_Yes()" if name == "always-equal-result" else "None"
    return ATTACKS[name] + WRONG.format(fn=fn, result=result)


def _lookup(fn: str) -> str:
    return _READ_TESTS + WRONG.format(fn=fn, result="_table.get(repr(args))")


@pytest.fixture(params=["bwrap", "unshare", "docker"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The process backend under bubblewrap and under its unshare fallback, and Docker."""
    if request.param == "docker":
        request.getfixturevalue("docker_image")
        return "docker"
    if request.param == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")
    if request.param == "unshare":
        if shutil.which("unshare") is None or os.geteuid() != 0:
            pytest.skip("the unshare fallback needs util-linux unshare and root")
        monkeypatch.setenv("RL_SANDBOX_NO_BWRAP", "1")
    return "process"


@pytest.fixture
def code_env(backend: str):
    env = envs.make("code", sandbox_backend=backend)
    yield env, env.dataset("train")[0]
    env.close()


@pytest.fixture
def fix_env(backend: str):
    env = envs.make("shell-fix-test", sandbox_backend=backend)
    yield env, env.dataset("train")[0]
    env.close()


def _code_grade(env, task, code: str, tests: str | None = None):
    payload = {"code": code, "tests": tests or task["tests"], "entry_point": task["entry_point"]}
    return env.grader(payload)


def _fix_grade(env, task, calc: str):
    return env.grader({"kind": "fix_test", "path": "calc.py", "files": {"calc.py": calc},
                       "hidden_tests": task["hidden_tests"]})


def _fn(task) -> str:
    return task["variant"]  # the function with the bug


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_code_solution_cannot_forge_its_verdict(code_env, attack):
    env, task = code_env
    grade = _code_grade(env, task, _attack(attack, task["entry_point"]))
    assert grade.reward == 0.0 and not grade.passed, (attack, grade)


def test_code_solution_cannot_read_the_tests(code_env):
    env, task = code_env
    grade = _code_grade(env, task, _lookup(task["entry_point"]))
    assert grade.reward == 0.0 and not grade.passed, grade


def test_code_tests_never_import_what_the_solution_plants(code_env):
    env, task = code_env
    solution = task["solution"]  # passes the task's asserts, never the added one: only the planted module could
    tests = task["tests"].replace("def check(candidate):\n", "def check(candidate):\n    import fractions\n") + \
        "    assert candidate(0) == 'never'\n"
    assert _code_grade(env, task, _SHADOW + solution, tests).reward == 0.0
    assert _code_grade(env, task, solution, tests.replace("    assert candidate(0) == 'never'\n", "")).passed


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_shell_fix_cannot_forge_its_verdict(fix_env, attack):
    env, task = fix_env
    grade = _fix_grade(env, task, _attack(attack, _fn(task)))
    assert grade.reward == 0.0 and not grade.passed, (attack, grade)


def test_shell_fix_cannot_read_the_hidden_tests(fix_env):
    env, task = fix_env
    grade = _fix_grade(env, task, _lookup(_fn(task)))
    assert grade.reward == 0.0 and not grade.passed, grade


def test_the_references_still_pass(code_env, fix_env):
    """The control: the same graders pass a right answer on this backend."""
    (code, code_task), (fix, fix_task) = code_env, fix_env
    assert _code_grade(code, code_task, code_task["solution"]).passed
    assert _fix_grade(fix, fix_task, fix_task["expect"]).passed


def test_the_tests_process_is_out_of_the_solutions_reach(code_env):
    """The solution's process shares the uid of the tests' process, its parent, and still cannot open its
    stdout (the verdict's channel), stdin (the tests), memory or environment, nor ptrace it. The tests
    pass only if every attempt was refused."""
    env, _ = code_env
    probe = ("import ctypes, os\n"
             "def reach():\n"
             "    out = []\n"
             "    for name, mode in (('fd/1', 'w'), ('fd/0', 'r'), ('mem', 'rb'), ('environ', 'rb')):\n"
             "        try:\n"
             "            open('/proc/%d/%s' % (os.getppid(), name), mode).close()\n"
             "            out.append(name + ' opened')\n"
             "        except OSError as e:\n"
             "            out.append(type(e).__name__)\n"
             "    libc = ctypes.CDLL(None, use_errno=True)\n"
             "    out.append(libc.ptrace(16, os.getppid(), 0, 0))  # PTRACE_ATTACH\n"
             "    return out\n")
    tests = "def check(candidate):\n    assert candidate() == ['PermissionError'] * 4 + [-1], candidate()\n"
    grade = env.grader({"code": probe, "tests": tests, "entry_point": "reach"})
    assert grade.passed, grade.details


HONEST = """
import collections
def values(x, *, scale=1):
    print('a solution may print')  # its output is not the judge's
    return (x * scale, {1: [2.5, None]}, {3}, frozenset({4}), b'x', 1j, True, collections.Counter('aab'))
def mutate(xs):
    xs.append(1)
    return len(xs)
def fails(kind):
    raise {'value': ValueError, 'key': KeyError}[kind]('no')
def stops():
    raise StopIteration
"""

def test_an_honest_solution_meets_the_tests_as_in_one_process(code_env):
    """Results come back with their types, keyword arguments and exceptions as the solution raised them;
    a StopIteration (which would end a test's loop early) comes back as an error."""
    env, _ = code_env
    tests = ("from __solution__ import mutate, fails, stops\n"
             "def check(candidate):\n"
             "    got = candidate(2, scale=3)\n"
             "    assert got == (6, {1: [2.5, None]}, {3}, frozenset({4}), b'x', 1j, True, {'a': 2, 'b': 1}), got\n"
             "    assert [type(v) for v in got[:3]] == [int, dict, set] and got[6] is True\n"
             "    xs = [0]\n"
             "    assert mutate(xs) == 2 and xs == [0]  # the solution got a copy\n"
             "    for kind, exc in (('value', ValueError), ('key', KeyError)):\n"
             "        try:\n"
             "            fails(kind)\n"
             "        except exc:\n"
             "            pass\n"
             "        else:\n"
             "            raise AssertionError(kind)\n"
             "    try:\n"
             "        stops()\n"
             "    except StopIteration:\n"
             "        raise AssertionError('a StopIteration reached the tests')\n"
             "    except Exception:\n"
             "        pass\n")
    grade = env.grader({"code": HONEST, "tests": tests, "entry_point": "values"})
    assert grade.passed, grade.details
    assert "a solution may print" in grade.details["stderr_tail"]
