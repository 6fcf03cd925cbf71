"""The suite's warm start for the entry points that torchrun, make and the continuous loop start.

On ``PYTHONPATH`` only inside the test suite (``tests/warm.py`` puts it there, with
``RECSYS_WARM_SOCK``). Python imports this file at startup, before anything else runs: when the
command line is ``python [-u] -m <one of WARM_MODULES> ...`` and the suite's warm Python is
listening, this process hands the run to it: the warm Python forks a child that already holds
torch, TorchRec and fbgemm, gives it this process's argv, environment, working folder and
stdin/stdout/stderr (the descriptors themselves, passed over the socket), and this process
stays as the run's stand-in for whoever started it (torchrun, make): it passes on every signal
it gets to the child's process group, and exits as the child did (its code, or killed by the
same signal). The child kills itself when this process dies, so a SIGKILL of it (the one
signal that cannot be passed on) still ends the run. Anything else (another command, no
listener, another ``PYTHONPATH``) starts as usual: only the standard library is imported here.
"""

from __future__ import annotations

import os
import sys

WARM_MODULES = ("training.train", "training.continuous", "training.export")
SOCK_ENV = "RECSYS_WARM_SOCK"
PATH_ENV = "RECSYS_WARM_PYTHONPATH"  # the warm Python's own PYTHONPATH: its sys.path
FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCONT")


def _paths(value: str) -> set[str]:
    return {os.path.realpath(p) for p in value.split(os.pathsep) if p}


def _warm_module(argv: list[str]) -> tuple[str, list[str], bool] | None:
    """``(module, args, unbuffered)`` when ``argv`` is ``python [-u] -m MODULE args``."""
    flags, rest = [], argv[1:]
    while rest and rest[0] != "-m":
        if rest[0] != "-u":
            return None  # another interpreter flag (-X importtime, -c, a script): cold
        flags.append(rest.pop(0))
    if len(rest) < 2 or rest[1] not in WARM_MODULES:
        return None
    return rest[1], rest[2:], bool(flags)


def _hand_over(sock_path: str, module: str, args: list[str], unbuffered: bool) -> None:
    """Run ``module`` in a child of the warm Python; return only if it could not take it."""
    import contextlib
    import json
    import signal
    import socket
    import struct

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
        req = {"module": module, "args": args, "cwd": os.getcwd(), "env": dict(os.environ),
               "watch": os.getpid(), "unbuffered": unbuffered}  # fmt: skip
        body = json.dumps(req).encode()
        socket.send_fds(s, [struct.pack("!Q", len(body)) + body], [0, 1, 2])
        reply = s.makefile("rb")
        line = reply.readline()
    except OSError:  # no warm Python (yet), or it went away: start as usual
        s.close()
        return
    if not line:
        return  # refused before forking: start as usual
    child = json.loads(line)["pid"]

    def forward(signum: int, _frame: object) -> None:
        try:
            os.killpg(child, signum)
        except OSError:  # not its group's leader yet (microseconds after the fork)
            with contextlib.suppress(OSError):
                os.kill(child, signum)

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    line = reply.readline()  # the child's exit (signals interrupt it and it carries on)
    code = json.loads(line)["rc"] if line else 1
    if code < 0:  # killed by a signal: die by it too, as the caller would have seen it
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def _main() -> None:
    sock_path = os.environ.get(SOCK_ENV, "")
    if not sock_path or _paths(os.environ.get("PYTHONPATH", "")) != _paths(
        os.environ.get(PATH_ENV, "")
    ):
        return
    found = _warm_module(list(getattr(sys, "orig_argv", [])))
    if found:
        _hand_over(sock_path, *found)


_main()
