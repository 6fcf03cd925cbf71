"""Load tests: the summary/knee arithmetic on small CSVs, and a real headless run on the stack."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loadtest import report
from loadtest.config import seconds
from tests.conftest import ROOT, _env
from tests.stack import Stack

STATS_HEADER = (
    "Type,Name,Request Count,Failure Count,Median Response Time,Average Response Time,"
    "Min Response Time,Max Response Time,Average Content Size,Requests/s,Failures/s,"
    "50%,66%,75%,80%,90%,95%,98%,99%,99.9%,99.99%,100%\n"
)
HISTORY_HEADER = (
    "Timestamp,User Count,Type,Name,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,"
    "99.9%,99.99%,100%,Total Request Count,Total Failure Count,Total Median Response Time,"
    "Total Average Response Time,Total Min Response Time,Total Max Response Time,"
    "Total Average Content Size\n"
)


def _locust_csvs(tmp_path: Path) -> Path:
    prefix = tmp_path / "locust"
    Path(f"{prefix}_stats.csv").write_text(
        STATS_HEADER
        + "grpc,recsys.v1.Ranker/Score,1000,10,4,5.1,1,80,420,99.5,1.0,4,5,5,6,8,12,20,30,70,80,80\n"
        + ",Aggregated,1000,10,4,5.1,1,80,420,99.5,1.0,4,5,5,6,8,12,20,30,70,80,80\n"
    )
    Path(f"{prefix}_failures.csv").write_text(
        "Method,Name,Error,Occurrences\n"
        "grpc,recsys.v1.Ranker/Score,\"GrpcError('DEADLINE_EXCEEDED: Deadline Exceeded')\",7\n"
        "grpc,recsys.v1.Ranker/Score,\"GrpcError('UNAVAILABLE: backend restarting')\",2\n"
        "grpc,recsys.v1.Ranker/Score,\"GrpcError('UNAVAILABLE: connection reset')\",1\n"
    )
    Path(f"{prefix}_stats_history.csv").write_text(
        HISTORY_HEADER
        + "100,0,,Aggregated,0,0,N/A,N/A,N/A,N/A,N/A,N/A,N/A,N/A,N/A,N/A,N/A,0,0,0,0,0,0,0\n"
        + "101,2,,Aggregated,90,0,4,5,5,6,8,12,20,30,70,80,80,90,0,4,5,1,80,420\n"
        + "102,4,,Aggregated,110,1,5,5,5,6,8,12,20,35,70,80,80,200,1,4,5,1,80,420\n"
    )
    return prefix


def test_summary_slo_knee_and_plot(tmp_path: Path) -> None:
    prefix = _locust_csvs(tmp_path)
    s = report.summarize(prefix)
    assert (s["requests"], s["failures"], s["rps"]) == (1000, 10, 99.5)
    assert (s["p50_ms"], s["p95_ms"], s["p99_ms"], s["max_ms"]) == (4, 12, 30, 80)
    assert s["failures_by_type"] == {"DEADLINE_EXCEEDED": 7, "UNAVAILABLE": 3}
    assert report.slo_violation(s, p99_ms=30, failure_ratio=0.01) == ""
    assert report.slo_violation(s, p99_ms=29, failure_ratio=None) == "p99 30 ms > limit 29 ms"
    assert "failure ratio 0.0100 > limit 0.001" in report.slo_violation(s, None, 0.001)

    steps = [
        {"users": 1, "rps": 50.0, "p50_ms": 2, "p99_ms": 5, "requests": 500, "failures": 0, "failure_ratio": 0.0},
        {"users": 2, "rps": 95.0, "p50_ms": 2, "p99_ms": 9, "requests": 950, "failures": 0, "failure_ratio": 0.0},
        {"users": 4, "rps": 120.0, "p50_ms": 4, "p99_ms": 40, "requests": 1200, "failures": 0, "failure_ratio": 0.0},
        {"users": 8, "rps": 118.0, "p50_ms": 9, "p99_ms": 90, "requests": 1180, "failures": 0, "failure_ratio": 0.0},
    ]  # fmt: skip
    best = report.knee(steps, p99_ms=50)
    assert best is not None and best["users"] == 4
    assert report.knee(steps, p99_ms=1) is None
    assert "<- knee" in report.steps_table(steps, best).splitlines()[3]

    report.plot(Path(f"{prefix}_stats_history.csv"), tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert seconds("10s") == 10 and seconds("2m") == 120 and seconds("7") == 7


@pytest.fixture(scope="module")
def gateway(stack: Stack) -> str:
    """The shared TorchServe + gateway on free ports (tests/stack.py): what Locust calls."""
    return stack.target


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
                     "-u", "2", "-r", "2", "-t", "10s", "--out", str(out),
                     "--slo-failure-ratio", "0")  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["requests"] > 0 and s["failures"] == 0, s
    assert s["model_name"] == "dlrm-tiny" and s["model_version"] == "1.0"
    assert s["users"] == 2 and s["examples_per_request"] == 50
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert s["commit"] == head.stdout.strip()  # the commit measured, not "unknown"
    assert s["p50_ms"] <= s["p99_ms"] <= s["max_ms"]
    assert (out / "report.html").stat().st_size > 0
    assert (out / "latency.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "locust_stats_history.csv").exists()


@pytest.mark.slow
def test_slo_gate_fails_with_an_impossible_limit(
    gateway: str, rows_tsv: Path, tmp_path: Path
) -> None:
    # Two worker processes behind a master: also covers --processes.
    proc = _loadtest("--host", gateway, "--data", str(rows_tsv), "-u", "2", "-r", "2",
                     "-t", "4s", "--processes", "2", "--out", str(tmp_path / "r"),
                     "--slo-p99-ms", "0.001")  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr[-3000:]
    assert "SLO: p99" in proc.stderr and "> limit 0.001 ms" in proc.stderr
    s = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert s["requests"] > 0 and s["processes"] == 2
    assert s["workers"] == 2, "the master did not see both load workers"


@pytest.mark.slow
def test_step_load_finds_a_knee_and_calibration_names_the_bottleneck(
    gateway: str, rows_tsv: Path, tmp_path: Path
) -> None:
    out = tmp_path / "steps"
    proc = _loadtest("--host", gateway, "--data", str(rows_tsv), "--step-users", "1,2",
                     "--step-duration", "3s", "--slo-p99-ms", "100000", "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    doc = json.loads((out / "steps.json").read_text())
    assert [st["users"] for st in doc["steps"]] == [1, 2]
    assert (out / "step_1").is_dir() and (out / "step_2").is_dir()
    passing = [st for st in doc["steps"] if st["requests"] > 0 and st["p99_ms"] <= 100000]
    best = max(passing, key=lambda st: st["rps"])  # the documented rule, recomputed here
    assert doc["knee"]["users"] == best["users"] and doc["knee"]["rps"] == best["rps"]
    assert f"at {best['users']} users" in proc.stdout
    cal = tmp_path / "cal"
    proc = _loadtest("--host", gateway, "--data", str(rows_tsv), "-u", "2", "-r", "2", "-t", "8s",
                     "--calibrate", "--out", str(cal))  # fmt: skip
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
         "-u", "2", "-r", "2", "-t", "1h", "--out", str(out)],
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
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stdout + stderr[-3000:]
    assert time.time() - t0 < 30, "the load did not stop promptly"
    s = json.loads((out / "summary.json").read_text())
    assert s["stopped_by"] == "SIGTERM" and s["requests"] > 0 and s["failures"] == 0, s
    assert s["started_at"] < s["ended_at"] <= time.time()
    assert "stopped by SIGTERM" in stdout
    assert (out / "report.html").stat().st_size > 0
    assert (out / "latency.png").read_bytes()[:4] == b"\x89PNG"
