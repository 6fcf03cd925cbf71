"""One headless Locust run (single process, or a master with N workers) -> its summary numbers.

Shared by ``loadtest.run`` (against the gateway) and ``loadtest.calibrate`` (against a no-op
server); it knows nothing of either.

Stopping early: a program that called :func:`stop_on_signals` (``loadtest.run``) takes SIGINT
and SIGTERM as "end the load now": the running Locust gets one SIGINT (its own clean quit,
which writes the CSVs and the HTML report; it runs in a process group of its own so a
terminal's Ctrl-C reaches it only this way), the summary says ``stopped_by``, and no further
run starts (:func:`stop_requested`). So ``make loadtest DURATION=2h &`` ... ``kill $!`` spans
exactly what ran in between and still leaves its report.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from loadtest import report, tally
from loadtest.config import ROOT, LoadConfig, seconds
from recsys_stack.net import free_ports

log = logging.getLogger("loadtest")
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
# stop_on_signals' state: installed, the signal received, the Locust (master) running now.
_stop: dict[str, Any] = {"installed": False, "signal": None, "locust": None}


def _on_stop(signum: int, frame: object) -> None:
    name = signal.Signals(signum).name
    proc = _stop["locust"]
    if _stop["signal"] is None:
        log.info("%s: stopping the load (report and summary still written)", name)
    _stop["signal"] = _stop["signal"] or name
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # Locust: KeyboardInterrupt -> HTML report, CSVs, quit
        _stop["locust"] = None  # once: a second SIGINT would cut its report short


def end_load() -> bool:
    """End the running Locust now, as a signal would but without marking a stop (a caller
    that planned the end: ``loadtest.chaos``); False when none runs."""
    proc = _stop["locust"]
    if proc is None or proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGINT)
    _stop["locust"] = None
    return True


def stop_on_signals() -> None:
    """From now on (main thread), SIGINT and SIGTERM stop the load early and cleanly."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _on_stop)
    _stop["installed"] = True


def stop_requested() -> str | None:
    """The signal (``"SIGTERM"``) that asked to stop, or None."""
    return _stop["signal"]


def locust_env(cfg: LoadConfig, host: str) -> dict[str, str]:
    """What the locustfile reads in every load process (see its docstring)."""
    env = dict(os.environ, LOADTEST_DATA=str(cfg.data), LOADTEST_EXAMPLES=str(cfg.examples))
    env["LOADTEST_TIMEOUT_S"] = str(cfg.timeout_s)
    env["LOADTEST_SAMPLE_ROWS"], env["LOADTEST_SEED"] = str(cfg.sample_rows), str(cfg.seed)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["RECSYS_GATEWAY"] = host
    return env


def run_locust(
    cfg: LoadConfig,
    host: str,
    users: int,
    duration: str,
    out: Path,
    spawn_rate: float,
    locustfile: Path = LOCUSTFILE,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """One headless Locust run into ``out`` (CSVs, HTML, locust.log, the end-of-run files of
    ``loadtest/tally.py``) -> its summary numbers (:func:`loadtest.report.summarize`).

    ``locustfile``: another user module (the chaos run's records each call); ``env``: extra
    variables for the load processes.

    With ``cfg.processes > 1`` the summary also says how many workers the master saw
    (``workers``), read from its log.
    """
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("locust_*.json"):  # a report folder used before: not this run's counts
        old.unlink()
    env = {**locust_env(cfg, host), tally.PREFIX_ENV: str(out / "locust"), **(env or {})}
    base = [sys.executable, "-m", "locust", "-f", str(locustfile)]
    cmd = [*base, "--loglevel", "INFO" if cfg.processes > 1 else "WARNING", "--headless",
           "--host", host, "-u", str(users), "-r", str(spawn_rate),
           "-t", duration, "--csv", str(out / "locust"), "--html", str(out / "report.html"),
           "--only-summary", "--stop-timeout", "2", "--exit-code-on-error", "0"]  # fmt: skip
    if stop_requested():
        raise RuntimeError(f"{stop_requested()} before the load started")
    workers: list[subprocess.Popen[bytes]] = []
    group = 0 if _stop["installed"] else None  # a group of its own: see the module docstring
    logf = (out / "locust.log").open("wb")
    started = time.time()
    try:
        if cfg.processes > 1:
            port = free_ports(1)[0]
            cmd += ["--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
                    "--expect-workers", str(cfg.processes), "--expect-workers-max-wait", "60"]  # fmt: skip
            wcmd = [*base, "--loglevel", "WARNING", "--worker", "--master-host", "127.0.0.1",
                    "--master-port", str(port)]  # fmt: skip
            for _ in range(cfg.processes):
                w = subprocess.Popen(wcmd, cwd=ROOT, env=env, stdout=logf,
                                     stderr=subprocess.STDOUT, process_group=group)  # fmt: skip
                workers.append(w)
        log.info("locust: %d users, %s, %d process(es) -> %s", users, duration, cfg.processes, out)
        master = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
                                  process_group=group)  # fmt: skip
        _stop["locust"] = master
        if stop_requested():  # a signal between the start and the line above
            _on_stop(signal.SIGINT, None)
        try:
            master.wait(timeout=seconds(duration) + 120)
        except BaseException:  # a timeout, or Ctrl-C where nothing forwards it
            master.kill()
            master.wait()
            raise
    finally:
        _stop["locust"] = None
        for w in workers:  # they quit when the master does; make sure
            try:
                w.wait(timeout=15)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        logf.close()
    text = (out / "locust.log").read_text(errors="replace")
    if master.returncode != 0 or not (out / f"locust{tally.FINAL}").exists():
        raise RuntimeError(f"locust exited {master.returncode}; log tail:\n{text[-1500:]}")
    summary = report.summarize(out / "locust")
    summary["started_at"], summary["ended_at"] = round(started, 1), round(time.time(), 1)
    if stop_requested():
        summary["stopped_by"] = stop_requested()
    if cfg.processes > 1:
        summary["workers"] = report.workers_seen(text)
    return summary
