"""Train / validation / test: the rows cut in three (training/data/prep.py), every decision of
a run (periodic evaluations, ``checkpoints/best``, early stopping) made on validation, and the
final report on test rows no decision saw; what the export records and the tools default to.

The schedule runs for real (evaluator, monitor, checkpointer: DCP saves in this process) with
scripted figures: a validation AUC and a test AUC per step that disagree on which step is
best, so a run that chose on its test rows (or reported its validation rows) is told apart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from recsys_stack import datafile
from serving.tools import evaldata
from tests.training.test_best import _Steps, _Trainer
from training.checkpoint import store
from training.checkpoint.checkpointer import Checkpointer
from training.config import Config, DataConfig, load_config
from training.data.binary import load_binary
from training.data.loader import Arrays
from training.data.prep import prepare_data, split_rows
from training.errors import ConfigError, DataError
from training.export.record import data_record
from training.features import NUM_DENSE, NUM_SPARSE
from training.metrics import evaluator as evaluator_module
from training.metrics.evaluator import Evaluator
from training.metrics.log import MetricsLog, read_metrics
from training.metrics.monitor import Monitor
from training.step_loop import TrainLoop, run_schedule

TINY = "training/configs/tiny.toml"


def test_prepare_data_cuts_three_disjoint_splits_in_file_order(tmp_path: Path) -> None:
    cfg = DataConfig(synthetic_rows=2000, synthetic_vocab=50, cache_dir=str(tmp_path / "c"),
                     synthetic_dir=str(tmp_path / "s"), preprocess_processes=1)  # fmt: skip
    s = prepare_data(cfg, rank=0, progress=False)
    assert (len(s.train), len(s.valid), len(s.test)) == (1800, 100, 100)
    whole = load_binary(Path(s.info["binary"]))
    # train, then validation, then test: every row in exactly one split, in file order
    joined = np.concatenate([np.asarray(a.dense) for a in (s.train, s.valid, s.test)])
    assert np.array_equal(joined, np.asarray(whole.dense))
    assert s.info["splits"] == {"train": {"first_row": 0, "rows": 1800},
                                "valid": {"first_row": 1800, "rows": 100},
                                "test": {"first_row": 1900, "rows": 100}}  # fmt: skip
    assert (s.info["eval_rows"], s.info["valid_rows"], s.info["test_rows"]) == (200, 100, 100)
    cfg.valid_fraction = 0.25  # a quarter of the held-out rows validate, the rest test
    s = prepare_data(cfg, rank=0, progress=False)
    assert (len(s.train), len(s.valid), len(s.test)) == (1800, 50, 150)


def test_the_split_settings_are_checked_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"^data.valid_fraction = 1.0: must be in \(0, 1\)$"):
        load_config(TINY, ["data.valid_fraction=1.0"])
    with pytest.raises(DataError) as e:  # 20 rows: 2 held out, 1 validation, 1 test
        split_rows(12, 0.1, 0.5)  # 1 held out: validation or test would be empty
    assert "data.eval_fraction=0.1 and data.valid_fraction=0.5" in str(e.value)
    assert "\n" not in str(e.value) and split_rows(20, 0.1, 0.5) == (18, 1, 1)


def test_a_split_of_one_label_is_refused_in_one_line(tmp_path: Path) -> None:
    tsv = tmp_path / "rows.tsv"  # the last 4 rows, validation and test, all clicks
    tsv.write_text("".join(f"{int(i % 2 or i >= 16)}\t{i}" + "\t" * 12 + "\tab" * 26 + "\n"
                           for i in range(20)))  # fmt: skip
    cfg = DataConfig(path=str(tsv), eval_fraction=0.2, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError) as e:
        prepare_data(cfg, rank=0, progress=False)
    assert str(e.value) == (
        "the validation split (rows 17..18 of 20) holds only label 1: its AUC is undefined; use "
        "more rows or other data.eval_fraction (0.2) / data.valid_fraction (0.5)"
    )


def _rows(n: int, first: float) -> Arrays:
    """``n`` rows whose first dense value tells which split they are (``first``)."""
    dense = np.full((n, NUM_DENSE), first, np.float32)
    return Arrays(np.zeros(n, np.int8), dense, np.zeros((n, NUM_SPARSE), np.int64), None)


def _run(tmp_path: Path, valid: dict[int, float], test: dict[int, float],
         mp: pytest.MonkeyPatch, **train: Any) -> tuple[Evaluator, list[dict[str, Any]]]:  # fmt: skip
    """The real schedule over ``max(valid)`` steps whose evaluation at step s scores
    ``valid[s]`` on the validation rows and ``test[s]`` on the test rows."""
    cfg = load_config(TINY, ["train.keep_last=1", "train.checkpoint_every=0",
                             *(f"train.{k}={v}" for k, v in train.items())])  # fmt: skip
    trainer, progress, holder = _Trainer(), store.Progress(), []
    loop = TrainLoop(_Steps(trainer, holder), iter(()), progress, batch_size=1,
                     train_rows=10**6, total=max(valid), log_every=10**6,
                     loss_log=MetricsLog(tmp_path / "loss.jsonl", enabled=True))  # fmt: skip
    holder.append(loop)

    def scripted(model: Any, arrays: Arrays, *args: Any) -> dict[str, float]:
        auc = (valid if arrays.dense[0, 0] == 1.0 else test)[progress.step]
        return {"auc": auc, "ne": 1 - auc, "eval_rows": len(arrays)}

    mp.setattr(evaluator_module, "evaluate", scripted)
    log = MetricsLog(tmp_path / "metrics.jsonl", enabled=True)
    evaluator = Evaluator(cfg, _rows(10, 1.0), log, rank=0, world=1, test=_rows(7, 2.0))
    monitor = Monitor.from_config(cfg.train)
    ckpt = Checkpointer(tmp_path / "checkpoints", trainer, progress, cfg, {}, monitor=monitor)  # type: ignore[arg-type]
    ckpt.forget_best(rank=0)
    run_schedule(loop, trainer, evaluator, ckpt, monitor)  # type: ignore[arg-type]
    return evaluator, read_metrics(tmp_path / "metrics.jsonl")


def test_best_and_early_stopping_follow_validation_and_the_report_is_on_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # validation peaks at step 20 and then falls (early stopping at 40); the test rows would
    # have picked step 40 and never stopped
    valid = {10: 0.60, 20: 0.70, 30: 0.65, 40: 0.64, 50: 0.63, 60: 0.62}
    test = {10: 0.50, 20: 0.55, 30: 0.80, 40: 0.90, 50: 0.91, 60: 0.92}
    evaluator, records = _run(tmp_path, valid, test, monkeypatch, eval_every=10,
                              early_stop_patience=2)  # fmt: skip
    assert [r["step"] for r in records] == [10, 20, 30, 40]
    assert [r["split"] for r in records] == ["valid"] * 3 + ["test"]
    assert [r["auc"] for r in records[:3]] == [0.60, 0.70, 0.65]  # periodic: validation rows
    final = records[-1]
    assert final["final"] and final["stopped_early"].startswith("early stopping at step 40")
    assert final["auc"] == 0.90 and final["eval_rows"] == 7  # the report: the test rows
    assert final["valid"]["auc"] == 0.64 and final["valid"]["eval_rows"] == 10
    assert final["best"]["step"] == 20 and final["best"]["value"] == 0.70  # chosen on validation
    best = store.resolve("best", tmp_path / "checkpoints")
    assert best.name == "step_00000020"
    assert store.read_tensors(best)["w"].tolist() == [20.0] * 3
    assert evaluator.report is evaluator.test


def test_a_final_best_is_judged_on_its_validation_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the last step is validation's best though its test AUC is the worst: it is the best
    valid, test = {10: 0.60, 20: 0.70}, {10: 0.90, 20: 0.50}
    _, records = _run(tmp_path, valid, test, monkeypatch, eval_every=10)
    assert records[-1]["best"]["step"] == 20 and records[-1]["auc"] == 0.50


def test_the_export_and_the_tools_default_to_the_test_rows(tmp_path: Path) -> None:
    tsv = tmp_path / "day.tsv"
    tsv.write_text("".join(f"{i % 2}\t{i}" + "\t" * 12 + "\tab" * 26 + "\n" for i in range(40)))
    cfg = Config()
    cfg.data.path, cfg.data.cache_dir = str(tsv), str(tmp_path / "c")
    info = {"rows": 40, "eval_rows": 10, "valid_rows": 4, "test_rows": 6, "valid_fraction": 0.4}
    data = data_record(cfg, {"data": info})
    assert (data["valid_rows"], data["test_rows"], data["valid_fraction"]) == (4, 6, 0.4)
    unseen = data["unseen"]
    assert (unseen["first_row"], unseen["rows"], unseen["at_end"]) == (34, 6, True)
    assert "its test split, the last 6 rows" in unseen["why"]
    window = evaldata.model_window({"data": data}, "m v1", 0)
    assert (window.first, window.count) == (34, 6)  # make evaluate's default: rows 35..40
    assert window.describe().startswith(f"rows 35..40 of {tsv}")
    # a rollout on the held-out rows (its --holdout of the file): never trained on, validation
    # rows included, and said; one training row in them: trained on
    held, why = evaldata.unseen_by({"data": data}, evaldata.Window([tsv], 30, 10), "m v1")
    assert held is True and why.endswith("(its validation rows among them chose its checkpoint)")
    assert evaldata.unseen_by({"data": data}, evaldata.Window([tsv], 29, 11), "m v1")[0] is False
    # an export of a run from before the test split: its whole held-out split, as before
    older = datafile.record([tsv], rows=40, skipped_rows=0, eval_fraction=0.25, eval_rows=10)
    assert (older["unseen"]["first_row"], older["unseen"]["rows"]) == (30, 10)
    skipped = datafile.record([tsv], 40, 2, 0.25, 10, test_rows=6, valid_fraction=0.4)
    assert (skipped["unseen"]["first_row"], skipped["unseen"]["rows"]) == (None, 6)
