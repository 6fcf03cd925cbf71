"""A warm Python for the suite's entry-point runs: ``python -m training.export``, ``-m
training.train`` (one process, or each rank torchrun starts), ``-m training.continuous``:
each starts in ~0.1 s instead of ~8 s of imports.

Each of those runs is a new process that spends most of its life importing torch, TorchRec and
fbgemm (~7 s of CPU on this 2-core machine, against ~0.5 s of work for a tiny export): a
fork server here imports them once, then forks one child per run. The child is the run's own
process, as ``python -m`` makes it: its own pid and process group, the caller's working folder,
environment and argv, the module run as ``__main__`` by :func:`runpy.run_module`, exit code
and atexit handlers as a normal exit. Two ways in:

* the suite's own calls (``run_export``, ``run_train(nproc=0)`` in ``tests/conftest.py``):
  :func:`run_module`, output captured in files;
* every other start of those modules below a pytest worker (torchrun's ranks, ``make train``,
  the continuous loop's exports): ``tests/warm_site/sitecustomize.py``, on the ``PYTHONPATH``
  :func:`install` exports, hands the process's run to this server and stays as its stand-in
  (signals passed on, its exit mirrored, the child ended when the stand-in is killed), so
  torchrun, make and the tests see the process they started.

What it does not repeat is the imports: a test that checks what a cold start prints
(third-party noise at import) or costs runs the real ``python -m`` (``cold=True`` in
``tests/conftest.py``, which also leaves the stand-in out), and ``RECSYS_TEST_COLD=1`` turns
all of this off.

The server is single-threaded (forking a process with threads is unsafe) and runs no torch op
before a fork (torch's thread pools start at the first op, in the child); it serves one pytest
worker and what that worker starts, several runs at once, and exits when that worker does.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What the entry points import before their main() runs: third-party packages only, the
# costly part (~7 s of CPU). Never the project's own modules nor a submodule the package's own
# import does not load (torch.distributed.checkpoint): a run that forgot to import one must
# fail warm as it fails cold (before, the preloaded submodule hid a missing import).
PRELOAD = ("torch", "torchrec", "fbgemm_gpu", "numpy", "matplotlib")
COLD_ENV = "RECSYS_TEST_COLD"
SITE = Path(__file__).resolve().parent / "warm_site"  # sitecustomize.py: the stand-in
SOCK_ENV, PATH_ENV = "RECSYS_WARM_SOCK", "RECSYS_WARM_PYTHONPATH"  # as sitecustomize reads them


def _stdio(req: dict, fds: list[int]) -> None:
    """The child's stdin/stdout/stderr: the stand-in's own descriptors when it passed them
    (``sitecustomize``), else /dev/null and the files the client reads."""
    if fds:
        for target, fd in zip((0, 1, 2), fds, strict=True):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
    else:
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        os.close(fd)
        for target, path in ((1, req["stdout"]), (2, req["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, target)
            os.close(out)
    # new stream objects on 0-2, buffered as ``python [-u]`` makes them
    raw = req.get("unbuffered", False)
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        binary = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        buffered: io.RawIOBase | io.BufferedIOBase = binary
        if fd == 0:
            buffered = io.BufferedReader(binary)
        elif not raw:
            buffered = io.BufferedWriter(binary)
        stream = io.TextIOWrapper(
            buffered, encoding=old.encoding, errors=old.errors,  # type: ignore[arg-type]
            line_buffering=fd == 2 or (fd == 1 and os.isatty(1)), write_through=raw,
        )  # fmt: skip
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _watch(pid: int) -> None:
    """End this run (its whole group) when process ``pid``, its stand-in, dies: a SIGKILL of
    the stand-in (the one signal it cannot pass on) then still ends the run."""
    import select
    import threading

    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        os.killpg(0, signal.SIGKILL)

    def wait() -> None:
        select.select([pidfd], [], [])
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=wait, name="warm-stand-in-watch", daemon=True).start()


def _child(req: dict, fds: list[int]) -> None:
    """In the forked child: become the run (never returns)."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it
        os.setsid()  # its own process group: a timeout kills what it started too
        if req.get("watch"):
            _watch(req["watch"])
        _stdio(req, fds)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[0] = req["cwd"]  # as ``python -m`` puts its working folder first
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit():
            import torch

            torch.set_num_threads(int(threads))
        sys.argv = ["-m", *req["args"]]
        import runpy

        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        _exit_as_cold()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _exit_as_cold() -> None:
    """What a cold Python does at exit, in its order: wait for the non-daemon threads (a run
    that leaves one running hangs here, as it would cold: before, the child's ``os._exit``
    skipped the wait and such a run passed warm in 68 s and hung cold), then the atexit
    handlers. The threads waited for are named on stderr first."""
    import atexit
    import threading

    waiting = [t.name for t in threading.enumerate()
               if t is not threading.main_thread() and not t.daemon and t.is_alive()]  # fmt: skip
    if waiting:
        print(f"warm: waiting at exit for non-daemon threads {waiting} (as a cold Python does)",
              file=sys.stderr, flush=True)  # fmt: skip
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()


def _read_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """One request: a JSON line (the suite's client) or, from ``sitecustomize``, a length-
    prefixed JSON body with the stand-in's stdin/stdout/stderr descriptors attached."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    if fds:
        (size,) = struct.unpack("!Q", data[:8])
        data = data[8:]
        while len(data) < size:
            more = conn.recv(size - len(data))
            if not more:
                raise ConnectionError("the stand-in went away mid-request")
            data += more
        return json.loads(data), list(fds)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise ConnectionError("the client went away mid-request")
        data += more
    return json.loads(data), []


def serve(path: str, parent: int) -> None:
    """Import :data:`PRELOAD`, then run each request on ``path`` in a forked child (several at
    once: torchrun's ranks start together); each connection gets the child's pid, then its
    exit code. Ends when ``parent`` (the pytest worker that started it) is gone, also when it
    went during the imports (before, the parent was read after them: a pytest run that ended
    meanwhile left the server running for ever)."""
    import importlib
    import selectors

    for name in PRELOAD:
        importlib.import_module(name)
        if os.getppid() != parent:
            return
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the socket appears whole: a client never sees it unbound
    sock.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    running: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (child pid, its connection)
    while True:
        events = sel.select(timeout=2.0)
        if not events and os.getppid() != parent:  # the pytest worker is gone
            return
        for key, _ in events:
            if key.fileobj is not sock:  # a child exited
                pidfd = int(key.fd)
                pid, conn = running.pop(pidfd)
                sel.unregister(pidfd)
                os.close(pidfd)
                _, status = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):
                    rc = os.waitstatus_to_exitcode(status)
                    conn.sendall(json.dumps({"rc": rc}).encode() + b"\n")
                conn.close()
                continue
            conn, _ = sock.accept()
            try:
                req, fds = _read_request(conn)
            except (OSError, ValueError):
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                others = [c.fileno() for _, c in running.values()]
                for fd in [sock.fileno(), conn.fileno(), sel.fileno(), *running, *others]:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                _child(req, fds)
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            running[pidfd] = (pid, conn)
            sel.register(pidfd, selectors.EVENT_READ)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


class Warm:
    """The client: one server per process that asks (a pytest worker), started on first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="warm-"))
        self.sock = self.dir / "sock"

    def start(self, env: dict[str, str], cwd: Path) -> None:
        """Start the server in the background (it imports for a few seconds: a stand-in that
        finds no socket yet starts cold)."""
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - the server's for its life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.warm", str(self.sock), str(os.getpid())], cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip

    def _wait_started(self) -> None:
        deadline = time.monotonic() + 300
        while not self.sock.exists():
            if self.proc is None or self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.dir / "server.log").read_text()[-3000:]
                raise AssertionError(f"the warm Python did not start:\n{tail}")
            time.sleep(0.05)

    def run(
        self, module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """``python -m module args`` as a forked child of the warm server."""
        cmd = [sys.executable, "-m", module, *args]
        if self.proc is None or self.proc.poll() is not None:
            self.start(env, cwd)
        self._wait_started()
        out = tempfile.mkdtemp(dir=self.dir)
        req = {"module": module, "args": args, "cwd": str(cwd), "env": env,
               "stdout": f"{out}/stdout", "stderr": f"{out}/stderr"}  # fmt: skip
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(self.sock))
            s.sendall(json.dumps(req).encode() + b"\n")
            reply = s.makefile("r")
            pid = json.loads(reply.readline())["pid"]
            s.settimeout(timeout)
            try:
                line = reply.readline()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(cmd, timeout) from None
            if not line:
                raise AssertionError(
                    f"the warm Python died running {module}: {self.dir}/server.log"
                )
            rc = json.loads(line)["rc"]
        stdout, stderr = (Path(out, n).read_text(errors="replace") for n in ("stdout", "stderr"))
        for name in ("stdout", "stderr"):
            Path(out, name).unlink()
        os.rmdir(out)
        return subprocess.CompletedProcess(cmd, rc, stdout, stderr)


_WARM: Warm | None = None


def install(root: Path, env: dict[str, str]) -> None:
    """Start this process's warm server (``env``, in ``root``) and export what the stand-in
    needs to every process started from here on: the socket and ``PYTHONPATH`` with
    :data:`SITE` first (with ``RECSYS_TEST_COLD=1``: nothing)."""
    global _WARM
    if os.environ.get(COLD_ENV, "") not in ("", "0") or _WARM is not None:
        return
    path = os.pathsep.join([str(SITE), env.get("PYTHONPATH", "")])
    env = {**env, "PYTHONPATH": path, PATH_ENV: path}
    _WARM = Warm()
    _WARM.start(env, root)
    os.environ.update({"PYTHONPATH": path, PATH_ENV: path, SOCK_ENV: str(_WARM.sock)})


def cold_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the stand-in: a process started with it starts cold."""
    return {k: v for k, v in env.items() if k != SOCK_ENV}


def run_module(
    module: str,
    args: list[str],
    cwd: Path,
    env: dict[str, str],
    timeout: float,
    cold: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``python -m module args`` (captured, text), warm unless ``cold`` or
    ``RECSYS_TEST_COLD=1``."""
    global _WARM
    if cold or os.environ.get(COLD_ENV, "") not in ("", "0"):
        return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=cold_env(env),
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if _WARM is None:
        _WARM = Warm()
    return _WARM.run(module, args, cwd, env, timeout)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of pytest is the worker's to handle
    serve(sys.argv[1], int(sys.argv[2]))
