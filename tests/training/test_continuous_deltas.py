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
import shutil
from pathlib import Path

import pytest

from recsys_model.delta import read_pointer
from serving.tools.deltas import acks
from serving.tools.supervisor import read_state
from tests.conftest import _env
from tests.stack import run_python, start_supervisor
from tests.training.test_continuous import copy_days, make_days, meta_of, run_continuous
from training.metrics.log import read_metrics

pytestmark = pytest.mark.slow

ROWS = 20_000  # a day: 78 steps of the tiny preset's global batch of 256
MODEL = "dlrm-tiny"


def test_the_loop_publishes_a_gated_delta_that_every_worker_serves(tmp_path: Path) -> None:
    days = tmp_path / "days"
    make_days(days, 3, ROWS)
    inbox, run, store, serve = (tmp_path / n for n in ("inbox", "run", "store", "serve"))
    common = ["--run-dir", str(run), "--data-dir", str(inbox), "continuous.export_every=1",
              f'data.cache_dir="{tmp_path / "cache"}"', f'continuous.model_store="{store}"',
              f'continuous.serve_dir="{serve}"', "continuous.deltas=true",
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
        run_continuous(common, nproc=1)
        (delta,) = [e for e in read_metrics(run / "continuous.jsonl") if e["event"] == "delta"]
        print(delta)
        assert delta["promoted"], delta
        assert delta["base"] == version and delta["workers"] == 2
        assert delta["rows"] > 0 and delta["bytes"] > 0
        # only the rows day 1's pass trained were compared (RUN/touched.npz, kept by the first
        # run since its export), not "all" (tiny's 26 tables of 128 rows: day 1 hits most)
        tables = sum(int(t["rows"]) for t in schema["tables"])
        assert isinstance(delta["compared"], int) and delta["rows"] <= delta["compared"] <= tables
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


def test_an_int4_stack_takes_int4_deltas_and_an_unanswered_one_is_a_full_publish(
    tmp_path: Path,
) -> None:
    """A stack whose workers serve int4 tables is refreshed by int4 deltas (before, the loop
    made int8 ones, which every int4 worker refused); then, with the workers unable to
    acknowledge (their acks folder replaced by a file), the next delta is put back after
    ``continuous.delta_timeout_s`` and the same publish is a full export + rollout, the
    refused delta's file removed and the ledger's clock restarted by the export."""
    days = tmp_path / "days"
    make_days(days, 4, ROWS)
    inbox, run, store, serve = (tmp_path / n for n in ("inbox", "run", "store", "serve"))
    common = ["--run-dir", str(run), "--data-dir", str(inbox), "continuous.export_every=1",
              f'data.cache_dir="{tmp_path / "cache"}"', f'continuous.model_store="{store}"',
              f'continuous.serve_dir="{serve}"', "continuous.delta_timeout_s=5",
              """continuous.export_args=["--parity-rows", "2000", "cpu_variant=int4", """
              """"formats=['int8', 'int4']"]""",
              'continuous.rollout_args=["--steps", "100", "--keep-previous-s", "0", '
              '"--drain-s", "0", "--margin", "0.05"]']  # fmt: skip
    copy_days(days, inbox, ["day_0", "day_1"])
    run_continuous([*common, "continuous.rollout=false"], nproc=1)
    (export,) = [e for e in read_metrics(run / "continuous.jsonl") if e["event"] == "export"]
    assert export["ok"], export
    version = export["version"]
    schema = json.loads((run / "export" / "schema.json").read_text())
    assert schema["serving"]["cpu"] == "int4"

    env = _env({"RECSYS_SERVE_DIR": str(serve), "RECSYS_MODEL_STORE": str(store)})
    started, _, _ = start_supervisor(run / "export" / "schema.json", env, "--replicas", "1",
                                     "--torchserve.workers", "2", timeout=300)  # fmt: skip
    try:
        assert started.returncode == 0, started.stderr
        copy_days(days, inbox, ["day_2"])
        run_continuous([*common, "continuous.deltas=true"], nproc=1)
        (delta,) = [e for e in read_metrics(run / "continuous.jsonl") if e["event"] == "delta"]
        print(delta)
        assert delta["promoted"] and delta["format"] == "int4", delta
        assert delta["workers"] == 2 and delta["rows"] > 0 and "fallback" not in delta
        folder = store.resolve() / "deltas" / MODEL / version
        pids = [int(f.stem) for f in (folder / "acks").glob("*.json")]
        seen = acks(folder, pids)
        assert {a["format"] for a in seen.values()} == {"int4"}
        assert {a["version"] for a in seen.values()} == {delta["version"]}, seen

        shutil.rmtree(folder / "acks")
        (folder / "acks").write_text("not a folder: no worker can acknowledge\n")
        copy_days(days, inbox, ["day_3"])
        run_continuous([*common, "continuous.deltas=true"], nproc=1)
        events = read_metrics(run / "continuous.jsonl")
        late = [e for e in events if e.get("step", 0) > delta["step"]]
        print(late)
        kinds = [e["event"] for e in late if e["event"] != "file"]
        assert kinds == ["delta", "export", "rollout"], late
        refused, full, rolled = (e for e in late if e["event"] != "file")
        assert not refused["promoted"] and refused["fallback"], refused
        assert "do not acknowledge" in refused["reason"], refused
        assert full["ok"] and rolled["promoted"], (full, rolled)
        assert json.loads((serve / "plan.json").read_text())["default"] == full["version"]
        assert [e["file"] for e in read_pointer(folder)["chain"]] == [f"0001-{delta['version']}.pt"]
        assert not list(folder.glob("0002-*")), list(folder.iterdir())  # the refused delta's
        assert meta_of(run)["continuous"]["files_since_export"] == 1  # counted: the export
    finally:
        run_python("serving.tools.supervisor", "stop", env=env)
