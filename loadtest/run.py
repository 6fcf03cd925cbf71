"""``python -m loadtest.run``: headless Locust against the gateway, with reports and an SLO gate.

    python -m loadtest.run --users 8 --spawn-rate 8 --duration 30s --host 127.0.0.1:50051

writes ``--out`` (default ``reports/<timestamp>/``): Locust's CSVs (``locust_*.csv``) and HTML
report, ``summary.json`` (requests, failures, rps, p50/p95/p99/max ms, failures by gRPC code,
commit, model name/version as the gateway reports them, users, examples per request) and
``latency.png`` (percentiles and throughput over time). Exit codes: 0 ok, 1 the gateway or Locust
failed, 2 bad options, 3 an SLO limit (``--slo-p99-ms``, ``--slo-failure-ratio``) was broken;
the reason is printed in one line.

Step load: ``--step-users 1,2,4,8 --step-duration 10s --slo-p99-ms 50`` runs one load per user
count (into ``step_<users>/``), prints a table and writes ``steps.json`` with the knee: the step
with the highest throughput whose p99 is under the limit (exit 3 when no step is).

Several load processes: ``--processes N`` (N > 1) starts a Locust master that only aggregates
and N worker processes that generate the load, all on loopback (master port chosen free). Each
Python process tops out at about one core, so use this when the generator is the bottleneck
(``python -m loadtest.calibrate`` measures its ceiling; ``--calibrate`` here runs it first and
adds ``generator_ceiling_rps`` and ``bottleneck`` to summary.json).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest import report
from serving.torchserve import free_ports

log = logging.getLogger("loadtest")
ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
SLO_EXIT = 3


@dataclass
class LoadConfig:
    host: str = field(default_factory=lambda: os.environ.get("RECSYS_GATEWAY", "127.0.0.1:50051"))
    """gateway host:port (env RECSYS_GATEWAY)"""
    users: int = 4
    """concurrent closed-loop users (no think time)"""
    spawn_rate: float = 4.0
    """users started per second"""
    duration: str = "30s"
    """Locust run time, e.g. 10s, 2m"""
    data: Path | None = None
    """Criteo TSV for payloads (default: the first data/synthetic/*.tsv)"""
    examples: int = 100
    """examples per request"""
    processes: int = 1
    """load processes; > 1: a Locust master plus this many workers"""
    out: Path | None = None
    """report folder (default reports/<timestamp>/)"""
    slo_p99_ms: float | None = None
    """exit 3 when p99 is above this"""
    slo_failure_ratio: float | None = None
    """exit 3 when failures / requests is above this"""
    step_users: list[int] = field(default_factory=list)
    """step-load mode: user counts, one run each"""
    step_duration: str = "10s"
    """run time of each step"""
    calibrate: bool = False
    """measure the generator's ceiling against a no-op server first"""
    generator_ceiling_rps: float | None = None
    """a ceiling measured before (python -m loadtest.calibrate)"""


def seconds(duration: str) -> float:
    """``"90"``, ``"10s"``, ``"2m"``, ``"1h"`` -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    d = duration.strip()
    try:
        return float(d[:-1]) * units[d[-1]] if d[-1] in units else float(d)
    except (ValueError, IndexError):
        raise ValueError(f"duration {duration!r}: expected e.g. 30s, 2m") from None


def default_data() -> Path:
    found = sorted((ROOT / "data" / "synthetic").glob("*.tsv"))
    if not found:
        raise ValueError(
            "no --data and no data/synthetic/*.tsv: make one with "
            "`python -m training.data.synthetic --rows 20000 --out data/synthetic/loadtest.tsv`"
        )
    return found[0]


def run_locust(
    cfg: LoadConfig, host: str, users: int, duration: str, out: Path, spawn_rate: float
) -> dict[str, Any]:
    """One headless Locust run into ``out`` (CSVs, HTML, locust.log) -> its summary numbers."""
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, LOADTEST_DATA=str(cfg.data), LOADTEST_EXAMPLES=str(cfg.examples))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["RECSYS_GATEWAY"] = host
    base = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--loglevel", "WARNING"]
    cmd = [*base, "--headless", "--host", host, "-u", str(users), "-r", str(spawn_rate),
           "-t", duration, "--csv", str(out / "locust"), "--html", str(out / "report.html"),
           "--only-summary", "--stop-timeout", "2", "--exit-code-on-error", "0"]  # fmt: skip
    workers: list[subprocess.Popen[bytes]] = []
    logf = (out / "locust.log").open("wb")
    try:
        if cfg.processes > 1:
            port = free_ports(1)[0]
            cmd += ["--master", "--master-bind-host", "127.0.0.1", "--master-bind-port", str(port),
                    "--expect-workers", str(cfg.processes), "--expect-workers-max-wait", "60"]  # fmt: skip
            wcmd = [*base, "--worker", "--master-host", "127.0.0.1", "--master-port", str(port)]
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
    if master.returncode != 0 or not (out / "locust_stats.csv").exists():
        tail = (out / "locust.log").read_text(errors="replace")[-1500:]
        raise RuntimeError(f"locust exited {master.returncode}; log tail:\n{tail}")
    return report.summarize(out / "locust")


def model_info(host: str, data: Path, examples: int) -> dict[str, str]:
    """One Score call: the model name and version the gateway serves (fails fast when down)."""
    import grpc

    from loadtest.payload import request_pool
    from serving.client import RankerClient

    client = RankerClient(host, timeout=10)
    try:
        reply = client.stub.Score(request_pool(data, examples, size=1)[0], timeout=10)
    except grpc.RpcError as e:
        code, details = e.code().name, e.details()  # type: ignore[attr-defined]
        raise RuntimeError(f"{host}: {code}: {details} (is the stack up? `make serve`)") from None
    finally:
        client.close()
    return {"model_name": reply.model_name, "model_version": reply.model_version}


def git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def single(cfg: LoadConfig, out: Path) -> tuple[dict[str, Any], str]:
    """The plain mode: one load, summary.json + plot -> (summary, SLO violation or '')."""
    assert cfg.data is not None
    info = model_info(cfg.host, cfg.data, cfg.examples)
    ceiling = cfg.generator_ceiling_rps
    if cfg.calibrate:
        from loadtest.calibrate import ceiling_run

        ceiling = ceiling_run(cfg, out / "calibration")["rps"]
    s = run_locust(cfg, cfg.host, cfg.users, cfg.duration, out, cfg.spawn_rate)
    summary: dict[str, Any] = {
        **s, "commit": git_commit(), **info, "host": cfg.host, "users": cfg.users,
        "spawn_rate": cfg.spawn_rate, "duration": cfg.duration, "processes": cfg.processes,
        "examples_per_request": cfg.examples, "data": str(cfg.data),
    }  # fmt: skip
    if ceiling is not None:
        summary["generator_ceiling_rps"] = ceiling
        # Far below what the generator can send: the server is what limits throughput.
        summary["bottleneck"] = "server" if s["rps"] < 0.5 * ceiling else "generator"
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    title = (
        f"{info['model_name']} v{info['model_version']}: {cfg.users} users, {cfg.examples} ex/req"
    )
    report.plot(out / "locust_stats_history.csv", out / "latency.png", title)
    return summary, report.slo_violation(s, cfg.slo_p99_ms, cfg.slo_failure_ratio)


def step_load(cfg: LoadConfig, out: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """One run per user count -> (steps, knee); writes steps.json and a plot per step."""
    assert cfg.data is not None and cfg.slo_p99_ms is not None
    info = model_info(cfg.host, cfg.data, cfg.examples)
    steps = []
    for u in cfg.step_users:
        d = out / f"step_{u}"
        s = run_locust(cfg, cfg.host, u, cfg.step_duration, d, spawn_rate=float(u))
        report.plot(d / "locust_stats_history.csv", d / "latency.png", f"{u} users")
        steps.append({"users": u, **s})
    best = report.knee(steps, cfg.slo_p99_ms, cfg.slo_failure_ratio)
    doc = {"commit": git_commit(), **info, "examples_per_request": cfg.examples,
           "slo_p99_ms": cfg.slo_p99_ms, "steps": steps, "knee": best}  # fmt: skip
    (out / "steps.json").write_text(json.dumps(doc, indent=2) + "\n")
    return steps, best


def parse_args(argv: Sequence[str] | None = None) -> LoadConfig:
    d = LoadConfig()
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default=d.host, help="gateway host:port (default %(default)s)")
    p.add_argument("-u", "--users", type=int, default=d.users)
    p.add_argument("-r", "--spawn-rate", type=float, default=d.spawn_rate)
    p.add_argument("-t", "--duration", default=d.duration, help="e.g. 30s, 2m")
    p.add_argument("--data", type=Path, help="Criteo TSV (default: data/synthetic/*.tsv)")
    p.add_argument("--examples", type=int, default=d.examples, help="examples per request")
    p.add_argument("--processes", type=int, default=d.processes, help="load processes")
    p.add_argument("--out", type=Path, help="report folder (default reports/<timestamp>)")
    p.add_argument("--slo-p99-ms", type=float)
    p.add_argument("--slo-failure-ratio", type=float)
    p.add_argument("--step-users", default="", help="step-load mode, e.g. 1,2,4,8")
    p.add_argument("--step-duration", default=d.step_duration)
    p.add_argument("--calibrate", action="store_true", help="measure the generator ceiling first")
    p.add_argument("--generator-ceiling-rps", type=float)
    ns = vars(p.parse_args(argv))
    try:
        ns["step_users"] = [int(u) for u in ns["step_users"].split(",") if u.strip()]
    except ValueError:
        p.error(f"--step-users {ns['step_users']!r}: expected e.g. 1,2,4,8")
    if ns["step_users"] and ns["slo_p99_ms"] is None:
        p.error("--step-users needs --slo-p99-ms (the knee is the best step under it)")
    if ns["users"] < 1 or ns["examples"] < 1 or ns["processes"] < 1:
        p.error("--users, --examples and --processes must be >= 1")
    return LoadConfig(**ns)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = parse_args(argv)
    try:
        seconds(cfg.duration), seconds(cfg.step_duration)
        cfg.data = cfg.data or default_data()
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = cfg.out or ROOT / "reports" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2, default=str) + "\n")
    try:
        if cfg.step_users:
            steps, best = step_load(cfg, out)
            print(report.steps_table(steps, best))
            if best is None:
                print(f"SLO: no step has p99 <= {cfg.slo_p99_ms:g} ms", file=sys.stderr)
                return SLO_EXIT
            print(f"knee: {best['rps']:.1f} rps at {best['users']} users ({out / 'steps.json'})")
            return 0
        summary, violation = single(cfg, out)
    except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"{summary['requests']} requests, {summary['failures']} failures, "
        f"{summary['rps']:.1f} rps ({summary['rps'] * summary['examples_per_request']:,.0f} examples/s), "
        f"p50 {summary['p50_ms']:g} ms, p95 {summary['p95_ms']:g} ms, p99 {summary['p99_ms']:g} ms "
        f"({out / 'summary.json'})"
    )
    if violation:
        print(f"SLO: {violation}", file=sys.stderr)
        return SLO_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
