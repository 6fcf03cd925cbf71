"""What a restart serves (issue 46 item 1): after `make stop` and `make serve` the stack served
the run's last export (a v2 the gate had refused twice) as its only version, and a better v3
was then refused because that bad default scored near chance ("the evaluation data does not
fit the model"). Now a restart serves the plan it served last, and a bad default does not
block a candidate that fits the rows."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest

from serving import plan as plan_io
from serving.plan import Plan, Version
from serving.tools import canary
from serving.tools.restart_plan import plan_to_serve

DENSE, SPARSE = ("I1", "I2"), ("C1",)


def _mar(store: Path, version: str, sparse: tuple[str, ...] = SPARSE) -> str:
    name = f"m-{version}.mar"
    schema = {"model": {"name": "m", "version": version},
              "features": {"dense": list(DENSE), "sparse": list(sparse)}}  # fmt: skip
    with zipfile.ZipFile(store / name, "w") as z:
        z.writestr("schema.json", json.dumps(schema))
    return name


def _plan(default: str, *others: str, **kw: object) -> Plan:
    versions = {v: Version(f"m-{v}.mar", DENSE, SPARSE) for v in (default, *others)}
    return Plan(model="m", default=default, versions=versions, **kw)  # type: ignore[arg-type]


def test_a_restart_serves_the_last_plan_not_the_last_export(tmp_path: Path) -> None:
    store, plan_file = tmp_path / "store", tmp_path / "plan.json"
    store.mkdir()
    for v in ("1", "2", "3"):
        _mar(store, v)
    # v1 served, v3 promoted over it (v1 kept for rollback); v2 was refused and withdrawn
    plan_io.save(_plan("3", "1", previous="1"), plan_file)
    plan, note = plan_to_serve(plan_file, store, "m-2.mar", ("m", "2"), from_export=False)
    assert plan.default == "3" and set(plan.versions) == {"1", "3"} and plan.previous == "1"
    assert "serving the last plan: default v3, also v1" in note
    assert "the export v2 is not served: `make rollout VERSION=2`" in note
    export, note = plan_to_serve(plan_file, store, "m-2.mar", ("m", "2"), from_export=True)
    assert (export.default, list(export.versions), note) == ("2", ["2"], "")


def test_the_export_alone_when_the_last_plan_cannot_be_served(tmp_path: Path) -> None:
    store, plan_file = tmp_path / "store", tmp_path / "plan.json"
    store.mkdir()
    _mar(store, "2")
    plan, note = plan_to_serve(plan_file, store, "m-2.mar", ("m", "2"), from_export=False)
    assert plan.default == "2" and note == ""  # no plan yet: the export
    plan_io.save(_plan("1"), plan_file)  # its archive is gone from the store
    plan, note = plan_to_serve(plan_file, store, "m-2.mar", ("m", "2"), from_export=False)
    assert plan.default == "2" and "v1 (m-1.mar) is no longer in" in note
    _mar(store, "1")
    _mar(store, "4", sparse=("C1", "C2"))  # a new feature set: the plan's versions cannot serve it
    plan, note = plan_to_serve(plan_file, store, "m-4.mar", ("m", "4"), from_export=False)
    assert plan.default == "4" and "takes other features" in note
    with pytest.raises(ValueError, match="holds m v2, not m v9"):
        plan_to_serve(plan_file, store, "m-2.mar", ("m", "9"), from_export=False)


def test_a_bad_default_does_not_block_a_candidate_that_fits() -> None:
    bad = {"auc": 0.54291, "normalized_entropy": 1.02, "log_loss": 0.7, "calibration": 1.4}
    good = {"auc": 0.78, "normalized_entropy": 0.85, "log_loss": 0.46, "calibration": 1.0}
    ok, table = canary.compare(bad, good, margin=0.002)
    assert ok and "accepted: the default scores AUC 0.54291" in table, table
    ok, table = canary.compare(bad, dict(bad), margin=0.002)
    assert not ok and "refused: neither fits these rows" in table, table
    ok, _ = canary.compare(good, bad, margin=0.002)
    assert not ok  # a fitting default and a worse candidate: refused as before
