"""The in-sandbox agent: a small stdlib-only server that runs inside every sandbox.

It is shipped as a source file (read-only inside the sandbox) so images only need python3. One
long-lived agent per sandbox keeps state (files, background servers) across execs and
makes an exec a fork+exec inside the sandbox instead of a new container exec (~57 ms
through the docker API). When its connection closes (the owner died or closed the
sandbox) or its deadline passes, it exits, and the backend's pid namespace / init kills
everything else that runs in the sandbox.

Frames: 8-byte header (json length, blob length, big endian), json, blob.
"""
import errno
import io
import json
import os
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import time

HDR = struct.Struct(">II")
CHUNK = 1 << 16


def kill_group(proc, budget=1.0):
    """SIGKILL a command's process group until it is gone: members forking meanwhile (a
    fork bomb) race a single kill. The leader is reaped first, else its zombie keeps the
    group alive."""
    end = time.monotonic() + budget
    while time.monotonic() < end:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            return
        if proc.returncode is None:
            try:
                proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        reap_orphans(())  # as pid 1, killed members are our zombies: they keep the group alive
        time.sleep(0.002)


def kill_all_but_me(settle=0.5):
    """SIGKILL every process this user can signal in the sandbox (its pid namespace) but the agent."""
    end = time.monotonic() + settle
    while time.monotonic() < end:
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        time.sleep(0.02)  # let pid 1 (us, or docker's init) reap them
        reap_orphans(())
        try:
            os.kill(-1, 0)
        except OSError:
            return  # nothing left to signal


def reap_orphans(keep):
    """As pid 1 of the sandbox, reap orphaned zombies (they would hold pids forever),
    leaving the children in `keep` to subprocess, which waits for them itself."""
    if os.getpid() != 1:
        return
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid in keep:
            return
        try:
            os.waitpid(info.si_pid, 0)
        except ChildProcessError:
            return


class Conn:
    def __init__(self, rfd, wfd):
        self.rfd, self.wfd = rfd, wfd

    def _read_exact(self, n):
        parts = []
        while n:
            b = os.read(self.rfd, min(n, 1 << 20))
            if not b:
                raise EOFError
            parts.append(b)
            n -= len(b)
        return b"".join(parts)

    def recv(self):
        jlen, blen = HDR.unpack(self._read_exact(HDR.size))
        head = json.loads(self._read_exact(jlen))
        if head.get("chunked"):
            return head, ChunkReader(self)
        return head, (self._read_exact(blen) if blen else b"")

    def send(self, head, blob=b""):
        j = json.dumps(head).encode()
        self.send_raw(HDR.pack(len(j), len(blob)) + j + blob)

    def send_raw(self, data):
        data = memoryview(data)
        while data:
            n = os.write(self.wfd, data)
            data = data[n:]


LEN = struct.Struct(">I")


class ChunkReader:
    """File-like view of incoming chunk frames (4-byte length, data; length 0 ends)."""

    def __init__(self, conn):
        self.conn, self.buf, self.done = conn, b"", False

    def read(self, n=-1):
        while not self.done and (n < 0 or len(self.buf) < n):
            (k,) = LEN.unpack(self.conn._read_exact(LEN.size))
            if k == 0:
                self.done = True
            else:
                self.buf += self.conn._read_exact(k)
        if n < 0:
            n = len(self.buf)
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def drain(self):
        while not self.done:
            self.buf = b""
            self.read(1 << 20)


class ChunkWriter:
    """File-like sink that sends chunk frames; streams big files and tars in bounded memory."""

    def __init__(self, conn):
        self.conn, self.buf = conn, bytearray()

    def write(self, data):
        self.buf += data
        if len(self.buf) >= CHUNK * 4:
            self.flush()
        return len(data)

    def flush(self):
        if self.buf:
            self.conn.send_raw(LEN.pack(len(self.buf)) + bytes(self.buf))
            self.buf = bytearray()

    def end(self):
        self.flush()
        self.conn.send_raw(LEN.pack(0))


class Agent:
    def __init__(self, conn, workdir, base_env, deadline, pids=0):
        self.conn, self.workdir, self.base_env, self.deadline = conn, workdir, base_env, deadline
        self.pids = pids

    def path(self, p):
        return p if os.path.isabs(p) else os.path.join(self.workdir, p)

    def remaining(self):
        return self.deadline - time.monotonic()

    def saturated(self):
        """Leftover processes (a backgrounded fork bomb) fill the pid limit: nothing can run."""
        if not self.pids:
            return False
        try:
            n = sum(1 for d in os.listdir("/proc") if d.isdigit())
        except OSError:
            return False
        return n >= self.pids - 2

    @staticmethod
    def spawn(argv, cwd, env, blob):
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.PIPE if blob else subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        try:  # make the OOM killer pick user commands (and their children) before the agent
            with open("/proc/%d/oom_score_adj" % p.pid, "w") as f:
                f.write("1000")
        except OSError:
            pass
        return p

    def op_exec(self, h, blob):
        argv = h["argv"]
        env = dict(self.base_env)
        env.update(h.get("env") or {})
        cwd = self.path(h.get("cwd") or self.workdir)
        cap = int(h["max_output"])
        timeout = min(float(h["timeout"]), max(self.remaining(), 0.0))
        t0 = time.monotonic()
        note = None
        if self.saturated():
            kill_all_but_me()
            note = "process limit reached: every process of the sandbox was killed first"
        try:
            try:
                p = self.spawn(argv, cwd, env, blob)
            except BlockingIOError:
                # the pid limit is exhausted (a fork bomb left running in the background): the
                # sandbox is wedged, so clear every process but us and try once more
                kill_all_but_me()
                note = "process limit reached: every process of the sandbox was killed first"
                p = self.spawn(argv, cwd, env, blob)
        except (OSError, ValueError) as e:
            code = 127 if isinstance(e, FileNotFoundError) else 126
            return {"exit_code": code, "out_len": 0, "timed_out": False, "wall_time": time.monotonic() - t0,
                    "error": "cannot start %r: %s" % (argv[0] if argv else "", e)}, b""
        sel = selectors.DefaultSelector()
        bufs = {p.stdout.fileno(): bytearray(), p.stderr.fileno(): bytearray()}
        dropped = {p.stdout.fileno(): 0, p.stderr.fileno(): 0}
        for fd in bufs:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        pending = memoryview(blob) if blob else None
        if pending is not None:
            os.set_blocking(p.stdin.fileno(), False)
            sel.register(p.stdin.fileno(), selectors.EVENT_WRITE)
        sel.register(self.conn.rfd, selectors.EVENT_READ)  # owner hang-up
        end = t0 + timeout
        timed_out = hung_up = False
        exited_at = None
        open_fds = set(bufs)
        while open_fds:
            reap_orphans((p.pid,))
            now = time.monotonic()
            if now >= end:
                timed_out = p.poll() is None
                break
            if exited_at is None and p.poll() is not None:
                exited_at = now
            # a background child may keep the pipes open forever: stop shortly after exit
            if exited_at is not None and now - exited_at > 0.05:
                break
            wait = end - now if exited_at is None else 0.01
            for key, _ in sel.select(min(wait, 0.05 if exited_at is None and p.poll() is None else wait)):
                fd = key.fd
                if fd == self.conn.rfd:
                    hung_up = True
                    break
                if pending is not None and fd == p.stdin.fileno():
                    try:
                        n = os.write(fd, pending[:CHUNK])
                        pending = pending[n:]
                    except (BrokenPipeError, OSError):
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        p.stdin.close()
                        pending = None
                    continue
                try:
                    data = os.read(fd, CHUNK)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(fd)
                    open_fds.discard(fd)
                    continue
                room = cap - len(bufs[fd])
                if room > 0:
                    bufs[fd] += data[:room]
                dropped[fd] += max(0, len(data) - max(room, 0))
            if hung_up:
                break
        if not (timed_out or hung_up) and p.poll() is None:
            # it closed its stdout/stderr but runs on: the timeout still applies
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out or hung_up:
            kill_group(p)
        try:
            rc = p.wait(timeout=2)
        except subprocess.TimeoutExpired:
            os.kill(p.pid, signal.SIGKILL)
            rc = p.wait()
        sel.close()
        for f in (p.stdout, p.stderr):
            f.close()
        if p.stdin and not p.stdin.closed:
            try:
                p.stdin.close()
            except OSError:
                pass
        if hung_up:
            raise EOFError
        out, err = (bytes(b) for b in bufs.values())  # insertion order: stdout, stderr
        o_drop, e_drop = dropped.values()
        error = None
        if timed_out:
            code = 124
            error = "timed out after %.1fs" % timeout
            if self.remaining() <= 0:
                error = "sandbox lifetime (ttl) expired"
        elif rc < 0:
            code = 128 - rc
            name = signal.Signals(-rc).name if -rc in signal.Signals._value2member_map_ else str(-rc)
            error = "killed by %s" % name
            if -rc == signal.SIGKILL:
                error += " (out of memory or a limit)"
        else:
            code = rc
        if note:
            error = note if error is None else note + "; " + error
        return {"exit_code": code, "timed_out": timed_out, "wall_time": time.monotonic() - t0, "error": error,
                "out_len": len(out), "out_trunc": o_drop > 0, "err_trunc": e_drop > 0,
                "out_dropped": o_drop, "err_dropped": e_drop}, out + err

    def op_write(self, h, src):
        path = self.path(h["path"])
        d = os.path.dirname(path)
        if d:
            os.makedirs(d, exist_ok=True)
        # O_NONBLOCK: a FIFO planted at the path must not hang the agent
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, h.get("mode", 0o644))
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", path)
            os.set_blocking(fd, True)
            while True:
                data = src.read(1 << 20) if not isinstance(src, bytes) else src
                if not data:
                    break
                mv = memoryview(data)
                while mv:
                    mv = mv[os.write(fd, mv):]
                if isinstance(src, bytes):
                    break
        finally:
            os.close(fd)
        os.chmod(path, h.get("mode", 0o644))
        return {}, b""

    def op_read(self, h, blob):
        path = self.path(h["path"])
        if os.path.isdir(path):
            raise IsADirectoryError(21, "Is a directory", path)
        # errors (missing, denied) surface before streaming starts; only regular files,
        # so /dev/zero or a FIFO cannot stream forever or hang the agent
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise OSError(errno.EINVAL, "not a regular file", path)
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
        limit = h.get("max") or -1

        def produce(w):
            left = limit
            with f:
                while left != 0:
                    data = f.read(1 << 20 if left < 0 else min(left, 1 << 20))
                    if not data:
                        break
                    w.write(data)
                    left = left - len(data) if left > 0 else left
        return {}, produce

    def op_tar_out(self, h, blob):
        path = self.path(h["path"])
        if not os.path.isdir(path):
            raise NotADirectoryError(20, "Not a directory", path)

        def produce(w):
            import tarfile  # lazily: it costs ~10 ms of every sandbox start

            with tarfile.open(fileobj=w, mode="w|") as tf:
                for name in sorted(os.listdir(path)):
                    tf.add(os.path.join(path, name), arcname=name)
        return {}, produce

    def op_tar_in(self, h, src):
        path = self.path(h["path"])
        os.makedirs(path, exist_ok=True)
        import tarfile

        fileobj = io.BytesIO(src) if isinstance(src, bytes) else src
        with tarfile.open(fileobj=fileobj, mode="r|") as tf:
            try:
                tf.extractall(path, filter="fully_trusted")  # runs as the sandbox user anyway
            except TypeError:
                tf.extractall(path)
        return {}, b""

    def op_ping(self, h, blob):
        return {"pid": os.getpid(), "remaining": self.remaining()}, b""

    def op_deadline(self, h, blob):
        self.deadline = time.monotonic() + float(h["ttl"])
        return {}, b""

    def serve(self):
        sel = selectors.DefaultSelector()
        sel.register(self.conn.rfd, selectors.EVENT_READ)
        while True:
            reap_orphans(())
            left = self.remaining()
            if left <= 0:
                return "ttl"
            if not sel.select(min(left, 0.5 if os.getpid() == 1 else 60.0)):
                continue
            try:
                h, blob = self.conn.recv()
            except (EOFError, OSError):
                return "eof"
            op = h.get("op")
            if op == "close":
                self.conn.send({"ok": True})
                return "close"
            fn = getattr(self, "op_" + str(op), None)
            try:
                if fn is None:
                    raise ValueError("unknown op %r" % op)
                res, out = fn(h, blob)
                res["ok"] = True
            except EOFError:
                return "eof"
            except Exception as e:  # report, keep serving
                res, out = error_reply(e), b""
            try:
                if isinstance(blob, ChunkReader):
                    blob.drain()  # keep the stream in sync even when the op failed early
                if callable(out):
                    self.conn.send({"ok": True, "chunked": True})
                    w = ChunkWriter(self.conn)
                    try:
                        out(w)
                        trailer = {"ok": True}
                    except OSError as e:  # EPIPE etc. on our own connection is fatal below
                        trailer = error_reply(e)
                    except Exception as e:
                        trailer = error_reply(e)
                    w.end()
                    self.conn.send(trailer)
                else:
                    self.conn.send(res, out)
            except (OSError, EOFError):
                return "eof"


def error_reply(e):
    return {"ok": False, "error": "%s: %s" % (type(e).__name__, e), "errno": getattr(e, "errno", None),
            "strerror": getattr(e, "strerror", None), "filename": getattr(e, "filename", None),
            "type": type(e).__name__}


def undumpable():
    """Sandboxed code runs as our uid: made non-dumpable, we are out of its reach through ptrace and
    /proc/<our pid>/ (fd/ holds our channel to the owner and our log on the host's disk, mem/ our
    memory). Commands it runs are dumpable again from their exec."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def main():
    undumpable()
    cfg = json.loads(sys.argv[1])
    os.umask(0o022)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    if cfg.get("connect"):
        # docker: connect to the owner's socket (mounted read-only from the host)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(cfg["connect"])
        conn = Conn(s.fileno(), s.fileno())
    else:
        conn = Conn(0, 1)
        # user commands must never inherit our protocol pipes
        sys.stdout = open(os.devnull, "w")
    os.makedirs(cfg["workdir"], exist_ok=True)
    os.chdir(cfg["workdir"])
    agent = Agent(conn, cfg["workdir"], cfg["env"], time.monotonic() + float(cfg["ttl"]), int(cfg.get("pids", 0)))
    conn.send({"ok": True, "ready": True, "pid": os.getpid()})
    agent.serve()
    # leaving: as pid 1 our exit kills every process of the sandbox (pid namespace);
    # under docker's init, the init exits with us and the container stops


if __name__ == "__main__":
    main()
