"""``make sweep`` (issue 48 item 4): Optuna trials of real training runs on the validation AUC.

The end-to-end test runs ``make sweep PRESET=tiny`` twice on small data (2 trials, then the
same command with TRIALS=3 continues the study in its journal file: one more trial), checks
the report, the plot and the best config, and trains that config. The pieces are tested with
real parts: the objective read from metrics.jsonl records (validation first), a real child
process stopped when pruned or out of time, the preset as the space's own point, the TOML
writer against ``tomllib``, and the budget counted over a real Optuna study.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import textwrap
import threading
import time
import tomllib
from pathlib import Path

import optuna
import pytest

from tests.conftest import ROOT, run_make, run_train
from training.config import config_to_dict, load_config
from training.metrics.log import read_metrics
from training.sweep import best, space
from training.sweep import trial as runner
from training.sweep.options import SpaceConfig, parse_args
from training.sweep.study import counted, needs_default

SMALL = ["data.synthetic_rows=4000", "train.max_steps=12", "train.eval_every=6"]


def test_the_objective_prefers_validation_records_and_takes_the_last() -> None:
    legacy = [{"step": 6, "auc": 0.70}, {"step": 12, "auc": 0.68, "final": True}]
    assert runner.trial_value(legacy)["auc"] == 0.68  # the run's end, not its best
    split = [
        {"step": 6, "auc": 0.71, "split": "valid", "auc_ci": [0.6, 0.8]},
        {"step": 12, "auc": 0.73, "split": "valid"},
        {
            "step": 12,
            "auc": 0.99,
            "split": "test",
            "final": True,  # the trainer's final record
            "valid": {"auc": 0.74, "auc_ci": [0.7, 0.78], "eval_rows": 1000},
        },
    ]
    assert runner.trial_value(split)["auc"] == 0.74  # the whole validation split; never test
    assert [r["auc"] for r in runner.valid_records(split)] == [0.71, 0.73, 0.74]
    assert runner.on_test(split) == {"auc": 0.99}
    assert runner.trial_value([{"step": 1, "loss": 0.5}]) is None


def _writer(path: Path, evals: int, pause_s: float) -> list[str]:
    """A real child that writes ``evals`` evaluation records to ``path``, then sleeps long."""
    code = textwrap.dedent(f"""
        import json, time
        with open({str(path)!r}, "a") as f:
            for i in range(1, {evals} + 1):
                f.write(json.dumps({{"step": i, "samples_seen": 100 * i, "auc": 0.5 + i / 100}}) + "\\n")
                f.flush()
                time.sleep({pause_s})
        time.sleep(600)
    """)
    return [sys.executable, "-c", code]


def _watch(stop: threading.Event, prune_after: int = 0, deadline: float = 0.0) -> runner.Watch:
    reports: list[tuple[float, int]] = []
    return runner.Watch(
        report=lambda v, s: reports.append((v, s)),
        should_prune=lambda: bool(prune_after) and len(reports) >= prune_after,
        heartbeat=lambda: None, stop=stop, deadline=deadline, poll_s=0.05,
    )  # fmt: skip


def test_a_pruned_trial_is_stopped_at_its_evaluation(tmp_path: Path) -> None:
    watch = _watch(threading.Event(), prune_after=2)
    start = time.monotonic()
    cmd = _writer(tmp_path / "metrics.jsonl", evals=5, pause_s=0.3)
    with pytest.raises(runner.Pruned, match="pruned at 200 rows seen"):
        runner.run(cmd, tmp_path, 1, watch)
    assert time.monotonic() - start < 30  # killed, not waited for (it sleeps 600 s)
    assert watch.reported == {100, 200}


def test_the_time_budget_and_an_interrupt_stop_a_running_trial(tmp_path: Path) -> None:
    cmd = _writer(tmp_path / "a" / "metrics.jsonl", evals=1, pause_s=0)
    with pytest.raises(runner.Pruned, match="time budget"):
        runner.run(cmd, tmp_path / "a", 1, _watch(threading.Event(), deadline=time.monotonic() + 2))
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    with pytest.raises(runner.Interrupted):
        runner.run(_writer(tmp_path / "b" / "metrics.jsonl", 1, 0), tmp_path / "b", 1, _watch(stop))


def test_evaluations_are_reported_on_the_presets_grid_whatever_the_batch(tmp_path: Path) -> None:
    """A trial at another batch size evaluates near, not at, the preset's rows seen: the pruner
    gets the nearest of the preset's evaluations (100, 200, 300 rows on a grid of 150)."""
    watch = _watch(threading.Event(), deadline=time.monotonic() + 3)
    watch.grid = 150
    with pytest.raises(runner.Pruned, match="time budget"):
        runner.run(_writer(tmp_path / "metrics.jsonl", 3, 0), tmp_path, 1, watch)
    assert watch.reported == {1, 2}


def test_a_failed_run_names_its_error_line(tmp_path: Path) -> None:
    code = "import sys; print('error: data.path = x: no such file', file=sys.stderr); sys.exit(2)"
    with pytest.raises(runner.Failed, match=r"error: data.path = x: no such file \(exit 2"):
        runner.run([sys.executable, "-c", code], tmp_path, 1, _watch(threading.Event()))


@pytest.mark.parametrize("preset", ["tiny", "demo", "criteo-kaggle"])
def test_the_preset_is_the_first_point_of_its_space(preset: str) -> None:
    base = load_config(f"training/configs/{preset}.toml")
    params = space.default_params(base, SpaceConfig())
    values = space.suggest(optuna.trial.FixedTrial(params), base, SpaceConfig())
    again = load_config(f"training/configs/{preset}.toml", space.overrides(values))
    assert config_to_dict(again) == config_to_dict(base)


def test_sizes_that_must_agree_follow_each_other() -> None:
    base = load_config("training/configs/tiny.toml")
    params = {**space.default_params(base, SpaceConfig()), "embedding_dim": 16, "batch_size": 128}
    values = space.suggest(optuna.trial.FixedTrial(params), base, SpaceConfig())
    cfg = load_config("training/configs/tiny.toml", space.overrides(values))  # validates
    assert cfg.model.dense_arch == [16, 16]  # the bottom MLP ends at the embedding dim
    assert cfg.train.eval_every == 60  # evaluations at the same rows seen as at batch 256


def test_the_best_config_writer_round_trips_a_preset(tmp_path: Path) -> None:
    raw = tomllib.loads((ROOT / "training/configs/demo.toml").read_text())
    assert tomllib.loads(best.dumps(raw)) == raw  # sharding.tables.t_C1 and all
    path = best.write_best(tmp_path / "b.toml", ROOT / "training/configs/demo.toml",
                           ["optim.dense_lr=0.01", "model.dense_arch=[32, 16]"], "demo-best",
                           ["from a test"])  # fmt: skip
    cfg = load_config(path)
    assert (cfg.name, cfg.optim.dense_lr, cfg.model.dense_arch) == ("demo-best", 0.01, [32, 16])


def test_the_budget_leaves_out_interrupted_trials() -> None:
    study = optuna.create_study(direction="maximize")
    ok, failed, interrupted = study.ask(), study.ask(), study.ask()
    study.tell(ok, 0.7)
    failed.set_user_attr("failed", "error: ...")
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    study.tell(interrupted, state=optuna.trial.TrialState.FAIL)
    study.ask()  # running
    assert counted(study) == 3


def test_an_interrupted_preset_trial_is_enqueued_again() -> None:
    study = optuna.create_study(direction="maximize")
    assert needs_default(study)
    study.enqueue_trial({"x": 1.0}, user_attrs={"default": True})
    assert not needs_default(study)  # waiting
    study.tell(study.ask(), state=optuna.trial.TrialState.FAIL)  # interrupted: not counted
    assert needs_default(study)


def test_training_overrides_go_to_the_trials_and_the_rest_to_the_sweep() -> None:
    args = parse_args(["--preset", "tiny", "trials=5", "--parallel", "2", "train.epochs=2",
                       "space.max_epochs=4", "--data", "/x.tsv"])  # fmt: skip
    assert (args.config.trials, args.config.parallel, args.config.space.max_epochs) == (5, 2, 4)
    assert args.train_overrides == ["train.epochs=2", 'data.path="/x.tsv"']
    assert args.base.train.epochs == 2 and args.out == Path("runs/sweep-tiny")


def test_help_answers_without_torch_and_bad_keys_are_one_line() -> None:
    code = (
        "import sys\nfrom training.sweep.__main__ import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
        "print('torch' if 'torch' in sys.modules else 'torch-free')"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.stdout.rstrip().endswith("torch-free"), proc.stderr[-2000:]
    assert (
        "--trials" in proc.stdout and "--storage" in proc.stdout and "space.params" in proc.stdout
    )
    for argv, said in [
        (["trialz=3"], "unknown key 'trialz' (did you mean 'trials'?)"),
        (["train.epochz=3"], "unknown key 'train.epochz' (did you mean 'train.epochs'?)"),
        (["--preset", "nope"], "preset = nope: no training/configs/nope.toml"),
        (["space.size_factors=[0, 1]"], "space.size_factors = [0.0, 1.0]: must be positive"),
    ]:
        proc = subprocess.run([sys.executable, "-m", "training.sweep", *argv], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: ") and said in lines[0], lines[0]


def _sweep(out: Path, trials: int, data_dirs: list[str]) -> str:
    extra = ["--parallel", "2", "--seed", "3", *SMALL, *data_dirs]
    proc = run_make("sweep", {"PRESET": "tiny", "SWEEP_DIR": str(out), "TRIALS": str(trials),
                              "SWEEP_ARGS": shlex.join(extra)}, timeout=400)  # fmt: skip
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_make_sweep_runs_resumes_reports_and_its_best_config_trains(
    tmp_path: Path, data_dirs: list[str]
) -> None:
    out = tmp_path / "sweep"
    first = _sweep(out, 2, data_dirs)
    assert "trial 0: " in first and "trial 1: " in first, first[-3000:]
    journal = out / "study.journal"
    assert journal.is_file()
    before = journal.stat().st_size
    second = _sweep(out, 3, data_dirs)  # the same command, a larger budget: one more trial
    assert "1 trials to run (2 in the study)" in second, second[-3000:]
    assert "trial 2: " in second and "trial 0: " not in second
    assert journal.stat().st_size > before
    summary = json.loads((out / "summary.json").read_text())
    assert sum(summary["trials"].values()) == 3 and summary["trials"]["complete"] >= 1
    report = (out / "report.md").read_text()
    assert report.count("\n| ") == 4  # the header and 3 trials
    assert "0 (preset) | complete" in report and "validation AUC [95% CI]" in report
    assert (out / "trials.png").stat().st_size > 10_000
    won = summary["best"]
    ci = won["value"]["auc_ci"]
    assert ci[0] < won["value"]["auc"] < ci[1]
    last = read_metrics(Path(won["run_dir"]) / "metrics.jsonl")[-1]
    assert last["split"] == "test"  # the final record: its validation figures are under valid
    assert won["value"]["auc"] == last["valid"]["auc"]  # the run's own last validation figure
    # the best config trains as it is, and is the trial's config
    run = tmp_path / "best_run"
    run_train(["--config", str(out / "best.toml"), "--run-dir", str(run), "--no-progress"], nproc=0)
    trained = json.loads((run / "config.json").read_text())
    tried = json.loads((Path(won["run_dir"]) / "config.json").read_text())
    assert {**trained, "name": None} == {**tried, "name": None}
    assert trained["name"] == "tiny-best"
    third = _sweep(out, 3, data_dirs)  # nothing left to run: the report again
    assert "nothing to run" in third and "trial 3" not in third
