"""Batches for the trainer: each rank reads its own slice of every global batch.

The training stream is a deterministic function of (seed, epoch, rows consumed in the epoch):
each epoch shuffles the training rows with a seed of its own, and step ``s`` takes rows
``[s*G, (s+1)*G)`` of that order, where ``G`` is the global batch size. Rank ``r`` of ``W``
takes rows ``[r*G/W, (r+1)*G/W)`` of those. A checkpoint therefore only needs
``(epoch, rows_in_epoch)``, and a resume on another world size sees the same global batches.

The last batch of an epoch, fewer than ``G`` rows, is **padded**, not dropped: each rank's
share is filled up to ``G/W`` rows with padding rows (no ids, dense zeros) of weight 0, and
the real rows are weighted ``G / rows`` so that the loss (:class:`WeightedBatch`,
``training.model.WeightedDLRMTrain``), averaged over the ranks, is the mean over the batch's
real rows, as a full batch's is. Every batch keeps the same shape on every rank (what the
sharded input exchange and a compiled MLP want), and every training row is trained once an
epoch (``samples_seen`` counts real rows). The continuous loop carries its last rows into the
next file instead (``pad_last=False``: training/continuous/carry.py).

Shapes: ``B`` local batch, ``D`` = 13 dense, ``F`` = 26 sparse features.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torchrec import KeyedJaggedTensor
from torchrec.datasets.utils import Batch

from training.features import SPARSE_NAMES, dense_transform, hash_values, pack_ids


@dataclass
class Arrays:
    """Column arrays of one split (numpy, possibly memory-mapped)."""

    labels: np.ndarray  # int8[N]
    dense: np.ndarray  # float32[N, D] raw values
    sparse: np.ndarray  # int[N, F] ids, -1 = missing: raw, or hashed into ``hashed_for``
    prob: np.ndarray | None  # float32[N] true click probability (synthetic data only)
    hashed_for: tuple[int, ...] | None = None
    """Table sizes the ids were hashed into at preprocessing (the binary cache's
    ``rows_per_table``); None: raw ids, hashed by :func:`make_batch`."""

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def rows(self, start: int, stop: int) -> Arrays:
        sl = slice(start, stop)
        return Arrays(
            self.labels[sl],
            self.dense[sl],
            self.sparse[sl],
            None if self.prob is None else self.prob[sl],
            self.hashed_for,
        )

    def take(self, idx: np.ndarray) -> Arrays:
        """Rows ``idx`` gathered into arrays of their own (a copy: a batch's worth)."""
        return Arrays(
            np.asarray(self.labels[idx]),
            np.asarray(self.dense[idx]),
            np.asarray(self.sparse[idx]),
            None if self.prob is None else np.asarray(self.prob[idx]),
            self.hashed_for,
        )


@dataclass
class Joined:
    """The rows of ``head`` then those of ``tail``, neither copied: the continuous loop's rows
    carried from the previous file before a file's own (training/continuous/carry.py)."""

    head: Arrays
    tail: Arrays

    def __post_init__(self) -> None:
        if self.head.hashed_for != self.tail.hashed_for:
            raise ValueError(
                f"rows carried from the previous file hold ids hashed for tables of "
                f"{self.head.hashed_for} rows, the file's for {self.tail.hashed_for}"
            )

    def __len__(self) -> int:
        return len(self.head) + len(self.tail)

    def take(self, idx: np.ndarray) -> Arrays:
        """Rows ``idx`` (sorted, of the joined numbering) gathered from both parts."""
        cut = int(np.searchsorted(idx, len(self.head)))
        a, b = self.head.take(idx[:cut]), self.tail.take(idx[cut:] - len(self.head))
        # true probabilities (synthetic days) only when both parts have them
        prob = None if a.prob is None or b.prob is None else np.concatenate([a.prob, b.prob])
        return Arrays(
            np.concatenate([a.labels, b.labels]),
            np.concatenate([a.dense, b.dense]),
            np.concatenate([a.sparse, b.sparse]),
            prob,
            self.tail.hashed_for,
        )


@dataclass
class WeightedBatch(Batch):
    """A torchrec ``Batch`` with a weight per row (float32[B]): 0 for padding rows, else the
    factor that makes a padded last batch's loss the mean over its real rows (1 in a full
    batch). ``to``/``pin_memory``/``record_stream`` keep it, as the pipeline calls them."""

    weights: torch.Tensor

    def to(self, device: torch.device, non_blocking: bool = False) -> WeightedBatch:
        moved = super().to(device, non_blocking=non_blocking)
        weights = self.weights.to(device=device, non_blocking=non_blocking)
        return WeightedBatch(moved.dense_features, moved.sparse_features, moved.labels, weights)

    def record_stream(self, stream: torch.Stream) -> None:
        super().record_stream(stream)
        self.weights.record_stream(stream)

    def pin_memory(self) -> WeightedBatch:
        pinned = super().pin_memory()
        return WeightedBatch(pinned.dense_features, pinned.sparse_features, pinned.labels,
                             self.weights.pin_memory())  # fmt: skip


@dataclass
class ModelBatch:
    """A trainer batch plus what evaluation needs beside it."""

    batch: WeightedBatch
    weights: torch.Tensor  # float32[B]; 0 marks padding rows
    prob: torch.Tensor | None  # float32[B] oracle probabilities


def make_batch(
    arrays: Arrays | Joined, idx: np.ndarray, rows_per_table: np.ndarray, pad: int = 0,
    weight: float = 1.0,
) -> ModelBatch:  # fmt: skip
    """Gather rows ``idx`` into a torchrec Batch: transformed dense, table rows in a KJT; then
    ``pad`` padding rows (no ids, dense zeros, label 0) of weight 0, the real rows ``weight``.

    The transforms are the artifact's own (``training.features``). Ids are hashed once: by
    preprocessing when the cache was built for these tables (``arrays.hashed_for``), else here
    (raw ids); ids hashed for other table sizes are an error, not hashed again. Missing ids
    (-1) become zero-length bags, so each feature has 0 or 1 id per example.
    """
    if isinstance(arrays, Joined):  # gathered from both parts first (sorted ``idx``)
        arrays, idx = arrays.take(idx), np.arange(len(idx))
    if pad:  # padding rows touch no table row: an optimizer step moves none for them
        got = arrays.take(idx)
        arrays = Arrays(
            np.concatenate([got.labels, np.zeros(pad, got.labels.dtype)]),
            np.concatenate([got.dense, np.zeros((pad, got.dense.shape[1]), got.dense.dtype)]),
            np.concatenate([got.sparse, np.full((pad, got.sparse.shape[1]), -1, got.sparse.dtype)]),
            None if got.prob is None else np.concatenate([got.prob, np.zeros(pad, np.float32)]),
            got.hashed_for,
        )
        idx = np.arange(len(idx) + pad)
    rows = torch.as_tensor(rows_per_table, dtype=torch.int64)
    if arrays.hashed_for is not None and list(arrays.hashed_for) != rows.tolist():
        raise ValueError(
            f"the ids were hashed for tables of {list(arrays.hashed_for)} rows at preprocessing, "
            f"the model's tables have {rows.tolist()}"
        )
    labels = torch.from_numpy(arrays.labels[idx].astype(np.float32))
    dense = dense_transform(torch.from_numpy(np.ascontiguousarray(arrays.dense[idx])))
    sparse = np.ascontiguousarray(arrays.sparse[idx], dtype=np.int64)
    values, lengths = pack_ids(torch.from_numpy(sparse))
    if arrays.hashed_for is None:
        values = hash_values(values, lengths, rows)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=SPARSE_NAMES, values=values, lengths=lengths.reshape(-1)
    )
    prob = None if arrays.prob is None else torch.from_numpy(arrays.prob[idx].astype(np.float32))
    weights = torch.full((len(idx),), weight, dtype=torch.float32)
    if pad:
        weights[len(idx) - pad :] = 0.0
    return ModelBatch(batch=WeightedBatch(dense, kjt, labels, weights), weights=weights, prob=prob)


def row_digest(positions: np.ndarray) -> int:
    """Order-free 64-bit digest of a set of stream positions (``epoch * rows + row``).

    The sum (mod 2^64) of a mixing hash (splitmix64's finalizer) of each position: the digests
    of disjoint sets add up to the digest of their union, so ranks whose row counts and
    digests add up to those of the global batches read each of those rows once between them
    (up to a 2^-64 chance), and a rank whose digest is that of its own slices read no other's.
    """
    x = positions.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    return int(x.sum(dtype=np.uint64))


@dataclass
class ReadLedger:
    """What a rank's :class:`TrainStream` handed out since this process started.

    Recorded per rank in every checkpoint's ``meta.json`` (``reads``), so a multi-node run
    shows where each rank ran and that the ranks read disjoint slices of the same batches. The
    pipeline fetches a batch or two ahead of its step, so ``end`` may be past the checkpoint's.
    """

    rank: int
    start: tuple[int, int] | None = None  # (epoch, rows_in_epoch) before its first batch
    end: tuple[int, int] | None = None  # (epoch, rows_in_epoch) after its last batch
    rows: int = 0
    digest: int = 0  # row_digest of the (epoch, row) positions read, summed mod 2^64

    def add(self, epoch: int, row: int, batch_rows: int, idx: np.ndarray, n: int) -> None:
        """Rows ``idx`` (of ``n`` training rows) read for the batch of ``batch_rows`` rows (all
        ranks) at ``(epoch, row)``."""
        if self.start is None:
            self.start = (epoch, row)
        self.end = (epoch, row + batch_rows)
        self.rows += len(idx)
        self.digest = (self.digest + row_digest(epoch * n + idx)) % 2**64

    def record(self) -> dict[str, Any]:
        """JSON-ready: rank, node (torchrun's ``GROUP_RANK``), host, pid and what it read."""
        return {
            "rank": self.rank,
            "node": int(os.environ.get("GROUP_RANK", "0")),
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "from": list(self.start) if self.start else None,
            "to": list(self.end) if self.end else None,
            "rows": self.rows,
            "digest": f"{self.digest:016x}",
        }


def step_rows(row: int, global_batch: int, rows: int, pad_last: bool) -> int:
    """Training rows in the step that begins at ``row`` of an epoch of ``rows``: a whole
    batch, or with ``pad_last`` what is left of the epoch when less (module doc)."""
    return min(global_batch, rows - row) if pad_last else global_batch


def epoch_order(rows: int, seed: int, epoch: int) -> np.ndarray:
    """The order ``int64[rows]`` in which epoch ``epoch`` of a run seeded ``seed`` reads its
    training rows: what :class:`TrainStream` and the baseline
    (:mod:`training.metrics.baseline`) both train on."""
    return np.random.default_rng([seed, epoch]).permutation(rows)


class TrainStream:
    """Endless-until-``epochs`` iterator of this rank's training batches (``Batch``).

    Every batch handed out is counted in ``reads`` (:class:`ReadLedger`). ``pad_last``: each
    epoch's last rows, fewer than a batch, are a padded batch (module doc); False: they are
    left out (the continuous loop carries them into the next file).
    """

    def __init__(
        self,
        arrays: Arrays | Joined,
        *,
        global_batch: int,
        rank: int,
        world_size: int,
        rows_per_table: list[int],
        seed: int,
        epochs: int,
        start_epoch: int = 0,
        start_row: int = 0,
        reads: ReadLedger | None = None,
        pad_last: bool = True,
    ) -> None:
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} is not divisible by {world_size} ranks")
        self.arrays = arrays
        self.global_batch = global_batch
        self.local_batch = global_batch // world_size
        self.rank = rank
        self.rows_per_table = np.asarray(rows_per_table, dtype=np.int64)
        self.seed = seed
        self.epochs = epochs
        self.epoch = start_epoch
        self.row = start_row
        self.reads = ReadLedger(rank) if reads is None else reads
        self.pad_last = pad_last

    @property
    def steps_per_epoch(self) -> int:
        n, g = len(self.arrays), self.global_batch
        return -(-n // g) if self.pad_last else n // g

    def order(self, epoch: int) -> np.ndarray:
        """Shuffled row order of ``epoch`` (the same on every rank and world size)."""
        return epoch_order(len(self.arrays), self.seed, epoch)

    def __iter__(self) -> Iterator[Batch]:
        while self.epoch < self.epochs:
            perm, g = self.order(self.epoch), self.global_batch
            while self.row < len(perm) and (self.pad_last or self.row + g <= len(perm)):
                real = step_rows(self.row, g, len(perm), self.pad_last)
                lo = self.row + self.rank * self.local_batch
                hi = min(lo + self.local_batch, self.row + real)
                idx = np.sort(perm[lo:hi]) if hi > lo else np.zeros(0, np.int64)  # sorted reads
                self.reads.add(self.epoch, self.row, real, idx, len(perm))
                self.row += real
                yield make_batch(self.arrays, idx, self.rows_per_table,
                                 pad=self.local_batch - len(idx), weight=g / real).batch  # fmt: skip
            self.epoch += 1
            self.row = 0


def eval_batches(
    arrays: Arrays, *, batch_size: int, rank: int, world_size: int, rows_per_table: list[int]
) -> Iterator[ModelBatch]:
    """This rank's contiguous share of ``arrays`` in batches of exactly ``batch_size`` rows.

    Every rank yields the same number of batches (collectives need it); rows past the end
    are padding with weight 0, so metrics count every row exactly once.
    """
    n = len(arrays)
    per_rank = -(-n // world_size)
    steps = max(1, -(-per_rank // batch_size))
    rows = np.asarray(rows_per_table, dtype=np.int64)
    start = rank * per_rank
    for s in range(steps):
        lo = start + s * batch_size
        hi = min(lo + batch_size, start + per_rank, n)
        real = np.arange(lo, max(hi, lo))
        pad = batch_size - len(real)
        idx = np.concatenate([real, np.zeros(pad, dtype=np.int64)]) if pad else real
        mb = make_batch(arrays, idx, rows)
        if pad:
            mb.weights[len(real) :] = 0.0
        yield mb
