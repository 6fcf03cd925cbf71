"""Logs that are not amplifiers: a process's output, each kind of line rate-limited, size-rotated.

Why a pump on the file descriptor: what floods a log is not always Python logging. grpc-core
(C++) writes one line to fd 2 per failed TLS handshake, TorchServe's Java frontend and workers
write to their stdout; a ``logging`` filter sees none of that. So a process's stdout and stderr
go into a pipe, and ``python -m recsys_stack.logpump`` (this module, standard library only) reads
it and writes each line to the log, unless its kind (the line with every number, hex string
and address masked, cut to :data:`KIND_CHARS` characters) already had ``per_kind`` lines in
this ``interval_s``: the rest of that window is counted, and when it ends one ``suppressed K
similar lines`` line says how many went unwritten, with the first of them. At most
:data:`MAX_KINDS` kinds are tracked; past that every new kind shares one budget, so lines made
unique on purpose still cannot flood.

Why a process rather than a thread: a reader in another process keeps the last lines of a
process that crashes (grpc-core's fatal assertion, a segfault's message: a thread would die with
them), never holds the GIL of the gateway's event loop, and exits by itself once every writer
has closed the pipe (ignoring SIGINT and SIGTERM so that it drains what the process wrote on
its way out). Its command line names no file (the settings come in ``RECSYS_LOGPUMP``): tools
that find a stack's processes by the paths in their command lines do not take it for one.

The file (``file``; none = the pump's own stdout, e.g. a container's log) is rotated by size as
``logging.handlers.RotatingFileHandler`` does (``FILE`` -> ``FILE.1`` ... ``FILE.<files-1>``, the
oldest dropped): at most ``files`` x ``max_mb`` on disk. Each start writes one mark line
(``==== ...``: time, the logged process's pid, what it is) first, so restarts appended to one
file can be told apart.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import re
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

ENV = "RECSYS_LOGPUMP"  # the pump's settings (JSON), read by main()
KIND_CHARS = 120  # a line's kind: its first 120 characters, numbers masked
MAX_KINDS = 256  # kinds tracked at once; a new one past that shares the budget of OTHER
MAX_LINE = 64 * 1024  # a longer line is cut here (a writer never holds the pump's memory)
OTHER = b"\0other"
MARK = "===="
# a number, hex string, IPv4/IPv6 address with its port, time: any run of hex digits, dots,
# colons and brackets holding a digit becomes one mark
_MASK = re.compile(rb"0x[0-9a-fA-F]+|[0-9a-fA-F.:\[\]]*[0-9][0-9a-fA-F.:\[\]]*")


@dataclass
class LogConfig:
    """Rotation and rate limit of a log file (recsys_stack/logpump.py)."""

    max_mb: float = 10.0
    """Size (MB) at which the file is rotated (FILE -> FILE.1 -> ...); 0 = never rotated."""
    files: int = 5
    """Files kept, the current one included: at most ``files`` x ``max_mb`` on disk."""
    per_kind: int = 10
    """Lines of one kind (the line with its numbers and addresses masked) written per
    ``interval_s``; the rest are counted and reported in one ``suppressed K similar lines``
    line when the interval ends. 0 = every line is written."""
    interval_s: float = 60.0
    """The rate limit's window, in seconds."""

    def __post_init__(self) -> None:
        if self.max_mb < 0 or self.files < 1 or self.per_kind < 0 or self.interval_s <= 0:
            raise ValueError("log: max_mb >= 0, files >= 1, per_kind >= 0, interval_s > 0")


def kind(line: bytes) -> bytes:
    """What lines of one kind share: the start of the line with every number masked
    (timestamps, pids, ports, addresses, hex ids)."""
    return _MASK.sub(b"#", line[: 4 * KIND_CHARS])[:KIND_CHARS]  # cut once masked: the cut
    # then falls at the same place whatever the widths of the numbers before it


def stamp() -> bytes:
    """The time as Python logging's ``asctime`` writes it."""
    now = time.time()
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now)).encode() + b",%03d" % (
        int(now * 1000) % 1000
    )


@dataclass
class _Window:
    start: float
    written: int = 0
    suppressed: int = 0
    sample: bytes = b""


class Limiter:
    """At most ``per_kind`` lines of each kind per ``interval_s`` (fixed windows that start at
    the kind's first line); the count of the others comes back as one summary line."""

    def __init__(self, per_kind: int, interval_s: float) -> None:
        self.per_kind, self.interval_s = per_kind, interval_s
        self.windows: dict[bytes, _Window] = {}

    def lines(self, line: bytes, now: float) -> list[bytes]:
        """What to write for ``line`` (no newline): itself, nothing, or a summary first."""
        if self.per_kind <= 0:
            return [line]
        k = kind(line)
        w = self.windows.get(k)
        if w is None and len(self.windows) >= MAX_KINDS:
            k, w = OTHER, self.windows.get(OTHER)
        out = []
        if w is not None and now - w.start >= self.interval_s:
            out += self._summary(w, now)
            w = None
        if w is None:
            w = self.windows[k] = _Window(now)
        if w.written < self.per_kind:
            w.written += 1
            return [*out, line]
        if not w.suppressed:
            w.sample = line
        w.suppressed += 1
        return out

    def due(self, now: float | None = None) -> list[bytes]:
        """Summaries of the windows that ended (all of them: ``now`` None, at the end); ended
        windows are forgotten."""
        out = []
        for k, w in list(self.windows.items()):
            if now is None or now - w.start >= self.interval_s:
                out += self._summary(w, now)
                del self.windows[k]
        return out

    def _summary(self, w: _Window, now: float | None) -> list[bytes]:
        if not w.suppressed:
            return []
        span = (time.monotonic() if now is None else now) - w.start
        sample = w.sample[:300].decode(errors="replace").encode()
        head = b"%s logpump: suppressed %d similar lines in %.0f s, like: " % (
            stamp(),
            w.suppressed,
            span,
        )
        return [head + sample]


class RotatingFile:
    """Appends to ``path``; past ``max_bytes`` it rotates as RotatingFileHandler does."""

    def __init__(self, path: Path, max_bytes: int, files: int) -> None:
        self.path, self.max_bytes, self.files = path, max_bytes, files
        self.f: BinaryIO = open_log(path)
        self.size = self.f.tell()

    def write(self, data: bytes) -> None:
        if self.f.closed:  # a rotation that failed half-way (the folder gone): try again
            self.f = open_log(self.path)
            self.size = self.f.tell()
        if self.max_bytes and self.size and self.size + len(data) > self.max_bytes:
            self.rotate()
        self.f.write(data)
        self.size += len(data)

    def rotate(self) -> None:
        self.f.close()
        names = [self.path, *(Path(f"{self.path}.{i}") for i in range(1, self.files))]
        for older, newer in zip(reversed(names[1:]), reversed(names[:-1]), strict=True):
            if newer.exists():
                os.replace(newer, older)
        self.f = open(self.path, "wb" if self.files == 1 else "ab")  # noqa: SIM115
        self.size = self.f.tell()

    def flush(self) -> None:
        self.f.flush()


def pump(fd: int, out: RotatingFile | BinaryIO, limiter: Limiter, mark: str) -> None:
    """Write ``mark``, then ``fd``'s lines to ``out`` through ``limiter`` until every writer
    has closed it; write errors (a full disk, a closed stdout) drop lines but never stop the
    draining, so a writer never blocks on a full pipe."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    pending = b""

    def emit(lines: list[bytes]) -> None:
        try:
            for line in lines:
                out.write(line + b"\n")
            out.flush()
        except OSError:
            pass

    emit([mark.encode(errors="replace")])
    while True:
        if poller.poll(1000 if limiter.windows else None):
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            if len(pending) > MAX_LINE:
                lines.append(pending[:MAX_LINE])
                pending = b""
            now = time.monotonic()
            emit([out_line for line in lines for out_line in limiter.lines(line, now)])
        emit(limiter.due(time.monotonic()))
    emit(([*limiter.lines(pending, time.monotonic())] if pending else []) + limiter.due())


def start(
    fd: int, cfg: LogConfig, file: Path | None, mark: str, new_session: bool, stdout: int = 1
) -> subprocess.Popen[bytes]:
    """A pump reading the pipe end ``fd`` (closed here: the pump holds it now) into ``file``
    (None: into this process's descriptor ``stdout``); ``mark`` heads its start line.
    ``new_session``: outside this process's group (it then outlives this process and exits
    when the pipe closes). Writing to a file, the pump holds none of this process's
    descriptors: a ``make serve | tee`` ends when ``make serve`` does, not when TorchServe
    does. OSError: ``file`` cannot be written."""
    try:
        if file is not None:
            open_log(file).close()  # its error here, in the caller's words, not in the pump
        line = f"{stamp().decode()} {MARK} {mark}"  # stamped now: before what the process writes
        settings = dataclasses.asdict(cfg) | {"file": str(file) if file else "", "mark": line}
        here = str(Path(__file__).resolve().parents[1])  # this code, whatever the working folder
        path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH", "")) if p)
        quiet = subprocess.DEVNULL if file is not None else None
        return subprocess.Popen(
            [sys.executable, "-m", "recsys_stack.logpump"], stdin=fd,
            stdout=stdout if file is None else quiet, stderr=quiet, start_new_session=new_session,
            env={**os.environ, ENV: json.dumps(settings), "PYTHONPATH": path},
        )  # fmt: skip
    finally:
        os.close(fd)


def open_log(file: Path) -> BinaryIO:
    """``file`` opened to append (its folder made)."""
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        return open(file, "ab")
    except OSError as e:
        raise OSError(f"log file {file}: {e.strerror or e}") from None


def capture(cfg: LogConfig, file: Path | None, mark: str) -> subprocess.Popen[bytes]:
    """This process's stdout and stderr (file descriptors 1 and 2: C++ and Python alike)
    through a pump; at exit the pipe is closed and the pump waited for, so a supervisor that
    reads the log after this process exits finds every line in it. OSError: ``file`` cannot
    be written (nothing was redirected)."""
    read, write = os.pipe()
    try:
        proc = start(read, cfg, file, mark, new_session=False, stdout=2)  # stderr stays stderr
    except BaseException:
        os.close(write)
        raise
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(write)
    if hasattr(sys.stdout, "reconfigure"):  # print() reaches the log at once, as stderr does
        sys.stdout.reconfigure(line_buffering=True)
    atexit.register(_drain, proc)
    return proc


def _drain(proc: subprocess.Popen[bytes]) -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    os.close(null)
    with contextlib.suppress(subprocess.TimeoutExpired):  # a child holding the pipe keeps it
        proc.wait(timeout=10)


def version() -> str:
    """This project's installed version (for start marks)."""
    from importlib import metadata

    try:
        return metadata.version("recsys-stack")
    except metadata.PackageNotFoundError:
        return "unknown"


def main() -> int:
    """``python -m recsys_stack.logpump``: stdin to the log ``$RECSYS_LOGPUMP`` describes."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # drain until the last writer closes the pipe
    s = json.loads(os.environ[ENV])
    cfg = LogConfig(**{f.name: s[f.name] for f in dataclasses.fields(LogConfig)})
    out: RotatingFile | BinaryIO = sys.stdout.buffer
    if s["file"]:
        try:
            out = RotatingFile(Path(s["file"]), int(cfg.max_mb * 1024 * 1024), cfg.files)
        except OSError:  # writable when started (start() checked): gone since; drain anyway
            out = open(os.devnull, "wb")  # noqa: SIM115
    pump(sys.stdin.fileno(), out, Limiter(cfg.per_kind, cfg.interval_s), s["mark"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
