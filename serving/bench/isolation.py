"""``make bench-isolation`` (``python -m serving.bench.isolation``): does one client's abuse
cost another client anything? (issue 45's acceptance bench)

One TorchServe and one gateway (TLS, a token file of two tokens, KServe v2 REST on, metrics on
their own port, the gateway's soft open-files limit ``--gateway-nofile``) on one model. A
legitimate client (its own process: ``--legit-loops`` closed loops of ``--legit-examples``-
example ``Score`` calls over TLS with token A) is measured alone, then beside each abuser in
turn (:mod:`serving.bench.isolation_abusers`, each in its own process), ``--seconds`` per row,
in one run. Per row: the legitimate calls, success %, p50/p99 of the successful ones and the
p99 over the p99 alone; the abuser's calls and outcomes; the gateway's log growth and CPU; the
load average. For the run: the gateway's log growth and RSS at start and end, and the targets
met or not (serving/bench/isolation_report.py). Writes ``--out``/isolation-<time>.json and
.md (the markdown table for docs/bench.md); ``--save`` also copies the JSON to docs/results/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

from recsys_stack import logs
from recsys_stack.config import ConfigError, parse
from serving.bench import isolation_report as report
from serving.bench.isolation_load import Client
from serving.bench.isolation_stack import ROOT, Stack, max_request, start_stack, tiny_model
from serving.bench.model import Model, payload
from serving.bench.run import stopping_all
from serving.gateway.config import GatewayConfig
from serving.torchserve.config import TorchServeConfig

logger = logging.getLogger(__name__)
RAMP_WAIT_S = 60.0
DESCRIPTION = (
    "Isolation bench (issue 45): a legitimate client (2 loops of 10-example Score calls over TLS"
    " with token A, its own process) measured alone, then beside each abuser in turn (its own"
    " process): another tenant's largest valid requests at 16 and 64 loops, calls without a"
    " token, 1,100 idle TLS connections against the gateway's soft open-files limit of 1,024,"
    " /metrics scrapes, 4 MiB JSON bombs to REST infer, malformed HTTP, plaintext to the TLS"
    " port. Per row: legitimate calls, success %, p50/p99 and p99 over p99 alone, the abuser's"
    " outcomes, the gateway's log growth and CPU, the load; for the run: log growth and RSS at"
    " start and end against the targets (>= 99.9%, <= 2x, < 2 MB, <= 1.5x). Writes --out/"
    "isolation-<time>.json and .md (--save: the JSON in docs/results/ too). Short run: --seconds"
    " 5 --rows alone,max-tenant-16,json-bomb."
)
Row = Literal["alone", "max-tenant-16", "max-tenant-64", "no-token", "idle-conns",
              "metrics-scrape", "json-bomb", "malformed-http", "plaintext-tls"]  # fmt: skip
ROWS: list[Row] = ["alone", "max-tenant-16", "max-tenant-64", "no-token", "idle-conns",
                   "metrics-scrape", "json-bomb", "malformed-http", "plaintext-tls"]  # fmt: skip


@dataclass
class IsolationConfig:
    """The legitimate client alone, then beside each abuser in turn, on one gateway."""

    rows: list[Row] = field(default_factory=lambda: list(ROWS))
    """Rows, in order (``alone`` first: the p99 ratios need it). ``max-tenant-16``/``-64``:
    token B sending the largest valid requests at 16/64 loops; ``no-token``: ``--flood-loops``
    loops of calls without a token; ``idle-conns``: ``--idle-connections`` idle TLS connections;
    ``metrics-scrape``: ``--flood-loops`` loops of GET /metrics; ``json-bomb``: ``--bomb-loops``
    loops of a ``--bomb-bytes`` ``[{},{},...]`` body to REST infer with token B;
    ``malformed-http``: ``--flood-loops`` loops of broken HTTP/1.1 requests to the REST port;
    ``plaintext-tls``: ``--flood-loops`` loops of plaintext HTTP/2 to the TLS gRPC port."""
    seconds: float = 15.0
    """Seconds the legitimate client is measured in each row."""
    ramp_s: float = 2.0
    """Seconds each abuser runs before the legitimate client's clock starts."""
    warmup_s: float = 3.0
    """Untimed seconds of the legitimate client before the first row."""
    legit_loops: int = 2
    """The legitimate client's closed loops (threads, one TLS connection each)."""
    legit_examples: int = 10
    """Examples per legitimate call (rows of the export's sample)."""
    legit_timeout_s: float = 5.0
    """Deadline of each legitimate call."""
    legit_retries: bool = True
    """The legitimate client retries UNAVAILABLE/CANCELLED as our tools' channels do
    (serving/tools/channel.py); off: every failure counts."""
    flood_loops: int = 64
    """Loops of the ``no-token``, ``metrics-scrape``, ``malformed-http`` and ``plaintext-tls``
    abusers."""
    bomb_loops: int = 8
    """Loops of the ``json-bomb`` abuser."""
    bomb_bytes: int = 4 << 20
    """Size of each JSON bomb."""
    idle_connections: int = 1100
    """Idle TLS connections the ``idle-conns`` abuser holds."""
    abuser_timeout_s: float = 10.0
    """An abuser's wait for an answer before counting ``timeout``."""
    gateway_nofile: int = 1024
    """The gateway's soft open-files limit (hard unchanged); 0 = inherited."""
    gateway_code: Path | None = None
    """The checkout whose ``serving/`` the gateway runs (first on its PYTHONPATH): another
    worktree's gateway measured by this bench; default this checkout (not the venv's editable
    install, which may point elsewhere)."""
    export: Path | None = None
    """An export folder whose ``<name>-<version>.mar`` is in ``--model-store`` (default: train
    ``--preset`` for ``--train-steps`` steps and export it, ~15 s for tiny)."""
    model_store: Path | None = None
    """The model store holding ``--export``'s .mar (default: the export's run's ``store``)."""
    preset: Literal["tiny", "demo"] = "tiny"
    """The preset trained when no ``--export`` is given."""
    train_steps: int = 30
    """Steps it is trained."""
    out: Path = Path("reports/bench-isolation")
    """Where isolation-<time>.json and .md go."""
    save: bool = False
    """Also copy the JSON to docs/results/isolation-<date>.json."""
    startup_timeout_s: float = 300.0
    """Longest wait for TorchServe and the gateway to be ready."""
    torchserve: TorchServeConfig = field(default_factory=TorchServeConfig)
    """TorchServe as ``make serve`` starts it (ports, model, workdir set by the bench)."""
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    """The gateway as ``make serve`` starts it (ports, TLS, tokens, backend set by the bench)."""

    def __post_init__(self) -> None:
        if not self.rows:
            raise ValueError("rows: name at least one of " + ", ".join(ROWS))
        if min(self.seconds, self.legit_timeout_s, self.abuser_timeout_s) <= 0:
            raise ValueError("seconds and the timeouts must be > 0")
        if min(self.ramp_s, self.warmup_s) < 0:
            raise ValueError("ramp_s and warmup_s must be >= 0")
        if min(self.legit_loops, self.legit_examples, self.flood_loops, self.bomb_loops) < 1:
            raise ValueError("legit_loops, legit_examples, flood_loops, bomb_loops: >= 1")


def abuser_of(row: str, cfg: IsolationConfig) -> tuple[str, int] | None:
    """``(kind, loops)`` of a row's abuser (connections for ``idle-conns``); None alone."""
    if row == "alone":
        return None
    if row.startswith("max-tenant-"):
        return "max-tenant", int(row.rsplit("-", 1)[1])
    if row == "json-bomb":
        return row, cfg.bomb_loops
    if row == "idle-conns":
        return row, cfg.idle_connections
    return row, cfg.flood_loops


def specs(cfg: IsolationConfig, up: Stack) -> dict[str, Any]:
    """What every client is told (``role`` and ``loops`` added per client)."""
    return {"target": up.target, "http_port": up.gateway.http_port,
            "metrics_port": up.gateway.metrics.port, "ca": str(up.ca),
            "model_name": up.model_name, "bomb_bytes": cfg.bomb_bytes,
            "timeout_s": cfg.abuser_timeout_s, "retries": cfg.legit_retries}  # fmt: skip


def legit_spec(
    cfg: IsolationConfig, up: Stack, files: dict[str, Path], seconds: float
) -> dict[str, Any]:
    return {**specs(cfg, up), "role": "legit", "loops": cfg.legit_loops, "seconds": seconds,
            "token": up.tokens[0], "request": str(files["legit"]),
            "timeout_s": cfg.legit_timeout_s}  # fmt: skip


def run_row(
    row: str, cfg: IsolationConfig, up: Stack, files: dict[str, Path], work: Path
) -> dict[str, Any]:
    """One row: the abuser (if any) started, ``ramp_s`` later the legitimate client measured
    for ``seconds``, then the abuser stopped; the row's figures."""
    abuse = abuser_of(row, cfg)
    with contextlib.ExitStack() as procs:
        legit = Client(legit_spec(cfg, up, files, cfg.seconds), work / f"{row}-legit.err", procs)
        abuser = None
        if abuse:
            spec = {**specs(cfg, up), "role": abuse[0], "loops": abuse[1],
                    "connections": cfg.idle_connections, "token": up.tokens[1],
                    "request": str(files["max" if abuse[0] == "max-tenant" else "legit"])}  # fmt: skip
            abuser = Client(spec, work / f"{row}-abuser.err", procs)
        for c in (legit, abuser):
            if c is not None:
                c.wait_for("ready", 120)
        log0, cpu0, t0 = up.log_bytes(), up.cpu_s(), time.monotonic()
        if abuser is not None:
            abuser.send("go")
            # idle-conns: every connection tried once (handshakes the gateway cannot take
            # time out one by one: after RAMP_WAIT_S the row runs with what is open)
            if not abuser.wait_for("ramped", RAMP_WAIT_S, required=False):
                logger.warning("%s: not at full strength after %.0f s", row, RAMP_WAIT_S)
            time.sleep(cfg.ramp_s)
        legit.send("go")
        legit_out = legit.figures(cfg.seconds + 120)
        ab_out = None
        if abuser is not None:
            abuser.send("stop")
            ab_out = abuser.figures(30)
            ab_out["label"] = f"{abuse[0]} x{abuse[1]:,}" if abuse else "-"
    return {
        "row": row,
        "legit": report.legit_figures(legit_out),
        "abuser": ab_out,
        "seconds": time.monotonic() - t0,
        "log_growth_bytes": up.log_bytes() - log0,
        "gateway_cpu_s": up.cpu_s() - cpu0,
        "gateway_rss": up.rss(),
        "loadavg": os.getloadavg(),
    }


def _commit() -> str:
    proc = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    return proc.stdout.strip()


def bench(cfg: IsolationConfig, work: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    """Start the stack, run every row; ``{"rows", "run", "settings"}``."""
    load_before = os.getloadavg()
    if cfg.export is None:
        logger.info("building the %s model (%d steps)", cfg.preset, cfg.train_steps)
        export, store = tiny_model(work / "model", cfg.preset, cfg.train_steps)
    else:
        export, store = cfg.export, cfg.model_store or cfg.export.parent.parent / "store"
    model = Model.load(export)
    limits = cfg.gateway.limits
    files = {"legit": work / "legit.bin", "max": work / "max.bin"}
    files["legit"].write_bytes(payload(model, cfg.legit_examples).score.SerializeToString())
    files["max"].write_bytes(max_request(model, limits.max_examples, limits.max_ids_per_feature))
    logger.info("starting TorchServe and the gateway (TLS, 2 tokens, soft nofile %s)",
                cfg.gateway_nofile or "inherited")  # fmt: skip
    up = start_stack(export, store, (model.name, model.version), cfg.torchserve, cfg.gateway,
                     work, cfg.gateway_nofile, cfg.startup_timeout_s, stack,
                     (cfg.gateway_code or ROOT).resolve())  # fmt: skip
    clients = work / "clients"
    clients.mkdir()
    if cfg.warmup_s:
        with contextlib.ExitStack() as procs:
            warm = Client(legit_spec(cfg, up, files, cfg.warmup_s), clients / "warm.err", procs)
            warm.wait_for("ready", 120)
            warm.send("go")
            warm.figures(cfg.warmup_s + 120)
    rss_start, log_start = up.rss(), up.log_bytes()
    rows: list[dict[str, Any]] = []
    for i, row in enumerate(cfg.rows, 1):
        logger.info("[%d/%d] %s: running (%.0f s)", i, len(cfg.rows), row, cfg.ramp_s + cfg.seconds)
        rows.append(run_row(row, cfg, up, files, clients))
        report.add_ratios(rows)
        logger.info("%s", report.row_line(i, len(cfg.rows), rows[-1]))
        if up.proc.poll() is not None:
            logger.error(
                "the gateway exited with code %s: rows after %s skipped", up.proc.returncode, row
            )
            break
    soft, hard = (
        psutil.Process(up.proc.pid).rlimit(psutil.RLIMIT_NOFILE)
        if up.proc.poll() is None
        else (None, None)
    )
    run = {"rss_start": rss_start, "rss_end": up.rss(), "log_bytes_start": log_start,
           "log_bytes_end": up.log_bytes(), "log_growth_bytes": up.log_bytes() - log_start,
           "gateway_exit": up.proc.poll()}  # fmt: skip
    settings = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": _commit(),
        "gateway_code": up.gateway_code,
        "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "model": {"name": model.name, "version": model.version, "export": str(export),
                  "served_variant": model.schema.get("served_variant")},
        "torchserve_workers": up.torchserve_workers, "gateway_nofile": [soft, hard],
        "limits": dataclasses.asdict(limits), "max_request_bytes": files["max"].stat().st_size,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items()
                   if k not in ("torchserve", "gateway")},
    }  # fmt: skip
    return {"rows": rows, "run": run, "settings": json.loads(json.dumps(settings, default=str))}


def keep_logs(work: Path, dest: Path) -> None:
    """The gateway's log and the clients' stderr, kept past the scratch folder (a failed run's
    first place to look; the log's growth is one of the figures)."""
    dest.mkdir(parents=True, exist_ok=True)
    for src in (work / "gateway-logs", work / "clients"):
        if src.is_dir():
            shutil.copytree(src, dest / src.name, dirs_exist_ok=True)


def write(result: dict[str, Any], out: Path, stamp: str, save: bool) -> list[Path]:
    """The JSON and the markdown table in ``out`` (and the JSON in docs/results/ with ``save``)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"isolation-{stamp}.json", out / f"isolation-{stamp}.md"]
    paths[0].write_text(json.dumps(result, indent=2) + "\n")
    paths[1].write_text(report.markdown(result) + "\n")
    if save:
        paths.append(ROOT / "docs" / "results" / f"isolation-{time.strftime('%Y-%m-%d')}.json")
        shutil.copyfile(paths[0], paths[-1])
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``make bench-isolation``)."""
    try:
        cfg = parse(IsolationConfig, argv, "python -m serving.bench.isolation", DESCRIPTION)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logs.configure(fmt="%(asctime)s %(message)s")
    stamp = time.strftime("%Y%m%d-%H%M%S")

    def body(work: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
        stack.callback(keep_logs, work, cfg.out / f"isolation-{stamp}-logs")  # before rmtree
        return bench(cfg, work, stack)

    result = stopping_all("isobench-", body)
    if isinstance(result, int):
        return result
    print(report.table(result))
    print()
    print(report.markdown(result))
    for path in write(result, cfg.out, stamp, cfg.save):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
