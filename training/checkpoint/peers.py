"""A rank whose peers are gone (a node killed, a process crashed) says so in one line.

The collective that was waiting on the lost rank fails: at once when the peer's connections
close (gloo: ``Connection closed by peer``), else after ``train.collective_timeout``. Every
surviving rank that sees it prints one ``error:`` line naming itself, the lost connection and
the checkpoint a relaunch resumes from, then exits with :data:`EXIT_PEER_LOST` (torchrun then
stops the node's other ranks and adds its own failure report).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from training.checkpoint import store as checkpoint
from training.errors import CheckpointError

EXIT_PEER_LOST = 3
# What gloo, NCCL and the c10d store say when the other end of a collective is gone.
_LOST = re.compile(
    r"Connection (?:closed|reset) by peer[^.\n]*|Broken pipe|Timed out[^.\n]*|"
    r"[Tt]imeout[^.\n]*|remote process exited[^.\n]*|NCCL communicator was aborted[^.\n]*"
)


def lost_peer(exc: BaseException) -> str | None:
    """The phrase of ``exc`` (or of an exception it wraps) that says a peer is gone, or None.

    Only while a multi-rank process group is up: alone, nothing can be lost.
    """
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return None
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, RuntimeError | dist.DistError | CheckpointException):
            found = _LOST.search(str(seen))
            if found:
                return found.group(0).strip()
        seen = seen.__cause__ or seen.__context__
    return None


def message(reason: str, run_dir: Path, timeout_s: int) -> str:
    """The one line a surviving rank prints: who, what was lost, where a relaunch resumes."""
    if re.search("[Tt]ime(d )?out", reason):
        reason += f": no answer within train.collective_timeout = {timeout_s} s"
    rank, world = dist.get_rank(), dist.get_world_size()
    node = os.environ.get("GROUP_RANK")  # torchrun's node number, as the rendezvous gave it
    where = f"rank {rank} of {world} (host {socket.gethostname()}"
    where += f", torchrun node {node})" if node is not None else ")"
    root = run_dir / "checkpoints"
    try:
        latest = checkpoint.read_latest(root)
    except CheckpointError as e:
        resume = f"but {e}"
    else:
        resume = (
            f"{root}/latest ({latest.name}) is intact: relaunch every node to resume from it"
            if latest is not None
            else "no checkpoint was saved yet: relaunch every node to start over"
        )
    return f"{where}: another rank of this run is gone ({reason}); {resume}"
