"""Load tests: the summary/knee arithmetic on hand-made run files, and real headless runs on a
stack whose gateway admits at most 150 examples in flight (so that load can be made to fail)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest import report, run
from loadtest.config import seconds
from serving.gateway.validate import Limits
from tests.conftest import ROOT, _env
from tests.stack import running_stack

# The gateway scores at most this many examples at once; one call more waits in the (one)
# tenant's queue of TENANT_QUEUE_CALLS, and past it a call is refused (RESOURCE_EXHAUSTED):
# 2 users x 50 examples always pass, 3 x 100 overload it (the budget is released before a
# reply leaves, so a closed-loop user never meets its own last call).
INFLIGHT_LIMIT = 150
TENANT_QUEUE_CALLS = 1

HISTORY_HEADER = (
    "Timestamp,User Count,Type,Name,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,"
    "99.9%,99.99%,100%,Total Request Count,Total Failure Count,Total Median Response Time,"
    "Total Average Response Time,Total Min Response Time,Total Max Response Time,"
    "Total Average Content Size\n"
)


def _run_files(tmp_path: Path) -> Path:
    """What a Locust run leaves: its once-a-second history CSV and, written as it quit, the
    end-of-run stats (loadtest/tally.py) and two load processes' own counts."""
    prefix = tmp_path / "locust"
    Path(f"{prefix}_stats_history.csv").write_text(
        HISTORY_HEADER
        + "100,0,,Aggregated,0,0,N/A,N/A,N/A,N/A,N/A,N/A,N/A,N/A,N/A,N/A,N/A,0,0,0,0,0,0,0\n"
        + "101,2,,Aggregated,90,0,4,5,5,6,8,12,20,30,70,80,80,90,0,4,5,1,80,420\n"
        + "102,4,,Aggregated,110,1,5,5,5,6,8,12,20,35,70,80,80,200,1,4,5,1,80,420\n"
    )
    # 990 successes, 10 failures (fast refusals and slow deadlines, their own latencies)
    final = {
        "requests": 1000, "failures": 10, "locust_span_s": 14.0, "written_at": 1.0,
        "ok": {"requests": 990, "p50_ms": 4, "p95_ms": 12, "p99_ms": 30, "max_ms": 80.5,
               "min_ms": 1.0, "mean_ms": 5.1},
        "failed": {"requests": 10, "p50_ms": 1, "p95_ms": 5000, "p99_ms": 5000, "max_ms": 5001.2,
                   "min_ms": 0.5, "mean_ms": 3500.0},
        "errors": [
            {"name": "recsys.v1.Ranker/Score (failed)", "error": "GrpcError('DEADLINE_EXCEEDED: Deadline Exceeded')", "occurrences": 7},
            {"name": "recsys.v1.Ranker/Score (failed)", "error": "GrpcError('UNAVAILABLE: backend restarting')", "occurrences": 2},
            {"name": "recsys.v1.Ranker/Score (failed)", "error": "GrpcError('UNAVAILABLE: connection reset')", "occurrences": 1},
        ],
    }  # fmt: skip
    Path(f"{prefix}_final.json").write_text(json.dumps(final))
    ws = {"rows": 512, "sampled": True, "seed": 0, "file_bytes": 10**9, "file_rows_est": 4 * 10**6,
          "distinct_ids": 9000, "source": "x.tsv", "requests": 1024}  # fmt: skip
    for pid, calls, first, last in ((11, 500, 100.0, 109.0), (12, 503, 100.5, 110.0)):
        doc = {"pid": pid, "calls": calls, "failures": 5, "first_call_at": first,
               "last_call_at": last, "working_set": ws}  # fmt: skip
        Path(f"{prefix}_load-{pid}.json").write_text(json.dumps(doc))
    return prefix


def test_summary_is_of_successful_calls_and_failures_fail_the_gate(tmp_path: Path) -> None:
    s = report.summarize(_run_files(tmp_path))
    assert (s["requests"], s["successes"], s["failures"]) == (1000, 990, 10)
    assert s["span_s"] == 10.0 and s["span_from"] == "load processes"  # first start, last end
    assert s["rps"] == 99.0 and s["failed_rps"] == 1.0  # successful calls only
    # percentiles of the successful calls: the 5 s deadlines are reported apart
    assert (s["p50_ms"], s["p95_ms"], s["p99_ms"], s["max_ms"]) == (4, 12, 30, 80.5)
    assert s["failed_latency_ms"] == {"p50_ms": 1, "p99_ms": 5000, "max_ms": 5001.2}
    assert s["failures_by_type"] == {"DEADLINE_EXCEEDED": 7, "UNAVAILABLE": 3}
    # the load processes made 1,003 calls: 3 never reached Locust's final stats, and it says so
    assert s["calls_made"] == 1003 and s["unreported_calls"] == 3 and s["load_processes"] == 2
    assert s["working_set"]["rows"] == 512 and s["working_set"]["sampled"] is True
    assert report.slo_violation(s, p99_ms=30, failure_ratio=0.01) == ""
    assert report.slo_violation(s, p99_ms=29, failure_ratio=0.01) == "p99 30 ms > limit 29 ms"
    both = report.slo_violation(s, 29, 0.001)
    assert (
        both
        == "failure ratio 0.0100 > limit 0.001 (10 of 1,000 calls failed); p99 30 ms > limit 29 ms"
    )
    assert report.slo_violation({**s, "successes": 0, "failure_ratio": 1.0}, None, 1.0) == (
        "no call succeeded"
    )
    line = run.result_line({**s, "examples_per_request": 100})
    assert line.startswith("1,000 calls, 10 failed (1.00%: DEADLINE_EXCEEDED 7, UNAVAILABLE 3)")
    assert "successful: 99.0 calls/s (9,900 examples/s)" in line
    assert "working set 512 rows (of ~4,000,000), 9,000 distinct ids" in line
    assert "3 calls made are missing" in line
    # without the end-of-run stats there is no summary (the once-a-second CSV is not one)
    Path(f"{tmp_path / 'locust'}_final.json").unlink()
    with pytest.raises(ValueError, match="no end-of-run stats"):
        report.summarize(tmp_path / "locust")


def test_the_knee_is_never_a_step_that_fails_its_calls(tmp_path: Path) -> None:
    def step(users: int, rps: float, p99: float, failures: int = 0) -> dict[str, Any]:
        n = int(rps * 10) + failures
        return {"users": users, "rps": rps, "p50_ms": 2, "p99_ms": p99, "requests": n,
                "successes": n - failures, "failures": failures, "failure_ratio": failures / n}  # fmt: skip

    # 8 users: the most successful calls/s and a fast p99 (refusals are quick), 40% failed
    steps = [step(1, 50.0, 5), step(2, 95.0, 9), step(4, 120.0, 40), step(8, 130.0, 30, 870)]
    best = report.knee(steps, p99_ms=50, failure_ratio=0.01)
    assert best is not None and best["users"] == 4
    assert report.knee(steps, p99_ms=50, failure_ratio=0.5)["users"] == 8  # type: ignore[index]
    assert report.knee(steps, p99_ms=1, failure_ratio=0.01) is None
    table = report.steps_table(steps, best).splitlines()
    assert "<- knee" in table[3] and "40.09%" in table[4]

    prefix = _run_files(tmp_path)
    report.plot(Path(f"{prefix}_stats_history.csv"), tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert seconds("10s") == 10 and seconds("2m") == 120 and seconds("7") == 7


@pytest.fixture(scope="module")
def gateway(
    exported: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """TorchServe + the gateway on free ports (tests/stack.py), the gateway's in-flight budget
    :data:`INFLIGHT_LIMIT` examples: what Locust calls."""
    export, store, _ = exported
    limits = Limits(max_inflight_examples=INFLIGHT_LIMIT, tenant_queue_calls=TENANT_QUEUE_CALLS)
    with running_stack(export, store, tmp_path_factory.mktemp("gw"), limits=limits) as st:
        yield st.target


@pytest.fixture(scope="module")
def rows_tsv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tsv = tmp_path_factory.mktemp("rows") / "rows.tsv"
    subprocess.run(
        [sys.executable, "-m", "training.data.synthetic", "--rows", "2000", "--out", str(tsv),
         "--no-progress"],
        cwd=ROOT, env=_env(), check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return tsv


def _loadtest(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loadtest.run", *args],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip


@pytest.mark.slow
def test_headless_run_writes_reports(gateway: str, rows_tsv: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    proc = _loadtest("--host", gateway, "--data", str(rows_tsv), "--examples", "50",
                     "-u", "2", "-r", "2", "-t", "20s", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    # 20 s: at load 20-35 a 10 s run made 0 calls (the users' start took it all)
    assert s["requests"] > 0 and s["failures"] == 0 and s["successes"] == s["requests"], s
    # the figures are Locust's end-of-run stats: every call the load process made
    assert s["calls_made"] == s["requests"] and "unreported_calls" not in s, s
    assert s["rps"] == pytest.approx(s["requests"] / s["span_s"], rel=1e-3)
    # the whole 2,000-row file is the working set (it is smaller than sample_rows)
    ws = s["working_set"]
    assert ws["rows"] == ws["file_rows"] == 2000 and ws["sampled"] is False, ws
    assert ws["distinct_ids"] > 0 and ws["requests"] == 1024
    assert "working set 2,000 rows (all 2,000)" in proc.stdout
    assert s["model_name"] == "dlrm-tiny" and s["model_version"] == "1.0"
    assert s["users"] == 2 and s["examples_per_request"] == 50
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert s["commit"] == head.stdout.strip()  # the commit measured, not "unknown"
    assert s["p50_ms"] <= s["p99_ms"] <= s["max_ms"]
    assert (out / "report.html").stat().st_size > 0
    assert (out / "latency.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "locust_stats_history.csv").exists()


@pytest.mark.slow
def test_an_overloaded_gateway_fails_the_run(gateway: str, rows_tsv: Path, tmp_path: Path) -> None:
    # The acceptance: 8 users of 100 examples against a 150-example budget. Most calls are
    # refused at once; the run fails by default (--slo-failure-ratio 0.01) and says why, with
    # the p99 limit broken too. Two worker processes behind a master: also covers --processes.
    proc = _loadtest("--host", gateway, "--data", str(rows_tsv), "-u", "8", "-r", "8",
                     "-t", "4s", "--processes", "2", "--out", str(tmp_path / "r"),
                     "--slo-p99-ms", "0.001")  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["failure_ratio"] > 0.01 and s["failures_by_type"].get("RESOURCE_EXHAUSTED"), s
    slo = next(line for line in proc.stderr.splitlines() if line.startswith("SLO: "))
    assert slo.startswith(f"SLO: failure ratio {s['failure_ratio']:.4f} > limit 0.01 (")
    assert "p99" in slo and "> limit 0.001 ms" in slo
    # throughput and percentiles of the successful calls only
    assert 0 < s["successes"] == s["requests"] - s["failures"]
    assert s["rps"] == pytest.approx(s["successes"] / s["span_s"], rel=1e-3)
    assert s["p50_ms"] <= s["p99_ms"] <= s["max_ms"]
    assert s["processes"] == 2 and s["load_processes"] == 2
    assert s["workers"] == 2, "the master did not see both load workers"
    # a worker's last report may reach the master late: then the summary says how many
    assert s["calls_made"] - s["requests"] == s.get("unreported_calls", 0) >= 0


@pytest.mark.slow
def test_step_load_finds_a_knee_and_calibration_names_the_bottleneck(
    gateway: str, rows_tsv: Path, tmp_path: Path
) -> None:
    # 100 examples a call: 1 user is within the gateway's budget, 3 are not (one call in
    # flight, one waiting, the third's refused in microseconds): step 3 cannot be the knee.
    out = tmp_path / "steps"
    proc = _loadtest("--host", gateway, "--data", str(rows_tsv), "--step-users", "1,3",
                     "--step-duration", "3s", "--slo-p99-ms", "100000", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    doc = json.loads((out / "steps.json").read_text())
    assert [st["users"] for st in doc["steps"]] == [1, 3]
    assert (out / "step_1").is_dir() and (out / "step_3").is_dir()
    one, two = doc["steps"]
    assert one["failures"] == 0 and two["failure_ratio"] > doc["slo_failure_ratio"] == 0.01, doc
    assert doc["knee"]["users"] == 1 and doc["knee"]["rps"] == one["rps"]
    assert "at 1 users" in proc.stdout
    assert all(st["calls_made"] == st["requests"] for st in doc["steps"]), doc["steps"]
    cal = tmp_path / "cal"
    proc = _loadtest("--host", gateway, "--data", str(rows_tsv), "-u", "2", "-r", "2", "-t", "8s",
                     "--examples", "50", "--calibrate", "--out", str(cal))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    s = json.loads((cal / "summary.json").read_text())
    ceiling = json.loads((cal / "calibration" / "calibration.json").read_text())["rps"]
    assert s["generator_ceiling_rps"] == ceiling > 0
    # the documented rule: server-bound when the run reached under half the generator's ceiling
    assert s["bottleneck"] == ("server" if s["rps"] < 0.5 * ceiling else "generator")


@pytest.mark.slow
def test_calibrate_alone_measures_the_generator_ceiling(rows_tsv: Path, tmp_path: Path) -> None:
    # `python -m loadtest.calibrate` as the README runs it: Locust against the no-op server,
    # every reply validated by the Locust user (a bad one would be a failure). 8 s, not 3: on a
    # loaded 2-core machine Locust's start-up can take the whole of a 3 s run (0 requests).
    out = tmp_path / "cal"
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.calibrate", "-u", "2", "-r", "2", "-t", "8s",
         "--data", str(rows_tsv), "--out", str(out)],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    doc = json.loads((out / "calibration.json").read_text())
    assert doc["users"] == 2 and doc["processes"] == 1, doc
    assert doc["requests"] > 0 and doc["failures"] == 0 and doc["rps"] > 0, doc
    assert f"generator ceiling: {doc['rps']:.1f} rps" in proc.stdout


@pytest.mark.slow
def test_sigterm_stops_the_load_with_its_report(
    gateway: str, rows_tsv: Path, tmp_path: Path
) -> None:
    # A load meant for an hour, ended by SIGTERM once calls are flowing (how a load spans
    # another command: `make loadtest DURATION=1h & ... kill $!`): Locust quits cleanly, the
    # report and summary.json are written, exit 0.
    out = tmp_path / "r"
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadtest.run", "--host", gateway, "--data", str(rows_tsv),
         "--examples", "50", "-u", "2", "-r", "2", "-t", "1h", "--out", str(out)],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    history = out / "locust_stats_history.csv"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        rows = history.read_text().splitlines()[1:] if history.exists() else []
        if any(int(r.split(",")[17]) > 0 for r in rows if r.split(",")[17].isdigit()):
            break  # "Total Request Count" > 0: calls are flowing
        time.sleep(0.5)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout + stderr[-3000:]
    # promptly: a minute at most (an hour-long load; 38.8 s seen at load 20-35 beside make demo)
    assert time.time() - t0 < 90, "the load did not stop promptly"
    s = json.loads((out / "summary.json").read_text())
    assert s["stopped_by"] == "SIGTERM" and s["requests"] > 0 and s["failures"] == 0, s
    assert s["calls_made"] == s["requests"], s  # the calls of the stop timeout counted too
    assert s["started_at"] < s["ended_at"] <= time.time()
    assert "stopped by SIGTERM" in stdout
    assert (out / "report.html").stat().st_size > 0
    assert (out / "latency.png").read_bytes()[:4] == b"\x89PNG"
