"""The continuous loop's delta path end to end (issue 36): ``continuous.deltas=true`` against a
real ``make serve`` stack (the supervisor: TorchServe with 2 workers + the gateway).

Days 0 and 1 arrive with no stack: the model after day 0 is exported (v<step>, the run's
``RUN/export``) when day 1 arrives, then day 1 is trained. That version is served. Day 2 arrives
under the delta path: the model after day 1 is published as a delta over the served default,
gated on day 2's rows (which neither model trained on), and every worker acknowledges it;
``continuous.jsonl`` records rows, bytes, the gate, ``served_s`` and ``freshness_s``. Then
``python -m serving.tools.deltas rollback`` puts every worker back on the base.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from recsys_model.delta import read_pointer
from serving.tools.deltas import acks
from serving.tools.supervisor import read_state
from tests.conftest import ROOT, _env
from tests.stack import run_python, start_supervisor
from tests.training.test_continuous import copy_days, run_continuous
from training.metrics.log import read_metrics

pytestmark = pytest.mark.slow

ROWS = 20_000  # a day: 78 steps of the tiny preset's global batch of 256
MODEL = "dlrm-tiny"


def test_the_loop_publishes_a_gated_delta_that_every_worker_serves(tmp_path: Path) -> None:
    days = tmp_path / "days"
    subprocess.run(
        [sys.executable, "-m", "training.data.synthetic", "--days", "3", "--drift", "0.1",
         "--rows", str(ROWS), "--vocab", "100", "--out", str(days), "--no-progress"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    inbox, run, store, serve = (tmp_path / n for n in ("inbox", "run", "store", "serve"))
    common = ["--run-dir", str(run), "--data-dir", str(inbox), "continuous.export_every=1",
              f'data.cache_dir="{tmp_path / "cache"}"', f'continuous.model_store="{store}"',
              f'continuous.serve_dir="{serve}"',
              'continuous.export_args=["--parity-rows", "2000"]']  # fmt: skip
    copy_days(days, inbox, ["day_0", "day_1"])
    run_continuous([*common, "continuous.rollout=false"], nproc=1)  # day 0's model: v<step>
    (export,) = [e for e in read_metrics(run / "continuous.jsonl") if e["event"] == "export"]
    assert export["ok"], export
    version = export["version"]
    schema = json.loads((run / "export" / "schema.json").read_text())
    assert schema["model"]["version"] == version

    env = _env({"RECSYS_SERVE_DIR": str(serve), "RECSYS_MODEL_STORE": str(store)})
    started, _, _ = start_supervisor(
        run / "export" / "schema.json",
        env,
        "--replicas",
        "1",
        "--torchserve.workers",
        "2",
        timeout=300,
    )
    try:
        assert started.returncode == 0, started.stderr
        assert read_state(serve)["plan"]
        copy_days(days, inbox, ["day_2"])
        run_continuous([*common, "continuous.deltas=true"], nproc=1)
        (delta,) = [e for e in read_metrics(run / "continuous.jsonl") if e["event"] == "delta"]
        print(delta)
        assert delta["promoted"], delta
        assert delta["base"] == version and delta["workers"] == 2
        assert delta["rows"] > 0 and delta["bytes"] > 0
        assert delta["gate"]["passed"] and delta["gate"]["eval_rows"] > 0
        assert 0 < delta["served_s"] <= delta["freshness_s"]
        folder = store.resolve() / "deltas" / MODEL / version
        label = delta["version"]
        assert read_pointer(folder)["version"] == label
        pids = [int(f.stem) for f in (folder / "acks").glob("*.json")]
        assert len(pids) == 2 and all(a["version"] == label for a in acks(folder, pids).values())

        back = run_python("serving.tools.deltas", "rollback", "--workdir", str(serve), env=env)
        assert back.returncode == 0, back.stderr
        record = json.loads(back.stdout.strip().splitlines()[-1])
        assert (
            record["event"] == "delta_rollback"
            and record["version"] == ""
            and record["workers"] == 2
        )
        assert all(a["version"] == "" for a in acks(folder, pids).values())
    finally:
        run_python("serving.tools.supervisor", "stop", env=env)
