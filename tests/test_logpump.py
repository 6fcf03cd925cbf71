"""The log pump (recsys_stack/logpump.py): kinds, the rate limit, rotation, start marks, drain.

The pump is the real process (``python -m recsys_stack.logpump``) reading a real pipe, as the
gateway and TorchServe's launcher start it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from recsys_stack import logpump
from recsys_stack.logpump import Limiter, LogConfig, kind
from tests.conftest import ROOT, _env

GRPC_LINE = (
    "I1205 00:00:47.{us:06d}   {pid} ssl_transport_security.cc:2158] Handshake failed with "
    "error SSL_ERROR_SSL: error:100000f7:SSL routines:OPENSSL_internal:WRONG_VERSION_NUMBER"
)


def grpc_line(i: int) -> bytes:
    return GRPC_LINE.format(us=i * 7919 % 1_000_000, pid=20000 + i).encode()


def test_kind_masks_numbers_and_addresses() -> None:
    assert kind(grpc_line(1)) == kind(grpc_line(2))
    assert kind(b"bad request from 10.0.0.1:5531") == kind(b"bad request from [::1]:61000")
    assert kind(b"bad request from 10.0.0.1") != kind(b"backend 10.0.0.1 added")
    assert kind(b"worker 0x7f3a2c pid 12") == kind(b"worker 0xdeadbeef pid 987")


def test_limiter_writes_per_kind_lines_then_one_summary() -> None:
    lim = Limiter(per_kind=3, interval_s=10.0)
    out = [ln for i in range(100) for ln in lim.lines(grpc_line(i), now=1.0 + i * 0.01)]
    out += lim.lines(b"another kind", now=2.0)
    assert out == [grpc_line(0), grpc_line(1), grpc_line(2), b"another kind"]
    assert lim.due(now=5.0) == []  # the window is still open
    (summary,) = lim.due(now=11.5)
    assert b"suppressed 97 similar lines" in summary and grpc_line(3) in summary
    assert list(lim.windows) == [kind(b"another kind")]  # ended windows are forgotten
    assert lim.lines(grpc_line(200), now=12.0) == [grpc_line(200)]  # a new window


def test_lines_made_unique_share_one_budget_past_max_kinds() -> None:
    lim = Limiter(per_kind=2, interval_s=60.0)
    written = [ln for i in range(5000) for ln in lim.lines(b"x" * (i % 60) + b"y" * (i // 60), 0)]
    assert len(written) <= logpump.MAX_KINDS * 2 + 2
    assert len(lim.windows) <= logpump.MAX_KINDS + 1


def _pump(cfg: LogConfig, file: Path, mark: str) -> tuple[subprocess.Popen[bytes], int]:
    read, write = os.pipe()
    return logpump.start(read, cfg, file, mark, new_session=True), write


def test_rotation_bounds_the_files_and_a_restart_appends_a_mark(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    cfg = LogConfig(max_mb=16 / 1024, files=3, per_kind=0)  # 16 KiB files, 3 kept
    proc, w = _pump(cfg, log, "first start")
    for i in range(1000):  # ~100 KB: rotates about six times
        os.write(w, b"line %04d %s\n" % (i, b"." * 90))
    os.close(w)
    assert proc.wait(timeout=60) == 0
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["x.log", "x.log.1", "x.log.2"], files
    for p in tmp_path.iterdir():
        assert p.stat().st_size <= 16 * 1024, (p, p.stat().st_size)
    tail = log.read_text().splitlines()
    assert tail[-1].startswith("line 0999 ")  # the newest lines are in the current file
    proc, w = _pump(cfg, log, "second start")
    os.write(w, b"after the restart\n")
    os.close(w)
    assert proc.wait(timeout=60) == 0
    lines = log.read_text().splitlines()
    assert lines[: len(tail)] == tail  # appended, not truncated
    mark, last = lines[len(tail) :]
    assert mark.endswith(f" {logpump.MARK} second start") and last == "after the restart"


def test_a_dying_writer_loses_nothing_and_limits_hold(tmp_path: Path) -> None:
    """A child that writes 200 lines of one kind and dies of SIGKILL: the pump writes the
    start mark, per_kind of them, one summary, and the line it printed last."""
    log = tmp_path / "c.log"
    read, write = os.pipe()
    pump = logpump.start(read, LogConfig(per_kind=5), log, "child start", new_session=True)
    code = (
        "import os, signal\n"
        f"for i in range(200): os.write(2, {GRPC_LINE!r}.format(us=i, pid=i).encode() + b'\\n')\n"
        "os.write(2, b'last words\\n')\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    child = subprocess.run([sys.executable, "-c", code], stderr=write, cwd=ROOT, env=_env(),
                           timeout=60, check=False)  # fmt: skip
    os.close(write)
    assert child.returncode == -9
    assert pump.wait(timeout=60) == 0
    lines = log.read_text().splitlines()
    assert lines[0].endswith(f"{logpump.MARK} child start")
    assert sum("Handshake failed" in ln and "suppressed" not in ln for ln in lines) == 5
    assert "last words" in lines
    (summary,) = [ln for ln in lines if "suppressed" in ln]
    assert "suppressed 195 similar lines" in summary
    assert len(log.read_bytes()) < 2500


def test_the_pump_outlives_signals_until_the_pipe_closes(tmp_path: Path) -> None:
    """Ctrl-C or SIGTERM to a process group reaches its pump too: it keeps draining."""
    log = tmp_path / "s.log"
    proc, w = _pump(LogConfig(), log, "start")
    deadline = time.monotonic() + 30
    while not log.exists() or not log.read_text():  # started (its mark is written)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(2)
    proc.terminate()
    time.sleep(0.3)
    os.write(w, b"written after the signals\n")
    os.close(w)
    assert proc.wait(timeout=30) == 0
    assert "written after the signals" in log.read_text()
