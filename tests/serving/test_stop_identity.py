"""``make stop`` / ``make status`` with a serve.json whose pids another process holds now (a
reboot, a stale file): the supervisor signals a recorded pid only while it is still the process
it started (boot, start time and command line as recorded), and says so in one line otherwise.

The "other process" is real: ``setsid sleep 300``, a session and process group of its own, whose
pid is written into serve.json as the gateway's and TorchServe's."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from recsys_stack.config import to_dict
from serving.gateway.config import GatewayConfig
from serving.torchserve import process
from serving.torchserve.config import TorchServeConfig
from tests.conftest import ROOT, _env


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """``setsid sleep 300``: its own session and process group (as the gateway and TorchServe
    run), killed after the test."""
    proc = subprocess.Popen(["setsid", "sleep", "300"])
    deadline = time.monotonic() + 30
    while (process.identity(proc.pid) or {}).get("cmdline") != ["sleep", "300"]:
        assert time.monotonic() < deadline, "setsid did not exec sleep within 30 s"
        time.sleep(0.01)  # setsid sets up the session, then execs sleep in the same pid
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def _state(workdir: Path, pid: int, identity: dict[str, Any] | None) -> None:
    """A serve.json naming ``pid`` as the gateway and the TorchServe replica (``identity``
    None: written the way the supervisor did before it recorded identities)."""
    ts = TorchServeConfig(workdir=workdir / "torchserve", model_name="m", model_version="1")
    replica: dict[str, Any] = {"pid": pid, "torchserve": to_dict(ts)}
    state: dict[str, Any] = {"replicas": [replica], "gateway_pid": pid,
                             "gateway": to_dict(GatewayConfig())}  # fmt: skip
    if identity is not None:
        replica["identity"] = state["gateway_identity"] = identity
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "serve.json").write_text(json.dumps(state))


def _supervisor(command: str, workdir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "serving.tools.supervisor", command], cwd=ROOT,
        env=_env({"RECSYS_SERVE_DIR": str(workdir)}), capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None and process.identity(proc.pid) is not None


def test_stop_leaves_a_process_that_took_a_recorded_pid_alone(
    sleeper: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    pid = sleeper.pid
    now = process.identity(pid)
    assert now is not None and now["cmdline"] == ["sleep", "300"], now
    # what start recorded: a gateway launched earlier that has exited since; its pid is reused
    then = now | {"start": now["start"] - 1, "cmdline": [sys.executable, "-m", "serving.gateway"]}
    workdir = tmp_path / "serve"
    _state(workdir, pid, then)
    status = _supervisor("status", workdir)
    assert status.returncode == 3, status  # not running
    assert f"gateway: not running (pid {pid} is now another process)" in status.stdout, status
    stopped = _supervisor("stop", workdir)
    assert stopped.returncode == 0, stopped
    assert _alive(sleeper), "stop signalled a process that is not the stack's"
    lines = stopped.stdout.splitlines()
    assert f"torchserve: not running (pid {pid} is now another process)" in lines, stopped
    assert f"gateway: not running (pid {pid} is now another process)" in lines, stopped
    assert lines[-1] == f"not running ({workdir})", stopped
    assert not (workdir / "serve.json").exists()  # nothing of ours left to stop


def test_stop_refuses_to_signal_a_pid_recorded_without_its_identity(
    sleeper: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    pid = sleeper.pid
    workdir = tmp_path / "serve"
    _state(workdir, pid, None)  # a serve.json of the supervisor before identities
    stopped = _supervisor("stop", workdir)
    assert stopped.returncode == 1, stopped
    assert _alive(sleeper), "stop signalled a pid it could not tell was the stack's"
    want = f"gateway: pid {pid} is alive, but serve.json was written without its start time"
    assert want in stopped.stdout and f"kill -TERM -- -{pid}" in stopped.stdout, stopped
    assert (workdir / "serve.json").exists()  # kept for whoever checks the pid by hand


def test_identity_tells_a_process_from_a_later_one_with_its_pid(
    sleeper: subprocess.Popen[bytes],
) -> None:
    got = process.identity(sleeper.pid)
    assert got is not None and got["start"] > 0 and got["boot_id"], got
    assert process.identity(sleeper.pid) == got  # stable while it runs
    sleeper.kill()
    sleeper.wait(timeout=10)
    assert process.identity(sleeper.pid) is None  # reaped: no such process


def test_the_identity_recorded_at_start_is_the_command_started() -> None:
    """``Popen`` returns before the kernel has set the new command line (it reads empty for a
    moment): what ``start`` records must be the command started, or ``stop`` would take its
    own process for another one and leave it running. Twenty starts, each checked later."""
    for i in range(20):
        proc = subprocess.Popen(["sleep", f"{30 + i}"], start_new_session=True)
        try:
            recorded = process.started_identity(proc)
            assert recorded["cmdline"] == ["sleep", f"{30 + i}"], recorded
            assert process.identity(proc.pid) == recorded
        finally:
            proc.kill()
            proc.wait(timeout=10)
