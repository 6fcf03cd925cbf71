"""One headless Locust run (single process, or a master with N workers) -> its summary numbers.

Shared by ``loadtest.run`` (against the gateway) and ``loadtest.calibrate`` (against a no-op
server); it knows nothing of either.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.config import ROOT, LoadConfig, seconds
from recsys_stack.net import free_ports

log = logging.getLogger("loadtest")
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"


def locust_env(cfg: LoadConfig, host: str) -> dict[str, str]:
    """What the locustfile reads in every load process (see its docstring)."""
    env = dict(os.environ, LOADTEST_DATA=str(cfg.data), LOADTEST_EXAMPLES=str(cfg.examples))
    env["LOADTEST_TIMEOUT_S"] = str(cfg.timeout_s)
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
    """One headless Locust run into ``out`` (CSVs, HTML, locust.log) -> its summary numbers.

    ``locustfile``: another user module (the chaos run's records each call); ``env``: extra
    variables for the load processes.

    With ``cfg.processes > 1`` the summary also says how many workers the master saw
    (``workers``), read from its log.
    """
    out.mkdir(parents=True, exist_ok=True)
    env = {**locust_env(cfg, host), **(env or {})}
    base = [sys.executable, "-m", "locust", "-f", str(locustfile)]
    cmd = [*base, "--loglevel", "INFO" if cfg.processes > 1 else "WARNING", "--headless",
           "--host", host, "-u", str(users), "-r", str(spawn_rate),
           "-t", duration, "--csv", str(out / "locust"), "--html", str(out / "report.html"),
           "--only-summary", "--stop-timeout", "2", "--exit-code-on-error", "0"]  # fmt: skip
    workers: list[subprocess.Popen[bytes]] = []
    logf = (out / "locust.log").open("wb")
    try:
        if cfg.processes > 1:
            port = free_ports(1)[0]
            cmd += ["--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
                    "--expect-workers", str(cfg.processes), "--expect-workers-max-wait", "60"]  # fmt: skip
            wcmd = [*base, "--loglevel", "WARNING", "--worker", "--master-host", "127.0.0.1",
                    "--master-port", str(port)]  # fmt: skip
            for _ in range(cfg.processes):
                workers.append(
                    subprocess.Popen(wcmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT)
                )
        log.info("locust: %d users, %s, %d process(es) -> %s", users, duration, cfg.processes, out)
        master = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=logf, stderr=subprocess.STDOUT,
            timeout=seconds(duration) + 120,
        )  # fmt: skip
    finally:
        for w in workers:  # they quit when the master does; make sure
            try:
                w.wait(timeout=15)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
        logf.close()
    text = (out / "locust.log").read_text(errors="replace")
    if master.returncode != 0 or not (out / "locust_stats.csv").exists():
        raise RuntimeError(f"locust exited {master.returncode}; log tail:\n{text[-1500:]}")
    summary = report.summarize(out / "locust")
    if cfg.processes > 1:
        summary["workers"] = report.workers_seen(text)
    return summary
