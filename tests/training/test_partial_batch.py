"""An epoch's last partial batch is trained, not dropped (training/data/loader.py): padded to
the batch's shape with weight-0 rows that touch no table row, its real rows weighted so the
loss is their mean, on one rank or several; the loop counts the rows it trained. A real run
with a partial batch trains every row of its epochs (``samples_seen``) and records its splits.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRMTrain

from tests.conftest import run_train
from training.checkpoint.store import Progress, read_meta
from training.config import load_config
from training.data.loader import Arrays, TrainStream, make_batch, row_digest
from training.features import NUM_DENSE, NUM_SPARSE
from training.metrics.log import MetricsLog, read_metrics
from training.model import WeightedDLRMTrain, build_dlrm
from training.step_loop import TrainLoop

N, G = 43, 8  # 5 full batches of 8 and one of 3 rows an epoch
TABLES = [11] * NUM_SPARSE


def _arrays(n: int = N) -> Arrays:
    """Rows told apart by dense[:, 0] (their number + 1: padding rows' dense values are 0)."""
    rng = np.random.default_rng(0)
    dense = rng.random((n, NUM_DENSE), dtype=np.float32)
    dense[:, 0] = np.arange(1, n + 1)
    sparse = rng.integers(-1, 50, (n, NUM_SPARSE)).astype(np.int64)
    return Arrays((np.arange(n) % 3 == 0).astype(np.int8), dense, sparse, None)


def _stream(rank: int, world: int, epochs: int = 1) -> TrainStream:
    return TrainStream(_arrays(), global_batch=G, rank=rank, world_size=world,
                       rows_per_table=TABLES, seed=5, epochs=epochs)  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_row_is_trained_once_an_epoch_the_last_batch_padded(world: int) -> None:
    streams = [_stream(r, world, epochs=2) for r in range(world)]
    per_rank = [list(s) for s in streams]
    assert {len(b) for b in per_rank} == {12}  # ceil(43 / 8) steps an epoch, on every rank
    for epoch in (0, 1):
        rows = []
        for batches in per_rank:
            for b in batches[6 * epoch : 6 * epoch + 6]:
                assert b.labels.shape == (G // world,)  # the same shape every step
                real = b.weights > 0
                rows += (b.dense_features[real, 0].exp() - 1).round().int().tolist()
                pad = ~real
                assert not b.dense_features[pad].any() and not b.labels[pad].any()
        assert sorted(rows) == list(range(1, N + 1))  # each row once (log1p undone)
    last = [b[5] for b in per_rank]  # the epoch's last step: 3 real rows over the ranks
    weights = torch.cat([b.weights for b in last])
    assert torch.equal(weights, torch.tensor([G / 3] * 3 + [0.0] * (G - 3)))
    kjt = torch.cat([b.sparse_features.lengths().view(NUM_SPARSE, -1) for b in last], 1)
    assert not kjt[:, 3:].any()  # padding rows have no ids: no table row is touched
    total = sum(s.reads.rows for s in streams)
    assert total == 2 * N
    digest = sum(s.reads.digest for s in streams) % 2**64
    assert digest == row_digest(np.concatenate([np.arange(N), N + np.arange(N)]))
    assert all(s.reads.end == (1, N) for s in streams)


def _model() -> WeightedDLRMTrain:
    cfg = load_config("training/configs/tiny.toml", ["model.num_embeddings=11"]).model
    torch.manual_seed(0)
    return WeightedDLRMTrain(build_dlrm(cfg, device="cpu"))


def test_a_padded_batch_loss_is_the_mean_over_its_real_rows() -> None:
    model = _model()
    plain = DLRMTrain(model.model)  # torchrec's own loss, on the same weights
    arrays, rows = _arrays(), np.asarray(TABLES)
    full = make_batch(arrays, np.arange(8), rows).batch
    same = plain(Batch(full.dense_features, full.sparse_features, full.labels))[0]
    assert torch.equal(model(full)[0], same)  # a full batch: exactly DLRMTrain's loss
    real = np.array([4, 9, 30])
    alone = make_batch(arrays, real, rows).batch  # the 3 rows as a batch of their own
    expected = plain(Batch(alone.dense_features, alone.sparse_features, alone.labels))[0]
    one = model(make_batch(arrays, real, rows, pad=5, weight=8 / 3).batch)[0]
    assert torch.allclose(one, expected, rtol=1e-6)
    # two ranks: rank 0 has the 3 real rows and a padding row, rank 1 only padding; DDP
    # averages their gradients, so the mean of their losses is what is trained
    r0 = model(make_batch(arrays, real, rows, pad=1, weight=8 / 3).batch)[0]
    r1 = model(make_batch(arrays, real[:0], rows, pad=4, weight=8 / 3).batch)[0]
    assert r1.item() == 0.0 and torch.allclose((r0 + r1) / 2, expected, rtol=1e-6)
    one.backward()
    grads = [p.grad.clone() for p in model.model.over_arch.parameters()]
    model.zero_grad()
    expected.backward()
    for a, b in zip(grads, [p.grad for p in model.model.over_arch.parameters()], strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


class _Pipeline:
    def progress(self, batches: object) -> tuple[torch.Tensor, None]:
        return torch.tensor(0.5), None


def test_the_loop_counts_the_rows_it_trained_and_turns_the_epoch(tmp_path: Path) -> None:
    progress = Progress()
    loop = TrainLoop(_Pipeline(), iter(()), progress, batch_size=G, train_rows=N, total=20,
                     log_every=100, loss_log=MetricsLog(tmp_path / "l.jsonl", enabled=True),
                     pad_last=True)  # fmt: skip
    for _ in range(5):
        loop.step()
    assert (progress.epoch, progress.rows_in_epoch, progress.samples_seen) == (0, 40, 40)
    loop.step()  # the 3 rows of the padded batch
    assert (progress.epoch, progress.rows_in_epoch, progress.samples_seen) == (1, 0, 43)
    loop.step()
    assert (progress.epoch, progress.rows_in_epoch, progress.samples_seen) == (1, 8, 51)
    assert loop.window.samples == 51


@pytest.mark.slow
def test_a_run_trains_every_row_of_its_epochs_and_records_its_splits(
    tmp_path: Path, data_dirs: list[str]
) -> None:
    # 3,000 rows: 2,700 to train (10 batches of 256 and one of 140), 150 validation, 150 test
    run = tmp_path / "run"
    args = ["--config", "training/configs/tiny.toml", "--run-dir", str(run), "--no-progress",
            *data_dirs, "data.synthetic_rows=3000", "train.epochs=2", "train.eval_every=11",
            "train.checkpoint_every=0"]  # fmt: skip
    proc = run_train(args, nproc=0)
    final = json.loads(proc.stdout.strip().splitlines()[-1])["final"]
    assert final["step"] == 22 and final["samples_seen"] == 2 * 2700  # no row left out
    records = read_metrics(run / "metrics.jsonl")
    assert [(r["step"], r["split"], r["eval_rows"]) for r in records] == [
        (11, "valid", 150), (22, "test", 150)
    ]  # fmt: skip
    assert records[0]["samples_seen"] == 2700 and final["valid"]["eval_rows"] == 150
    assert final["splits"]["test"] == {"first_row": 2850, "rows": 150}
    assert final["baseline_train_rows"] == 2700  # the baseline: every training row too
    meta = read_meta(run / "checkpoints" / "step_00000022")
    assert (meta["data"]["valid_rows"], meta["data"]["test_rows"]) == (150, 150)
    assert "were never trained" not in proc.stderr
