"""Ctrl-C during training says, in one line, which checkpoint survived and how to resume.

A terminal's Ctrl-C sends SIGINT to the whole foreground group: torchrun and every rank. Each
rank turns the first SIGINT into one ``KeyboardInterrupt`` (a second one, torchrun passing the
signal on, is ignored, so no traceback interrupts the first's handling); rank 0 prints the line
(as a rank that lost its peers does, :mod:`training.checkpoint.peers`) and every rank exits with
:data:`EXIT_INTERRUPTED`. torchrun itself is started through :mod:`training.launch`, which
exits quietly on the signal instead of printing its own traceback.
"""

from __future__ import annotations

import signal
from pathlib import Path
from types import FrameType

from training.checkpoint import store as checkpoint
from training.config import Config
from training.errors import CheckpointError

EXIT_INTERRUPTED = 128 + signal.SIGINT  # 130, what a shell reports for a Ctrl-C'd command
_received: list[int] = []


def install() -> None:
    """Route SIGINT through :func:`_on_signal` (the main thread; before any work)."""
    signal.signal(signal.SIGINT, _on_signal)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    first = not _received
    _received.append(signum)
    if first:
        raise KeyboardInterrupt


def received() -> bool:
    """Whether this process got SIGINT: then any error that follows (a peer's connection
    closing as it exits) is the interrupt's, not a failure of its own."""
    return bool(_received)


def resume_command(cfg: Config, run_dir: Path) -> str:
    """The command that resumes ``run_dir`` (``make train`` when the run is of a preset)."""
    if (Path("training/configs") / f"{cfg.name}.toml").is_file():
        data = f" DATA={cfg.data.path}" if cfg.data.path else ""
        return f"make train PRESET={cfg.name} RUN={run_dir}{data} (with the same ARGS)"
    return f"torchrun ... -m training.train --run-dir {run_dir} (the same options)"


def message(cfg: Config, run_dir: Path) -> str:
    """The one line: what the interrupt left in ``run_dir`` and the command that resumes."""
    root = run_dir / "checkpoints"
    command = resume_command(cfg, run_dir)
    try:
        latest = checkpoint.read_latest(root)
    except CheckpointError as e:
        return f"interrupted (Ctrl-C), but {e}"
    if latest is None:
        return f"interrupted (Ctrl-C) before the first checkpoint: nothing was saved; {command} starts over"
    return (
        f"interrupted (Ctrl-C): {root}/latest ({latest.name}) is intact; the same command "
        f"resumes from it: {command}"
    )
