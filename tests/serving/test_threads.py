"""Worker threads follow the workers the replica really runs (issue 20): while a rollout has a
second version registered, each worker's intra-op threads are the cores over all the workers,
and they come back when it is gone (a real TorchServe, the workers' own log lines)."""

from __future__ import annotations

import json
import os
import time
import zipfile
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from serving.torchserve import manage
from serving.torchserve.client import score
from serving.torchserve.config import TorchServeConfig
from serving.torchserve.keys import inference_key
from serving.worker.codec import encode_request
from serving.worker.handler import RETUNE_S
from serving.worker.scoring import slice_examples
from tests.stack import running_torchserve

pytestmark = pytest.mark.slow


def another_version(good: Path, out: Path, version: str) -> None:
    """``good`` as another version of the same model (only the manifest differs)."""
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "MAR-INF/MANIFEST.json":
                doc = json.loads(data)
                doc["model"]["modelVersion"] = version
                data = json.dumps(doc).encode()
            dst.writestr(item, data, compress_type=item.compress_type)


def call_for(cfg: TorchServeConfig, export: Path, seconds: float) -> None:
    """Score one request of v1.0 back to back for ``seconds`` (the handler retunes on calls)."""
    s = np.load(export / "sample.npz")
    x = tuple(torch.from_numpy(s[k]) for k in ("dense", "values", "lengths"))
    body = encode_request(*slice_examples(*x, 0, 4))
    key = inference_key(cfg.key_file)
    end = time.monotonic() + seconds
    with grpc.insecure_channel(cfg.grpc_inference_target) as channel:
        while time.monotonic() < end:
            score(channel, (cfg.model_name, "1.0"), body, 30, key)
            time.sleep(0.05)


def test_threads_follow_the_workers_of_every_registered_version(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("one core: every worker has one thread whatever the count")
    export, store, _ = exported
    another_version(store / "dlrm-tiny-1.0.mar", store / "dlrm-tiny-1.1.mar", "1.1")
    try:
        with running_torchserve(store, tmp_path / "ts", workers=1) as (cfg, _):
            log = cfg.log_file
            assert f"on cpu ({cores} threads)" in log.read_text(errors="replace")
            manage.register(cfg, cfg.model_name, "1.1", "dlrm-tiny-1.1.mar", timeout=120)
            call_for(cfg, export, RETUNE_S * 2)
            text = log.read_text(errors="replace")
            assert f"on cpu ({cores // 2} threads)" in text  # the new version's worker
            assert f"2 workers on this replica: {cores // 2} threads" in text  # the old one's
            manage.unregister(cfg, cfg.model_name, "1.1")
            time.sleep(2)  # the removed worker exits
            call_for(cfg, export, RETUNE_S * 2)
            text = log.read_text(errors="replace")
            assert f"1 workers on this replica: {cores} threads" in text
    finally:
        (store / "dlrm-tiny-1.1.mar").unlink(missing_ok=True)
