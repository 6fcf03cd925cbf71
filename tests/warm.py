"""A warm Python for the suite's many short entry-point runs: ``python -m training.export`` and
one-process ``python -m training.train`` start in ~0.1 s instead of ~4.5 s.

Each of those runs is a new process that spends most of its life importing torch, TorchRec and
fbgemm (~4 s of CPU on the 2-core CI machine, against ~0.5 s of work for a tiny export): a
fork server here imports them once, then forks one child per run. The child is the run's own
process, as ``python -m`` makes it: its own pid and process group, the caller's working folder,
environment and argv, its stdout/stderr in files, the module run as ``__main__`` by
:func:`runpy.run_module`, exit code and atexit handlers as a normal exit. What it does not
repeat is the imports: a test that checks what a cold start prints (third-party noise at
import) or costs runs the real ``python -m`` (``cold=True`` in ``tests/conftest.py``), and
``RECSYS_TEST_COLD=1`` sends every run there.

The server is single-threaded (forking a process with threads is unsafe) and runs no torch op
before a fork (torch's thread pools start at the first op, in the child); it serves one pytest
worker, one run at a time, and exits when that worker does.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What the entry points import before their main() runs (not the entry modules themselves:
# runpy warns when the module it runs as __main__ was imported already).
PRELOAD = (
    "torch", "torch.distributed", "torch.distributed.checkpoint", "torchrec", "fbgemm_gpu",
    "numpy", "matplotlib", "training.trainer", "training.step_loop", "training.data.prep",
    "training.metrics.evaluator", "training.metrics.baseline", "training.checkpoint.checkpointer",
    "training.config", "training.export.config", "training.export.pipeline",
)  # fmt: skip
COLD_ENV = "RECSYS_TEST_COLD"


def _child(req: dict) -> None:
    """In the forked child: become the run (never returns)."""
    code = 1
    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the server ignores it
        os.setsid()  # its own process group: a timeout kills what it started too
        fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(fd, 0)
        for target, path in ((1, req["stdout"]), (2, req["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, target)
            os.close(out)
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
        import atexit

        atexit._run_exitfuncs()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> None:
    """Import :data:`PRELOAD`, then run each request on ``path`` in a forked child."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    parent = os.getppid()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # the socket appears whole: a client never sees it unbound
    sock.listen(4)
    sock.settimeout(2.0)
    while True:
        try:
            conn, _ = sock.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the pytest worker is gone
                return
            continue
        with conn:
            conn.settimeout(None)
            req = json.loads(conn.makefile("r").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                sock.close()
                conn.close()
                _child(req)
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            _, status = os.waitpid(pid, 0)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


class Warm:
    """The client: one server per process that asks (a pytest worker), started on first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self.dir = Path(tempfile.mkdtemp(prefix="warm-"))
        self.sock = self.dir / "sock"

    def _start(self, env: dict[str, str], cwd: Path) -> None:
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - the server's for its life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.warm", str(self.sock)], cwd=cwd, env=env,
            stdin=subprocess.DEVNULL, stdout=log, stderr=log,
        )  # fmt: skip
        deadline = time.monotonic() + 300
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = (self.dir / "server.log").read_text()[-3000:]
                raise AssertionError(f"the warm Python did not start:\n{tail}")
            time.sleep(0.05)

    def run(
        self, module: str, args: list[str], cwd: Path, env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """``python -m module args`` as a forked child of the warm server."""
        cmd = [sys.executable, "-m", module, *args]
        if self.proc is None or self.proc.poll() is not None:
            self._start(env, cwd)
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
        return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if _WARM is None:
        _WARM = Warm()
    return _WARM.run(module, args, cwd, env, timeout)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of pytest is the worker's to handle
    serve(sys.argv[1])
