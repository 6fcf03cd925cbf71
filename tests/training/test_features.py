"""One transform everywhere: the loader, the export's scorer and the portable scorer turn the same
raw rows into the same model inputs, because each calls ``recsys_model.features``.

Each path is run on its own input form (the loader on stored rows, the scorers on the
``(dense, values, lengths)`` a request decodes to) and its features are read where the model
takes them, then compared with each other and with the formula written out in plain Python.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from recsys_model import features as served
from recsys_model.portable_model import PortableScorer
from serving.worker.codec import decode_json
from training import features
from training.data.loader import Arrays, make_batch
from training.export.scorer import Scorer, raw_inputs
from training.features import DENSE_NAMES, NUM_DENSE, NUM_SPARSE, SPARSE_NAMES

# table sizes: tiny (everything hashes to 0), prime, power of two, large
ROWS = [[1, 2, 3, 97, 1000, 65_536, 1_000_003][f % 7] for f in range(NUM_SPARSE)]
HUGE = 2**63 - 1


def _raw_rows() -> Arrays:
    """Edge cases first (negative, missing, huge), then random rows."""
    rng = np.random.default_rng(7)
    n = 40
    dense = rng.integers(-5, 10_000, size=(n, NUM_DENSE)).astype(np.float32)
    dense[0] = [-3, -1, 0, 0, 1, 2**31 - 1, 1e9, -(2**31), 3, 4, 5, 0, 7]  # negative, 0 = missing
    sparse = rng.integers(0, 2**40, size=(n, NUM_SPARSE), dtype=np.int64)
    sparse[rng.random((n, NUM_SPARSE)) < 0.2] = -1
    sparse[0] = -1  # a row with every categorical missing
    sparse[1] = [HUGE, 0, 2**62, 2**32 - 1, 1, 2**63 - 2, *range(20)]  # huge ids and small ones
    return Arrays(rng.integers(0, 2, n).astype(np.int8), dense, sparse, None)


def _expected(arrays: Arrays) -> tuple[list[list[float]], list[list[int]]]:
    """The transforms by hand: ``log1p(max(x, 0))``; each present id ``mod rows``, feature-major."""
    dense = [[math.log1p(max(float(x), 0.0)) for x in row] for row in arrays.dense]
    ids = [[int(i) % ROWS[f] for i in arrays.sparse[:, f] if i >= 0] for f in range(NUM_SPARSE)]
    return dense, ids


def _request(arrays: Arrays) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows as a served request decodes them (JSON instances, a missing id left out)."""
    instances = [
        {
            "dense": [float(x) for x in arrays.dense[b]],
            "sparse": {
                n: [int(i)] for n, i in zip(SPARSE_NAMES, arrays.sparse[b], strict=True) if i >= 0
            },
        }
        for b in range(len(arrays))
    ]
    dense, values, lengths = decode_json({"instances": instances}, DENSE_NAMES, SPARSE_NAMES)
    return torch.from_numpy(dense), torch.from_numpy(values), torch.from_numpy(lengths)


class _Probe(nn.Module):
    """Stands in for the DLRM inside :class:`Scorer`: keeps what the scorer feeds it."""

    def forward(self, dense: torch.Tensor, kjt: object) -> torch.Tensor:
        self.seen = (dense, kjt)
        return torch.zeros(dense.shape[0], 1)


def _loader_features(arrays: Arrays) -> tuple[torch.Tensor, list[list[int]]]:
    batch = make_batch(arrays, np.arange(len(arrays)), np.asarray(ROWS)).batch
    kjt = batch.sparse_features
    return batch.dense_features, [kjt[n].values().tolist() for n in SPARSE_NAMES]


def _scorer_features(request: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, list[list[int]]]:
    probe = _Probe()
    Scorer(probe, ROWS)(*request)
    dense, kjt = probe.seen
    return dense, [kjt[n].values().tolist() for n in SPARSE_NAMES]  # type: ignore[attr-defined]


def _portable_features(
    request: tuple[torch.Tensor, ...], bags: str
) -> tuple[torch.Tensor, list[list[int]]]:
    """The dense input of the first dense layer (a hook), and the ids read back from pooled
    embeddings whose row ``r`` of each table is ``(r + 1, 1)``: value - 1 where count is 1."""
    spec = {"rows": ROWS, "dim": 2, "dense_arch": [4, 2], "over_arch": [1], "num_dense": 13}
    model = PortableScorer({**spec, "arch": "dlrm"}, bags=bags)
    with torch.no_grad():
        local = torch.cat([torch.arange(r, dtype=torch.float64) for r in ROWS])
        model.weight.copy_(torch.stack([local + 1, torch.ones_like(local)], dim=1))
    seen: list[torch.Tensor] = []
    model.dense[0].register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    model(*request)
    pooled = model.pooled(request[1], request[2])  # [B, F, 2]
    assert set(pooled[..., 1].unique().tolist()) <= {0.0, 1.0}
    ids = [
        [int(v) - 1 for v, c in zip(pooled[:, f, 0], pooled[:, f, 1], strict=True) if c == 1]
        for f in range(NUM_SPARSE)
    ]
    return seen[0], ids


@pytest.mark.parametrize("bags", ["embedding_bag", "scatter"])
def test_loader_export_scorer_and_portable_scorer_see_the_same_features(bags: str) -> None:
    assert max(ROWS) < 2**24  # table rows read back exactly from float32 embeddings
    arrays = _raw_rows()
    want_dense, want_ids = _expected(arrays)
    request = _request(arrays)
    assert all(
        torch.equal(a, b)
        for a, b in zip(request, raw_inputs(arrays.dense, arrays.sparse), strict=True)
    )
    paths = {
        "loader": _loader_features(arrays),
        "export scorer": _scorer_features(request),
        "portable scorer": _portable_features(request, bags),
    }
    for name, (dense, ids) in paths.items():
        assert dense.dtype == torch.float32, name
        assert torch.allclose(
            dense.double(), torch.tensor(want_dense, dtype=torch.float64), rtol=1e-6
        ), name
        assert ids == want_ids, name
    (ref_dense, ref_ids), *rest = paths.values()
    for dense, ids in rest:
        assert torch.equal(dense, ref_dense) and ids == ref_ids  # bit for bit
    assert want_ids[0][0] == HUGE % ROWS[0] and want_ids[5][0] == (2**63 - 2) % ROWS[5]


def test_training_features_are_the_served_functions() -> None:
    """One definition: training re-exports the torch functions the artifacts compile in."""
    for name in ("dense_transform", "hash_ids", "hash_values", "pack_ids"):
        assert getattr(features, name) is getattr(served, name)


def test_transforms_script_to_the_same_results() -> None:
    """TorchScript compiles the functions into the artifacts: scripted == eager."""
    arrays = _raw_rows()
    dense, values, lengths = _request(arrays)
    rows = torch.tensor(ROWS)
    assert torch.equal(
        torch.jit.script(served.dense_transform)(dense), served.dense_transform(dense)
    )
    assert torch.equal(
        torch.jit.script(served.hash_values)(values, lengths, rows),
        served.hash_values(values, lengths, rows),
    )
