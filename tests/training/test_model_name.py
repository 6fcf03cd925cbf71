"""Two runs of one preset do not become versions of one model: the default name (``dlrm-<preset>``)
is refused when the model store holds it from another run, unless ``--name`` (``NAME=``) says so."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest

from tests.conftest import run_export

pytestmark = pytest.mark.slow
FAST = ["--formats", '["fp32"]', "--cpu-variant", "fp32", "--parity-rows", "2000"]


def _copy_run(trained: Path, dst: Path) -> Path:
    shutil.copytree(trained / "checkpoints", dst / "checkpoints")
    shutil.copy(trained / "config.json", dst / "config.json")
    return dst


def test_a_second_run_of_the_preset_needs_a_name_of_its_own(trained: Path, tmp_path: Path) -> None:
    demo, mine = _copy_run(trained, tmp_path / "demo"), _copy_run(trained, tmp_path / "mine")
    store = tmp_path / "store"
    run_export(["--run-dir", str(demo), "--model-store", str(store), "--version", "1", *FAST])
    schema = json.loads(zipfile.ZipFile(store / "dlrm-tiny-1.mar").read("schema.json"))
    assert schema["source"]["run_dir"] == str(demo.resolve())  # the run's identity, archived

    # the same run: another version of its model
    run_export(["--run-dir", str(demo), "--model-store", str(store), "--version", "2", *FAST])

    # another run of the same preset: refused before any work, in one line that says what to do
    proc = run_export(
        ["--run-dir", str(mine), "--model-store", str(store), "--version", "3", *FAST],
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"error: {store / 'dlrm-tiny-1.mar'} is dlrm-tiny from another run ({demo.resolve()}), "
        f"not {mine.resolve()}: pass --name (make export NAME=dlrm-mine) so the two models stay "
        "apart"
    ], proc.stderr
    assert not (store / "dlrm-tiny-3.mar").exists() and not (mine / "export").exists()

    # a name given is the user's: their own model, or deliberately a version of the other
    run_export(["--run-dir", str(mine), "--model-store", str(store), "--version", "3",
                "--name", "dlrm-tiny-mine", *FAST])  # fmt: skip
    assert (store / "dlrm-tiny-mine-3.mar").is_file()
    # dlrm-tiny-mine-3.mar is not a version of dlrm-tiny: the demo's run goes on exporting
    run_export(["--run-dir", str(demo), "--model-store", str(store), "--version", "4", *FAST])
    assert (store / "dlrm-tiny-4.mar").is_file()


def test_an_archive_that_does_not_say_its_run_fails_closed(trained: Path, tmp_path: Path) -> None:
    run, store = _copy_run(trained, tmp_path / "run"), tmp_path / "store"
    store.mkdir()
    with zipfile.ZipFile(store / "dlrm-tiny-9.mar", "w") as z:  # no schema.json
        z.writestr("MAR-INF/MANIFEST.json", json.dumps({"model": {"modelName": "dlrm-tiny"}}))
    proc = run_export(["--run-dir", str(run), "--model-store", str(store), *FAST], check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot tell which run it is from" in lines[0], lines
