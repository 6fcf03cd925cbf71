"""Ctrl-C in ``make train``: a few lines naming the checkpoint that survived and the command
that resumes, not three tracebacks (two ranks' and torchrun's)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, _env, make_command
from training.checkpoint.store import is_complete

pytestmark = pytest.mark.slow


def test_ctrl_c_says_what_survived_and_how_to_resume(tmp_path: Path, data_dirs: list[str]) -> None:
    run = tmp_path / "run"
    # many epochs of the tiny preset: it is still training when the signal comes
    args = ["--no-progress", *data_dirs, "train.epochs=200", "train.checkpoint_every=20"]
    cmd = make_command("train", {"PRESET": "tiny", "RUN": str(run), "NPROC": "2"}, args)
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own group, as a terminal's foreground job
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or []), daemon=True)
    reader.start()
    deadline = time.monotonic() + 600
    while not (run / "checkpoints" / "latest").is_file():
        assert proc.poll() is None, "".join(lines)[-3000:]
        assert time.monotonic() < deadline, "no checkpoint in 600 s"
        time.sleep(0.2)
    time.sleep(2)  # training on, past its first checkpoint
    before = len(lines)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
    try:
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=30)
    after = [line.rstrip("\n") for line in lines[before:]]
    text = "\n".join(after)
    assert proc.returncode != 0, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    # the eval/checkpoint lines of steps already under way, then ours and make's
    assert len(after) <= 6, text
    errors = [line for line in after if line.startswith("error:")]
    assert len(errors) == 1, text
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert is_complete(run / "checkpoints" / latest)
    assert f"{run}/checkpoints/latest ({latest}) is intact" in errors[0], errors[0]
    assert f"make train PRESET=tiny RUN={run}" in errors[0], errors[0]
