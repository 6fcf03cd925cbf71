"""The rollout's gates (serving/tools/canary.py): the per-version counters they read, the error
gate's arithmetic, and on the real stack (``make serve``, TorchServe, ``make rollout``) a
candidate that passes the gateway's probe but fails real requests, rolled back by the error gate.

The failing candidate is the tiny model's archive with its scorer replaced by one whose embedding
table has a single row: the handler's warm-up (id 0) and the gateway's probe (no ids) score, so
the version is READY and in rotation; every request with real ids fails in the model.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import threading
import time
import zipfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from prometheus_client import generate_latest

from serving import plan as plan_io
from serving.gateway import metrics
from serving.gateway.auth import client_token
from serving.stubs import ranker_pb2_grpc
from serving.tools import canary
from serving.tools.canary import Verdict
from serving.tools.client import build_request
from serving.tools.supervisor import read_state, replicas
from serving.torchserve import manage
from serving.worker.codec import to_rows
from tests.conftest import _env
from tests.stack import run_python, start_supervisor

MODEL = "dlrm-tiny"
PASS, FAIL, NOT_JUDGED = Verdict.PASS, Verdict.FAIL, Verdict.NOT_JUDGED


def test_outcomes_count_each_versions_requests_by_status_code() -> None:
    m = metrics.configure(10, 10)
    for _ in range(3):
        metrics.scored("1", np.array([0.5], np.float32))
    metrics.scored("2", np.array([0.25], np.float32))
    for code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE):
        metrics.failed("2", code)
    metrics.show_plan("m", ["1", "2"], {"1": 1.0}, 5, "/x/plan.json")
    text = generate_latest(m.registry).decode()
    assert 'recsys_gateway_version_requests_total{code="INTERNAL",model_version="2"} 2.0' in text
    assert canary.outcomes(text) == {"1": (3.0, 0.0), "2": (4.0, 3.0)}
    assert canary.plan_generation(text, Path("/x/plan.json")) == 5
    assert canary.plan_generation(text, Path("/y/plan.json")) is None  # another gateway's


def test_the_error_gate_compares_the_candidate_with_the_default_over_one_window() -> None:
    start = {"1": (100.0, 1.0), "2": (40.0, 0.0)}  # before the first step: not counted
    gate = canary.ErrorGate("1", "2", max_excess=0.01, min_requests=20, start=start)
    judged = gate.check({"1": (200.0, 2.0), "2": (50.0, 5.0)})
    assert judged.verdict is NOT_JUDGED and "not judged" in judged.seen  # 10 requests: too few
    judged = gate.check({"1": (300.0, 3.0), "2": (70.0, 0.0)})
    assert judged.verdict is PASS and "within" in judged.seen  # 0/30 against the default's 2/200
    judged = gate.check({"1": (300.0, 3.0), "2": (70.0, 1.0)})
    assert judged.verdict is FAIL, judged  # 1/30 = 3.3% against 1.0%: 2.3 points over, 1 allowed
    assert judged.seen.startswith("errors v2 1/30 (3.3%), v1 2/200 (1.0%)"), judged


def test_the_evaluation_table_says_the_paired_verdict_on_the_same_rows() -> None:
    """Two evaluations of the same rows: the table adds DeLong's paired test of the candidate
    against the default (the gate itself stays the margin); other rows: no paired line."""
    from serving.tools.evaluate import metrics

    rng = np.random.default_rng(0)
    logit = 1.5 * rng.normal(size=3000) - 1.0  # the rows' true click model
    y = (rng.random(logit.size) < 1 / (1 + np.exp(-logit))).astype(np.int8)
    sigmoid = lambda z: 1 / (1 + np.exp(-z))  # noqa: E731
    base = metrics(y, sigmoid(0.6 * logit - 0.4 + rng.normal(0, 0.8, y.size)), 10)
    cand = metrics(y, sigmoid(logit + rng.normal(0, 0.2, y.size)), 10)
    ok, table = canary.compare(base, cand, 0.002)
    assert ok and "paired test (DeLong, 95%): the candidate is ahead (+0.0" in table, table
    ok, table = canary.compare(cand, base, 0.002)
    assert not ok and "the candidate is behind (-0.0" in table, table
    other = metrics(y[::-1].copy(), np.asarray(cand.scored[1])[::-1].copy(), 10)
    assert "paired" not in canary.compare(base, other, 0.002)[1]
    json.dumps(base)  # the report serializes the figures, not the rows


def test_the_error_gate_never_passes_what_it_could_not_judge() -> None:
    """19/19 failed candidate requests, one short of ``min_requests``: not judged, not passed;
    metrics off (no window) or unreachable (no counters now): not judged either."""
    gate = canary.ErrorGate("1", "2", max_excess=0.01, min_requests=20, start={})
    judged = gate.check({"1": (500.0, 0.0), "2": (19.0, 19.0)})
    assert judged.verdict is NOT_JUDGED, judged
    assert judged.seen == (
        "errors v2 19/19 (100.0%), v1 0/500 (0.0%): fewer than 20 requests, not judged"
    )
    assert gate.check({"1": (500.0, 0.0), "2": (20.0, 20.0)}).verdict is FAIL
    unreachable = gate.check(None)
    assert unreachable.verdict is NOT_JUDGED and "unreachable" in unreachable.seen
    metrics_off = canary.ErrorGate("1", "2", 0.01, 20, None)
    assert metrics_off.check({"2": (99.0, 0.0)}).verdict is NOT_JUDGED


class OneRowTable(torch.nn.Module):
    """A scorer whose embedding table has one row: id 0 and no ids at all score 0.5, any other
    id raises (index out of range), as a model exported with tables too small would."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.zeros(1, 1), requires_grad=False)

    def forward(self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return torch.sigmoid(dense[:, 0] * 0.0 + torch.index_select(self.table, 0, values).sum())


def broken_archive(good: Path, out: Path, version: str) -> None:
    """``good`` as ``version`` (manifest and schema.json), its scorer an :class:`OneRowTable`."""
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(out, "w") as dst:
        manifest = json.loads(src.read("MAR-INF/MANIFEST.json"))
        manifest["model"]["modelVersion"] = version
        schema = json.loads(src.read("schema.json"))
        schema["model"]["version"] = version
        served = manifest["model"]["serializedFile"]  # now a TorchScript file: say so
        for name, info in schema["variants"].items():
            if info["file"] == served:
                schema["variants"][name] = {"file": served, "kind": "torchscript",
                                            "requires": ["torch"]}  # fmt: skip
        scorer = io.BytesIO()
        torch.jit.save(torch.jit.script(OneRowTable()), scorer)
        replaced = {
            "MAR-INF/MANIFEST.json": json.dumps(manifest).encode(),
            "schema.json": json.dumps(schema).encode(),
            manifest["model"]["serializedFile"]: scorer.getvalue(),
        }
        for item in src.infolist():
            dst.writestr(item, replaced.get(item.filename) or src.read(item))


@dataclass
class Served:
    """``make serve`` of v1.0 with the failing v2.0 in its store, and a caller thread."""

    env: dict[str, str]
    workdir: Path
    metrics_port: int
    codes: Counter[str]


@contextlib.contextmanager
def serving_with_a_failing_candidate(
    exported: tuple[Path, Path, str], tmp_path: Path, pause_s: float
) -> Iterator[Served]:
    """The stack for the block, a thread calling it (requests naming no version, ``pause_s``
    apart) throughout; stopped after, nothing left running."""
    export, shared_store, _ = exported
    store = tmp_path / "store"  # a store of its own: the shared one's newest .mar stays 1.0's
    store.mkdir()
    good = shutil.copy(shared_store / f"{MODEL}-1.0.mar", store)
    broken_archive(Path(good), store / f"{MODEL}-2.0.mar", "2.0")
    workdir = tmp_path / "serve"
    env = _env({"RECSYS_SERVE_DIR": str(workdir), "RECSYS_MODEL_STORE": str(store)})
    start, gateway_port, metrics_port = start_supervisor(
        export / "schema.json", env, "--torchserve.workers", "1"
    )
    stop = threading.Event()
    codes: Counter[str] = Counter()

    def traffic(target: str, request: object, token: str) -> None:
        """Requests naming no version, one after the other, until ``stop``."""
        with grpc.insecure_channel(target) as channel:
            stub = ranker_pb2_grpc.RankerStub(channel)
            while not stop.is_set():
                try:
                    stub.Score(
                        request, metadata=(("authorization", f"Bearer {token}"),), timeout=10
                    )
                    codes["OK"] += 1
                except grpc.RpcError as e:
                    codes[e.code().name] += 1  # type: ignore[attr-defined]
                stop.wait(pause_s)

    caller = None
    try:
        assert start.returncode == 0, start.stderr
        target = f"127.0.0.1:{gateway_port}"
        s = np.load(export / "sample.npz")
        request = build_request(s["dense"][:20], to_rows(s["values"], s["lengths"])[:20])
        token = client_token(str(workdir / "gateway_token"))
        assert token
        caller = threading.Thread(target=traffic, args=(target, request, token), daemon=True)
        caller.start()
        yield Served(env, workdir, metrics_port, codes)
    except Exception:
        print((workdir / "gateway.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        stop.set()
        if caller is not None:
            caller.join(timeout=30)
        run_python("serving.tools.supervisor", "stop", env=env)


def _withdrawn(served: Served) -> canary.Outcomes:
    """Asserts v2.0 is out of the plan and unregistered; the counters per version."""
    plan = plan_io.load(Path(read_state(served.workdir)["plan"]))
    assert (plan.default, list(plan.versions), plan.traffic) == ("1.0", ["1.0"], {})
    assert manage.versions(replicas(served.workdir)[0], MODEL) == {"1.0": 1}  # 2.0 unregistered
    text = canary.scrape(f"http://127.0.0.1:{served.metrics_port}/metrics")
    assert text is not None
    return canary.outcomes(text)


@pytest.mark.slow
def test_a_candidate_failing_real_requests_is_rolled_back_by_the_error_gate(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    with serving_with_a_failing_candidate(exported, tmp_path, pause_s=0.02) as served:
        codes = served.codes
        ro = run_python("serving.tools.rollout", "--version", "2.0", "--no-evaluate",
                     "--steps", "50,100", "--dwell-s", "120", "--drain-s", "1",
                     "--error-min-requests", "10", env=served.env)  # fmt: skip
        assert ro.returncode == 1, ro.stderr
        assert "error gate: errors v2.0 " in ro.stdout and "promote" not in ro.stdout
        assert "refused: v2.0 is withdrawn; v1.0 keeps all traffic" in ro.stdout
        seen = _withdrawn(served)
        assert seen["2.0"][0] >= 10 and seen["2.0"][1] == seen["2.0"][0], seen  # all failed
        assert seen["1.0"][0] > 0 and seen["1.0"][1] == 0, seen
        before = codes.copy()
        time.sleep(2)  # the gateway routes nothing to 2.0 anymore: every call is OK again
        assert codes["OK"] > before["OK"] and codes["INTERNAL"] == before["INTERNAL"], codes
        assert set(codes) == {"OK", "INTERNAL"}, codes


@pytest.mark.slow
def test_a_failing_candidate_on_too_little_traffic_to_judge_is_refused(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """One call a second: at 50 % the candidate gets far fewer than ``--error-min-requests``
    (20) calls in the step and its extension, every one failing. The gate never judges, so
    the candidate is refused, never promoted."""
    with serving_with_a_failing_candidate(exported, tmp_path, pause_s=1.0) as served:
        ro = run_python("serving.tools.rollout", "--version", "2.0", "--no-evaluate",
                     "--steps", "50,100", "--dwell-s", "2", "--judge-timeout-s", "10",
                     "--drain-s", "1", env=served.env)  # fmt: skip
        assert ro.returncode == 1, ro.stderr
        assert "promote" not in ro.stdout, ro.stdout
        refused = [ln for ln in ro.stdout.splitlines() if ln.startswith("refused: ")]
        assert len(refused) == 1, ro.stdout
        assert refused[0].startswith(
            "refused: v2.0 is withdrawn: it could not be judged in 12 s at 50% (errors v2.0 "
        ), refused
        assert refused[0].endswith("not judged); v1.0 keeps all traffic"), refused
        seen = _withdrawn(served)
        assert 0 < seen["2.0"][0] < 20 and seen["2.0"][1] == seen["2.0"][0], seen  # all failed
