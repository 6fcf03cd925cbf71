"""Bad input fails fast with one line naming the problem, and never moves ``latest``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_train
from training.train import main as train_main

pytestmark = pytest.mark.slow

TINY = ["--config", "training/configs/tiny.toml", "--no-progress"]


def _one_error_line(stderr: str, launcher: bool = False) -> str:
    """Our processes print exactly one ``error:`` line and no traceback.

    Under torchrun (``launcher``), torchrun then adds its own ChildFailedError report; only
    our ranks' output is checked there (``make train`` runs a single-process preflight first,
    so a user of make sees just the one line).
    """
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    if launcher:
        assert not re.search(r"\[rank\d+\]: Traceback", stderr), stderr[-3000:]
    else:
        assert "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--data", "/nonexistent/day_0.tsv"], "data file not found: /nonexistent/day_0.tsv"),
        (['sharding.sharding_types=["row_wise"]'], "'row_wise' is not available on cpu"),
    ],
)
def test_bad_data_or_plan_is_one_line(
    overrides: list[str], expected: str, tmp_path: Path, data_dirs: list[str]
) -> None:
    proc = run_train(
        [*TINY, "--run-dir", str(tmp_path), *data_dirs, *overrides], nproc=0, check=False
    )
    assert proc.returncode == 2
    assert expected in _one_error_line(proc.stderr)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["model.embeding_dim=8"],
            "unknown key 'model.embeding_dim' (did you mean 'model.embedding_dim'?)",
        ),
        (["model.num_embeddings=[128,0]"], "has 2 entries"),
        (
            ["model.num_embeddings=" + str([128] * 3 + [0] + [128] * 22)],
            "model.num_embeddings[3] (table t_C4) = 0: a table needs at least 1 row",
        ),
        (['train.pipeline="fast"'], "train.pipeline = 'fast': must be one of"),
        (["--config", "training/configs/nope.toml"], "config file not found"),
    ],
)
def test_bad_config_is_one_line(
    overrides: list[str],
    expected: str,
    tmp_path: Path,
    data_dirs: list[str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Refused while parsing, before any process group or data: the entry point in process
    # (the subprocess path of the same main() is covered by the two cases above).
    code = train_main([*TINY, "--run-dir", str(tmp_path), *data_dirs, *overrides])
    assert code == 2
    assert expected in _one_error_line(capsys.readouterr().err)


def test_missing_data_fails_every_rank_without_hanging(
    tmp_path: Path, data_dirs: list[str]
) -> None:
    # Rank 0 finds the problem; rank 1 must not wait at a barrier for it.
    proc = run_train(
        [*TINY, "--run-dir", str(tmp_path), *data_dirs, "--data", str(tmp_path / "none.tsv")],
        nproc=2,
        check=False,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "data file not found" in _one_error_line(proc.stderr, launcher=True)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, data_dirs: list[str]) -> Path:
    run = tmp_path_factory.mktemp("trained")
    run_train([*TINY, "--run-dir", str(run), *data_dirs, "train.max_steps=4"], nproc=0)
    return run


def _snapshot(run: Path) -> tuple[str, list[str]]:
    ckpts = run / "checkpoints"
    return (ckpts / "latest").read_text(), sorted(p.name for p in ckpts.iterdir())


def _copy(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


def test_resume_into_another_model_shape(
    trained: Path, tmp_path: Path, data_dirs: list[str]
) -> None:
    run = _copy(trained, tmp_path / "run")
    before = _snapshot(run)
    proc = run_train(
        [
            *TINY,
            "--run-dir",
            str(run),
            *data_dirs,
            "model.embedding_dim=16",
            "model.dense_arch=[16,16]",
        ],
        nproc=0,
        check=False,
    )
    assert proc.returncode == 2
    line = _one_error_line(proc.stderr)
    assert "has model.embedding_dim=8 but this config has 16" in line
    assert _snapshot(run) == before


def test_corrupt_checkpoint_metadata(trained: Path, tmp_path: Path, data_dirs: list[str]) -> None:
    run = _copy(trained, tmp_path / "run")
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    (latest / ".metadata").write_bytes(b"\x00garbage")
    before = _snapshot(run)
    proc = run_train([*TINY, "--run-dir", str(run), *data_dirs], nproc=0, check=False)
    assert proc.returncode == 2
    assert "cannot read its DCP metadata" in _one_error_line(proc.stderr)
    assert _snapshot(run) == before


def test_latest_names_a_missing_checkpoint(
    trained: Path, tmp_path: Path, data_dirs: list[str]
) -> None:
    run = _copy(trained, tmp_path / "run")
    (run / "checkpoints" / "latest").write_text("step_00000999\n")
    proc = run_train([*TINY, "--run-dir", str(run), *data_dirs], nproc=0, check=False)
    assert proc.returncode == 2
    assert "names step_00000999, which is missing or incomplete" in _one_error_line(proc.stderr)


def test_resume_from_an_incomplete_directory(
    trained: Path, tmp_path: Path, data_dirs: list[str]
) -> None:
    partial = tmp_path / "step_00000007.partial"
    partial.mkdir()
    proc = run_train(
        [*TINY, "--run-dir", str(tmp_path / "r"), *data_dirs, "--resume", str(partial)],
        nproc=0,
        check=False,
    )
    assert proc.returncode == 2
    assert "is incomplete" in _one_error_line(proc.stderr)
