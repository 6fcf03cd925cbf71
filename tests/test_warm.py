"""The suite's warm start (tests/warm.py, tests/warm_site/sitecustomize.py) keeps what a caller
of ``python -m training.*`` sees: output, exit codes, signals, and no run outliving a killed
process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests import warm
from tests.conftest import ROOT, _env

pytestmark = pytest.mark.skipif(
    os.environ.get(warm.COLD_ENV, "") not in ("", "0"), reason="the warm Python is off"
)


def _server() -> psutil.Process:
    assert warm._WARM is not None and warm._WARM.proc is not None
    warm._WARM._wait_started()
    return psutil.Process(warm._WARM.proc.pid)


@pytest.mark.parametrize(
    "args", [["training.export", "--help"], ["training.train", "--no-such-option"]]
)
def test_a_warm_start_prints_and_exits_as_a_cold_one(args: list[str]) -> None:
    _server()
    runs = [
        subprocess.run(
            [sys.executable, "-u", "-m", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        for env in (_env(), warm.cold_env(_env()))
    ]
    (hot, cold) = runs
    assert (hot.returncode, hot.stdout, hot.stderr) == (cold.returncode, cold.stdout, cold.stderr)
    assert cold.returncode in (0, 2) and (cold.stdout or cold.stderr)


def _started(tmp_path: Path, data: list[str]) -> tuple[subprocess.Popen[bytes], psutil.Process]:
    """A long one-process training run started as make would: (the stand-in, the warm child)."""
    args = ["--config", "training/configs/tiny.toml", "--no-progress", "--run-dir",
            str(tmp_path / "run"), *data, "train.epochs=1000", "train.max_steps=0"]  # fmt: skip
    server = _server()
    before = {p.pid for p in server.children()}
    proc = subprocess.Popen([sys.executable, "-m", "training.train", *args], cwd=ROOT, env=_env())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = [p for p in server.children() if p.pid not in before]
        if new:
            return proc, new[0]
        assert proc.poll() is None, f"the run exited {proc.returncode} before its child showed"
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("no warm child appeared in 120 s")


def _gone(child: psutil.Process, within: float = 30.0) -> bool:
    try:
        child.wait(timeout=within)
    except psutil.TimeoutExpired:
        return False
    return True


def test_a_signal_to_the_stand_in_reaches_the_run_and_its_death_is_mirrored(
    tmp_path: Path, data_dirs: list[str]
) -> None:
    proc, child = _started(tmp_path, data_dirs)
    assert child.cwd() == str(ROOT) and child.environ().get("RANK") is None
    proc.send_signal(signal.SIGTERM)  # the run has no handler for it: killed by it
    assert proc.wait(timeout=60) == -signal.SIGTERM
    assert _gone(child)


def test_a_sigkilled_stand_in_takes_its_run_with_it(tmp_path: Path, data_dirs: list[str]) -> None:
    proc, child = _started(tmp_path, data_dirs)
    proc.kill()
    proc.wait(timeout=60)
    assert _gone(child), "the warm child outlived its SIGKILLed stand-in"


def test_only_this_suites_old_temp_roots_are_removed(tmp_path: Path) -> None:
    """Issue 46 item 9: the suite deleted every /tmp/rs-* older than a day on a shared machine;
    now only the roots it marked as its own."""
    import os

    from tests.conftest import SUITE_MARK, remove_old_roots

    ours, foreign, young = tmp_path / "rs-ours", tmp_path / "rs-someone", tmp_path / "rs-young"
    for d in (ours, foreign, young):
        d.mkdir()
    (ours / SUITE_MARK).write_text("")
    (young / SUITE_MARK).write_text("")
    day_ago = time.time() - 2 * 86400
    for d in (ours, foreign):
        os.utime(d, (day_ago, day_ago))
    assert remove_old_roots(tmp_path) == [ours]
    assert foreign.is_dir() and young.is_dir() and not ours.exists()


THREAD_MOD = """
import threading, time, pathlib, sys
def late():
    time.sleep(3)
    pathlib.Path(sys.argv[1]).write_text("written after main returned")
threading.Thread(target=late, name="late-writer").start()  # not a daemon: exit waits for it
"""

MODULES_MOD = """
import sys
print(sorted(m for m in sys.modules
             if m.split(".")[0] in ("training", "serving", "recsys_stack", "recsys_model")))
import torch
print(hasattr(torch.distributed, "checkpoint") and "checkpoint" in dir(torch.distributed))
"""


def test_a_warm_run_waits_for_its_non_daemon_threads_as_a_cold_one(tmp_path: Path) -> None:
    """Issue 46 item 7: the warm child ran the atexit handlers and ``os._exit``-ed, so a run
    leaving a non-daemon thread behind passed warm (68 s) and hung cold. Now it waits as a cold
    Python does, and names the threads it waits for."""
    (tmp_path / "late_thread.py").write_text(THREAD_MOD)
    runs = {}
    for cold in (False, True):
        out = tmp_path / f"out-{cold}"
        t0 = time.monotonic()
        proc = warm.run_module("late_thread", [str(out)], tmp_path, _env(), 120, cold=cold)
        runs[cold] = (proc, time.monotonic() - t0, out)
    for cold, (proc, took, out) in runs.items():
        assert proc.returncode == 0, (cold, proc.stderr)
        assert took >= 2.5 and out.read_text() == "written after main returned", (cold, took)
    assert "waiting at exit for non-daemon threads ['late-writer']" in runs[False][0].stderr


def test_a_warm_run_starts_with_no_project_module_loaded(tmp_path: Path) -> None:
    """Issue 46 item 7: the warm server preloaded project modules and torch submodules, so a
    missing ``import torch.distributed.checkpoint`` passed warm and failed cold. Now it
    preloads third-party packages only: what a run sees of the project is what it imports."""
    (tmp_path / "modules_seen.py").write_text(MODULES_MOD)
    hot, cold = (warm.run_module("modules_seen", [], tmp_path, _env(), 120, cold=c)
                 for c in (False, True))  # fmt: skip
    assert hot.returncode == cold.returncode == 0, (hot.stderr, cold.stderr)
    assert hot.stdout.splitlines()[0] == cold.stdout.splitlines()[0] == "[]", (
        hot.stdout,
        cold.stdout,
    )
    assert all(p not in warm.PRELOAD for p in ("torch.distributed.checkpoint", "training.config"))
