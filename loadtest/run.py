"""``python -m loadtest.run``: headless Locust against the gateway, with reports and an SLO gate.

    python -m loadtest.run --users 8 --spawn-rate 8 --duration 30s --host 127.0.0.1:50051

writes ``--out`` (default ``reports/<timestamp>/``): Locust's CSVs (``locust_*.csv``) and HTML
report, its end-of-run stats (``locust_final.json``), ``summary.json`` and ``latency.png``
(percentiles and throughput over time). summary.json: calls, failures (ratio, by gRPC code,
their latency), successful calls/s and their p50/p95/p99/max ms, the working set the requests
came from (rows, distinct ids, sampled or the whole file), commit, model name/version as the
gateway reports them, users, examples per request. Its figures are Locust's end-of-run stats,
not its once-a-second CSV; throughput and percentiles count successful calls only.

Exit codes: 0 ok, 1 the gateway or Locust failed, 2 bad options, 3 an SLO limit was broken:
the failure ratio (``--slo-failure-ratio``, default 0.01: a run that fails its calls fails) or
the p99 (``--slo-p99-ms``); the reason is printed in one line.

Step load: ``--step-users 1,2,4,8 --step-duration 10s --slo-p99-ms 50`` runs one load per user
count (into ``step_<users>/``), prints a table and writes ``steps.json`` with the knee: the step
with the highest throughput whose p99 and failure ratio are within the limits (exit 3 when no
step is).

Several load processes: ``--processes N`` (N > 1) starts a Locust master that only aggregates
and N worker processes that generate the load, all on loopback (master port chosen free). Each
Python process tops out at about one core, so use this when the generator is the bottleneck
(``python -m loadtest.calibrate`` measures its ceiling; ``--calibrate`` here runs it first and
adds ``generator_ceiling_rps`` and ``bottleneck`` to summary.json).

SIGINT or SIGTERM ends the load early and cleanly: Locust stops and writes its report,
summary.json says ``stopped_by`` (and ``started_at``/``ended_at`` as always), the exit code is
what the run's own would be; a step load ends with the step it was in. So a load can span
exactly another command: ``make loadtest DURATION=2h & load=$!; <command>; kill $load``.
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
from pathlib import Path
from typing import Any

from loadtest import report
from loadtest.calibrate import ceiling_run
from loadtest.config import ROOT, SHORT_FLAGS, LoadConfig, resolve_data
from loadtest.locust_runner import run_locust, stop_on_signals, stop_requested
from recsys_stack import config as rc

log = logging.getLogger("loadtest")
SLO_EXIT = 3


def model_info(host: str, data: Path, examples: int) -> dict[str, str]:
    """One Score call: the model name and version the gateway serves (fails fast when down)."""
    import grpc

    from loadtest.payload import first_request
    from serving.tools.channel import from_env
    from serving.tools.client import RankerClient

    token = os.environ.get("RECSYS_AUTH_TOKEN") or None  # what the Locust users send
    client = RankerClient(host, timeout=10, token=token, channel=from_env())
    try:
        reply = client.stub.Score(
            first_request(data, examples), timeout=10, metadata=client.metadata
        )
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
    steps: list[dict[str, Any]] = []
    for u in cfg.step_users:
        if stop_requested() and steps:
            break
        d = out / f"step_{u}"
        s = run_locust(cfg, cfg.host, u, cfg.step_duration, d, spawn_rate=float(u))
        report.plot(d / "locust_stats_history.csv", d / "latency.png", f"{u} users")
        steps.append({"users": u, **s})
    best = report.knee(steps, cfg.slo_p99_ms, cfg.slo_failure_ratio)
    doc = {"commit": git_commit(), **info, "examples_per_request": cfg.examples,
           "slo_p99_ms": cfg.slo_p99_ms, "slo_failure_ratio": cfg.slo_failure_ratio,
           "working_set": steps[0].get("working_set") if steps else None,
           "steps": steps, "knee": best}  # fmt: skip
    (out / "steps.json").write_text(json.dumps(doc, indent=2) + "\n")
    return steps, best


def result_line(s: dict[str, Any]) -> str:
    """The run in one line: calls and failures, then what the successful calls did."""
    ok = (
        f"successful: {s['rps']:.1f} calls/s ({s['rps'] * s['examples_per_request']:,.0f} "
        f"examples/s), p50 {s['p50_ms']:g} ms, p95 {s['p95_ms']:g} ms, p99 {s['p99_ms']:g} ms"
        if s["successes"]
        else "no call succeeded"
    )
    failed = ", ".join(f"{k} {v:,}" for k, v in sorted(s["failures_by_type"].items()))
    ws = s.get("working_set") or {}
    line = (
        f"{s['requests']:,} calls, {s['failures']:,} failed ({s['failure_ratio']:.2%}"
        + (f": {failed}" if failed else "")
        + f"); {ok}"
    )
    if ws:
        of = f"all {ws['file_rows']:,}" if "file_rows" in ws else f"of ~{ws['file_rows_est']:,}"
        line += f"; working set {ws['rows']:,} rows ({of}), {ws['distinct_ids']:,} distinct ids"
    if s.get("data"):
        line += f"; rows of {s['data']}"
    if s.get("unreported_calls"):
        line += f"; {s['unreported_calls']:,} calls made are missing from Locust's final stats"
    return line + (f", stopped by {s['stopped_by']}" if "stopped_by" in s else "")


def build_parser() -> argparse.ArgumentParser:
    p = rc.ArgumentParser(
        prog="python -m loadtest.run",
        description=__doc__.split("\n\n")[0],
        epilog="Exit codes: 0 ok, 1 the gateway or Locust failed, 2 bad options, 3 an SLO broken.",
    )
    return rc.add_config_args(p, LoadConfig, short=SHORT_FLAGS)


def parse_args(argv: Sequence[str] | None = None) -> LoadConfig:
    """The command line (+ --config file + RECSYS_GATEWAY) -> a checked LoadConfig."""
    cfg = rc.from_args(LoadConfig, build_parser().parse_args(argv))
    cfg.check()
    return cfg


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = parse_args(argv)
        resolve_data(cfg)
    except rc.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = cfg.out or ROOT / "reports" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    stop_on_signals()
    (out / "config.json").write_text(json.dumps(rc.to_dict(cfg), indent=2) + "\n")
    try:
        if cfg.step_users:
            steps, best = step_load(cfg, out)
            print(report.steps_table(steps, best))
            if best is None:
                print(
                    f"SLO: no step has p99 <= {cfg.slo_p99_ms:g} ms and a failure ratio <= "
                    f"{cfg.slo_failure_ratio:g}",
                    file=sys.stderr,
                )
                return SLO_EXIT
            print(
                f"knee: {best['rps']:.1f} successful calls/s at {best['users']} users "
                f"({best['failure_ratio']:.2%} failed; {out / 'steps.json'})"
            )
            return 0
        summary, violation = single(cfg, out)
    except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(result_line(summary) + f" ({out / 'summary.json'})")
    if violation:
        print(f"SLO: {violation}", file=sys.stderr)
        return SLO_EXIT
    return 0


if __name__ == "__main__":
    sys.exit(main())
