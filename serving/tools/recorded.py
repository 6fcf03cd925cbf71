"""The processes ``make serve`` recorded in ``serve.json`` (the gateway, each TorchServe
replica), and whether each pid is still the process started: a pid alone names whatever
process holds it now (after a reboot, or once the recorded one exited and the pid was given to
another), so each is recorded with its identity (``process.identity``: boot, start time,
command line) and compared before anything signals it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from serving.tools.state import read_state
from serving.torchserve import process


def replica_name(i: int) -> str:
    return "torchserve" if i == 0 else f"torchserve-{i}"


@dataclass(frozen=True)
class Recorded:
    """A process ``start`` recorded, and what holds its pid now."""

    name: str
    pid: int
    identity: dict[str, Any] | None
    """Its boot, start time and command line when started (None: a serve.json written
    before identities were recorded)."""

    def verdict(self) -> Literal["ours", "gone", "other", "unverified"]:
        """``ours``: the pid is still the process started; ``gone``: nothing holds it;
        ``other``: another process does now (never signal it); ``unverified``: something
        holds it and no identity was recorded to tell whether it is ours (never signal it)."""
        now = process.identity(self.pid)
        if now is None:
            return "gone"
        if self.identity is None:
            return "unverified"
        return "ours" if now == self.identity else "other"

    def note(self, verdict: str) -> str:
        """One line for a process that is not signalled ("" for ours, and gone for good)."""
        if verdict == "other":
            return f"{self.name}: not running (pid {self.pid} is now another process)"
        if verdict == "unverified":
            return (
                f"{self.name}: pid {self.pid} is alive, but serve.json was written without its "
                "start time and command line (an older supervisor): not signalled; if "
                f"`ps -o pid,lstart,args -g {self.pid}` shows the stack, end it with "
                f"`kill -TERM -- -{self.pid}`, then delete the serve.json"
            )
        if verdict == "gone" and (left := process.group_members(self.pid)):
            return (
                f"{self.name}: pid {self.pid} has exited, but its process group still holds "
                f"pids {sorted(p.pid for p in left)}: not signalled (only the leader's identity "
                f"is recorded); `kill -TERM -- -{self.pid}` if they are the stack's"
            )
        return ""


def recorded(workdir: Path) -> list[Recorded]:
    """The gateway and each TorchServe replica (``torchserve``, ``torchserve-1``, ...) as
    recorded."""
    state = read_state(workdir)
    out = [Recorded(replica_name(i), int(r["pid"]), r.get("identity"))
           for i, r in enumerate(state.get("replicas", []))]  # fmt: skip
    if "gateway_pid" in state:
        out.append(Recorded("gateway", int(state["gateway_pid"]), state.get("gateway_identity")))
    return out


def survey(workdir: Path) -> tuple[dict[str, int], list[str]]:
    """``({name: pid} of the recorded processes still running, notes)``: a pid another process
    holds now, or one recorded without an identity, is left out and named in a note."""
    alive, notes = {}, []
    for r in recorded(workdir):
        verdict = r.verdict()
        if verdict == "ours":
            alive[r.name] = r.pid
        elif note := r.note(verdict):
            notes.append(note)
    return alive, notes


def still_ours(workdir: Path, name: str) -> bool:
    """Checked again right before a signal: the pid may have been freed since the survey."""
    return any(r.name == name and r.verdict() == "ours" for r in recorded(workdir))
