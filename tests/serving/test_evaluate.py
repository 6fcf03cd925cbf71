"""Served-model evaluation: the tiny model's held-out rows scored through the real gateway give
the export's parity AUC; the metrics in process against slow obvious references."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serving.gateway.config import AuthConfig
from serving.gateway.validate import Limits
from serving.tools import evaluate
from serving.torchserve.config import TorchServeConfig
from tests.conftest import ROOT
from tests.stack import start_gateway, stop_gateway, wait_status

PNG = b"\x89PNG\r\n\x1a\n"
TOKEN = "evaluate-token-" + "e" * 24
PARITY_ROWS = 1000  # the tiny run's test split: the last 5% of 20,000 synthetic rows


@pytest.fixture(scope="module")
def synthetic_tsv(trained: Path, data_dirs: list[str]) -> Path:
    """The TSV the tiny model was trained on (its last 5%, its test split = the export's parity
    rows)."""
    (folder,) = [re.search(r'"(.*)"', o)[1] for o in data_dirs if "synthetic_dir" in o]  # type: ignore[index]
    data = json.loads((trained / "config.json").read_text())["data"]  # other tests add sets here
    name = (
        f"synthetic_r{data['synthetic_rows']}_v{data['synthetic_vocab']}_s{data['synthetic_seed']}"
    )
    return Path(folder) / f"{name}.tsv"


@pytest.fixture(scope="module")
def gateway(
    torchserve: tuple[TorchServeConfig, Any], exported: tuple[Path, Path, str], tmp_path_factory
) -> Iterator[tuple[str, Path]]:  # type: ignore[no-untyped-def]
    """A gateway taking the 2,000 parity rows in one request, so that they are scored in one
    forward as the export scored them: float32 results differ in the last bit between batch
    sizes, and the tiny model's held-out rows hold groups of identical rows whose tied scores
    then split, moving the AUC by up to 2e-4 (see README, make evaluate). With a token file, as
    ``make serve`` starts it; (target, token file)."""
    work = tmp_path_factory.mktemp("gw")
    tokens = work / "tokens"
    tokens.write_text(TOKEN + "\n")
    proc, target = start_gateway(
        exported[0] / "schema.json", [torchserve[0]], work / "gw.log",
        # 2,000 rows of one id per feature: the largest request these limits allow must fit
        # TorchServe's body limit (the gateway checks at start)
        limits=Limits(max_examples=PARITY_ROWS, max_ids_per_feature=8),
        deadline_s=10.0,  # 2,000 rows on a loaded box
        auth=AuthConfig(token_file=str(tokens)),
    )  # fmt: skip
    try:
        wait_status(target, "SERVING", 120)
        yield target, tokens
    finally:
        assert stop_gateway(proc) == 0


def _args(gateway: tuple[str, Path], *more: str) -> list[str]:
    host, port = gateway[0].rsplit(":", 1)
    return ["--host", host, "--port", port, "--token-file", str(gateway[1]), "--no-progress",
            *more]  # fmt: skip


def test_held_out_rows_give_the_parity_auc(
    gateway: tuple[str, Path],
    exported: tuple[Path, Path, str],
    synthetic_tsv: Path,
    tmp_path: Path,
    capsys,
) -> None:  # type: ignore[no-untyped-def]
    export = exported[0]
    parity = json.loads((export / "parity.json").read_text())
    schema = json.loads((export / "schema.json").read_text())
    served = schema["served_variant"]
    out = tmp_path / "report"
    assert parity["rows"] == PARITY_ROWS
    rc = evaluate.main(_args(gateway, "--data", str(synthetic_tsv), "--holdout", "0.05",
                             "--batch", str(PARITY_ROWS), "--out", str(out),
                             "--version", schema["model"]["version"]))  # fmt: skip
    assert rc == 0
    report = json.loads((out / "evaluation.json").read_text())
    assert report["rows"] == PARITY_ROWS
    assert abs(report["auc"] - parity["auc"][served]) <= 1e-4, (report["auc"], parity["auc"])
    assert (out / "calibration.png").read_bytes()[:8] == PNG
    printed = capsys.readouterr().out
    assert f"AUC {report['auc']:.6f}" in printed and "calibration" in printed


def test_figures_match_the_exports_sample(
    gateway: tuple[str, Path], exported: tuple[Path, Path, str], synthetic_tsv: Path, tmp_path: Path
) -> None:
    # The sample holds the first 1,000 parity rows with their labels and served probabilities:
    # every figure of the report, recomputed from them, must agree.
    export = exported[0]
    served = json.loads((export / "schema.json").read_text())["served_variant"]
    sample = np.load(export / "sample.npz")
    y, p = sample["labels"], sample[f"probs_{served}"]
    n = len(y)
    rc = evaluate.main(_args(gateway, "--data", str(synthetic_tsv), "--holdout", "0.05",
                             "--rows", str(n), "--batch", "300", "--out", str(tmp_path)))  # fmt: skip
    assert rc == 0
    report = json.loads((tmp_path / "evaluation.json").read_text())
    want = evaluate.metrics(y, p, bins=20)
    for key in ("rows", "normalized_entropy", "log_loss", "calibration", "actual_ctr"):
        assert report[key] == pytest.approx(want[key], abs=1e-6), key
    assert report["auc"] == pytest.approx(want["auc"], abs=5e-4)  # tied rows: see `gateway`


def test_unlabelled_rows_a_missing_gateway_and_no_token_are_one_line_errors(
    gateway: tuple[str, Path], synthetic_tsv: Path, tmp_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    unlabelled = tmp_path / "rows.tsv"
    unlabelled.write_text("".join(line.split("\t", 1)[1] for line in _head(synthetic_tsv, 5)))
    assert evaluate.main(["--data", str(unlabelled)]) == 2  # progress on: no "0/5 rows" first
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "evaluation needs labelled rows" in err, err
    labelled = tmp_path / "labelled.tsv"
    labelled.write_text("".join(_head(synthetic_tsv, 5)))
    args = ["--data", str(labelled), "--port", "1", "--timeout-s", "2", "--no-progress"]
    assert evaluate.main(args) == 1
    assert capsys.readouterr().err.startswith("error: UNAVAILABLE")
    wrong = tmp_path / "wrong_token"
    wrong.write_text("not-the-token\n")
    bad = _args(gateway, "--data", str(labelled), "--out", str(tmp_path / "r"))
    bad[bad.index("--token-file") + 1] = str(wrong)
    assert evaluate.main(bad) == 1
    assert capsys.readouterr().err.startswith("error: UNAUTHENTICATED")


def test_make_evaluate_passes_data_version_and_out() -> None:
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", "-o", ".venv/.installed", "evaluate",
         "DATA=held.tsv", "VERSION=2.0", "OUT=reports/x"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    line = [x for x in proc.stdout.splitlines() if "serving.tools.evaluate" in x]
    assert line and "--data held.tsv" in line[0] and "--version 2.0" in line[0]
    assert "--out reports/x" in line[0]


def _head(path: Path, n: int) -> list[str]:
    with path.open() as f:
        return [next(f) for _ in range(n)]


# --- metrics in process ------------------------------------------------------------------------


def test_auc_is_the_share_of_correctly_ordered_pairs() -> None:
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, size=300)
    p = np.round(rng.random(300), 1)  # many ties: each counts one half
    pos, neg = p[y == 1], p[y == 0]
    pairs = (pos[:, None] > neg[None, :]).mean() + 0.5 * (pos[:, None] == neg[None, :]).mean()
    assert evaluate.roc_auc(y, p) == pytest.approx(pairs, abs=1e-12)
    with pytest.raises(ValueError, match="both labels"):
        evaluate.roc_auc(np.ones(4), np.arange(4.0))


def test_ne_calibration_and_bins() -> None:
    rng = np.random.default_rng(1)
    y = (rng.random(10_000) < 0.25).astype(np.int8)
    base = evaluate.metrics(y, np.full(len(y), y.mean()), bins=4)
    assert base["normalized_entropy"] == pytest.approx(1.0)  # the base rate: NE 1 by definition
    assert base["calibration"] == pytest.approx(1.0)
    doubled = evaluate.metrics(y, np.full(len(y), 2 * y.mean()), bins=4)
    assert doubled["calibration"] == pytest.approx(2.0) and doubled["normalized_entropy"] > 1
    p = np.clip(y * 0.6 + 0.2, 0, 1)  # informative: better than the base rate
    good = evaluate.metrics(y, p, bins=4)
    assert good["normalized_entropy"] < 1 and good["auc"] == 1.0
    assert sum(b["rows"] for b in good["bins"]) == len(y) and len(good["bins"]) == 4
    manual = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    assert good["log_loss"] == pytest.approx(manual)


# --- the rows read: the trainer's rules, file:line in every error (no gateway: rows first) ---


def _good(i: int) -> str:
    """A well-formed labelled row: label, I1 = i, C1 = hex i, every other field empty."""
    return f"{i % 2}\t{i}" + "\t" * 13 + f"{i:x}" + "\t" * 25


def _evaluate_error(tmp_path: Path, lines: list[str], *more: str, capsys) -> str:  # type: ignore[no-untyped-def]
    """The one error line of ``evaluate`` on a file of ``lines`` (nothing listens on port 1)."""
    data = tmp_path / "rows.tsv"
    data.write_text("\n".join(lines) + "\n")
    rc = evaluate.main(["--data", str(data), "--port", "1", "--timeout-s", "2",
                        "--no-progress", "--out", str(tmp_path / "r"), *more])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0, (rc, err)
    return err


def test_a_label_other_than_0_or_1_is_refused_with_file_and_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    # "2" used to be taken as two clicks, moving the AUC
    lines = [_good(i) for i in range(6)]
    lines[2] = "2" + lines[2][1:]
    err = _evaluate_error(tmp_path, lines, capsys=capsys)
    assert err == f"error: {tmp_path / 'rows.tsv'}:3: column label: '2' is not 0 or 1"


def test_line_numbers_continue_across_batches(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    lines = [_good(i) for i in range(9)]
    lines[6] = lines[6].replace("\t6\t", "\t6.5\t")  # line 7, in the fourth batch of 2
    data = tmp_path / "rows.tsv"
    data.write_text("\n".join(lines) + "\n")
    want = f"{data}:7: column I1: '6.5' is not an integer"
    with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
        list(evaluate.batches(evaluate.file_window(data, 0.0, 0), 2))
    # the held-out half (lines 6..9): lines counted from the top of the file, not the window
    err = _evaluate_error(tmp_path, lines, "--holdout", "0.5", capsys=capsys)
    assert err == f"error: {want}", err


def test_an_empty_line_between_rows_is_refused_as_the_trainer_does(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    # skipped, it shifted every later row off its line; empty lines at the end are the end
    lines = [_good(i) for i in range(3)] + [""] + [_good(i) for i in range(3, 6)] + ["", ""]
    err = _evaluate_error(tmp_path, lines, capsys=capsys)
    assert err == f"error: {tmp_path / 'rows.tsv'}:4: empty line, expected 40 fields"
