"""Replacing a checkpoint or an export never leaves ``latest`` or the served schema pointing at
something missing: the new one is built aside, swapped in, and only then the old one deleted.

Crashes are simulated by making the real code's own rename (or the archiver) raise at the
critical point; everything else runs for real (DCP saves and loads, the export pipeline).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import ROOT
from training.checkpoint import store as checkpoint
from training.errors import RecsysError

STEP = 7


def _state(value: float) -> dict[str, Any]:
    return {"w": torch.full((4, 3), value), "b": torch.arange(5, dtype=torch.float32) + value}


def _save(root: Path, value: float, step: int = STEP) -> Path:
    progress = checkpoint.Progress(step=step)
    return checkpoint.save(root, progress, _state(value), {"value": value}, [], keep_last=2)


def _load(path: Path) -> dict[str, Any]:
    state = _state(-1.0)
    dcp.load(state, checkpoint_id=str(path))
    return state


def _assert_holds(path: Path | None, value: float) -> None:
    assert path is not None and checkpoint.is_complete(path), path
    loaded = _load(path)
    for key, tensor in _state(value).items():
        assert torch.equal(loaded[key], tensor), (path, key)
    assert checkpoint.read_meta(path)["value"] == value


def _fail_on(monkeypatch: pytest.MonkeyPatch, when: Any) -> None:
    """os.replace / shutil.rmtree raise (a crash) on the call ``when(name, src, dst)`` picks."""
    real_replace, real_rmtree = os.replace, shutil.rmtree

    def replace(src: Any, dst: Any, *a: Any, **kw: Any) -> None:
        if when("replace", Path(src), Path(dst)):
            raise OSError(f"simulated crash: os.replace({src}, {dst})")
        real_replace(src, dst, *a, **kw)

    def rmtree(path: Any, *a: Any, **kw: Any) -> None:
        if when("rmtree", Path(path), None):
            raise OSError(f"simulated crash: shutil.rmtree({path})")
        real_rmtree(path, *a, **kw)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)


# The moments of a re-save of an existing step that ``latest`` names, and which checkpoint
# (the old value 1.0 or the new 2.0) ``latest`` must resolve to after a crash there.
CRASH_POINTS = {
    # the new shards are complete; the first thing that touches the old directory fails
    "removing_the_old": (
        lambda op, src, dst: src.name == checkpoint.step_dir_name(STEP),
        1.0,
    ),
    # the old one is out of the way; renaming the new one in fails
    "renaming_the_new_in": (
        lambda op, src, dst: op == "replace" and src.name.endswith(checkpoint.PARTIAL),
        1.0,
    ),
    # the new one is in place and named by latest; deleting the old copy fails
    "deleting_the_old_copy": (
        lambda op, src, dst: op == "rmtree" and src.name.endswith(".old"),
        2.0,
    ),
}


@pytest.mark.parametrize("point", list(CRASH_POINTS))
def test_resave_interrupted_anywhere_keeps_latest_loadable(
    point: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "checkpoints"
    first = _save(root, 1.0)
    assert checkpoint.read_latest(root) == first
    when, expected = CRASH_POINTS[point]
    with monkeypatch.context() as m:
        _fail_on(m, when)
        with pytest.raises(OSError, match="simulated crash"):
            _save(root, 2.0)  # a resumed run re-saving the step that latest names
    # What a resume (--resume auto) or an export would take now: complete, loadable, intact.
    _assert_holds(checkpoint.read_latest(root), expected)
    _assert_holds(checkpoint.resolve("auto", root), expected)
    # The next save succeeds and leaves nothing of the interrupted one behind.
    _assert_holds(_save(root, 3.0), 3.0)
    assert sorted(p.name for p in root.iterdir()) == ["latest", checkpoint.step_dir_name(STEP)]
    _assert_holds(checkpoint.read_latest(root), 3.0)


def test_leftover_of_a_swap_is_restored_by_the_next_save(tmp_path: Path) -> None:
    # A re-save killed between its two renames of step 7 while latest names step 9: the old
    # step 7 sits aside. The next save (another step) puts it back among the checkpoints.
    root = tmp_path / "checkpoints"
    _save(root, 1.0, step=7)
    _save(root, 9.0, step=9)
    seven = root / checkpoint.step_dir_name(7)
    seven.rename(seven.with_name(seven.name + ".old"))
    assert checkpoint.complete_checkpoints(root) == [root / checkpoint.step_dir_name(9)]
    _save(root, 11.0, step=11)
    assert sorted(p.name for p in root.iterdir()) == [
        "latest",
        checkpoint.step_dir_name(9),
        checkpoint.step_dir_name(11),
    ]  # step 7 came back, then was pruned as the oldest of three (keep_last=2)


# ----------------------------------------------------------------------------- export


def _tree(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


@pytest.mark.slow
def test_failed_archive_leaves_previous_export_and_mar_byte_identical(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from training.export import pipeline

    run, store = tmp_path / "run", tmp_path / "store"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("export"))

    def export(**kw: Any) -> dict[str, Any]:
        cfg = pipeline.ExportConfig(
            run_dir=run, model_store=store, version="1.0", formats=["fp32"], cpu_variant="fp32",
            parity_rows=4000, progress=False, handler=ROOT / "serving/worker/handler.py", **kw,
        )  # fmt: skip
        return pipeline.run_export(cfg)

    export()
    mar = store / "dlrm-tiny-1.0.mar"
    before_dir, before_mar = _tree(run / "export"), mar.read_bytes()
    assert "schema.json" in before_dir

    def archiver_fails(*args: Any, **kw: Any) -> Path:
        raise RecsysError("archiving the .mar failed: simulated")

    with monkeypatch.context() as m:
        m.setattr(pipeline, "archive", archiver_fails)
        with pytest.raises(RecsysError, match="simulated"):
            export(overwrite=True, cuda_dtype="bf16")  # a schema that differs from the first
    assert _tree(run / "export") == before_dir  # schema.json and every artifact, byte for byte
    assert mar.read_bytes() == before_mar
    assert sorted(p.name for p in store.iterdir()) == [mar.name]  # no staging folder left
    assert not list(run.glob(".export*"))

    # With the archiver working, the same re-export replaces both together.
    export(overwrite=True, cuda_dtype="bf16")
    assert b'"cuda_dtype": "bf16"' in (run / "export" / "schema.json").read_bytes()
    assert mar.read_bytes() != before_mar
    assert sorted(p.name for p in store.iterdir()) == [mar.name]
    assert not list(run.glob(".export*"))
