"""End-to-end trainer tests: real torchrun process groups (gloo) on the tiny preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, run_train, third_party_noise
from tests.training.conftest import MOM, PLAN_A, PLAN_B, TINY, assert_plan_a_resumed_as_plan_b
from tests.training.conftest import losses as _losses
from tests.training.conftest import plan as _plan
from training.checkpoint.store import KILL_IN_SAVE_ENV, read_tensors
from training.metrics.log import read_metrics

pytestmark = pytest.mark.slow


def _scalar_steps(run: Path) -> dict[str, list[int]]:
    """TensorBoard's scalars of a run (``RUN/tb``) read back: the steps of each tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    return {tag: [e.step for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _resume_on_one_rank(src: Path, run: Path, data_dirs: list[str], max_steps: int) -> Path:
    """1 process (no torchrun: world size 1), PLAN_B, resuming ``src`` into a new run directory, up to ``max_steps``."""
    args = ["--run-dir", str(run), "--resume", str(src), *data_dirs, *PLAN_B]
    run_train([*TINY, *args, f"train.max_steps={max_steps}"], nproc=0)
    return run


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory, data_dirs: list[str]) -> Path:
    """2 ranks, column-wise + table-wise, 60 steps, checkpoints at 30 and 60."""
    run = tmp_path_factory.mktemp("run_a")
    run_train([*TINY, "--run-dir", str(run), *data_dirs, *PLAN_A, "train.max_steps=60"], nproc=2)
    return run


def test_two_rank_run_learns_and_records(run_a: Path) -> None:
    ckpts = run_a / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000060"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000030", "step_00000060"]
    plan = _plan(ckpts / "step_00000030")
    assert plan["t_C1"]["sharding_type"] == "column_wise" and plan["t_C1"]["ranks"] == [0, 1]
    assert plan["t_C3"]["sharding_type"] == "table_wise"
    evals = read_metrics(run_a / "metrics.jsonl")
    assert [e["step"] for e in evals] == [30, 60]
    for key in ("step", "auc", "ne", "samples_per_sec", "oracle_auc"):
        assert key in evals[-1]
    # It learns the planted signal: most of the way to the Bayes limit in 60 small steps.
    assert evals[-1]["auc"] > 0.9 * evals[-1]["oracle_auc"]
    assert evals[-1]["ne"] < 1.0
    losses = _losses(run_a)
    assert losses[60] < losses[10]
    # the linear baseline beside the final figures: the rows trained (60 x 256), the same
    # held-out rows; and the best evaluation's checkpoint named by checkpoints/best
    final = evals[-1]
    assert final["final"] and final["baseline_train_rows"] == 60 * 256
    assert 0.6 < final["baseline_auc"] < 1 and 0 < final["baseline_ne"] < 1, final
    best = max(evals, key=lambda e: e["auc"])["step"]
    assert (ckpts / "best").read_text().strip() == f"step_{best:08d}"
    assert final["best"]["step"] == best
    meta = json.loads((ckpts / f"step_{best:08d}" / "meta.json").read_text())
    assert meta["monitor"]["best_step"] == best


def test_tensorboard_scalars_are_the_logs(run_a: Path) -> None:
    steps = _scalar_steps(run_a)
    for tag in ("eval/auc", "eval/ne", "eval/samples_per_sec", "eval/train_loss"):
        assert steps[tag] == [30, 60], (tag, steps)
    assert steps["eval/baseline_auc"] == steps["eval/baseline_ne"] == [60]
    assert steps["train/loss"] == sorted(_losses(run_a)) == [10, 20, 30, 40, 50, 60]


@pytest.fixture(scope="module")
def run_b(run_a: Path, tmp_path_factory: pytest.TempPathFactory, data_dirs: list[str]) -> Path:
    """Run A's step 30 resumed on 1 process (PLAN_B) with zero further steps: the resumed
    state saved as loaded, under the new plan."""
    src = run_a / "checkpoints" / "step_00000030"
    return _resume_on_one_rank(src, tmp_path_factory.mktemp("run_b"), data_dirs, max_steps=30)


def test_resume_on_one_rank_with_another_plan_restores_state(run_a: Path, run_b: Path) -> None:
    src = run_a / "checkpoints" / "step_00000030"
    dst = run_b / "checkpoints" / "step_00000030"
    assert_plan_a_resumed_as_plan_b(src, dst)
    meta = json.loads((dst / "meta.json").read_text())
    assert meta["progress"]["step"] == 30 and meta["world_size"] == 1


def test_resume_from_one_rank_on_two_ranks_restores_state(
    run_b: Path, tmp_path: Path, data_dirs: list[str]
) -> None:
    # The other direction: a 1-process checkpoint (every table whole) resumed by 2 ranks that
    # split C1 and C2 by columns; zero further steps, so the state is saved as loaded.
    src = run_b / "checkpoints" / "step_00000030"
    args = ["--run-dir", str(tmp_path), "--resume", str(src), *data_dirs, *PLAN_A]
    proc = run_train([*TINY, *args, "train.max_steps=30"], nproc=2)
    # issue 46 item 10: torch's "deprecating ShardedTensor" FutureWarning at every resume
    assert not third_party_noise(proc.stdout + proc.stderr), third_party_noise(proc.stderr)[:5]
    dst = tmp_path / "checkpoints" / "step_00000030"
    plan = _plan(dst)
    assert plan["t_C1"]["sharding_type"] == "column_wise" and plan["t_C1"]["ranks"] == [0, 1]
    saved, loaded = read_tensors(src), read_tensors(dst)
    for key, value in saved.items():
        if key.startswith("model."):
            assert torch.equal(loaded[key], value), key  # weights bit-exact through resharding
    key = f"{MOM}t_C3.weight.t_C3.momentum1"  # table-wise -> table-wise: accumulators exact
    assert torch.equal(loaded[key], saved[key]), key
    meta = json.loads((dst / "meta.json").read_text())
    assert meta["progress"]["step"] == 30 and meta["world_size"] == 2


def test_resumed_loss_continues_where_it_was(
    run_a: Path, tmp_path: Path, data_dirs: list[str]
) -> None:
    src = run_a / "checkpoints" / "step_00000030"
    run_c = _resume_on_one_rank(src, tmp_path / "c", data_dirs, max_steps=60)
    a, c = _losses(run_a), _losses(run_c)
    assert sorted(c) == [40, 50, 60]  # the step counter continued from 30
    for step in (40, 50, 60):
        # Same global batches on 1 rank as on 2; only the float summation order and the
        # column-sharded accumulators differ, so the curves stay together.
        assert abs(c[step] - a[step]) < 0.01, (step, a[step], c[step])


def test_kill_during_save_keeps_latest_then_resumes(tmp_path: Path, data_dirs: list[str]) -> None:
    run = tmp_path / "k"
    args = [*TINY, "--run-dir", str(run), *data_dirs, "train.max_steps=60"]
    proc = run_train(args, nproc=2, env={KILL_IN_SAVE_ENV: "60"}, check=False)
    assert proc.returncode != 0
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000030"
    assert (ckpts / "step_00000060.partial").is_dir()  # the interrupted save, never renamed
    assert not (ckpts / "step_00000060").exists()
    run_train(args, nproc=2)  # resume=auto picks latest and redoes steps 31..60
    assert (ckpts / "latest").read_text().strip() == "step_00000060"
    assert not (ckpts / "step_00000060.partial").exists()
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    assert steps == [30, 60]  # the killed run's eval at 60 was dropped when 31..60 were redone
    assert _scalar_steps(run)["eval/auc"] == [30, 60]  # and purged from TensorBoard


def test_trains_on_criteo_file_with_edge_cases(tmp_path: Path, data_dirs: list[str]) -> None:
    data = ROOT / "tests" / "data" / "criteo_edge_cases.tsv"
    run = tmp_path / "edge"
    proc = run_train(
        [
            *TINY,
            "--run-dir",
            str(run),
            "--data",
            str(data),
            *data_dirs[:1],
            "train.batch_size=2",
            # 9 rows (labels 0 1 0 1 | 0 1 | 1 0 1): 4 to train, 2 validation, 3 test, each of
            # the held-out splits with both labels (an AUC needs them)
            "data.eval_fraction=0.55",
            "train.eval_every=0",
            "train.checkpoint_every=0",
        ],
        nproc=2,
    )
    meta = json.loads((run / "checkpoints" / "step_00000002" / "meta.json").read_text())
    report = meta["data"]["parse_report"]
    assert report["rows_ok"] == 9 and report["rows_bad"] == 1
    assert "criteo_edge_cases.tsv:" in proc.stderr  # the skipped row is named with file:line


def test_dcn_interaction_trains_on_one_process(tmp_path: Path, data_dirs: list[str]) -> None:
    proc = run_train(
        [
            *TINY,
            "--run-dir",
            str(tmp_path),
            *data_dirs,
            'model.arch="dlrm_dcn"',
            "train.max_steps=30",
        ],
        nproc=0,
    )
    final = json.loads(proc.stdout.strip().splitlines()[-1])["final"]
    assert final["step"] == 30
    # It learns the planted signal, like DLRM: most of the way to the Bayes limit (a DCN that
    # trained nothing, or scored at random, sits near 0.5).
    print(f"DCN AUC {final['auc']:.4f}, oracle {final['oracle_auc']:.4f}")
    assert final["auc"] > 0.9 * final["oracle_auc"], final
    assert (tmp_path / "curves.png").stat().st_size > 10_000
