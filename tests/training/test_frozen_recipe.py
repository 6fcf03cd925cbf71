"""docs/operating.md's frozen-model recipe (continuous learning, "A run.") works for any preset as
printed: its commands run here on the tiny preset (smaller days, in a scratch folder), and the
day-0 checkpoint it scores from survives the fresh run's ``train.keep_last`` pruning."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT, VENV_BIN, _env
from training.checkpoint.store import check_compatible, complete_checkpoints, is_complete
from training.errors import CheckpointError

pytestmark = pytest.mark.slow
README = (ROOT / "docs" / "operating.md").read_text()  # the guide that holds the recipe
# what the recipe's commands read relative to the repository root
LINKED = ("Makefile", "training", "serving", "recsys_stack", "requirements", "pyproject.toml")


def recipe() -> list[str]:
    """The recipe's block: its commands, continuation lines joined."""
    start = README.index("```bash\n", README.index("**A run.** Six days")) + len("```bash\n")
    block = README[start : README.index("\n```", start)]
    return block.replace("\\\n", " ").splitlines()


def on_tiny(line: str) -> str:
    """The line for the tiny preset on small days and one process (the loop on 2 ranks is
    tests/training/test_continuous.py's); make told the venv is built (as the suite's
    make_command does)."""
    for old, new in (("PRESET=demo", "PRESET=tiny"), ("--days 6", "--days 3"),
                     ("--rows 200000", "--rows 3000"), ("--vocab 1000", "--vocab 100"),
                     ("make continuous ", "make continuous NPROC=1 ")):  # fmt: skip
        line = line.replace(old, new)
    venv = VENV_BIN.parent
    if line.startswith("make "):
        line = f"make --no-print-directory -o {venv}/.installed VENV={venv} " + line[5:]
    return line


def test_the_frozen_recipe_runs_on_another_preset_and_keeps_its_checkpoint(
    tmp_path: Path,
) -> None:
    lines = recipe()
    wanted = ("python -m training.data.synthetic", "make continuous", "cp ")
    steps = [line for line in lines if line.startswith(wanted)]
    assert any("runs/frozen" in line for line in steps) and any(
        line.startswith("cp ") for line in steps
    ), lines
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    for line in steps:
        command = on_tiny(line.split("   #")[0])
        proc = subprocess.run(
            ["bash", "-c", f"source {VENV_BIN / 'activate'} && {command}"], cwd=tmp_path,
            env=_env({"RECSYS_SERVE_DIR": str(tmp_path / "serve")}), capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, f"{command}\n{(proc.stdout + proc.stderr)[-3000:]}"
    runs = tmp_path / "runs"
    frozen = [json.loads(x) for x in (runs / "frozen" / "progressive.jsonl").open()]
    assert [r["file"] for r in frozen] == ["day_1.tsv", "day_2.tsv"], frozen
    fresh = [json.loads(x) for x in (runs / "fresh" / "progressive.jsonl").open()]
    assert frozen[0]["auc"] == pytest.approx(fresh[1]["auc"], abs=1e-6)  # the same day-0 model
    # the fresh run's keep_last pruned its day-0 step; the copy the frozen run scored from is kept
    day0 = runs / "day0"
    assert is_complete(day0)
    kept = [p.name for p in complete_checkpoints(runs / "fresh" / "checkpoints")]
    assert len(kept) == 2 and day0.name not in kept, kept
    step = json.loads((day0 / "meta.json").read_text())["progress"]["step"]
    assert all(int(name.split("_")[1]) > step for name in kept), (kept, step)


def test_a_shape_mismatch_points_at_the_checkpoints_preset(tmp_path: Path) -> None:
    # what the recipe met when make added PRESET's config to a --resume of another preset
    meta = {"config": {"name": "tiny", "model": {"embedding_dim": 8}}}
    with pytest.raises(CheckpointError) as e:
        check_compatible(tmp_path, meta, {"embedding_dim": 16})
    assert str(e.value) == (
        f"checkpoint {tmp_path} has model.embedding_dim=8 but this config has 16: a resume keeps "
        "the model's shape, so give its preset's config (PRESET=tiny, --config "
        "training/configs/tiny.toml), or train a new model (another --run-dir, or --resume none)"
    )
