"""The benchmark: its plain-PyTorch DLRM matches torchrec's, and a tiny run writes its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from tests.conftest import ROOT, _env, third_party_noise
from training.bench.run import METHODS
from training.bench.steppers import PlainDLRM, _plain_inputs
from training.config import load_config
from training.data.loader import Arrays, make_batch
from training.features import NUM_DENSE, NUM_SPARSE
from training.model import build_dlrm


def test_plain_dlrm_matches_torchrec_dlrm() -> None:
    """Same weights in, same logits out: the plain baseline is the same model, not a lighter one."""
    cfg = load_config("training/configs/tiny.toml")
    torch.manual_seed(0)
    ref = build_dlrm(cfg.model, device="cpu")
    plain = PlainDLRM(
        cfg.model.rows(), cfg.model.embedding_dim, cfg.model.dense_arch, cfg.model.over_arch
    )
    ref_tables = ref.sparse_arch.embedding_bag_collection.embedding_bags.values()
    ref_linears = [m for m in ref.modules() if isinstance(m, nn.Linear)]
    plain_linears = [m for m in plain.modules() if isinstance(m, nn.Linear)]
    assert len(ref_linears) == len(plain_linears)
    with torch.no_grad():
        for dst, src in zip(plain.tables, ref_tables, strict=True):
            dst.weight.copy_(src.weight)
        for dst, src in zip(plain_linears, ref_linears, strict=True):
            dst.load_state_dict(src.state_dict())

    rng = np.random.default_rng(0)
    n = 64
    sparse = rng.integers(0, 10_000, size=(n, NUM_SPARSE), dtype=np.int64)
    sparse[rng.random(sparse.shape) < 0.2] = -1  # missing ids become empty bags
    arrays = Arrays(
        labels=rng.integers(0, 2, n).astype(np.int8),
        dense=rng.integers(-2, 50, size=(n, NUM_DENSE)).astype(np.float32),
        sparse=sparse,
        prob=None,
    )
    batch = make_batch(arrays, np.arange(n), np.asarray(cfg.model.rows())).batch
    dense, values, offsets, _ = _plain_inputs(batch)
    with torch.no_grad():
        expected = ref(batch.dense_features, batch.sparse_features).squeeze(-1)
        got = plain(dense, values, offsets)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tiny_bench_writes_three_methods_and_ratios(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "training.bench",
        "--max-rows=1000",
        "--batch-size=256",
        "--steps=5",
        "--warmup=2",
        "--repeats=1",
        "--threads=1",
        "--synthetic-rows=20000",
        "--synthetic-vocab=1000",
        f"--cache-dir={tmp_path / 'cache'}",
        f"--synthetic-dir={tmp_path / 'synthetic'}",
        f"--json={out}",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not third_party_noise(proc.stdout + proc.stderr), third_party_noise(proc.stderr)[:10]
    assert "trainer / ceiling = " in proc.stdout and "trainer / plain PyTorch = " in proc.stdout

    result = json.loads(out.read_text())
    methods = result["methods"]
    assert set(METHODS) <= set(methods)
    for name in METHODS:
        assert methods[name]["samples_per_sec"] > 0, name
        assert methods[name]["p50_step_ms"] > 0, name
        assert methods[name]["steps"] == 5, name
    rate = {name: methods[name]["samples_per_sec"] for name in METHODS}
    ratios = result["ratios"]
    assert ratios["trainer/ceiling"] == pytest.approx(rate["trainer"] / rate["ceiling"])
    assert ratios["trainer/plain"] == pytest.approx(rate["trainer"] / rate["plain"])
    assert result["setup"]["num_embeddings"] == [min(r, 1000) for r in _kaggle_rows()]


def _kaggle_rows() -> list[int]:
    return load_config(ROOT / "training/configs/criteo-kaggle.toml").model.rows()
