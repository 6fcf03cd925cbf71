"""The chaos run: its arithmetic on hand-made records, its options, and a short real run
(two TorchServe replicas + gateway under Locust, three faults) whose report must hold up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest import chaos, faults
from loadtest import chaos_report as cr
from recsys_stack import config as rc
from tests.conftest import ROOT, _env

ACCEPT = {"min_success_ratio": 0.99, "max_rotation_s": 3.0, "max_rss_growth": 0.05}


def _calls() -> list[cr.Call]:
    """10 s of calls every 0.1 s, 10 ms each; replica b (:2) out between 4 s and 6.5 s; two
    failures: one started before the fault at 4 s and ended after it (150 ms), one after."""
    calls = []
    for i in range(100):
        t = 100.0 + i * 0.1
        backend = ":1" if i % 2 or 4 <= t - 100 < 6.5 else ":2"
        code = "UNAVAILABLE" if i in (39, 41) else "OK"
        calls.append(cr.Call(t, 150.0 if i == 39 else 10.0, code, backend))
    return calls


def test_recovery_phases_and_verdict_from_records() -> None:
    calls = _calls()
    events = [
        {"event": 1, "fault": "kill-replica", "component": "b", "backend": ":2",
         "at": 104.0, "ready_at": 106.0, "detail": "", "error": ""},
        {"event": 2, "fault": "gateway-takeover", "component": "gateway a", "backend": "",
         "at": 108.0, "ready_at": 108.5, "detail": "", "error": ""},
    ]  # fmt: skip
    ev = cr.recovery(calls, events, 100.0, calls[-1].end)
    # last failure (i=41) ends at 104.1 + 0.01; b's first success after ready is i=66 (106.6)
    assert ev[0]["recover_s"] == pytest.approx(0.11) and ev[0]["ready_s"] == 2.0
    assert ev[0]["rotation_s"] == pytest.approx(0.61) and ev[0]["t_s"] == 4.0
    assert ev[0]["failures_by_code"] == {"UNAVAILABLE": 2}
    assert ev[1]["rotation_s"] is None and ev[1]["recover_s"] == 0.0
    ph = cr.phases(calls, events, 100.0, calls[-1].end)
    # by end time: the call in flight at 4 s counts against the fault
    assert [p["requests"] for p in ph] == [39, 41, 20]
    assert [p["failures"] for p in ph] == [0, 2, 0]
    assert ph[1]["p50_ms"] == 10.0 and ph[1]["success_ratio"] == pytest.approx(39 / 41)
    report = {
        "overall": cr.stats(calls), "events": ev, "phases": ph, "skipped": [],
        "gateways": {"a": cr.rss_growth([(100.0, 100 * cr.MB), (101.0, 100 * cr.MB), (110.0, 104 * cr.MB)], 101.0)},
    }  # fmt: skip
    assert report["gateways"]["a"]["growth"] == pytest.approx(0.04)
    assert report["overall"]["success_ratio"] == 0.98
    assert cr.verdict(report, ACCEPT) == ["success ratio 0.98 < 0.99"]
    late = {**ACCEPT, "min_success_ratio": 0.9, "max_rotation_s": 0.5, "max_rss_growth": 0.03}
    misses = cr.verdict({**report, "skipped": [("pause-replica", "too late")]}, late)
    assert len(misses) == 3 and "back in rotation 0.61 s" in misses[0]
    assert "RSS grew 4.0%" in misses[1] and misses[2].startswith("fault pause-replica")
    assert "2 failed" in cr.table(report)
    text = (
        "# HELP recsys_gateway_backend_hedges_total second copies\n"
        'recsys_gateway_backend_hedges_total{backend="127.0.0.1:1"} 3.0\n'
        'recsys_gateway_backend_hedges_total{backend="127.0.0.1:2"} 4.0\n'
        'recsys_gateway_backend_call_examples_bucket{le="1.0"} 9.0\n'
        "recsys_gateway_backend_call_examples_count 100.0\n"
    )
    counts = faults.scrape_counts(text)
    assert counts == {"backend_calls": 100.0, "hedges": 7.0}
    report["hedges"] = cr.hedges([counts, {"backend_calls": 40.0, "hedges": 0.0}])
    assert report["hedges"] == {"hedges": 7, "backend_calls": 140, "ratio": 0.05}
    assert "hedges 7 of 140 TorchServe calls (5.00%)" in cr.table(report)
    assert cr.verdict(report, {**ACCEPT, "max_hedge_ratio": 0.05}) == ["success ratio 0.98 < 0.99"]
    hedged = cr.verdict(report, {**ACCEPT, "max_hedge_ratio": 0.04})
    assert hedged[-1] == "hedges: 7 of 140 TorchServe calls (5.00%, limit 4%)"


def test_a_fault_after_the_last_call_gets_an_empty_phase_and_the_load_waits_for_it() -> None:
    """CI: a takeover due at 30 s landed at 70.3 s, after a 70 s load's last call (70.1 s),
    and that call was counted in two phases. Now its phase is empty, and the load runs on
    until one interval after the last fault."""
    calls = _calls()
    late = [{"event": 1, "fault": "gateway-takeover", "component": "gateway a", "backend": "",
             "at": calls[-1].end + 0.2, "ready_at": None, "detail": "", "error": ""}]  # fmt: skip
    ph = cr.phases(calls, late, 100.0, calls[-1].end)
    assert [p["requests"] for p in ph] == [len(calls), 0]
    cfg = chaos.ChaosConfig(duration="70s", interval_s=10)
    ev = faults.Event("gateway-takeover", "gateway a", "", 100.0 + 69.0)
    assert chaos.load_end(cfg, [], 100.0) == 170.0 and chaos.load_end(cfg, [ev], 100.0) == 179.0
    with pytest.raises(rc.ConfigError, match="max_extension_s"):
        chaos.ChaosConfig(max_extension_s=-1).check()


def test_options_refused_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert chaos.main(["--schedule", '["kill-worker", "kill-workr"]']) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: schedule: unknown fault 'kill-workr'") and "\n" not in err
    assert chaos.main(["--users", "0"]) == 2
    assert "users = 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        chaos.main(["--help"])
    assert "pause-replica" in capsys.readouterr().out


def _failed_calls(out: Path, phase: dict[str, object], takeover_s: float) -> str:
    """The phase and each failed call (start, s after the first call; ms; code; backend), so
    a failure says when it happened against the takeover, and with what code."""
    calls = chaos.Records(out / "requests").poll()
    t0 = min(c.start for c in calls)
    failed = [f"{c.start - t0:.3f}s {c.ms:.0f}ms {c.code} {c.backend or '-'}"
              for c in calls if not c.ok]  # fmt: skip
    return f"{json.dumps(phase)}; takeover at {takeover_s}s; failed: {'; '.join(failed[:20])}"


@pytest.fixture(scope="module")
def rows_tsv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tsv = tmp_path_factory.mktemp("rows") / "rows.tsv"
    subprocess.run(
        [sys.executable, "-m", "training.data.synthetic", "--rows", "2000", "--out", str(tsv),
         "--no-progress"],
        cwd=ROOT, env=_env(), check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    return tsv


@pytest.mark.slow
def test_short_chaos_run(exported: tuple[Path, Path, str], rows_tsv: Path, tmp_path: Path) -> None:
    """70 s of load, a fault every 10 s (or once the last one recovered): kill a worker of
    replica a (its restart takes 5-15 s, 25-30 s on a busy machine: 45 s left no time for the
    third fault there), pause replica b, take the gateway over.

    Floor: a fault may cost the calls in flight when it hits (at most ``users`` each), never
    the calls after it (failover, graceful takeover); so may the cold start (a fresh worker's
    first TorchScript calls can outlast the gateway's backend deadline): failures <= users x
    (faults + 1). A failover that stops working costs every call for seconds: hundreds.
    """
    export, store, _ = exported
    out, users = tmp_path / "chaos", 4
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.chaos", "--gateway.schema", str(export / "schema.json"),
         "--model-store", str(store), "--data", str(rows_tsv), "--out", str(out),
         "--duration", "70s", "--interval-s", "10", "--users", str(users), "--examples", "20",
         "--schedule", '["kill-worker", "pause-replica", "gateway-takeover"]',
         "--min-success-ratio", "0.5"],  # the floor below is stricter and derived
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    tail = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "report.json").exists(), tail
    report = json.loads((out / "report.json").read_text())
    # 0: every fault injected, every component ready again, every replica back in rotation
    # within 3 s of being ready, gateway RSS growth under 5 %
    assert proc.returncode == 0, tail
    assert report["violations"] == [] and report["skipped"] == []
    events, o = report["events"], report["overall"]
    assert [e["fault"] for e in events] == ["kill-worker", "pause-replica", "gateway-takeover"]
    assert [e["component"] for e in events] == ["a", "b", "gateway a"]
    assert all(e["error"] == "" and e["ready_s"] is not None for e in events), events
    assert events[1]["ready_s"] >= 5.0  # paused for pause_s
    assert "a exited 0" in events[2]["detail"]  # graceful SIGTERM
    assert all(e["rotation_s"] is not None and e["rotation_s"] <= 3.0 for e in events[:2])
    codes = set(o["failures_by_code"])
    assert not codes & {"INTERNAL", "UNKNOWN", "BAD_REPLY"}, o
    assert o["failures"] <= users * (len(events) + 1), o
    # no record lost: Locust counts every call; its stats are final when its run time ends,
    # while calls still finish (and are recorded) during its 2 s stop timeout
    rate = o["requests"] / report["duration_s"]
    assert -users <= o["requests"] - report["locust"]["requests"] <= 2 * rate + users
    phases = report["phases"]
    assert len(phases) == len(events) + 1 and sum(p["requests"] for p in phases) == o["requests"]
    assert all(p["requests"] > 0 and p["p50_ms"] <= p["p99_ms"] <= p["max_ms"] for p in phases)
    # the takeover costs no call: what the stopping gateway's grpc cancels, or a reset connect
    # fails, the users' channel retries (serving/tools/channel.py; tests/serving/test_takeover.py)
    assert phases[-1]["failures"] == 0, _failed_calls(out, phases[-1], events[2]["t_s"])
    # both replicas answered; the gateway that took over served the phases after it
    assert report["ok_by_replica"]["a"] > 0 and report["ok_by_replica"]["b"] > 0
    assert set(report["gateways"]) == {"a", "b"}
    assert all(g["start_mb"] > 0 for g in report["gateways"].values())
    assert (out / "chaos.png").read_bytes()[:4] == b"\x89PNG"
    assert "fault" in proc.stdout and "success" in proc.stdout
