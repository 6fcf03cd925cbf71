"""Issue 45's isolation bench, short: one client's abuse must cost another client nothing.

``make bench-isolation`` (serving/bench/isolation.py) in a few rows of ~5 s on the tiny
model: the legitimate client (2 loops of 10-example Score calls over TLS with token A, its own
process) alone, then beside another tenant's largest valid requests at 16 loops, 64 loops of
calls without a token, 8 loops of 4 MiB JSON bombs to REST infer, and 64 loops of plaintext
to the TLS gRPC port (each abuser in its own process). In every row the legitimate client's
success must stay >= 99.9%, and the gateway's log must not grow by more than
:data:`LOG_BOUND` over the rows. The table is printed (``-s``) and is the failure message.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from serving.bench import isolation_report as report
from serving.bench.isolation import IsolationConfig, Row, bench
from serving.torchserve.config import TorchServeConfig

ROWS: list[Row] = ["alone", "max-tenant-16", "no-token", "json-bomb", "plaintext-tls"]
SECONDS = 4.0
# The full bench's bound (2 MB over its 9 rows of 15 s + 2 s of ramp) in proportion to these
# rows' seconds: ~0.5 MB. A line per refused connection or request is what it catches.
LOG_BOUND = int(report.LOG_BYTES * len(ROWS) * (SECONDS + 1) / (9 * (15 + 2)))


def test_abusers_cost_the_legitimate_client_nothing(exported: tuple[Path, Path, str]) -> None:
    export, store, _ = exported
    cfg = IsolationConfig(
        rows=ROWS, seconds=SECONDS, ramp_s=1.0, warmup_s=1.0, export=export, model_store=store,
        torchserve=TorchServeConfig(jvm_args=os.environ.get("RECSYS_TS_JVM_ARGS", "")),
    )  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="iso-", dir="/tmp"))  # short: TorchServe's sockets
    t0 = time.monotonic()
    try:
        with contextlib.ExitStack() as stack:
            result = bench(cfg, work, stack)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = report.table(result)
    print(f"\n{text}\n({time.monotonic() - t0:.0f} s)")
    rows = result["rows"]
    problems = [f"the gateway exited after {rows[-1]['row']}"] if len(rows) < len(ROWS) else []
    problems += [
        f"legitimate success {r['legit']['success_pct']:.2f}% < {report.SUCCESS_PCT}% beside "
        f"{r['row']} ({r['legit']['codes']})"
        for r in rows
        if r["legit"]["success_pct"] < report.SUCCESS_PCT
    ]
    grown = result["run"]["log_growth_bytes"]
    if grown >= LOG_BOUND:
        problems.append(f"the gateway's log grew {grown:,} bytes (bound {LOG_BOUND:,})")
    assert not problems, "\n".join([*problems, text])
