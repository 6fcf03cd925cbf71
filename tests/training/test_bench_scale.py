"""``python -m training.bench.scale`` end to end at a tiny size: every stage runs for real
(preprocessing with 1 and 2 processes, torchrun on 1 node x 2 ranks and on 2 nodes x 1 rank),
and the JSON it writes is complete and consistent with the cache layout."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, _env, third_party_noise
from training.config import load_config
from training.data.layout import NPY_HEADER, array_dtypes

TINY = ROOT / "training/configs/tiny.toml"


@pytest.mark.slow
def test_tiny_bench_scale_writes_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "training.bench.scale", "--rows=20000", f"--preset={TINY}",
        "--part-bytes=1000000",  # several parts, so 2 processes really share the work
        "--processes=2", "--repeats=1", "--window=3", "--windows=1",
        f"--work={tmp_path / 'work'}", f"--out={out}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not third_party_noise(proc.stdout + proc.stderr), third_party_noise(proc.stderr)[:10]
    assert "preprocess speedup: " in proc.stdout and "train 2x1/1x2: " in proc.stdout
    assert (out / "scale-training.png").stat().st_size > 0
    result = json.loads((out / "scale-training.json").read_text())

    pre = result["preprocess"]
    assert pre["parts"] > 1
    assert pre["identical"] and pre["differing_files"] == []
    for kind, processes in (("single", 1), ("parallel", 2)):
        assert pre[kind]["processes_used"] == processes
        assert pre[kind]["rows_per_sec"] > 0 and len(pre[kind]["runs"]) == 1
        assert pre[kind]["runs"][0]["rows"] == 20000
        assert pre[kind]["runs"][0]["cpu_s"] > 0 and pre[kind]["runs"][0]["others_cpu_s"] >= 0
    assert pre["speedup"] == pytest.approx(
        pre["parallel"]["rows_per_sec"] / pre["single"]["rows_per_sec"]
    )
    assert pre["round_speedups"] == [pytest.approx(pre["speedup"])]  # one round: the same pair

    # bytes per row on disk = the layout's per-row bytes + one .npy header per array
    tables = load_config(TINY).model.rows()
    dtypes = array_dtypes(tables, has_prob=True)
    per_row = {"labels": 1, "dense": 13, "sparse": 26, "prob": 1}
    layout = sum(dtypes[name].itemsize * n for name, n in per_row.items())
    cache = result["cache"]
    assert cache["rows"] == 20000
    assert pre["single"]["runs"][0]["layout_bytes_per_row"] == layout
    assert cache["bytes_per_row"] == pytest.approx(layout + len(dtypes) * NPY_HEADER / 20000)
    prob = dtypes["prob"].itemsize + NPY_HEADER / 20000
    assert cache["bytes_per_row_without_prob"] == pytest.approx(cache["bytes_per_row"] - prob)

    train = result["train"]
    for name, world in (("1x2", 2), ("2x1", 2)):
        t = train[name]
        assert t["world"] == world and len(t["windows"]) == 1
        assert t["samples_per_sec"] > 0 and t["warmup_samples_per_sec"] > 0
        assert t["final_eval"]["step"] == 6 and t["peak_rss"] > 0
        assert t["cpu_s"] > 0 and t["others_cpu_s"] >= 0
    rates = {name: train[name]["samples_per_sec"] for name in ("1x2", "2x1")}
    assert train["ratios"]["2x1/1x2"] == pytest.approx(rates["2x1"] / rates["1x2"])
    assert result["setup"]["load_after"]
