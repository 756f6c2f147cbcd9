"""Hidden tests against an untrusted solution, in two processes, so the solution cannot forge the verdict.

The code and shell graders copy this file into a fresh sandbox of their own (`run_judge`) and run it as
`python3 -I judge.py SOLUTION_FILE MODULE`, the rest of the spec on stdin. The judge forks a child that runs
the solution, and runs the tests itself: the tests get a stand-in for the solution's module whose calls
travel to the child over a pair of pipes and come back as plain data (None, bool, int, float, complex, str,
bytes and lists, tuples, dicts, sets of them) rebuilt here, so a returned object cannot lie in a comparison.
The child shares the sandbox's uid, so it is kept from everything that decides the verdict:
- the judge forks it before reading the spec (tests, trusted context, nonce), which comes on the judge's
  stdin, a pipe the child never holds, and is in no file: the child cannot read answers off the tests;
- the verdict line goes to the judge's stdout; the child's stdout and stderr are the judge's stderr;
- the judge is non-dumpable from its first line, so the child cannot ptrace it or open its
  /proc/<pid>/fd, mem or environ;
- the judge's sys.path holds no directory the child can write to (`-I`, and the script's directory
  dropped), so a module the tests import late cannot be one the child planted.
A child that dies, hangs or answers nonsense makes the call raise: the tests fail.
The sandbox side imports little (a second interpreter and heavy imports cost more than the sandbox's start
on a loaded machine) and only the standard library: this file runs there as it is.
"""
from __future__ import annotations

import builtins
import json
import os
import sys
import types

TYPE_CHECKING = False  # typing's, without importing typing in the sandbox
if TYPE_CHECKING:
    from sandbox import ExecResult

PASSED = "ALL TESTS PASSED"
_SETS = {"tuple": tuple, "set": set, "frozenset": frozenset}


def run_judge(backend: str, solution: tuple[str, str], module: str, tests: str, context: str = "",
              check: str | None = None, timeout: float = 10.0) -> tuple[bool, ExecResult]:
    """The graders' side: run `tests` against `solution` (file name, source), importable as `module`, in a
    fresh sandbox. `context` is trusted code run before the tests (helpers they use); `check`, when given,
    names the solution's function that the tests' `check(candidate)` is called with. Returns (passed,
    the sandbox's ExecResult)."""
    import secrets

    from envs.domains.fresh_sandbox import run_in_fresh_sandbox

    nonce = secrets.token_hex(8)
    spec = {"nonce": nonce, "tests": tests, "context": context, "check": check}
    with open(__file__, encoding="utf-8") as f:
        files = {solution[0]: solution[1], "judge.py": f.read()}
    r = run_in_fresh_sandbox(backend, files, ["python3", "-I", "judge.py", solution[0], module],
                             stdin=json.dumps(spec), timeout=timeout)
    return (not r.timed_out and r.exit_code == 0 and f"{PASSED} {nonce}" in r.stdout), r


def encode(value: object) -> object:
    """`value` as JSON-able data; subclasses travel as their base type (a Counter as a dict)."""
    if value is None or isinstance(value, bool):
        return value
    for base in (int, float, str):
        if isinstance(value, base):
            return base(value)
    if isinstance(value, complex):
        return {"complex": [value.real, value.imag]}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, list):
        return [encode(v) for v in value]
    if isinstance(value, dict):
        return {"dict": [[encode(k), encode(v)] for k, v in value.items()]}
    for tag, kind in _SETS.items():
        if isinstance(value, kind):
            return {tag: [encode(v) for v in value]}
    raise TypeError(f"a {type(value).__name__} cannot pass between the tests and the solution")


def decode(data: object) -> object:
    """What `encode` made, rebuilt of exact built-in types; anything else is refused."""
    if data is None or type(data) in (bool, int, float, str):
        return data
    if type(data) is list:
        return [decode(v) for v in data]
    if type(data) is dict and len(data) == 1:
        ((tag, body),) = data.items()
        if tag == "dict" and type(body) is list:
            return {decode(k): decode(v) for k, v in body}
        if tag in _SETS and type(body) is list:
            return _SETS[tag](decode(v) for v in body)
        if tag == "bytes" and type(body) is str:
            return bytes.fromhex(body)
        if tag == "complex" and type(body) is list and all(type(x) is float for x in body):
            return complex(*body)
    raise ValueError(f"the solution's process sent data the judge does not read: {str(data)[:80]}")


class SolutionError(Exception):
    """The solution raised something the tests cannot meet as itself, or its process failed."""


class _Solution:
    """The child process running the solution, and the calls to it."""

    def __init__(self, path: str, module: str) -> None:
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        self.status: int | None = None
        self.pid = os.fork()  # no second interpreter to start: the judge holds no secret yet
        if self.pid == 0:
            try:
                os.close(req_w)
                os.close(resp_r)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)  # not the judge's stdin (the spec to come)
                os.dup2(2, 1)  # nor its stdout (the verdict)
                os.close(null)
                sys.stdout.reconfigure(line_buffering=True)  # what it prints gets out before it is killed
                serve(path, module, req_r, resp_w)
            finally:
                os._exit(0)
        os.close(req_r)
        os.close(resp_w)
        self._send, self._recv = os.fdopen(req_w, "w"), os.fdopen(resp_r, "r")

    def started(self) -> None:
        """Wait until the child has run the solution's top level (raises what that raised)."""
        self._reply()

    def call(self, name: str, args: tuple, kwargs: dict) -> object:
        self._send.write(json.dumps({"name": name, "args": encode(list(args)), "kwargs": encode(kwargs)}) + "\n")
        self._send.flush()
        return decode(self._reply()["value"])

    def _reply(self) -> dict:
        line = self._recv.readline()
        if not line:
            raise SolutionError(f"the solution's process ended (exit status {os.waitstatus_to_exitcode(self.end())})")
        reply = json.loads(line)
        if type(reply) is not dict:
            raise SolutionError("the solution's process sent no reply")
        if "raised" in reply:
            kind = getattr(builtins, str(reply["raised"]), None)
            message = str(reply.get("message", ""))
            # raised as itself where the tests may expect it; never one that steers a loop or exits
            if isinstance(kind, type) and issubclass(kind, Exception) and not issubclass(kind, StopIteration):
                raise kind(message)
            raise SolutionError(f"{reply['raised']}: {message}")
        return reply

    def module(self, name: str) -> types.ModuleType:
        """A stand-in for the solution's module: each public attribute is a function that calls the child."""
        solution = self

        def remote(attr: str) -> object:
            if attr.startswith("__"):  # the import system probes these: a module, not a package
                raise AttributeError(attr)

            def call(*args: object, **kwargs: object) -> object:
                return solution.call(attr, args, kwargs)

            call.__name__ = call.__qualname__ = attr
            return call

        stand_in = types.ModuleType(name)
        stand_in.__getattr__ = remote  # type: ignore[method-assign]
        return stand_in

    def end(self) -> int:
        """Kill the child if it still runs; its wait status."""
        if self.status is None:
            os.kill(self.pid, 9)  # SIGKILL (a zombie takes it too)
            self.status = os.waitpid(self.pid, 0)[1]
        return self.status


def _undumpable() -> None:
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _tests_line(exc: BaseException) -> int | None:
    """The line of tests.py where `exc` was raised (or passed through last)."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "tests.py":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def judge(path: str, module: str) -> int:
    """Run the tests of the spec on stdin against the solution in `path`; print the verdict line only if
    they all pass."""
    _undumpable()  # first: nothing the child could take is in memory yet, and it does not exist yet
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) != here]
    solution = _Solution(path, module)
    spec = json.loads(sys.stdin.read())
    try:
        solution.started()
        stand_in = solution.module(module)
        sys.modules[module] = stand_in
        ns: dict[str, object] = {"__name__": "__hidden_tests__"}
        exec(compile(spec["context"], "context.py", "exec"), ns)
        if spec["check"]:
            ns[spec["check"]] = getattr(stand_in, spec["check"])  # some tests name it, not `candidate`
        exec(compile(spec["tests"], "tests.py", "exec"), ns)
        if spec["check"]:
            ns["check"](ns[spec["check"]])
    except Exception as exc:  # noqa: BLE001 - any failure of the tests is the verdict, said on stderr
        line = _tests_line(exc)
        where = f" at tests.py line {line}" if line else ""
        print(f"the tests failed{where}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
        return 1
    finally:
        solution.end()
    print(f"{PASSED} {spec['nonce']}", flush=True)
    return 0


def serve(path: str, module: str, req_fd: int, resp_fd: int) -> None:
    """The child: run the solution as `module`, then answer calls until the judge hangs up."""
    recv, send = os.fdopen(req_fd, "r"), os.fdopen(resp_fd, "w")

    def reply(message: dict) -> None:
        send.write(json.dumps(message) + "\n")
        send.flush()

    def raised(exc: BaseException) -> dict:
        return {"raised": type(exc).__name__, "message": str(exc)[:300]}

    namespace = types.ModuleType(module)
    namespace.__file__ = os.path.abspath(path)
    sys.modules[module] = namespace
    try:
        with open(path, encoding="utf-8") as f:
            exec(compile(f.read(), path, "exec"), namespace.__dict__)
    except BaseException as exc:  # noqa: BLE001 - SystemExit included: the judge learns it ended
        reply(raised(exc))
        return
    reply({"ready": True})
    for line in recv:
        request = json.loads(line)
        try:
            fn = getattr(namespace, request["name"])
            reply({"value": encode(fn(*decode(request["args"]), **decode(request["kwargs"])))})
        except BaseException as exc:  # noqa: BLE001 - the call's failure is the answer
            reply(raised(exc))


if __name__ == "__main__":
    sys.exit(judge(sys.argv[1], sys.argv[2]))
