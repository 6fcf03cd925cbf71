"""The feature log and ``Feedback`` against real gateways and a real TorchServe (one for the
module): what is logged is what was scored, from every front door; clicks are checked all or
nothing and written; a gateway without the log refuses them; a full queue drops and counts
without failing a call; SIGTERM closes the files with every record in them."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from recsys_stack.net import free_ports
from recsys_stack.online import CLICKS, IMPRESSIONS, OPT_OUT_HEADER, criteo_row
from serving.gateway.config import AuthConfig, MetricsConfig
from serving.gateway.featurelog import FeatureLogConfig
from serving.stubs import ranker_pb2, ranker_pb2_grpc
from serving.tools.client import build_request
from serving.worker.codec import to_rows
from tests.stack import (
    gateway_metrics,
    running_torchserve,
    start_gateway,
    stop_gateway,
    wait_status,
)

pytestmark = pytest.mark.slow
TOKEN = "flog-token-" + "f" * 24
AUTH = (("authorization", f"Bearer {TOKEN}"),)
MODEL = "dlrm-tiny"
PREFIX = "recsys_gateway_feature_log"


@dataclass
class Gateway:
    target: str
    http: int
    metrics: int
    dir: Path
    proc: Any

    def stub(self) -> Any:
        return ranker_pb2_grpc.RankerStub(grpc.insecure_channel(self.target))

    def post(
        self, path: str, doc: Any, token: str | None = TOKEN, headers: dict[str, str] | None = None
    ) -> tuple[int, Any]:
        headers = {**({"Authorization": f"Bearer {token}"} if token else {}), **(headers or {})}
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}{path}",
                                     data=json.dumps(doc).encode(), headers=headers)  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())


@dataclass
class Loop:
    on: Gateway  # feature log on, files closed after 0.5 s
    off: Gateway  # feature log off
    rows: dict[str, np.ndarray]
    ts: Any


def _start(export: Path, ts: Any, work: Path, name: str, **flog: Any) -> Gateway:
    folder = work / name
    folder.mkdir()
    http, metrics = free_ports(2)
    proc, target = start_gateway(
        export / "schema.json", [ts], folder / "gateway.log", deadline_s=10.0, http_port=http,
        auth=AuthConfig(token_file=str(work / "tokens")), metrics=MetricsConfig(port=metrics),
        feature_log=FeatureLogConfig(dir=str(folder / "flog"), **flog),
    )  # fmt: skip
    return Gateway(target, http, metrics, folder / "flog", proc)


@pytest.fixture(scope="module")
def loop(
    exported: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Loop]:
    export, store, _ = exported
    work = tmp_path_factory.mktemp("flog")
    (work / "tokens").write_text(TOKEN + "\n")
    s = np.load(export / "sample.npz")
    rows = {k: s[k] for k in s.files}
    rows["sparse"] = to_rows(rows["values"], rows["lengths"])
    with running_torchserve(store, work / "ts", workers=1, response_timeout_s=60) as (ts, _):
        on = _start(export, ts, work, "on", enabled=True, max_file_age_s=0.5)
        off = _start(export, ts, work, "off")
        try:
            for g in (on, off):
                wait_status(g.target, "SERVING", 120)
            yield Loop(on, off, rows, ts)
        finally:
            assert stop_gateway(on.proc) == 0 and stop_gateway(off.proc) == 0


def records(folder: Path, kind: str) -> list[dict[str, Any]]:
    """Every record of the closed ``kind`` files under ``folder``."""
    return [json.loads(line) for p in sorted((folder / kind).glob(f"{kind}-*.jsonl"))
            for line in p.read_text().splitlines()]  # fmt: skip


def wait_for(get: Callable[[], list[dict[str, Any]]], ok: Callable[[list[Any]], bool]) -> list[Any]:
    deadline = time.monotonic() + 60
    while not ok(got := get()):
        assert time.monotonic() < deadline, f"never there: {got[-3:]}"
        time.sleep(0.2)
    return got


def _score(g: Gateway, dense: np.ndarray, sparse: np.ndarray) -> Any:
    return g.stub().Score(build_request(dense, sparse), metadata=AUTH, timeout=30)


def _row(dense: np.ndarray, sparse: np.ndarray) -> str | None:
    return criteo_row(dense.tolist(), [[int(i)] if i >= 0 else [] for i in sparse])


def test_what_is_logged_is_what_was_scored(loop: Loop) -> None:
    dense, sparse = loop.rows["dense"][:40].copy(), loop.rows["sparse"][:40]
    dense[5, 0] = 0.5  # a dense value no Criteo row holds: logged as arrays
    reply = _score(loop.on, dense, sparse)
    rid = reply.request_id
    assert rid.split(".")[2] == "40"
    got = wait_for(lambda: [r for r in records(loop.on.dir, IMPRESSIONS)
                            if r["request_id"] == rid], lambda g: len(g) == 40)  # fmt: skip
    by = {r["example"]: r for r in got}
    assert sorted(by) == list(range(40))
    for k, r in by.items():
        assert np.float32(r["score"]) == np.float32(reply.scores[k])
        assert (r["model"], r["version"]) == (MODEL, reply.model_version)
        if k == 5:
            assert r["row"] is None and r["dense"][0] == 0.5
            assert r["sparse"] == [[int(i)] if i >= 0 else [] for i in sparse[5]]
        else:
            assert r["row"] == _row(dense[k], sparse[k]) is not None
    assert not [p for p in (loop.on.dir / IMPRESSIONS).iterdir() if p.suffix == ".jsonl"
                and p.name.startswith(".") is False and p.stat().st_size == 0]  # fmt: skip


def test_a_call_that_opts_out_is_scored_and_not_logged(loop: Loop) -> None:
    """``make score``, ``make evaluate`` and a rollout's gate score rows that are not traffic:
    they send ``x-recsys-feature-log: off`` (RankerClient(log=False)), or their rows would
    become training rows with no click."""
    dense, sparse = loop.rows["dense"][:3], loop.rows["sparse"][:3]
    quiet = loop.on.stub().Score(build_request(dense, sparse), timeout=30,
                                 metadata=(*AUTH, (OPT_OUT_HEADER, "off")))  # fmt: skip
    logged = _score(loop.on, dense, sparse)  # after it: once its lines are there, so would be
    assert len(quiet.scores) == 3 and quiet.request_id  # the quiet call's (one writer, in order)
    wait_for(lambda: [r for r in records(loop.on.dir, IMPRESSIONS)
                      if r["request_id"] == logged.request_id], lambda g: len(g) == 3)  # fmt: skip
    assert not [r for r in records(loop.on.dir, IMPRESSIONS) if r["request_id"] == quiet.request_id]


def test_kserve_http_logs_too_and_answers_the_request_id(loop: Loop) -> None:
    ids = loop.rows["sparse"][:3].T
    inputs = [
        {"name": "dense", "datatype": "FP32", "shape": [3, 13],
         "data": loop.rows["dense"][:3].reshape(-1).tolist()},
        {"name": "values", "datatype": "INT64", "shape": [int((ids >= 0).sum())],
         "data": ids[ids >= 0].tolist()},
        {"name": "lengths", "datatype": "INT32", "shape": [26, 3],
         "data": (ids >= 0).astype(int).reshape(-1).tolist()},
    ]  # fmt: skip
    status, doc = loop.on.post(f"/v2/models/{MODEL}/infer", {"inputs": inputs})
    assert status == 200, doc
    rid = doc["parameters"]["request_id"]
    assert doc["id"] == rid  # no id of the client's: ours
    status, doc = loop.on.post(f"/v2/models/{MODEL}/infer", {"id": "mine", "inputs": inputs})
    assert doc["id"] == "mine" and doc["parameters"]["request_id"].count(".") == 3
    # the opt-out holds at this door too (an HTTP header, its name in any case)
    status, doc = loop.on.post(f"/v2/models/{MODEL}/infer", {"inputs": inputs},
                               headers={"X-Recsys-Feature-Log": "off"})  # fmt: skip
    assert status == 200, doc
    quiet = doc["parameters"]["request_id"]
    last = loop.on.post(f"/v2/models/{MODEL}/infer", {"inputs": inputs})[1]["parameters"]
    got = wait_for(lambda: [r for r in records(loop.on.dir, IMPRESSIONS)
                            if r["request_id"] in (rid, last["request_id"])],
                   lambda g: len(g) == 6)  # fmt: skip
    assert not [r for r in records(loop.on.dir, IMPRESSIONS) if r["request_id"] == quiet]
    got = [r for r in got if r["request_id"] == rid]
    assert [r["row"] for r in sorted(got, key=lambda r: r["example"])] == [
        _row(loop.rows["dense"][k], loop.rows["sparse"][k]) for k in range(3)]  # fmt: skip


def _click(rid: str, example: int = 0, label: int = 1, t: int = 0) -> Any:
    return ranker_pb2.Click(request_id=rid, example=example, label=label, event_time_ms=t)


def test_feedback_is_checked_all_or_nothing_and_written(loop: Loop) -> None:
    g = loop.on
    rid = _score(g, loop.rows["dense"][:10], loop.rows["sparse"][:10]).request_id
    issued = int(rid.split(".")[0], 36)
    stub = g.stub()
    reply = stub.Feedback(ranker_pb2.FeedbackRequest(
        clicks=[_click(rid, 3), _click(rid, 9, 0, issued + 5)]), metadata=AUTH, timeout=30)  # fmt: skip
    assert reply.accepted == 2
    status, doc = g.post("/v1/feedback", {"clicks": [{"request_id": rid, "example": 4,
                                                      "label": 1}]})  # fmt: skip
    assert (status, doc) == (200, {"accepted": 1})
    got = wait_for(lambda: [c for c in records(g.dir, CLICKS) if c["request_id"] == rid],
                   lambda c: len(c) == 3)  # fmt: skip
    assert sorted((c["example"], c["label"]) for c in got) == [(3, 1), (4, 1), (9, 0)]
    assert [c["event_time_ms"] for c in got if c["example"] == 9] == [issued + 5]
    forged = rid[:-1] + ("0" if rid[-1] != "0" else "1")
    now = int(time.time() * 1000)
    bad = [
        (_click("nonsense"), "clicks[1].request_id 'nonsense' is not a request id"),
        (_click(forged), "clicks[1].request_id"),
        (_click(rid, 10), "clicks[1].example: 10, but request"),
        (_click(rid, 0, 2), "clicks[1].label: 2, not 0 or 1"),
        (_click(rid, 0, 1, issued - 1), "clicks[1].event_time_ms"),
        (_click(rid, 0, 1, now + 120_000), "more than 60 s after"),
    ]
    for click, why in bad:  # the good click before it is refused with it
        with pytest.raises(grpc.RpcError) as e:
            stub.Feedback(ranker_pb2.FeedbackRequest(clicks=[_click(rid, 7), click]),
                          metadata=AUTH, timeout=30)  # fmt: skip
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in e.value.details()
    assert "not issued by this stack" in _details(stub, _click(forged))
    with pytest.raises(grpc.RpcError) as e:
        stub.Feedback(ranker_pb2.FeedbackRequest(clicks=[_click(rid)] * 1001), metadata=AUTH)
    assert "at most 1000" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        stub.Feedback(ranker_pb2.FeedbackRequest(clicks=[_click(rid)]), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    status, doc = g.post("/v1/feedback", {"clicks": [{"request_id": rid, "example": "1",
                                                      "label": 1}]})  # fmt: skip
    assert status == 400 and "clicks[0].example" in doc["error"]
    assert g.post("/v1/feedback", {"clicks": []}, token="wrong")[0] == 401
    time.sleep(1.5)  # files close after 0.5 s: a refused click would be in view by now
    assert not [c for c in records(g.dir, CLICKS) if c["example"] == 7]
    m = gateway_metrics(g.metrics)
    assert m[(f"{PREFIX}_clicks_accepted_total", ())] == 3
    assert m[(f"{PREFIX}_clicks_refused_total", (("reason", "invalid"),))] >= len(bad) * 2
    assert m[(f"{PREFIX}_impressions_total", ())] >= 10
    assert m[(f"{PREFIX}_files_closed_total", (("kind", CLICKS),))] >= 1


def _details(stub: Any, click: Any) -> str:
    with pytest.raises(grpc.RpcError) as e:
        stub.Feedback(ranker_pb2.FeedbackRequest(clicks=[click]), metadata=AUTH, timeout=30)
    return str(e.value.details())


def test_without_the_log_feedback_says_how_to_turn_it_on(loop: Loop) -> None:
    reply = _score(loop.off, loop.rows["dense"][:2], loop.rows["sparse"][:2])
    assert reply.request_id.split(".")[2] == "2"  # ids all the same
    with pytest.raises(grpc.RpcError) as e:
        loop.off.stub().Feedback(ranker_pb2.FeedbackRequest(clicks=[_click(reply.request_id)]),
                                 metadata=AUTH, timeout=30)  # fmt: skip
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "feature_log.enabled" in e.value.details()
    status, doc = loop.off.post("/v1/feedback", {"clicks": []})
    assert status == 400 and "feature_log.enabled" in doc["error"]
    assert not loop.off.dir.exists()


def test_a_full_queue_drops_without_failing_calls_and_sigterm_writes_the_rest(
    loop: Loop, exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    (tmp_path / "tokens").write_text(TOKEN + "\n")
    g = _start(exported[0], loop.ts, tmp_path, "q", enabled=True, queue_examples=50,
               max_file_age_s=3600.0)  # fmt: skip
    try:
        wait_status(g.target, "SERVING", 120)
        kept = [_score(g, loop.rows["dense"][:10], loop.rows["sparse"][:10]).request_id
                for _ in range(3)]  # fmt: skip
        for _ in range(4):  # 100 examples never fit in a queue of 50: dropped, the call answered
            assert len(_score(g, loop.rows["dense"][:100], loop.rows["sparse"][:100]).scores) == 100
        m = gateway_metrics(g.metrics)
        dropped = ("reason", "queue_full"), ("kind", IMPRESSIONS)
        assert m[(f"{PREFIX}_dropped_total", tuple(sorted(dropped)))] == 400
        assert records(g.dir, IMPRESSIONS) == []  # an hour's file: still open
    finally:
        assert stop_gateway(g.proc) == 0
    got = records(g.dir, IMPRESSIONS)
    assert sorted({r["request_id"] for r in got}) == sorted(kept) and len(got) == 30
    assert not [p for p in (g.dir / IMPRESSIONS).iterdir() if p.name.startswith(".")]


def test_the_online_simulator_scores_clicks_and_reports_through_the_gateway(
    loop: Loop, tmp_path: Path
) -> None:
    """``python -m loadtest.online_sim`` (the online demo's users) against a logging gateway:
    every call answered, every click it drew reported with Feedback and written to the log,
    each on an impression the log holds."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, _env

    env = {**_env(), "RECSYS_GATEWAY_TOKEN_FILE": str(loop.on.dir.parent.parent / "tokens")}
    env.pop("RECSYS_SERVE_DIR", None)
    t0 = int(time.time() * 1000)  # the module's tests run one at a time: later clicks are its
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest.online_sim", "--target", loop.on.target, "--rps", "8",
         "--examples", "20", "--callers", "2", "--duration", "6s", "--click-delay-s", "0.5",
         "--day-s", "0", "--out", str(tmp_path / "sim")],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert set(s["calls"]) == {"OK"} and s["impressions"] == 20 * s["calls"]["OK"] > 0
    assert s["clicks_reported"] == s["clicks_drawn"] > 0 and s["clicks_pending"] == 0

    def clicks_on_its_impressions() -> list[dict[str, Any]]:
        seen = {(r["request_id"], r["example"]) for r in records(loop.on.dir, IMPRESSIONS)}
        return [c for c in records(loop.on.dir, CLICKS)
                if c["received_ms"] >= t0 and (c["request_id"], c["example"]) in seen]  # fmt: skip

    mine = wait_for(clicks_on_its_impressions, lambda got: len(got) >= s["clicks_reported"])
    assert len(mine) == s["clicks_reported"] and all(c["label"] == 1 for c in mine)
