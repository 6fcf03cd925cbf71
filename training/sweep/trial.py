"""One trial: a real training run in a child process, watched through its metrics.jsonl.

The child is ``python -m training.train`` (one process, ``OMP_NUM_THREADS`` threads) in its own
session, so that a Ctrl-C of the sweep reaches the sweep alone and the sweep stops its children
itself. Each evaluation record is reported to Optuna as it appears (its step: the training rows
seen, the same for every batch size), and a trial the pruner stops, or one still running when
the sweep's time is up or it is interrupted, is ended: SIGTERM to its process group, SIGKILL
after a grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KILL_GRACE_S = 10.0


def valid_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The evaluation records a sweep decides on: those of the validation split
    (``"split": "valid"``: the periodic ones, on ``train.eval_rows`` of it, and the final
    record's ``valid``, on all of it, with that record's step) when the trainer writes them,
    else every record without a split (a trainer with one held-out split evaluates on it); a
    final record's top-level figures are the test split's, never decided on. Records without
    an AUC are skipped."""
    valid = []
    for r in records:
        if r.get("split") == "test" and isinstance(r.get("valid"), dict):
            r = {**r["valid"], "step": r.get("step"), "samples_seen": r.get("samples_seen"),
                 "split": "valid"}  # fmt: skip
        if r.get("split") == "valid" and isinstance(r.get("auc"), int | float):
            valid.append(r)
    return valid or [
        r for r in records if "split" not in r and isinstance(r.get("auc"), int | float)
    ]


def trial_value(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The objective of a finished run: its last validation evaluation (the config's figure at
    the end of its epochs, as ``--config best.toml`` would reproduce it; not the best of its
    evaluations, which would favour runs with noisy curves). ``{"auc", "auc_ci", "eval_rows",
    "samples_seen", "step"}``; None when the run wrote none."""
    valid = valid_records(records)
    if not valid:
        return None
    last = max(enumerate(valid), key=lambda ir: (ir[1].get("step", 0), ir[0]))[1]
    keys = ("auc", "auc_ci", "eval_rows", "samples_seen", "step", "ne")
    return {k: last[k] for k in keys if k in last}


def on_test(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The run's figure on test rows (``"split": "test"``) no decision saw, when the trainer
    writes one (reported for the chosen trial only: choosing on it would spend it)."""
    test = [r for r in records if r.get("split") == "test" and "auc" in r]
    return (
        {k: test[-1][k] for k in ("auc", "auc_ci", "eval_rows") if k in test[-1]} if test else None
    )


class Pruned(Exception):
    """The pruner (or the time budget) stopped the trial; ``reason`` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Interrupted(Exception):
    """The sweep was interrupted while the trial ran (the trial is not counted)."""


class Failed(Exception):
    """The run exited with an error; the message is its last error line and its log."""


@dataclass
class Watch:
    """How a trial is watched: Optuna's trial (report / should_prune), when to give up."""

    report: Callable[[float, int], None]
    should_prune: Callable[[], bool]
    heartbeat: Callable[[], None]
    stop: threading.Event
    deadline: float = 0.0  # time.monotonic() after which the trial is cut (0: none)
    grid: int = 0  # rows seen between the preset's evaluations: steps are evaluations (0: rows)
    poll_s: float = 1.0
    heartbeat_s: float = 30.0
    reported: set[int] = field(default_factory=set)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a metrics.jsonl that may be being written."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    lines = text.split("\n")[:-1]  # the last piece: a line not ended yet (or "")
    out = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def command(preset: Path, run_dir: Path, overrides: list[str]) -> list[str]:
    """The trial's training command: one process, a fresh run in ``run_dir``."""
    return [sys.executable, "-m", "training.train", "--config", str(preset),
            "--run-dir", str(run_dir), "--resume", "none", "--no-progress", *overrides]  # fmt: skip


def run(cmd: list[str], run_dir: Path, threads: int, watch: Watch) -> list[dict[str, Any]]:
    """Run ``cmd`` (writing ``run_dir/metrics.jsonl``), reporting each new validation AUC to
    ``watch`` (at the nearest of the preset's evaluations when ``watch.grid``: a batch size
    that does not divide the preset's evaluation interval lands near it, not beside it); its
    records when it exits 0. Raises :class:`Pruned`, :class:`Interrupted` or
    :class:`Failed`, with the child ended first."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    log_path = run_dir / "train.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)  # fmt: skip
    try:
        return _watch(proc, run_dir / "metrics.jsonl", log_path, watch)
    finally:
        end(proc)


def _watch(
    proc: subprocess.Popen[bytes], metrics: Path, log_path: Path, watch: Watch
) -> list[dict[str, Any]]:
    beat = time.monotonic()
    while True:
        rc = proc.poll()  # before the read: records written before the exit are all seen
        records = read_records(metrics)
        for r in valid_records(records):
            seen = int(r.get("samples_seen", r.get("step", 0)))
            step = max(1, round(seen / watch.grid)) if watch.grid else seen
            if step in watch.reported:
                continue
            watch.reported.add(step)
            watch.report(float(r["auc"]), step)
            if rc is None and watch.should_prune():
                raise Pruned(f"pruned at {seen:,} rows seen (validation AUC {r['auc']:.4f})")
        if rc is not None:
            break
        if watch.stop.is_set():
            raise Interrupted("the sweep was interrupted")
        now = time.monotonic()
        if watch.deadline and now > watch.deadline:
            raise Pruned("cut by the sweep's time budget (timeout)")
        if now - beat > watch.heartbeat_s:
            watch.heartbeat()
            beat = now
        watch.stop.wait(watch.poll_s)
    if rc != 0:
        raise Failed(f"{error_line(log_path)} (exit {rc}; log {log_path})")
    return records


def error_line(log_path: Path) -> str:
    """The run's own one-line error (``error: ...``), else its log's last line."""
    lines = log_path.read_text(errors="replace").splitlines() if log_path.is_file() else []
    errors = [ln for ln in lines if ln.startswith("error: ")]
    return (errors[-1] if errors else lines[-1] if lines else "no output").strip()


def end(proc: subprocess.Popen[bytes]) -> None:
    """Stop ``proc``'s process group if it still runs: SIGTERM, then SIGKILL after
    :data:`KILL_GRACE_S`."""
    if proc.poll() is not None:
        return
    for sig, wait_s in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
            return
