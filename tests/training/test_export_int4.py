"""INT4 tables and the memory budget's per-table mix (``--formats`` int4, ``--memory-budget``):
exported from the tiny trained run, parity judged against the reference, and served through
the handler's own initialize + handle from the unpacked .mar."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from recsys_model.mapped import layout
from tests.conftest import run_export
from training.export.budget import choose
from training.export.parity import MAX_AUC_DROP_QUANT


def _sizes(rows: list[int], dim: int) -> dict[str, int]:
    return {f: layout(rows, dim, [f] * len(rows))[2] for f in ("fp16", "int8", "int4")}


def _serve(model_dir: Path, body: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, np.ndarray]:
    """The handler as TorchServe runs it: initialize on the unpacked .mar, then handle."""
    from serving.worker.codec import decode_response
    from serving.worker.handler import RecsysHandler

    monkeypatch.setenv("RECSYS_WARM_UP", "0")
    manifest = json.loads((model_dir / "MAR-INF" / "MANIFEST.json").read_text())
    context = SimpleNamespace(
        system_properties={"model_dir": str(model_dir), "gpu_id": None},
        manifest=manifest, set_response_status=lambda *a, **k: None,
    )  # fmt: skip
    handler = RecsysHandler()
    handler.initialize(context)
    (out,) = handler.handle([{"body": body}], context)
    return handler, decode_response(out)


def test_int4_and_a_budget_mix_are_exported_checked_and_served(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from serving.worker.codec import encode_request

    run, store = tmp_path / "run", tmp_path / "store"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("export"))
    probe = run_export(
        ["--run-dir", str(run), "--no-archive", "--formats", '["int4"]', "--cpu-variant", "int4"]
    )
    schema = json.loads((run / "export" / "schema.json").read_text())
    rows, dim = [t["rows"] for t in schema["tables"]], schema["tables"][0]["dim"]
    sizes = _sizes(rows, dim)
    assert schema["variants"]["int4"]["tables"]["bytes"] == sizes["int4"] <= 0.55 * sizes["int8"]
    assert "|ΔAUC| int4 vs" in probe.stdout

    budget = (sizes["int4"] + sizes["int8"]) // 2
    run_export(["--run-dir", str(run), "--model-store", str(store), "--version", "1",
                "--formats", '["int8", "int4"]', "--memory-budget", str(budget)])  # fmt: skip
    export = run / "export"
    schema = json.loads((export / "schema.json").read_text())
    parity = json.loads((export / "parity.json").read_text())
    mix = schema["memory_budget"]
    chosen = [t["format"] for t in mix["tables"]]
    assert mix["bytes"] == (export / "tables_mixed.bin").stat().st_size <= budget
    assert {"int4"} < set(chosen), chosen  # some tables lowered to int4, not all
    assert schema["variants"]["mixed"]["tables"]["formats"] == chosen
    ref = parity["auc"]["eager"]
    for v in ("int4", "mixed", "int8"):
        assert abs(parity["auc"][v] - ref) <= MAX_AUC_DROP_QUANT, parity["auc"]
    assert schema["serving"]["cpu"] == "mixed"

    served = tmp_path / "served"
    (mar,) = store.glob("*.mar")
    zipfile.ZipFile(mar).extractall(served)
    s = np.load(export / "sample.npz")
    body = encode_request(s["dense"], s["values"], s["lengths"])
    handler, probs = _serve(served, body, monkeypatch)
    assert handler.served["variant"] == "mixed"
    np.testing.assert_allclose(probs, s["probs_mixed"], atol=1e-6, rtol=0)
    assert np.abs(probs - s["probs_int8"]).max() > 0  # int4 tables: other scores than int8

    monkeypatch.setenv("RECSYS_VARIANT", "int4")  # int4 itself, from the export folder
    for name in ("mapped_int4.pt", "tables_int4.bin"):
        shutil.copy(export / name, served / name)
    handler, probs = _serve(served, body, monkeypatch)
    assert handler.served == {"device": "cpu", "variant": "int4", "file": "mapped_int4.pt",
                              "dtype": "int4"}  # fmt: skip
    np.testing.assert_allclose(probs, s["probs_int4"], atol=1e-6, rtol=0)


def test_a_budget_below_all_int4_is_one_error_naming_the_floor(
    trained: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("export"))
    proc = run_export(["--run-dir", str(run), "--no-archive", "--memory-budget", "1000"], False)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert "memory_budget = 1000 bytes is below the all-int4 tables'" in errors[0]
    assert "Traceback" not in proc.stderr and not (run / "export").exists()


def test_the_greedy_lowers_the_cheapest_loss_per_byte_first() -> None:
    rows, dim = [1000, 1000, 1000], 16
    losses = [{"fp16": 0.0, "int8": 1e-6, "int4": 1e-3},   # cheap to lower
              {"fp16": 0.0, "int8": 1e-6, "int4": 1e-1},   # int4 costly
              {"fp16": 0.0, "int8": 5e-5, "int4": 5e-2}]  # fmt: skip
    sizes = _sizes(rows, dim)
    assert choose(rows, dim, losses, sizes["fp16"]) == ["fp16"] * 3
    assert choose(rows, dim, losses, sizes["int8"]) == ["int8"] * 3
    assert choose(rows, dim, losses, sizes["int8"] - 1)[0] == "int4"
    assert choose(rows, dim, losses, sizes["int4"]) == ["int4"] * 3
    # at dim 8 an int8 row is an fp16 row's size: lowering goes straight to int4
    assert choose(rows, 8, losses, _sizes(rows, 8)["fp16"] - 1) == ["int4", "fp16", "fp16"]
    # tables of unequal size: lowering the large one costs twice the loss but saves 100x the
    # bytes, so per byte it is the cheaper step (a greedy on loss alone lowers the small one,
    # which also fits this budget: the test tells them apart)
    rows2 = [100_000, 1_000]
    losses2 = [{"fp16": 0.0, "int8": 2e-6, "int4": 1.0}, {"fp16": 0.0, "int8": 1e-6, "int4": 1.0}]
    assert choose(rows2, dim, losses2, _sizes(rows2, dim)["fp16"] - 1) == ["int8", "fp16"]


def test_budget_freed_by_the_last_step_is_given_back() -> None:
    """The small table is lowered first (cheapest per byte), the file still 1 byte over; then
    the large one is lowered, freeing 100x what was missing: the small one goes back to fp16
    (the descent alone leaves both int8 and most of the budget unused)."""
    rows, dim = [100_000, 1_000], 16
    losses = [{"fp16": 0.0, "int8": 1e-2, "int4": 1.0}, {"fp16": 0.0, "int8": 1e-9, "int4": 1.0}]
    small_saves = _sizes([1_000], dim)["fp16"] - _sizes([1_000], dim)["int8"]
    budget = _sizes(rows, dim)["fp16"] - small_saves - 1
    formats = choose(rows, dim, losses, budget)
    assert formats == ["int8", "fp16"]
    assert layout(rows, dim, formats)[2] <= budget
