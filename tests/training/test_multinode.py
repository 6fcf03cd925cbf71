"""Multi-node training for real: two torchrun "nodes" on this machine, ``make train-multinode``.

Each node is a torchrun of its own (agent + rank) joined to the other by a c10d rendezvous on a
free port, as two machines sharing the run directory and the data caches are. Three launches:

- ``two_nodes``: ``make train-multinode`` without NODE_RANK (both nodes launched here), tiny
  with C1 and C2 split by columns across the nodes, one whole epoch (71 steps: 70 full and
  the last 80 rows padded), checkpoints at 30, 60 and 71 (all kept).
- ``killed``: each node launched alone (``NODE_RANK=0`` and ``1``: what each machine runs) on
  fresh data folders, so that both nodes' ``--prepare-only`` race on them; it resumes
  ``two_nodes``'s step 30 for 3 epochs, and node 1 (its torchrun and its rank: the whole node)
  is SIGKILLed once step 60 is saved.
- ``one_node``: ``make train NPROC=1`` resumes ``killed``'s ``latest`` with every table whole
  and no further step, so its checkpoint is the state as loaded.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from recsys_stack.net import free_ports
from tests.conftest import ROOT, _env, make_command, run_make
from tests.training.conftest import PLAN_A, PLAN_B, assert_plan_a_resumed_as_plan_b, losses, plan
from training.checkpoint.store import read_latest, read_meta, read_tensors
from training.data.loader import Arrays, TrainStream, row_digest
from training.metrics.log import read_metrics

pytestmark = pytest.mark.slow

NODE_ARGS = ["--no-progress", "train.collective_timeout=30"]
# tiny: 20,000 rows, 10% held out; 70 full steps an epoch and a 71st of 80 rows, padded
TRAIN_ROWS, GLOBAL_BATCH, STEPS_PER_EPOCH = 18_000, 256, 71
TIMEOUT_S = 30  # the rendezvous's join timeout and the collectives' timeout of these runs


def _data_args(base: Path) -> list[str]:
    return [f'data.cache_dir="{base / "cache"}"', f'data.synthetic_dir="{base / "synthetic"}"']


def _variables(run: Path, **more: str) -> dict[str, str]:
    port = free_ports(1)[0]
    return {
        "PRESET": "tiny", "NPROC": "1", "RUN": str(run), "RDZV_ENDPOINT": f"127.0.0.1:{port}",
        "RDZV_ID": f"test-{port}", "RDZV_TIMEOUT": str(TIMEOUT_S), **more,
    }  # fmt: skip


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return _data_args(tmp_path_factory.mktemp("mn_data"))


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory: pytest.TempPathFactory, data: list[str]) -> tuple[Path, str]:
    run = tmp_path_factory.mktemp("two_nodes")
    args = [*NODE_ARGS, *data, *PLAN_A, f"train.max_steps={STEPS_PER_EPOCH}", "train.keep_last=3"]
    proc = run_make("train-multinode", _variables(run, NNODES="2"), args)
    return run, proc.stdout + proc.stderr


@dataclass
class Killed:
    run: Path
    node0: str  # node 0's output (make, --prepare-only, torchrun, its rank)
    node1: str
    node0_exit: int
    seconds_to_exit: float  # from the SIGKILL of node 1 to node 0's exit
    latest_at_kill: str


def _kill_node(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a node: its make, torchrun agent and ranks (which torchrun puts in sessions of
    their own), as when the machine goes down."""
    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(proc.pid)
        for p in [*parent.children(recursive=True), parent]:
            with contextlib.suppress(psutil.NoSuchProcess):  # exited meanwhile
                p.send_signal(signal.SIGKILL)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory, two_nodes: tuple[Path, str]) -> Killed:
    base = tmp_path_factory.mktemp("killed")
    run, src = base / "run", two_nodes[0] / "checkpoints" / "step_00000030"
    args = [*NODE_ARGS, *_data_args(base / "data"), *PLAN_A, "--resume", str(src)]
    args += ["train.epochs=3", "train.max_steps=0"]
    variables = _variables(run, NNODES="2")
    logs = [base / "node0.log", base / "node1.log"]
    nodes = []
    for rank, log in enumerate(logs):
        cmd = make_command("train-multinode", {**variables, "NODE_RANK": str(rank)}, args)
        with log.open("wb") as out:
            node = subprocess.Popen(
                cmd, cwd=ROOT, env=_env(), stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        nodes.append(node)
    try:
        latest, deadline = run / "checkpoints" / "latest", time.monotonic() + 240
        while not (latest.is_file() and latest.read_text().strip() != "step_00000030"):
            assert all(n.poll() is None for n in nodes), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after step 30 in 240 s"
            time.sleep(0.02)
        at_kill = latest.read_text().strip()
        _kill_node(nodes[1])
        killed_at = time.monotonic()
        node0_exit = nodes[0].wait(timeout=120)
        seconds = time.monotonic() - killed_at
        nodes[1].wait(timeout=10)
    finally:
        for n in nodes:
            if n.poll() is None:
                _kill_node(n)
    text = [log.read_text(errors="replace") for log in logs]
    return Killed(run, text[0], text[1], node0_exit, seconds, at_kill)


@pytest.fixture(scope="module")
def one_node(
    tmp_path_factory: pytest.TempPathFactory, killed: Killed, data: list[str]
) -> tuple[Path, Path]:
    """``killed``'s latest resumed by one process under plan B, with no further step."""
    src = read_latest(killed.run / "checkpoints")
    assert src is not None
    step = read_meta(src)["progress"]["step"]
    run = tmp_path_factory.mktemp("one_node")
    args = [*NODE_ARGS, *data, *PLAN_B, "--resume", str(src), f"train.max_steps={step}"]
    run_make("train", {"PRESET": "tiny", "NPROC": "1", "RUN": str(run)}, args)
    return src, run / "checkpoints" / src.name


def test_two_nodes_train_and_checkpoint(two_nodes: tuple[Path, str]) -> None:
    run, output = two_nodes
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000071"
    assert sorted(p.name for p in ckpts.glob("step_*")) == [f"step_000000{s}" for s in (30, 60, 71)]
    meta = read_meta(ckpts / "step_00000071")
    assert meta["world_size"] == 2
    assert plan(ckpts / "step_00000071")["t_C1"]["ranks"] == [0, 1]  # split across the nodes
    # Each launch's lines prefixed with its NODE_RANK; rank 0 (the one that logs) is on either.
    assert re.search(r"^\[node [01]\] .* INFO training: eval ", output, re.M), output[-3000:]
    final = read_metrics(run / "metrics.jsonl")[-1]
    assert final["step"] == 71 and final["auc"] > 0.9 * final["oracle_auc"], final


def _digest_of(epoch: int, rows: np.ndarray) -> str:
    return f"{row_digest(epoch * TRAIN_ROWS + rows):016x}"


def test_each_rank_read_only_its_slice(two_nodes: tuple[Path, str]) -> None:
    # Every rank's reads as recorded in the last checkpoint: the epoch's order (the seed's
    # permutation), each global batch cut in 2 halves, rank r reading half r of every one; the
    # last 80 rows (18,000 mod 256), fewer than a rank's half, are rank 0's, padded.
    reads = read_meta(two_nodes[0] / "checkpoints" / "step_00000071")["reads"]
    assert sorted(r["rank"] for r in reads) == [0, 1]
    assert sorted(r["node"] for r in reads) == [0, 1]  # one rank on each node
    order = np.random.default_rng([0, 0]).permutation(TRAIN_ROWS)
    full = (STEPS_PER_EPOCH - 1) * GLOBAL_BATCH
    batches = order[:full].reshape(STEPS_PER_EPOCH - 1, 2, -1)
    for r in reads:  # the whole epoch, and only this rank's half of each batch
        mine = batches[:, r["rank"]].ravel()
        mine = np.concatenate([mine, order[full:]]) if r["rank"] == 0 else mine
        assert (r["from"], r["to"]) == ([0, 0], [0, TRAIN_ROWS]), r
        assert r["rows"] == len(mine)
        assert r["digest"] == _digest_of(0, mine), r
    # Between them: each row of the split once, none left out.
    total = sum(int(r["digest"], 16) for r in reads) % 2**64
    assert f"{total:016x}" == _digest_of(0, np.arange(TRAIN_ROWS))
    assert sum(r["rows"] for r in reads) == TRAIN_ROWS


def test_the_ledger_counts_what_each_rank_reads_across_epochs() -> None:
    # In process, 2 epochs of 5 steps: each rank's ledger is its halves of the batches, and
    # the two add up to every (epoch, row) position of both epochs' batches once. The stream
    # of the continuous loop (pad_last=False), which carries the last 3 rows of each file
    # instead of padding them (a batch run's padded last batch: test_partial_batch.py).
    n, g = 43, 8  # 3 rows left out per epoch
    arrays = Arrays(
        np.zeros(n, np.int8), np.zeros((n, 13), np.float32), np.zeros((n, 26), np.int64), None
    )
    ledgers = []
    for rank in (0, 1):
        stream = TrainStream(
            arrays, global_batch=g, rank=rank, world_size=2, rows_per_table=[4] * 26,
            seed=1, epochs=2, pad_last=False,
        )  # fmt: skip
        assert sum(1 for _ in stream) == 10
        ledgers.append(stream.reads)
    every = [e * n + stream.order(e)[: 5 * g] for e in (0, 1)]
    for rank, ledger in enumerate(ledgers):
        assert (ledger.start, ledger.end, ledger.rows) == ((0, 0), (1, 40), 40)
        mine = np.concatenate([p.reshape(5, 2, -1)[:, rank].ravel() for p in every])
        assert ledger.digest == row_digest(mine)
    assert sum(ledger.digest for ledger in ledgers) % 2**64 == row_digest(np.concatenate(every))
    assert ledgers[0].digest != ledgers[1].digest


def test_each_data_folder_is_prepared_once(killed: Killed) -> None:
    # Both nodes ran --prepare-only at once on empty folders: one generated and preprocessed,
    # the other waited on the lock files and reused what it wrote.
    both = killed.node0 + killed.node1
    assert both.count("generating 20000 synthetic rows") == 1, both[-3000:]
    data = killed.run.parent / "data"
    assert len(list((data / "cache").glob("criteo-*"))) == 1
    synthetic = sorted(p.name for p in (data / "synthetic").iterdir())  # no lock, no tmp left
    assert synthetic == ["synthetic_r20000_v100_s0.prob.npy", "synthetic_r20000_v100_s0.tsv"]


def test_killed_node_stops_the_other_with_one_line(killed: Killed) -> None:
    assert killed.node0_exit != 0
    errors = [line for line in killed.node0.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, killed.node0[-3000:]
    assert "another rank of this run is gone" in errors[0], errors[0]
    assert "is intact: relaunch every node to resume from it" in errors[0]
    ours = killed.node0.split("failed (exitcode")[0]  # before torchrun's own failure report
    assert "Traceback" not in ours, killed.node0[-3000:]
    assert killed.seconds_to_exit < TIMEOUT_S, killed.seconds_to_exit
    print(f"node 0 exited {killed.seconds_to_exit:.1f} s after node 1 was killed")


def test_resume_on_two_nodes_is_bit_exact(killed: Killed, two_nodes: tuple[Path, str]) -> None:
    # `killed` resumed two_nodes's step 30 on 2 nodes: its step 60 is two_nodes's, bit for bit.
    a, b = two_nodes[0] / "checkpoints", killed.run / "checkpoints"
    assert killed.latest_at_kill == "step_00000060"
    saved, resumed = read_tensors(a / "step_00000060"), read_tensors(b / "step_00000060")
    assert saved.keys() == resumed.keys()
    for key, value in saved.items():
        assert torch.equal(resumed[key], value), key
    straight, again = losses(two_nodes[0]), losses(killed.run)
    assert [again[s] for s in (40, 50, 60)] == [straight[s] for s in (40, 50, 60)]


def test_latest_of_killed_run_resumes_on_one_node(
    killed: Killed, one_node: tuple[Path, Path]
) -> None:
    src, dst = one_node
    assert src.name >= "step_00000060"  # the kill left latest on a complete checkpoint
    assert_plan_a_resumed_as_plan_b(src, dst)
    meta = json.loads((dst / "meta.json").read_text())
    assert meta["world_size"] == 1 and meta["progress"] == read_meta(src)["progress"]
