"""TorchServe's process group: start, readiness, stop.

``start`` launches ``torchserve --foreground`` in its own session (launcher, java, Python
workers share one process group) and returns at once; ``wait_ready`` polls the management API
until the model has a READY worker; ``stop`` ends the whole group (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil  # a TorchServe dependency

from recsys_stack import logpump
from recsys_stack.cpus import available_cpus
from serving.torchserve import manage
from serving.torchserve.config import (
    TorchServeConfig,
    log_config_file,
    served_versions,
    write_properties,
)

logger = logging.getLogger(__name__)
LOAD_FAILURES_FATAL = 3
_pumps: list[subprocess.Popen[bytes]] = []  # the log pumps started here, until they exit


def torchserve_command(cfg: TorchServeConfig, properties: Path) -> list[str]:
    exe = Path(sys.executable).parent / "torchserve"
    log_config = log_config_file(cfg)
    return [
        str(exe if exe.exists() else "torchserve"),
        "--start", "--foreground", "--ncs",
        "--model-store", str(cfg.model_store.resolve()),
        "--ts-config", str(properties.resolve()),
        *(["--log-config", str(log_config)] if log_config else []),
    ]  # fmt: skip


def start(cfg: TorchServeConfig, cgroup: Path | None = None) -> subprocess.Popen[bytes]:
    """Start TorchServe in its own process group, in ``cfg.workdir``; returns at once.

    ``cfg`` names its model (see ``config.resolve_model``). Call ``wait_ready`` next. The group
    (launcher, java, Python workers) is what ``stop`` ends. ``cgroup``: a control group's
    ``cgroup.procs`` file that TorchServe is born in (see :func:`launch`).
    """
    if not (cfg.model_name and cfg.model_version):
        raise ValueError("TorchServeConfig without a model name/version: resolve_model(cfg) first")
    properties = write_properties(cfg).resolve()
    # the handler splits the cores among the workers
    return launch(cfg, properties, {"RECSYS_WORKERS": str(cfg.worker_count())}, cgroup)


def born_in(cgroup: Path, cmd: list[str]) -> list[str]:
    """``cmd`` run by a shell that first writes its own pid into ``cgroup`` (a group's
    ``cgroup.procs``) and then execs it: the process and all it forks start inside the group,
    so every page they touch is charged there (a process moved in later keeps what it held
    charged where it was). The exec keeps the pid; the command line becomes ``cmd``'s."""
    return ["/bin/sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cgroup), *cmd]


def launch(
    cfg: TorchServeConfig,
    properties: Path,
    env: dict[str, str | None] | None = None,
    cgroup: Path | None = None,
) -> subprocess.Popen[bytes]:
    """``torchserve`` with ``properties`` in ``cfg.workdir``, isolated from other instances on
    the machine (pid file, worker sockets, logs), in a new session; ``env``: variables to set
    for it (None = unset); ``cgroup``: started inside that group (:func:`born_in`; its
    ``Popen.args`` are then the shell's, so :func:`started_identity` is not for it)."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise FileNotFoundError("java not found: TorchServe 0.12 needs Java 17 (or set JAVA_HOME)")
    workdir = cfg.workdir.resolve()
    tmp = workdir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    if len(str(tmp)) > 90:  # worker sockets live here; AF_UNIX paths stop at 107 bytes
        raise ValueError(
            f"workdir {workdir} is too deep for TorchServe's sockets: pick a shorter one"
        )
    cfg.key_file.unlink(missing_ok=True)  # a stale key would pass for the new one
    child_env = dict(os.environ)
    child_env.update(
        TMPDIR=str(tmp),  # the launcher's pid file ($TMPDIR/.model_server.pid): one per instance
        TEMP=str(tmp),  # java.io.tmpdir: worker sockets .ts.sock.<port>
        LOG_LOCATION=str(workdir / "logs"),
        METRICS_LOCATION=str(workdir / "logs"),
    )
    # the CPUs the handler shares among the workers: the cgroup quota, not the node's cores
    child_env.setdefault("RECSYS_CPUS", str(available_cpus()))
    # where the workers find each version's embedding deltas (serving/worker/deltas.py)
    child_env.setdefault("RECSYS_DELTA_DIR", str(Path(cfg.model_store).resolve() / "deltas"))
    for name, value in (env or {}).items():
        if value is None:
            child_env.pop(name, None)
        else:
            child_env[name] = value
    cmd = torchserve_command(cfg, properties)
    read, write = os.pipe()  # its output, through a pump: rotated, each kind rate-limited
    try:
        proc = subprocess.Popen(
            born_in(cgroup, cmd) if cgroup else cmd,
            cwd=workdir,  # TorchServe writes key_file.json into its working directory
            env=child_env,
            stdin=subprocess.DEVNULL,
            stdout=write,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)  # the child keeps its own
    _pumps[:] = [p for p in _pumps if p.poll() is None]  # reaped: no zombie per start
    try:  # its own session: it drains what the group writes on its way out, then exits
        _pumps.append(logpump.start(read, cfg.log, cfg.log_file.resolve(), mark(cfg, proc.pid),
                                    new_session=True))  # fmt: skip
    except OSError:
        stop(proc, timeout=10)  # its output would have nowhere to go
        raise
    logger.info("torchserve started (pid %d), log %s", proc.pid, cfg.log_file)
    return proc


def mark(cfg: TorchServeConfig, pid: int) -> str:
    """The start line of TorchServe's log: which process and what it serves."""
    return (
        f"torchserve start: pid {pid}, recsys-stack {logpump.version()}, model "
        f"{cfg.model_name} v{cfg.model_version}, gRPC {cfg.grpc_inference_target}, "
        f"{cfg.worker_count()} workers"
    )


def log_tail(cfg: TorchServeConfig, lines: int = 40) -> str:
    try:
        text = cfg.log_file.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def describe(cfg: TorchServeConfig, timeout: float = 5.0) -> list[dict[str, Any]]:
    """The management API's description of the default version ``cfg`` registers at start
    (raises :class:`~serving.torchserve.manage.ManageError` if unreachable or unregistered)."""
    name, _, default = served_versions(cfg)  # the plan's default when there is a plan
    models = manage.describe(cfg, name, default, timeout)
    if models is None:
        raise manage.ManageError(
            f"{cfg.host}:{cfg.management_port}: {name} v{default} is not registered"
        )
    return models


def ready_workers(cfg: TorchServeConfig, timeout: float = 5.0) -> int:
    """Workers of the model in state READY (0 while loading or if TorchServe is unreachable)."""
    try:
        models = describe(cfg, timeout)
    except (OSError, ValueError, KeyError, RuntimeError):  # not up yet, key file not written yet
        return 0
    return sum(w.get("status") == "READY" for m in models for w in m.get("workers", []))


def _load_failures(cfg: TorchServeConfig) -> int:
    try:
        text = cfg.log_file.read_text(errors="replace")
    except FileNotFoundError:
        return 0
    text = text.rpartition(f"{logpump.MARK} torchserve start:")[2]  # this start's, not the last's
    return text.count(f"Load model failed: {cfg.model_name},")


def _last_worker_error(cfg: TorchServeConfig) -> str:
    """The last ``SomeError: message`` a worker printed, to head the error message."""
    errors = re.findall(r"MODEL_LOG - (\w+(?:Error|Exception): .*)", log_tail(cfg, 400))
    return errors[-1] if errors else "no Python error in the log"


def _not_ready_reason(
    cfg: TorchServeConfig, proc: subprocess.Popen[bytes] | None, waited: float, timeout: float
) -> str | None:
    """Why waiting longer is pointless, or None."""
    name, _, default = served_versions(cfg)
    model = f"{name}/{default}"
    failures = _load_failures(cfg)
    if failures >= LOAD_FAILURES_FATAL:  # TorchServe would retry forever, backing off
        return (
            f"{model}: the worker failed to load the model {failures} times,"
            f" last with {_last_worker_error(cfg)!r}"
        )
    if proc is not None and proc.poll() is not None:
        return f"torchserve exited with {proc.returncode} before {model} was ready"
    if waited > timeout:
        return f"{model} has no READY worker after {timeout:.0f} s"
    return None


def wait_ready(
    cfg: TorchServeConfig, timeout: float = 180.0, proc: subprocess.Popen[bytes] | None = None
) -> float:
    """Block until the model has a READY worker; returns the seconds waited.

    Raises ``RuntimeError`` with the log tail if ``proc`` exits, the worker fails to load the
    model ``LOAD_FAILURES_FATAL`` times, or ``timeout`` passes (Java startup plus the model
    load take ~10-30 s on 2 cores).
    """
    t0 = time.monotonic()
    while ready_workers(cfg) == 0:
        reason = _not_ready_reason(cfg, proc, time.monotonic() - t0, timeout)
        if reason:
            raise RuntimeError(f"{reason}; {cfg.log_file} ends with:\n{log_tail(cfg)}")
        time.sleep(0.25)
    return time.monotonic() - t0


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def identity(pid: int) -> dict[str, Any] | None:
    """What tells process ``pid`` apart from a later one given the same pid (after it exited,
    or after a reboot): the boot, its start time (field 22 of ``/proc/<pid>/stat``, clock ticks
    since boot) and its command line. None: no such process (or a zombie). A recorded PID alone
    names whatever process holds it now; record this beside it and compare before signalling."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name (field 2) may hold ") ": skip it
    if not fields or fields[0] in ("Z", "X"):  # field 3, the state: exited, not yet reaped
        return None
    args = raw.split(b"\0")
    cmdline = [a.decode(errors="replace") for a in (args[:-1] if args[-1] == b"" else args)]
    return {"boot_id": _boot_id(), "start": int(fields[19]), "cmdline": cmdline}


def started_identity(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> dict[str, Any]:
    """:func:`identity` of a process just started, once its command line is the one started:
    ``Popen`` returns when exec closes the descriptors, before the kernel has set the new
    command line (``/proc/<pid>/cmdline`` reads empty for a moment, longer on a busy machine).
    A script's interpreter comes first (``python .../torchserve --start ...``), so the command
    line must end with the arguments given. ``{"exited": True}`` (never equal to a live
    process's) when it has exited already."""
    args = [str(a) for a in proc.args] if isinstance(proc.args, list) else [str(proc.args)]
    deadline = time.monotonic() + timeout
    while (now := identity(proc.pid)) is not None:
        cmdline = now["cmdline"]
        if cmdline and (len(args) < 2 or cmdline[-(len(args) - 1) :] == args[1:]):
            return now
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"pid {proc.pid}: /proc/{proc.pid}/cmdline is {cmdline!r} {timeout:.0f} s after "
                f"starting {args[:3]}...: cannot record which process it is"
            )
        time.sleep(0.01)
    return {"exited": True}


def group_members(pgid: int) -> list[psutil.Process]:
    """Live (non-zombie) processes of process group ``pgid``."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def _is_java(p: psutil.Process) -> bool:
    try:
        return p.name() == "java"
    except psutil.Error:
        return False


def _signal_group(pgid: int, sig: signal.Signals, spare_leader: bool) -> None:
    for p in group_members(pgid):
        if spare_leader and p.pid == pgid:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)


def _wait_group_empty(proc: subprocess.Popen[bytes] | int, grace: float) -> bool:
    pgid = proc if isinstance(proc, int) else proc.pid
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not isinstance(proc, int):
            proc.poll()  # reap the launcher
        if not group_members(pgid):
            return True
        time.sleep(0.1)
    return False


def stop(proc: subprocess.Popen[bytes] | int, timeout: float = 30.0) -> None:
    """Stop TorchServe's process group (launcher, java, workers): drain, then SIGTERM, then SIGKILL.

    ``proc``: the ``Popen`` from ``start`` or the group id (the launcher's pid). Java alone gets
    SIGTERM first: its shutdown closes the listening ports (a gateway's next call is refused at
    once and goes to another replica) and answers the calls its workers are scoring. Signalling
    the workers with it killed them under those calls ("Worker died"; the others waited out
    their deadline, and the group took 12.9 s to stop against 3.3 s, drain included). What is
    left then gets SIGTERM (the launcher exits once java has: it waits on it, and reaps it: no
    zombie java where PID 1 does not reap); what outlives ``timeout`` is killed.
    """
    pgid = proc if isinstance(proc, int) else proc.pid
    deadline = time.monotonic() + timeout
    java = [p for p in group_members(pgid) if _is_java(p)]
    for p in java:
        with contextlib.suppress(psutil.Error):
            p.send_signal(signal.SIGTERM)
    psutil.wait_procs(java, timeout=max(0.0, deadline - time.monotonic()))
    _signal_group(pgid, signal.SIGTERM, spare_leader=True)
    if not _wait_group_empty(proc, max(1.0, deadline - time.monotonic())):
        logger.warning("torchserve group %d outlived SIGTERM by %.0f s: killing it", pgid, timeout)
        _signal_group(pgid, signal.SIGKILL, spare_leader=False)
        _wait_group_empty(proc, 5.0)
    if not isinstance(proc, int):
        proc.wait(timeout=5)
    left = group_members(pgid)
    if left:
        raise RuntimeError(f"torchserve processes survived SIGKILL: {[p.pid for p in left]}")
