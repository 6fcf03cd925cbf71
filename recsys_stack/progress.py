"""Progress bars that stay quiet in logs: tqdm frames on a terminal, one line per interval elsewhere.

``tqdm`` redraws with carriage returns; redirected to a file (``make bench > log``, CI) that is
thousands of frames on one line. :func:`progress` returns a real ``tqdm`` bar when stderr is a
terminal and otherwise one that prints a plain line (``desc: n/total unit (rate)``, the rate as
``s/unit`` below one unit a second) at most every ``RECSYS_PROGRESS_INTERVAL`` seconds (default
30) and once at the end.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from tqdm import tqdm

INTERVAL_ENV = "RECSYS_PROGRESS_INTERVAL"


class _Lines:
    """Passes whole lines through; drops tqdm's bare carriage returns and newlines."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    def write(self, text: str) -> None:
        if text.strip("\r\n"):
            self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


class _LogBar(tqdm):  # type: ignore[misc]
    """A tqdm whose display is a newline-terminated summary, printed every ``interval`` s."""

    def __init__(self, *args: Any, interval: float = 30.0, **kwargs: Any) -> None:
        self._interval = interval
        self._last = 0.0
        self._shown = -1
        kwargs["file"] = _Lines(kwargs.get("file") or sys.stderr)
        kwargs["mininterval"] = interval
        kwargs["dynamic_ncols"] = False
        super().__init__(*args, **kwargs)
        self._last = time.monotonic()

    def display(self, msg: str | None = None, pos: int | None = None) -> None:
        now = time.monotonic()
        final = self.total is not None and self.n >= self.total
        if self.disable or (  # type: ignore[has-type]
            not final and msg is None and (self.n == 0 or now - self._last < self._interval)
        ):
            return
        self._last = now
        self._shown = self.n
        d = self.format_dict
        rate = d.get("rate") or (self.n / d["elapsed"] if d.get("elapsed") else 0.0)
        total = f"/{self.total}" if self.total else ""
        post = f" {self.postfix}" if self.postfix else ""
        unit = d.get("unit", "it")
        # a slow unit (a fault every 20 s) as seconds per unit, as tqdm shows it: not 0.0/s
        pace = f"{1 / rate:,.1f} s/{unit}" if 0 < rate < 1 else f"{rate:,.1f} {unit}/s"
        self.fp.write(f"{self.desc or 'progress'}: {self.n}{total} {unit} ({pace}){post}\n")
        self.fp.flush()

    def close(self) -> None:
        if not self.disable and self.n != self._shown:  # type: ignore[has-type]
            self.display(msg="")  # a last line with the final count
        self.disable = True  # type: ignore[has-type]  # else tqdm's own close redraws
        super().close()

    def clear(self, *args: Any, **kwargs: Any) -> None:  # no carriage returns to clear
        pass


def progress(*args: Any, **kwargs: Any) -> tqdm:
    """``tqdm(*args, **kwargs)`` on a terminal; a line per interval when stderr is not one."""
    stream = kwargs.get("file") or sys.stderr
    if kwargs.get("disable") or getattr(stream, "isatty", lambda: False)():
        return tqdm(*args, **kwargs)
    interval = float(os.environ.get(INTERVAL_ENV, "30"))
    return _LogBar(*args, interval=interval, **kwargs)
