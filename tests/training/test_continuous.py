"""The continuous loop end to end: drifting days, progressive validation, every row trained once
(the last partial batch carried into the next file), a kill mid-file, a malformed file, an
export judged on the next file's unseen rows, TensorBoard; real torchrun process groups (gloo)
on tiny sizes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from serving.tools import evaldata
from tests import warm
from tests.conftest import ROOT, VENV_BIN, _env
from training.continuous.figure import draw
from training.continuous.file_loop import KILL_AT_STEP_ENV
from training.data.drift import drift_report
from training.data.synthetic import SyntheticSpec
from training.metrics.log import read_metrics

pytestmark = pytest.mark.slow

DAYS, ROWS, DRIFT = 4, 20_000, 0.2
STEPS_PER_DAY = ROWS // 256  # tiny: global batch 256, 32 more rows carried on each day (< 256)
SMALL = 10 * 256  # rows of a small day: 10 batches, none carried


def run_continuous(
    args: list[str],
    nproc: int = 2,
    env: dict[str, str] | None = None,
    check: bool = True,
    cold: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``torchrun -m training.continuous`` on the tiny config; its ranks start from the warm
    Python (tests/warm.py) unless ``cold``."""
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}",
           "-m", "training.continuous", "--config", "training/configs/tiny.toml",
           "--no-progress", *args]  # fmt: skip
    run_env = warm.cold_env(_env(env)) if cold else _env(env)
    proc = subprocess.run(cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-4000:]}")
    return proc


def copy_days(days: Path, dst: Path, names: list[str]) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        for f in (f"{n}.tsv", f"{n}.prob.npy"):
            shutil.copy(days / f, dst / f)
    return dst


def meta_of(run: Path) -> dict:
    latest = (run / "checkpoints" / "latest").read_text().strip()
    return json.loads((run / "checkpoints" / latest / "meta.json").read_text())


def scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def make_days(out: Path, days: int, rows: int, drift: float = 0.1) -> str:
    """``days`` synthetic days of ``rows`` rows (vocabulary 100) drifting by ``drift`` into
    ``out`` (``day_<d>.tsv`` and ``.prob.npy``); the generator's stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "training.data.synthetic", "--days", str(days), "--drift",
         str(drift), "--rows", str(rows), "--vocab", "100", "--out", str(out), "--no-progress"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return proc.stdout


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("days")
    stdout = make_days(out, DAYS, ROWS, DRIFT)
    assert "day 0's click model" in stdout, stdout
    return out


def test_the_drift_is_what_the_days_hold(days: Path) -> None:
    assert sorted(p.name for p in days.iterdir()) == sorted(
        f"day_{d}{ext}" for d in range(DAYS) for ext in (".tsv", ".prob.npy")
    )
    spec = SyntheticSpec(rows=ROWS, vocab_sizes=[100] * 26)
    same = drift_report(spec, 3, 0.0, 20_000)
    assert all(abs(r.loss) < 0.005 for r in same), same  # D = 0: day 0's model stays the best
    drifting = drift_report(spec, DAYS, DRIFT, 20_000)
    losses = [r.loss for r in drifting]
    assert losses[0] == 0.0 and losses == sorted(losses) and losses[-1] > 0.04, drifting


@pytest.fixture(scope="module")
def cont(days: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """4 days on 2 ranks, a malformed file between day 1 and day 2, files that are not there
    yet (a dot-file, a .tmp), and a stack serving another model: one export (of the model after
    3 days, at day 3's arrival), no rollout."""
    base = tmp_path_factory.mktemp("cont")
    inbox = copy_days(days, base / "inbox", [f"day_{d}" for d in range(DAYS)])
    (inbox / "day_1x.tsv").write_text("not\ta\tcriteo\trow\n" * 50)
    (inbox / ".day_9.tsv.tmp-1").write_text("half written\n")
    (inbox / "day_9.tsv.tmp").write_text("half written\n")
    serve, store = base / "serve", base / "store"
    serve.mkdir()
    (serve / "plan.json").write_text(json.dumps({"model": "dlrm-other", "default": "1"}))
    (serve / "serve.json").write_text(
        json.dumps({"replicas": [{"torchserve": {"model_store": str(store)}}]})
    )
    run = base / "run"
    run_continuous(
        ["--run-dir", str(run), "--data-dir", str(inbox), f'data.cache_dir="{base / "cache"}"',
         "data.max_bad_rows=5", "train.keep_last=10", f"continuous.export_every={DAYS - 1}",
         f'continuous.serve_dir="{serve}"', f'continuous.export_args=["--parity-rows", "{ROWS}"]'],
        cold=True,  # the loop's one cold run in the suite (its export too): no warm Python
    )  # fmt: skip
    return run, inbox, store


def test_each_file_is_scored_before_it_is_trained(cont: tuple[Path, Path, Path]) -> None:
    run, _, _ = cont
    prog = read_metrics(run / "progressive.jsonl")
    assert [r["file"] for r in prog] == [f"day_{d}.tsv" for d in range(DAYS)]
    ledger = meta_of(run)["continuous"]["files"]
    for r, f in zip(prog, ledger, strict=True):
        assert r["step"] == f["steps"][0]  # the model before the file's first step
        assert r["rows"] == ROWS and {"auc", "ne", "calibration", "oracle_auc"} <= set(r)
        assert f["segments"] == [[0, STEPS_PER_DAY * 256]] and f["done"]
    assert [r["step"] for r in prog] == [d * STEPS_PER_DAY for d in range(DAYS)]
    assert prog[0]["auc"] < 0.6 < prog[1]["auc"]  # an untrained model, then one of a day
    # the linear baseline, fitted on the days trained, scored on the same rows before each
    # new day (none before the first: it has seen nothing); its state is in the checkpoints
    assert "baseline_auc" not in prog[0]
    assert all(0.6 < r["baseline_auc"] < 1 and 0 < r["baseline_ne"] < 1 for r in prog[1:])
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert (run / "checkpoints" / latest / "baseline.npz").is_file()


def test_no_row_is_dropped_the_last_partial_batch_goes_to_the_next_file(
    cont: tuple[Path, Path, Path],
) -> None:
    run, _, _ = cont
    ledger = meta_of(run)["continuous"]["files"]
    out = 0
    for d, f in enumerate(ledger):  # 20,000 rows a day, batches of 256: 32 more rows a day
        assert (f["carried_in"], f["carried_out"]) == (32 * d, 32 * (d + 1)), f
        assert f["carry_from"] == (d - 1 if d else None) and f["carried_in"] == out
        assert f["carried_in"] + f["rows"] == f["row"] + f["carried_out"]
        out = f["carried_out"]
    assert sum(f["row"] for f in ledger) + out == DAYS * ROWS  # each row trained, or waiting
    events = [e for e in read_metrics(run / "continuous.jsonl") if e["event"] == "file"]
    assert [(e["trained_rows"], e["carried_out"]) for e in events] == [
        (f["row"], f["carried_out"]) for f in ledger
    ]
    # what waits for the next file is kept, and what no retained checkpoint needs is not
    kept = sorted(p.name for p in (run / "carry").iterdir())
    assert kept == [f"file_{DAYS - 2:06d}", f"file_{DAYS - 1:06d}"], kept
    assert json.loads((run / "carry" / kept[-1] / "meta.json").read_text())["rows"] == out


def test_a_malformed_file_is_rejected_and_the_loop_goes_on(cont: tuple[Path, Path, Path]) -> None:
    run, inbox, _ = cont
    assert (inbox / "rejected" / "day_1x.tsv").is_file() and not (inbox / "day_1x.tsv").exists()
    reason = (inbox / "rejected" / "day_1x.tsv.reason.txt").read_text()
    assert "max_bad_rows=5" in reason and "day_1x.tsv" in reason, reason
    events = read_metrics(run / "continuous.jsonl")
    assert [e["file"] for e in events if e["event"] == "rejected"] == ["day_1x.tsv"]
    assert [e["file"] for e in events if e["event"] == "file"][2:] == ["day_2.tsv", "day_3.tsv"]
    assert (inbox / ".day_9.tsv.tmp-1").exists() and (inbox / "day_9.tsv.tmp").exists()
    assert sorted(p.name for p in (inbox / "rejected").iterdir()) == [
        "day_1x.tsv", "day_1x.tsv.reason.txt"
    ]  # fmt: skip


def test_export_every_n_files_judged_on_the_next_files_unseen_rows(
    cont: tuple[Path, Path, Path],
) -> None:
    """The model after 3 days is exported when day 3 arrives: day 3 is the rows it never saw
    (schema.json, the tools' default rows, parity), and what it scores there is day 3's
    progressive AUC, the figure `make evaluate` gives."""
    run, _, store = cont
    events = read_metrics(run / "continuous.jsonl")
    step = (DAYS - 1) * STEPS_PER_DAY
    exports = [e for e in events if e["event"] == "export"]
    assert len(exports) == 1 and exports[0]["ok"] and exports[0]["step"] == step, exports
    assert exports[0]["after"] == "day_2.tsv" and exports[0]["unseen"].endswith("day_3.tsv")
    assert (store / f"dlrm-tiny-{step}.mar").is_file()
    schema = json.loads((run / "export" / "schema.json").read_text())
    data = schema["data"]
    assert data["files"][0]["path"].endswith("day_2.tsv")  # the file trained last
    assert data["eval_rows"] == 0 and [f["name"] for f in data["trained_files"]] == [
        f"day_{d}.tsv" for d in range(DAYS - 1)
    ]
    window = evaldata.model_window(schema, "v", 0)  # make evaluate's / score's default rows
    assert [p.name for p in window.paths] == ["day_3.tsv"] and window.count == ROWS
    assert (
        window.describe().startswith(f"rows 1..{ROWS} of ")
        and "(unseen by v: " in window.describe()
    )
    parity = json.loads((run / "export" / "parity.json").read_text())
    day3 = read_metrics(run / "progressive.jsonl")[DAYS - 1]
    assert parity["rows"] == day3["rows"] == ROWS and day3["step"] == step
    assert abs(parity["auc"]["int8"] - day3["auc"]) < 1e-3, (parity["auc"], day3)  # the same rows
    (rollout,) = [e for e in events if e["event"] == "rollout"]
    assert not rollout["promoted"] and "serves dlrm-other" in rollout["reason"], rollout


def test_tensorboard_scalars(cont: tuple[Path, Path, Path]) -> None:
    run, _, _ = cont
    files = scalars(run / "tb" / "files")
    assert [s for s, _ in files["progressive/auc"]] == list(range(DAYS))
    assert {"progressive/ne", "progressive/calibration", "rollout/promoted"} <= set(files)
    assert [s for s, _ in files["progressive/baseline_auc"]] == list(range(1, DAYS))
    prog = read_metrics(run / "progressive.jsonl")
    assert [round(v, 5) for _, v in files["progressive/auc"]] == [round(r["auc"], 5) for r in prog]
    loss = scalars(run / "tb")["train/loss"]
    assert [s for s, _ in loss][-1] == DAYS * STEPS_PER_DAY and len(loss) >= DAYS * 3


def test_a_model_frozen_after_day_0_loses_auc_the_fresh_one_keeps_it(
    cont: tuple[Path, Path, Path], days: Path, tmp_path: Path
) -> None:
    """Scored only (continuous.learn=false) from the checkpoint after day 0, following a
    folder the next days arrive in by rename, against the continuous run's figures."""
    run, _, _ = cont
    inbox = copy_days(days, tmp_path / "inbox", ["day_1"])
    frozen = tmp_path / "frozen"
    ckpt = run / "checkpoints" / f"step_{STEPS_PER_DAY:08d}"
    cmd = [str(VENV_BIN / "torchrun"), "--standalone", "--nproc_per_node=1", "-m",
           "training.continuous", "--config", "training/configs/tiny.toml", "--no-progress",
           "--run-dir", str(frozen), "--resume", str(ckpt), "--data-dir", str(inbox),
           "--follow", "continuous.learn=false", "continuous.poll_s=0.5",
           f"continuous.max_files={DAYS - 1}", f'data.cache_dir="{tmp_path / "cache"}"']  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        for d in range(2, DAYS):  # each next day arrives once the previous one is scored
            deadline = time.monotonic() + 120
            path = frozen / "progressive.jsonl"
            while not (path.is_file() and len(read_metrics(path)) == d - 1):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
                time.sleep(0.5)
            for ext in (".prob.npy", ".tsv"):  # written aside, then renamed in
                shutil.copy(days / f"day_{d}{ext}", inbox / f".day_{d}{ext}.tmp")
                os.replace(inbox / f".day_{d}{ext}.tmp", inbox / f"day_{d}{ext}")
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    fresh = {r["file"]: r["auc"] for r in read_metrics(run / "progressive.jsonl")}
    stale = {r["file"]: r["auc"] for r in read_metrics(frozen / "progressive.jsonl")}
    later = [f"day_{d}.tsv" for d in range(1, DAYS)]
    assert list(stale) == later
    assert stale["day_1.tsv"] == pytest.approx(fresh["day_1.tsv"], abs=1e-4)  # the same model
    print({f: (round(fresh[f], 4), round(stale[f], 4)) for f in later})
    assert stale[later[-1]] < stale["day_1.tsv"] - 0.02  # drift: the frozen model decays
    gain = sum(fresh[f] - stale[f] for f in later[1:]) / len(later[1:])
    assert gain > 0.01, (fresh, stale)
    ckpts = [p.name for p in (frozen / "checkpoints").glob("step_*")]
    assert ckpts == [ckpt.name]  # it trained nothing: the step stayed
    assert draw(run, frozen, tmp_path / "freshness.png").stat().st_size > 10_000


def test_kill_mid_file_resumes_without_training_a_row_twice(
    cont: tuple[Path, Path, Path], days: Path, tmp_path: Path
) -> None:
    inbox = copy_days(days, tmp_path / "inbox", ["day_0", "day_1"])
    run = tmp_path / "run"
    args = ["--run-dir", str(run), "--data-dir", str(inbox), "continuous.checkpoint_every=20",
            "continuous.export_every=0", f'data.cache_dir="{tmp_path / "cache"}"']  # fmt: skip
    # killed inside day 1, whose pass opens with the 32 rows carried from day 0
    proc = run_continuous(args, env={KILL_AT_STEP_ENV: "110"}, check=False)
    # the rank's own last line, not torchrun's summary: which failure torchrun observes first
    # (the killed rank, or its peer's broken collective) is a race
    assert proc.returncode != 0 and "killing rank 1 after step 110" in proc.stderr
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000100"
    resumed = run_continuous(args)
    assert "day_1.tsv: resuming at row 5632 of 20032 (step 100)" in resumed.stderr
    ledger = meta_of(run)["continuous"]["files"]
    for f in ledger:  # the positions recorded: each row of the order once, none skipped
        ends = [0, *(b for _, b in f["segments"])]
        assert [a for a, _ in f["segments"]] == ends[:-1] and ends[-1] == STEPS_PER_DAY * 256
    assert [b for _, b in ledger[0]["segments"][:3]] == [20 * 256, 40 * 256, 60 * 256]
    assert [b for _, b in ledger[1]["segments"][:3]] == [2 * 256, 22 * 256, 42 * 256]
    assert ledger[1]["carried_in"] == ledger[0]["carried_out"] == 32
    assert meta_of(run)["progress"]["step"] == 2 * STEPS_PER_DAY  # no step redone
    loss_steps = [r["step"] for r in read_metrics(run / "train_loss.jsonl")]
    assert loss_steps == sorted(set(loss_steps))
    prog = read_metrics(run / "progressive.jsonl")
    assert [r["file"] for r in prog] == ["day_0.tsv", "day_1.tsv"]  # scored once each
    fresh = read_metrics(cont[0] / "progressive.jsonl")
    assert prog[1]["auc"] == pytest.approx(fresh[1]["auc"], abs=1e-6)  # the same day-0 model
    assert prog[1]["baseline_auc"] == fresh[1]["baseline_auc"]  # its baseline too, exactly
    # new rows renamed in under a consumed name: a new file (said loudly), never skipped
    for ext in (".prob.npy", ".tsv"):
        shutil.copy(days / f"day_2{ext}", inbox / f".day_1{ext}.tmp")
        os.replace(inbox / f".day_1{ext}.tmp", inbox / f"day_1{ext}")
    again = run_continuous(args)
    assert "day_1.tsv: the name of a consumed file, with other content" in again.stderr
    ledger = meta_of(run)["continuous"]["files"]
    assert [(f["file"], f["index"], f["done"]) for f in ledger] == [
        ("day_0.tsv", 0, True), ("day_1.tsv", 1, True), ("day_1.tsv", 2, True)
    ]  # fmt: skip
    assert ledger[2]["content"] != ledger[1]["content"] and ledger[2]["content"]["bytes"] > 0
    assert meta_of(run)["progress"]["step"] == 3 * STEPS_PER_DAY
    prog = read_metrics(run / "progressive.jsonl")
    assert [(r["file"], r["file_index"]) for r in prog] == [
        ("day_0.tsv", 0), ("day_1.tsv", 1), ("day_1.tsv", 2)
    ]  # fmt: skip
    # the model after the interrupted day 1 (its carried rows read back at the resume) is the
    # uninterrupted run's: the same AUC on day 2's rows
    assert prog[2]["auc"] == pytest.approx(fresh[2]["auc"], abs=1e-6)


def test_a_second_run_of_the_config_publishes_its_own_model(days: Path, tmp_path: Path) -> None:
    """One config, one model store: a run killed before it recorded its export reuses its own
    archive, but a run directory deleted and started again (another run) must not publish the
    first run's ``dlrm-tiny-<step>.mar`` as its own: it exports its model under another name.
    Two small files (10 batches each): the model after the first is published when the
    second arrives, the rows it never saw."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    for d in (0, 1):  # the first 10 batches' rows of two days
        lines = (days / f"day_{d}.tsv").read_text().splitlines(keepends=True)[:SMALL]
        np.save(inbox / f"day_{d}.prob.npy", np.load(days / f"day_{d}.prob.npy")[:SMALL])
        (inbox / f"day_{d}.tsv").write_text("".join(lines))
    run, store = tmp_path / "run", tmp_path / "store"
    args = ["--run-dir", str(run), "--data-dir", str(inbox), "continuous.export_every=1",
            "continuous.rollout=false", f'continuous.model_store="{store}"',
            f'data.cache_dir="{tmp_path / "cache"}"', "continuous.keep_cache=true",
            'continuous.export_args=["--parity-rows", "2000"]']  # fmt: skip
    step = SMALL // 256

    def exports() -> list[dict]:
        return [e for e in read_metrics(run / "continuous.jsonl") if e["event"] == "export"]

    run_continuous(args, nproc=1)
    (first,) = exports()
    mar = store / f"dlrm-tiny-{step}.mar"
    assert first["ok"] and first["version"] == str(step) and not first.get("reused")
    assert first["mar"] == str(mar) and first["unseen"] == str(inbox / "day_1.tsv")
    before = mar.read_bytes()
    # killed after the export, before its record (and before the next checkpoint): the restart
    # publishes what the checkpoint holds when the file arrives, and finds its own archive
    checkpoints = run / "checkpoints"
    shutil.rmtree(checkpoints / f"step_{2 * step:08d}")
    (checkpoints / "latest").write_text(f"step_{step:08d}\n")
    events = run / "continuous.jsonl"
    events.write_text("".join(line for line in events.read_text().splitlines(keepends=True)
                              if '"export"' not in line))  # fmt: skip
    run_continuous(args, nproc=1)
    (restarted,) = exports()
    assert restarted["ok"] and restarted["reused"] and restarted["mar"] == str(mar)
    # the run directory deleted, the same config run again: the same step, another run
    shutil.rmtree(run)
    second = run_continuous(args, nproc=1)
    (other,) = exports()
    assert not other.get("reused") and other["mar"] != str(mar), other
    first_id, new_id = first["run_id"], (run / "run_id").read_text().strip()
    assert other["ok"] and other["version"] == f"{step}-{new_id[:8]}", other
    assert new_id != first_id
    assert mar.read_bytes() == before  # the first run's archive is left as it was
    # what each archive says it is: the run and the checkpoint it was exported from
    stamp = json.loads(zipfile.ZipFile(mar).read("identity.json"))
    assert stamp["run_id"] == first_id == first["run_id"] and stamp["step"] == step
    assert stamp["digest"] == first["checkpoint_digest"] == restarted["checkpoint_digest"]
    assert other["collisions"] == [f"{mar} is another model (run {first_id[:8]}, "
                                   f"checkpoint {stamp['digest'][:8]})"]  # fmt: skip
    assert "exporting this run's step" in second.stderr
    theirs = json.loads(zipfile.ZipFile(other["mar"]).read("identity.json"))
    assert theirs["run_id"] == new_id and theirs["step"] == step
    # the config run in another directory into the same store: refused the preset's name
    # (the export's rule, one name for one run's model); nothing exported. Every publish of
    # the run refused: a WARNING with the loop's own fix, counted, and the run exits 3
    elsewhere = tmp_path / "run2"
    proc = run_continuous(["--run-dir", str(elsewhere), *args[2:]], nproc=1, check=False)
    (refused,) = [e for e in read_metrics(elsewhere / "continuous.jsonl") if e["event"] == "export"]
    assert not refused["ok"] and "from another run" in refused["error"], refused
    assert sorted(store.glob("*.mar")) == sorted([mar, Path(other["mar"])])
    fix = "CONTINUOUS_ARGS='--name run2'"
    assert fix in refused["fix"], refused
    # the loop's process exits 3; torchrun (make continuous) says so, and exits 1
    assert proc.returncode == 1 and re.search(r"exitcode\s*:\s*3\b", proc.stderr), proc.stderr
    (warning,) = [x for x in proc.stderr.splitlines() if "publish of step" in x]
    assert "WARNING" in warning and fix in warning and "dlrm-run2" in warning, warning
    (error,) = [x for x in proc.stderr.splitlines() if x.startswith("error: every publish")]
    assert fix in error, error
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["publish"] == {"publishes": 1, "published": 0, "refused": 0,
                                  "not_rolled_out": 0, "failed": 1}  # fmt: skip
    # the fix works: the run's model renamed, the next file publishes it
    lines = (days / "day_2.tsv").read_text().splitlines(keepends=True)[:SMALL]
    np.save(inbox / "day_2.prob.npy", np.load(days / "day_2.prob.npy")[:SMALL])
    (inbox / "day_2.tsv").write_text("".join(lines))
    run_continuous(["--run-dir", str(elsewhere), *args[2:], "--name", "run2"], nproc=1)
    renamed = [e for e in read_metrics(elsewhere / "continuous.jsonl") if e["event"] == "export"]
    assert renamed[-1]["ok"] and renamed[-1]["model"] == "dlrm-run2", renamed[-1]
    assert (store / f"dlrm-run2-{2 * step}.mar").is_file()
