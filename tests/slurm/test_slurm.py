"""Training under a real Slurm: ``make train-slurm`` on the one-node cluster of this machine.

The cluster is deploy/slurm/local-cluster.sh's (``make slurm-deps``: munged, slurmctld and
slurmd, started here when not running; a failure to start fails the module naming the log).
They are left running after the session: starting is idempotent, a second session or the
user's own jobs may be using them, and ``make slurm-down`` stops them. Each job is the tiny
preset on two tasks of the one node, each task a torchrun "node" (``--ntasks=2``): what
``--nodes=2`` gives on a cluster.

- ``arrayed``: 3 TSV files preprocessed by a 2-task job array, the training job after it
  (``--dependency=afterok``): its ``--prepare-only`` merges the tasks' parts without parsing,
  into the bytes of one process's cache (every file hashed).
- ``cancelled``: a long job ``scancel``ed once a checkpoint is saved, submitted again by the
  same command: it resumes from ``latest``; then sent USR1 mid-training (what the time limit
  sends): the script requeues the job (``scontrol requeue``, as a preemption does), which
  starts again and resumes, to the last step.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from tests.conftest import ROOT, run_make
from training.data.build import preprocess
from training.data.synthetic import SyntheticSpec, generate

pytestmark = pytest.mark.slow

TWO_TASKS = "--ntasks=2 --ntasks-per-node=2"  # two torchrun nodes on this one host
FILES, ROWS = 3, 4000  # tiny: batch 256, 10% held out: 10,800 rows -> 43 steps an epoch
EPOCH = -(-FILES * ROWS * 9 // 10 // 256)  # the last partial batch is trained (padded)
JOB_TIMEOUT_S = 600  # generous: a busy 2-core machine takes minutes where a quiet one takes seconds


@pytest.fixture(scope="module", autouse=True)
def cluster() -> None:
    """The local cluster up (started when it is not), or the module fails with its reason."""
    proc = subprocess.run(
        ["bash", "deploy/slurm/local-cluster.sh", "up"], cwd=ROOT, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"the local Slurm did not start:\n{proc.stdout}{proc.stderr}", pytrace=False)


def job_state(job: str) -> dict[str, str]:
    """``scontrol show job`` of one job (the first task of an array) as ``{field: value}``."""
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    return dict(re.findall(r"(\w+)=(\S*)", out))


def array_states(job: str) -> list[str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, check=True
    ).stdout
    return re.findall(r"JobState=(\w+)", out)


DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def wait_done(job: str, log: Path, timeout: float = JOB_TIMEOUT_S) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while (state := job_state(job))["JobState"] not in DONE:
        assert time.monotonic() < deadline, f"job {job} {state['JobState']} after {timeout} s"
        time.sleep(1)
    assert state["JobState"] == "COMPLETED", f"job {job}: {state}\n{_tail(log)}"
    return state


def _tail(log: Path) -> str:
    return log.read_text(errors="replace")[-4000:] if log.is_file() else f"(no {log})"


def submit(run: Path, variables: dict[str, str], args: list[str]) -> dict[str, str]:
    """``make train-slurm`` for the tiny preset into ``run``; the job ids it printed."""
    variables = {"PRESET": "tiny", "RUN": str(run), "NPROC": "1", "NNODES": "1",
                 "SBATCH_ARGS": TWO_TASKS, **variables}  # fmt: skip
    out = run_make("train-slurm", variables, ["--no-progress", *args], timeout=120).stdout
    ids = dict(re.findall(r"submitted (training job|preprocessing job array) (\d+)", out))
    assert "training job" in ids, out
    return ids


def sha256_tree(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


@dataclass
class Arrayed:
    base: Path
    files: list[Path]
    ids: dict[str, str]
    train_log: str
    task_logs: list[str]


@pytest.fixture(scope="module")
def arrayed(tmp_path_factory: pytest.TempPathFactory) -> Arrayed:
    base = tmp_path_factory.mktemp("slurm")
    files = [
        generate(
            SyntheticSpec(rows=ROWS, seed=40 + i), base / "tsv" / f"day_{i}.tsv", progress=False
        )
        for i in range(FILES)
    ]
    run = base / "run"
    ids = submit(
        run, {"DATA": str(base / "tsv"), "SHARES": "2"}, [f'data.cache_dir="{base / "cache"}"']
    )
    wait_done(ids["training job"], run / f"slurm-{ids['training job']}.out")
    logs = sorted(run.glob(f"slurm-prepare-{ids['preprocessing job array']}_*.out"))
    return Arrayed(
        base, files, ids, (run / f"slurm-{ids['training job']}.out").read_text(),
        [log.read_text() for log in logs],
    )  # fmt: skip


def test_array_tasks_parse_shares_the_training_job_merges(arrayed: Arrayed) -> None:
    assert array_states(arrayed.ids["preprocessing job array"]) == ["COMPLETED"] * 2
    parsed = [
        int(m.group(1))
        for text in arrayed.task_logs
        if (m := re.search(r"parsed (\d+) of 3 parts", text))
    ]
    assert sorted(parsed) == [1, 2], arrayed.task_logs  # one 64 MiB part per small file
    assert "resuming: 3 of 3 parts are in" in arrayed.train_log  # merged, nothing parsed
    train = job_state(arrayed.ids["training job"])
    assert train["Dependency"] == "(null)" and train["NumTasks"] == "2"


def test_merged_cache_is_byte_identical_to_one_process(arrayed: Arrayed) -> None:
    (cache,) = (arrayed.base / "cache").glob("criteo-*")
    assert not [p.name for p in cache.parent.iterdir() if p.name.startswith(".")]  # no parts
    one = arrayed.base / "one" / cache.name
    preprocess(arrayed.files, one, processes=1, progress=False, rows_per_table=[128] * 26)
    assert sha256_tree(cache) == sha256_tree(one)
    assert sorted(sha256_tree(one)) == ["dense.npy", "labels.npy", "meta.json", "prob.npy",
                                        "sparse.npy"]  # fmt: skip


def test_two_tasks_are_two_torchrun_nodes(arrayed: Arrayed) -> None:
    import json

    run = arrayed.base / "run"
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{EPOCH:08d}"
    meta = json.loads((run / "checkpoints" / latest / "meta.json").read_text())
    assert meta["world_size"] == 2
    assert sorted(r["node"] for r in meta["reads"]) == [0, 1]
    assert "2 torchrun nodes x 1" in arrayed.train_log
    assert f"training exited 0; checkpoints/latest: step_{EPOCH:08d}" in arrayed.train_log


LONG = ["train.epochs=20", "train.checkpoint_every=20", "train.eval_every=1000"]
LAST_STEP = 20 * EPOCH  # 860: seconds of training here, minutes when the machine is busy


def _latest(run: Path) -> str | None:
    path = run / "checkpoints" / "latest"
    return path.read_text().strip() if path.is_file() else None


def _wait_latest_past(run: Path, job: str, past: str | None) -> str:
    """``latest`` once it names a checkpoint after ``past``, while ``job`` runs."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while (latest := _latest(run)) in (None, past):
        state = job_state(job)["JobState"]
        assert state in ("PENDING", "RUNNING", "CONFIGURING"), f"job {job} {state}"
        assert time.monotonic() < deadline, f"no checkpoint after {past} in {JOB_TIMEOUT_S} s"
        time.sleep(0.2)
    return latest


def _no_process_of(run: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while left := [p.pid for p in psutil.process_iter(["cmdline"])
                   if str(run) in " ".join(p.info["cmdline"] or [])]:  # fmt: skip
        assert time.monotonic() < deadline, f"processes of {run} still running: {left}"
        time.sleep(0.5)


def test_cancelled_resubmitted_and_requeued_job_resumes_from_latest(arrayed: Arrayed) -> None:
    run = arrayed.base / "long"
    variables = {"DATA": str(arrayed.base / "tsv")}
    args = [f'data.cache_dir="{arrayed.base / "cache"}"', *LONG]
    first = submit(run, variables, args)["training job"]
    at_cancel = _wait_latest_past(run, first, None)
    subprocess.run(["scancel", first], check=True)
    deadline = time.monotonic() + 120
    while job_state(first)["JobState"] != "CANCELLED":
        assert time.monotonic() < deadline, job_state(first)
        time.sleep(0.5)
    _no_process_of(run)  # slurmd ended every rank of both torchruns
    cancelled = _latest(run)
    assert cancelled is not None and int(cancelled[5:]) < LAST_STEP

    second = submit(run, variables, args)["training job"]  # the same command again
    log = run / f"slurm-{second}.out"
    at_requeue = _wait_latest_past(run, second, cancelled)
    # what the time limit sends 3 minutes before (--signal=B:USR1@180): the script requeues
    # itself (scontrol requeue, as a preemption does)
    subprocess.run(["scancel", "--batch", "--signal=USR1", second], check=True)
    deadline = time.monotonic() + 120
    while job_state(second)["Restarts"] == "0" or job_state(second)["JobState"] != "PENDING":
        assert time.monotonic() < deadline, job_state(second)
        time.sleep(0.5)
    # a requeued job waits ~2 min before it may start again (Slurm's BeginTime): not here
    subprocess.run(["scontrol", "update", f"JobId={second}", "StartTime=now"], check=True)
    state = wait_done(second, log)
    text = log.read_text()
    assert state["Restarts"] == "1"
    assert f"resumes {run}/checkpoints/latest: {cancelled}" in text
    assert f"resumed from {run}/checkpoints/{cancelled} at step {int(cancelled[5:])}" in text
    assert re.search(r"start 2 on .*latest: step_\d+\)", text)
    restarted = re.findall(rf"resumed from {run}/checkpoints/(step_\d+) at step", text)
    assert len(restarted) == 2 and restarted[1] >= at_requeue > cancelled >= at_cancel
    assert _latest(run) == f"step_{LAST_STEP:08d}"
    assert text.rstrip().endswith(f"training exited 0; checkpoints/latest: step_{LAST_STEP:08d}")
