"""Progress bars in non-interactive output: plain lines at an interval, no carriage returns."""

from __future__ import annotations

import io
import time

import pytest

from recsys_stack.progress import INTERVAL_ENV, progress


def test_non_tty_bar_writes_no_frames_for_a_fast_loop() -> None:
    out = io.StringIO()  # not a TTY
    with progress(total=10_000, desc="parse", unit="row", file=out) as bar:
        for _ in range(10_000):
            bar.update(1)
    text = out.getvalue()
    assert "\r" not in text and len(text.splitlines()) <= 1, text


def test_non_tty_bar_with_a_total_ends_with_a_summary_line() -> None:
    out = io.StringIO()
    with progress(total=10_000, desc="parse", unit="row", file=out) as bar:
        bar.update(10_000)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("parse: 10000/10000 row"), lines


def test_non_tty_iterable_bar_without_leave_has_no_frames() -> None:
    out = io.StringIO()
    assert sum(progress(range(500), desc="round 1/1 trainer", leave=False, file=out)) == 124750
    text = out.getvalue()
    assert "\r" not in text and len(text.splitlines()) <= 2, text


def test_non_tty_lines_are_bounded_by_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERVAL_ENV, "0.1")
    out = io.StringIO()
    start = time.monotonic()
    with progress(total=None, desc="train", unit="step", file=out) as bar:
        while time.monotonic() - start < 0.5:
            bar.update(1)
            bar.set_postfix(loss="0.5")
            time.sleep(0.002)
    text = out.getvalue()
    elapsed = time.monotonic() - start
    assert "\r" not in text
    assert 1 <= len(text.splitlines()) <= elapsed / 0.1 + 2, text


def test_disabled_bar_writes_nothing() -> None:
    out = io.StringIO()
    with progress(total=10, file=out, disable=True) as bar:
        bar.update(10)
    assert out.getvalue() == ""
